"""Token-choice top-k router with aux-loss-free bias (noaux_tc), group-limited selection and router replay.

Shape legend:
    T  tokens (batch and sequence flattened)
    D  hidden size
    E  routed experts
    K  experts per token (top_k)
    G  expert groups (n_group); E/G experts per group

Math (sigmoid scoring, as in DeepSeek-V3, arXiv 2412.19437 §2.1.2, and GLM-4.5; Hugging Face
``Glm4MoeTopkRouter`` in ``transformers/models/glm4_moe/modeling_glm4_moe.py``)::

    logits_TE  = x_TD @ W_ED^T                      # in fp32
    scores_TE  = sigmoid(logits_TE)                 # or softmax over E
    choice_TE  = scores_TE + e_score_correction_bias_E      # bias used for SELECTION only
    group_TG   = sum of the top-2 of choice within each group
    keep the top ``topk_group`` groups; other groups' experts get choice = -inf
    ids_TK     = topk(choice_TE, K)
    w_TK       = scores_TE.gather(ids_TK)          # UNBIASED scores
    w_TK      /= w_TK.sum(-1) + 1e-20              # if norm_topk_prob
    w_TK      *= routed_scaling_factor

Masked groups are filled with ``-inf`` (DeepSeek-V3 reference code, vLLM ``grouped_topk`` and
transformers 5.19 all do this; some older Hugging Face remote code used ``0.0``, which differs when biased
scores are negative).

Ties (exactly equal biased scores, e.g. saturated sigmoids or quantized logits): the lower index wins, both when
groups are kept and when experts are picked, so trainer and engine, CPU and GPU pick the same experts
(``torch.topk`` leaves the order of equal values unspecified and it differs between devices). Selection is a
stable descending sort truncated to the first k (:func:`topk_lowest_index`), which equals ``torch.topk`` whenever
the scores are distinct.

Router replay (R3, Ma et al., arXiv 2510.11370): given the inference engine's expert ids ``replay_ids_TK``,
skip selection and gather the trainer's own scores at those ids, then normalize and scale as above. The
ids carry no gradient; the weights do, so the router weight rows of every replayed expert receive gradient,
including experts the trainer itself would not have picked.
"""

from __future__ import annotations

import numbers
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ScoreFunc",
    "TopKRouter",
    "check_route_args",
    "flat_replay_ids",
    "router_scores",
    "select_experts",
    "topk_lowest_index",
    "topk_route",
]

ScoreFunc = Literal["sigmoid", "softmax"]


def router_scores(logits_TE: Tensor, score_func: ScoreFunc) -> Tensor:
    """Turn router logits into per-expert scores.

    Args:
        logits_TE: ``[T, E]`` router logits (computed in fp32).
        score_func: ``"sigmoid"`` (independent per expert, DeepSeek-V3/GLM-4.5) or ``"softmax"`` (over E).

    Returns:
        ``[T, E]`` fp32 scores.
    """
    logits_TE = logits_TE.float()
    if score_func == "sigmoid":
        return logits_TE.sigmoid()
    if score_func == "softmax":
        return logits_TE.softmax(dim=-1)
    raise ValueError(f"score_func={score_func!r} is not supported; use 'sigmoid' or 'softmax'")


