"""Mixture-of-Experts feed-forward block: router -> routed experts -> fp32 weighted sum, plus shared experts.

Shape legend:
    B  batch
    S  sequence length
    T  tokens, T = B * S (the block works on the flat ``[T, D]`` layout)
    D  hidden size
    F  routed expert intermediate size (moe_intermediate_size)
    E  routed experts
    K  experts per token (top_k)

Computation (Hugging Face ``Glm4MoeMoE``; DeepSeek-V3 arXiv 2412.19437 eq. 12-16)::

    ids_TK, w_TK, _ = router(x_TD)                       # w_TK fp32
    y_TKD           = experts(x_TD, ids_TK)              # unweighted, x dtype
    out_TD          = sum_k w_TK[:, k] * y_TKD[:, k]     # in fp32, cast back to x dtype
    out_TD         += shared_experts(x_TD)               # one SwiGLU of width n_shared * F

Module names match the Hugging Face checkpoint layout up to the router (ours: ``router``, HF: ``gate``):
``router.weight``, ``router.e_score_correction_bias``, ``experts.gate_up_proj``, ``experts.down_proj``,
``shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_rl.moe.experts import ExpertsBackend, GroupedExperts
from moe_rl.moe.router import ScoreFunc, TopKRouter, flat_replay_ids

__all__ = ["MoE", "SwiGLUMLP"]


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU feed-forward ``down(silu(gate(x)) * up(x))`` without biases.

    Used for GLM-4.5's first dense layers and for the shared experts. Parameter names
    (``gate_proj``, ``up_proj``, ``down_proj``) match Hugging Face ``Glm4MoeMLP``.

    Args:
        hidden_size: D.
        intermediate_size: width of the hidden activation.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=std)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., D]`` -> ``[..., D]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Token-choice MoE block with optional shared experts.

    Args:
        hidden_size: D.
        moe_intermediate_size: F, the width of each routed expert.
        n_routed_experts: E.
        num_experts_per_tok: K.
        n_shared_experts: shared experts, fused into one SwiGLU of width ``n_shared_experts * F``
            (0 = none).
        score_func: router scoring, ``"sigmoid"`` (GLM-4.5) or ``"softmax"``.
        n_group: expert groups for group-limited routing.
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the K gate weights.
        routed_scaling_factor: multiplies the gate weights.
        use_correction_bias: give the router a noaux_tc ``e_score_correction_bias`` buffer.
        backend: routed-expert compute backend, ``"loop"`` (reference) or ``"grouped_mm"``.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        n_routed_experts: int,
        num_experts_per_tok: int,
        *,
        n_shared_experts: int = 1,
        score_func: ScoreFunc = "sigmoid",
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        use_correction_bias: bool = True,
        backend: ExpertsBackend = "loop",
    ) -> None:
        super().__init__()
        if n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={n_shared_experts} must be >= 0")
        self.router = TopKRouter(
            hidden_size,
            n_routed_experts,
            num_experts_per_tok,
            score_func=score_func,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor,
            use_correction_bias=use_correction_bias,
        )
        self.experts = GroupedExperts(n_routed_experts, hidden_size, moe_intermediate_size, backend=backend)
        self.shared_experts = (
            SwiGLUMLP(hidden_size, n_shared_experts * moe_intermediate_size) if n_shared_experts > 0 else None
        )

    def init_weights(self, std: float = 0.02) -> None:
        """Re-initialize router, experts and shared experts (same scheme as at construction)."""
        self.router.init_weights(std)
        self.experts.init_weights(std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std)

    def forward(self, x: Tensor, replay_ids: Tensor | None = None) -> Tensor:
        """Apply the block.

        Args:
            x: ``[..., D]`` hidden states (e.g. ``[B, S, D]`` or ``[T, D]``).
            replay_ids: optional ``[..., K]`` integer expert ids (same leading shape as ``x``) to replay
                instead of the router's own selection (R3); see :func:`moe_rl.moe.router.topk_route`.

        Returns:
            Tensor shaped like ``x``, same dtype.

        Raises:
            ValueError: ``replay_ids`` does not match ``x``'s leading shape and top_k.
        """
        hidden = x.shape[-1]
        x_TD = x.reshape(-1, hidden)
        replay_ids_TK = flat_replay_ids(replay_ids, x, self.router.top_k)
        topk_ids_TK, topk_weights_TK, _ = self.router(x_TD, replay_ids_TK)
        y_TKD = self.experts(x_TD, topk_ids_TK)
        out_TD = torch.einsum("tkd,tk->td", y_TKD.float(), topk_weights_TK).to(x.dtype)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(x.shape)