def topk_lowest_index(values: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries along the last dim, best first; among equal values the lower index
    comes first (and wins the last slot).

    A stable descending sort truncated to ``k``: with distinct values it returns exactly ``torch.topk``'s
    (sorted) indices; with ties it is deterministic on every device, where ``torch.topk``'s order of equal
    values is unspecified. Cost: ``O(E log E)`` per row instead of ``O(E)``; for a router row of E <= 512
    experts this is far below the router GEMM's ``E * D`` multiply-adds (D in the thousands), and it needs no
    host sync (no data-dependent branch on whether ties exist), so it stays CUDA-graph / compile friendly.
    NaN sorts as the largest value, as in ``torch.topk``.

    Args:
        values: ``[..., E]`` float scores.
        k: how many to keep (``1 <= k <= E``).

    Returns:
        ``[..., k]`` int64 indices.
    """
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


@torch.no_grad()
def select_experts(
    scores_TE: Tensor,
    top_k: int,
    *,
    correction_bias_E: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> Tensor:
    """Pick ``top_k`` experts per token with an optional selection bias and group limit (no gradient).

    Args:
        scores_TE: ``[T, E]`` fp32 scores from :func:`router_scores`.
        top_k: experts per token (K).
        correction_bias_E: ``[E]`` fp32 noaux_tc bias added to the scores for selection only.
        n_group: number of expert groups G (``E % G == 0``). With ``n_group == 1`` there is no group limit.
        topk_group: groups kept per token; a group's score is the sum of its two best biased scores.

    Returns:
        ``[T, K]`` int64 expert ids, ordered by biased score, best first. Ties: the lower index wins, in group
        selection (equal group scores keep the lower group) and in expert selection (equal biased scores keep
        and list first the lower expert id); see :func:`topk_lowest_index`.
    """
    choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.float()
    if n_group > 1:
        num_tokens, num_experts = choice_TE.shape
        choice_TGe = choice_TE.view(num_tokens, n_group, num_experts // n_group)
        group_scores_TG = choice_TGe.topk(2, dim=-1).values.sum(dim=-1)
        keep_groups_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
        keep_groups_TG.scatter_(1, topk_lowest_index(group_scores_TG, topk_group), True)
        choice_TE = choice_TGe.masked_fill(~keep_groups_TG.unsqueeze(-1), float("-inf")).view(
            num_tokens, num_experts
        )
    return topk_lowest_index(choice_TE, top_k)


def check_route_args(num_experts: int, top_k: int, n_group: int, topk_group: int, score_func: str) -> None:
    """Validate routing sizes (shared by :func:`topk_route` and :class:`TopKRouter`).

    Raises:
        TypeError: a size is not an ``int`` (bool included).
        ValueError: ``top_k`` outside ``[1, E]``, ``n_group`` not dividing E (or < 2 experts per group),
            ``topk_group`` outside ``[1, n_group]``, fewer than ``top_k`` experts in the kept groups, or an
            unknown ``score_func``; the message names the argument, its value and the rule.
    """
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group={n_group} must be >= 1 and divide num_experts={num_experts}")
    if n_group > 1 and num_experts // n_group < 2:
        raise ValueError(
            f"n_group={n_group} leaves {num_experts // n_group} expert(s) per group; the group score sums "
            "the top-2 experts of a group, so each group needs at least 2"
        )
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if topk_group * (num_experts // n_group) < top_k:
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the kept groups: topk_group={topk_group} x "
            f"{num_experts // n_group} experts per group"
        )
    if score_func not in ("sigmoid", "softmax"):
        raise ValueError(f"score_func={score_func!r} is not supported; use 'sigmoid' or 'softmax'")


def topk_route(
    logits_TE: Tensor,
    top_k: int,
    *,
    score_func: ScoreFunc = "sigmoid",
    correction_bias_E: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    replay_ids_TK: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Functional core of :class:`TopKRouter`: scores, selection (or replay), gate weights.

    Args:
        logits_TE: ``[T, E]`` router logits; upcast to fp32.
        top_k: experts per token (K).
        score_func: ``"sigmoid"`` or ``"softmax"``.
        correction_bias_E: ``[E]`` noaux_tc selection bias, or ``None``.
        n_group: expert groups for the group limit (1 = none).
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the K gathered scores to sum to 1 (plus 1e-20 in the denominator).
        routed_scaling_factor: multiplies the final weights.
        replay_ids_TK: ``[T, K]`` integer expert ids to use instead of selecting (router replay). Any
            integer dtype is accepted (vLLM/prime-rl ship uint8/int16/int32). Sentinel rows
            (:mod:`moe_rl.replay.layout`): all ``-1`` = pad/placeholder, filled with distinct ids spread over the
            experts by pad ordinal (sgl-project/sglang PR #36404; such tokens must carry no loss); all ``-2`` = route this token
            with the trainer's own selection. Weights always come from the full (unmasked) ``scores_TE`` at
            the final ids, so a replayed expert outside the trainer's own top-k gets its true score and a
            gradient (ISEEKYAN/Megatron-LM PR #79).

    Returns:
        ``(topk_ids_TK int64, topk_weights_TK fp32, scores_TE fp32)``; ``scores_TE`` are the unbiased scores.

    Raises:
        TypeError: ``replay_ids_TK`` is not an integer tensor; a size argument is not an int.
        ValueError: inconsistent sizes (as :class:`TopKRouter`: ``top_k`` outside ``[1, E]``, ``n_group`` not
            dividing E, ``topk_group`` outside ``[1, n_group]``, ...), ``correction_bias_E`` not ``[E]``,
            ``logits_TE`` not 2-D, ``replay_ids_TK`` not ``[T, K]``, an id outside ``[0, E)`` or a repeated id
            in a non-sentinel replay row.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE has shape {tuple(logits_TE.shape)}; expected [T, E]")
    num_experts = logits_TE.shape[1]
    check_route_args(num_experts, top_k, n_group, topk_group, score_func)
    if correction_bias_E is not None and tuple(correction_bias_E.shape) != (num_experts,):
        raise ValueError(
            f"correction_bias_E has shape {tuple(correction_bias_E.shape)}; expected [E] = ({num_experts},) "
            "(one noaux_tc selection bias per routed expert)"
        )
    scores_TE = router_scores(logits_TE, score_func)

    def own_choice() -> Tensor:
        """The router's own top-k ids (no replay), ``[T, K]``."""
        return select_experts(
            scores_TE.detach(), top_k, correction_bias_E=correction_bias_E, n_group=n_group, topk_group=topk_group
        )

    if replay_ids_TK is None:
        topk_ids_TK = own_choice()
    else:
        expected = (scores_TE.shape[0], top_k)
        if tuple(replay_ids_TK.shape) != expected:
            raise ValueError(
                f"replay_ids has shape {tuple(replay_ids_TK.shape)} but the router expects [T, K] = {expected} "
                "(one row of top_k expert ids per token, tokens flattened in the same order as the input)"
            )
        if replay_ids_TK.dtype.is_floating_point or replay_ids_TK.dtype.is_complex or replay_ids_TK.dtype == torch.bool:
            raise TypeError(
                f"replay_ids must be an integer tensor of expert ids, got dtype {replay_ids_TK.dtype} (a float "
                "tensor would be truncated silently)"
            )
        from moe_rl.replay.fill import resolve_replay_ids
        from moe_rl.replay.layout import OWN_ROW

        replay_ids_TK = replay_ids_TK.to(device=scores_TE.device, dtype=torch.int64)
        own_ids_TK = own_choice() if bool((replay_ids_TK == OWN_ROW).all(dim=1).any()) else None
        topk_ids_TK = resolve_replay_ids(replay_ids_TK, scores_TE.shape[1], own_ids_TK)
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if norm_topk_prob:
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights_TK = topk_weights_TK * routed_scaling_factor
    return topk_ids_TK, topk_weights_TK, scores_TE


class TopKRouter(nn.Module):
    """Thin module around :func:`topk_route`: owns the router weight and the noaux_tc bias.

    Parameters and buffers (Hugging Face names in parentheses, under ``mlp.gate``):
        weight: ``[E, D]`` router projection, no bias (``weight``).
        e_score_correction_bias: ``[E]`` fp32 persistent buffer (``e_score_correction_bias``). It is not
            trained by gradient; an aux-loss-free balancing update (arXiv 2408.15664) adjusts it between
            optimizer steps. It stays fp32 when the module is cast (``.to(torch.bfloat16)``). Present only
            when ``use_correction_bias``.

    Args:
        hidden_size: D.
        num_experts: E.
        top_k: K (``1 <= K <= E``).
        score_func: ``"sigmoid"`` (GLM-4.5, DeepSeek-V3) or ``"softmax"``.
        n_group: expert groups G; ``E % G == 0`` and, when ``G > 1``, at least 2 experts per group.
        topk_group: groups kept per token, ``1 <= topk_group <= G`` and ``topk_group * E/G >= K``.
        norm_topk_prob: renormalize the K weights.
        routed_scaling_factor: multiplies the weights (GLM-4.5: 2.5; GLM-4.5-Air: 1.0).
        use_correction_bias: register ``e_score_correction_bias``.

    Raises:
        ValueError: on any inconsistent size; the message names the argument, its value and the rule.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "sigmoid",
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        use_correction_bias: bool = True,
    ) -> None:
        super().__init__()
        check_route_args(num_experts, top_k, n_group, topk_group, score_func)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func: ScoreFunc = score_func
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if use_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.register_buffer("e_score_correction_bias", None)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) router weight and a zero correction bias (Hugging Face ``_init_weights``)."""
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # Keep the selection bias in fp32 through module.to(bf16)/.half() (transformers does the same via
        # _keep_in_fp32_modules_strict): bias updates of ~1e-3 are below bf16 resolution near 0.5.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def forward(self, x_TD: Tensor, replay_ids_TK: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens.

        Args:
            x_TD: ``[T, D]`` hidden states, any float dtype (the projection runs in fp32).
            replay_ids_TK: optional ``[T, K]`` integer ids to replay instead of selecting.

        Returns:
            ``(topk_ids_TK int64, topk_weights_TK fp32, scores_TE fp32)``.
        """
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        return topk_route(
            logits_TE,
            self.top_k,
            score_func=self.score_func,
            correction_bias_E=self.e_score_correction_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            replay_ids_TK=replay_ids_TK,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_func={self.score_func}, n_group={self.n_group}, topk_group={self.topk_group}, "
            f"norm_topk_prob={self.norm_topk_prob}, routed_scaling_factor={self.routed_scaling_factor}"
        )


def flat_replay_ids(replay_ids: Tensor | None, x: Tensor, top_k: int) -> Tensor | None:
    """The ``[T, K]`` rows a MoE block's router replays (R3), checked against the block's input.

    Args:
        replay_ids: ``[..., K]`` integer expert ids with ``x``'s leading shape, or None (route normally).
        x: the block's input ``[..., D]``.
        top_k: ``K``, the router's experts per token.

    Returns:
        ``replay_ids`` reshaped to ``[T, K]`` (``T`` = tokens of ``x``), or None.

    Raises:
        ValueError: ``replay_ids``'s shape is not ``(*x.shape[:-1], top_k)``.
    """
    if replay_ids is None:
        return None
    expected = (*x.shape[:-1], top_k)
    if tuple(replay_ids.shape) != expected:
        raise ValueError(f"replay_ids has shape {tuple(replay_ids.shape)} but this MoE block expects {expected} "
                         f"(input leading shape {tuple(x.shape[:-1])} + top_k={top_k})")
    return replay_ids.reshape(-1, top_k)
