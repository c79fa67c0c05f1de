"""Decoder pieces shared by the GLM and DeepSeek-V3 model families (``glm4_moe``, ``glm_moe_dsa``, ``deepseek_v3``;
``nemotron_h`` uses the causal-LM mixin, the input checks and the packed attention).

Shape legend:
    B   batch
    S   sequence length
    T   tokens of the packed stream, T = B * S (row-major: token index ``b * S + s``, or ``b * cp * S + position``
        under context parallelism)
    D   hidden size
    L   decoder layers (``num_hidden_layers``)
    K   routed experts per token (``num_experts_per_tok``)

:class:`RMSNorm` and :func:`glm_mlp` are the blocks the families build their layers from, :class:`PreNormDecoderLayer`
the layer they share around their own attention (:func:`mla_config` builds the MLA families' attention config);
:class:`MoeCausalLMMixin` gives a causal LM its deterministic ``init_weights`` and ``set_experts_backend``;
:func:`as_per_layer` and :func:`split_replay_ids` turn the replay inputs into one entry per layer;
:func:`causal_lm_inputs` checks a GQA family's ``input_ids``, ``replay_ids`` and packed ``cu_seqlens``
(:func:`check_cu_seqlens`), and :func:`packed_causal_sdpa` is its causal attention, one sequence of a packed row at a
time;
:func:`token_stream` gives the MLA families (``glm_moe_dsa``, ``deepseek_v3``) the token indices of the packed
stream, with or without context parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe_rl.attention.mla import MLAConfig
from moe_rl.attention.mla import _RMSNorm as _MLARMSNorm
from moe_rl.moe import ExpertsBackend, GroupedExperts, MoE, SwiGLUMLP, TopKRouter

__all__ = [
    "MLA_UNIT_NORMS",
    "MoeCausalLMMixin",
    "PreNormDecoderLayer",
    "RMSNorm",
    "as_per_layer",
    "causal_lm_inputs",
    "check_cu_seqlens",
    "glm_mlp",
    "mla_config",
    "packed_causal_sdpa",
    "split_replay_ids",
    "token_stream",
]

MLA_LATENT_NORM_EPS = 1e-6
"""Epsilon of the two MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``): transformers'
``DeepseekV3Attention`` and ``GlmMoeDsaAttention`` build them with their RMSNorm's default eps, not
``rms_norm_eps``."""


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (Hugging Face ``Glm4MoeRMSNorm`` order).

    Args:
        dim: normalized (last) dimension.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def glm_mlp(cfg: Any, layer_idx: int, experts_backend: ExpertsBackend) -> nn.Module:
    """The feed-forward block of GLM layer ``layer_idx``: a dense :class:`moe_rl.moe.SwiGLUMLP` of width
    ``intermediate_size`` for the first ``first_k_dense_replace`` layers, else an :class:`moe_rl.moe.MoE` with the
    GLM router (sigmoid scores, noaux_tc ``e_score_correction_bias``, group-limited top-k, normalisation, routed
    scaling) and shared experts. ``cfg`` is any config with Hugging Face GLM field names (``GlmMoeConfig``,
    ``GlmMoeDsaConfig``)."""
    if not cfg.is_moe_layer(layer_idx):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
    return MoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts,
        score_func="sigmoid",
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        use_correction_bias=True,
        backend=experts_backend,
    )


MLA_UNIT_NORMS: tuple[type[nn.Module], ...] = (RMSNorm, _MLARMSNorm)
"""The ``_unit_norms`` of an MLA family's causal LM (:class:`MoeCausalLMMixin`): the decoder norms and the MLA
latent norms."""


def mla_config(cfg: Any, **family: Any) -> MLAConfig:
    """The :class:`moe_rl.attention.MLAConfig` of an MLA family's layer (``glm_moe_dsa``, ``deepseek_v3``).

    Reads the Hugging Face fields both configs have (``hidden_size``, ``num_attention_heads``, ``q_lora_rank``,
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_theta``,
    ``attention_bias``), sets the latent norms' eps to :data:`MLA_LATENT_NORM_EPS`, and passes ``family`` (the
    family's own settings: DSA indexer, YaRN, softmax scale, ...) on as further ``MLAConfig`` fields.

    Raises:
        TypeError: a ``family`` key that is not an ``MLAConfig`` field or repeats one set here.
    """
    return MLAConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=MLA_LATENT_NORM_EPS,
        attention_bias=cfg.attention_bias,
        **family,
    )


class PreNormDecoderLayer(nn.Module):
    """The pre-norm residual block of the GLM and DeepSeek-V3 families around a family's attention:
    ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` (:class:`RMSNorm`, ``rms_norm_eps``) and
    ``mlp`` (:func:`glm_mlp`: dense SwiGLU or MoE), registered in that order (the Hugging Face names). Subclasses
    write ``forward``: ``h + attention(input_layernorm(h))``, then :meth:`mlp_residual`.

    Args:
        cfg: a config with Hugging Face GLM field names. layer_idx: the layer's index (``is_moe`` from
        ``cfg.is_moe_layer``). experts_backend: as :func:`glm_mlp`. self_attn: the family's attention module.
    """

    def __init__(self, cfg: Any, layer_idx: int, experts_backend: ExpertsBackend, self_attn: nn.Module) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp: nn.Module = glm_mlp(cfg, layer_idx, experts_backend)

    def mlp_residual(self, h: Tensor, replay_ids: Tensor | None) -> Tensor:
        """``h + mlp(post_attention_layernorm(h))`` (``h [..., D]``, same shape out); an MoE ``mlp`` gets
        ``replay_ids [..., K]`` (its routed experts to replay, or None), a dense one ignores it."""
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            return h + self.mlp(x, replay_ids=replay_ids)
        return h + self.mlp(x)


def token_stream(
    input_ids: Tensor, cu_seqlens: Tensor | None, positions: Tensor | None, cp_group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """``(cu_seqlens, token_idx)`` of the global row-major token stream of a ``[B, S]`` batch, the coordinates
    :class:`moe_rl.attention.MultiheadLatentAttention` takes.

    Without context parallelism (``cp_group`` None) row ``b`` holds tokens ``b * S .. b * S + S - 1``. Under CP each
    row holds ``cp * S`` tokens (``cp`` = the size of ``cp_group``) of which this rank has the columns at
    ``positions`` (from :func:`moe_rl.distributed.parallelize.shard_for_context_parallel`), so its token indices
    are ``b * cp * S + positions``.

    Args:
        input_ids: ``[B, S]`` token ids (only the shape and device are read).
        cu_seqlens: ``None`` (one sequence per row: boundaries ``0, cp*S, 2*cp*S, ..``) or ``[N + 1]`` int
            boundaries of N sequences packed in one row (``input_ids [1, T]``), returned unchanged.
        positions: ``[S]`` or ``[B, S]`` int absolute positions of this rank's columns; required under CP, refused
            without it.
        cp_group: the context-parallel process group, or ``None``.

    Returns:
        ``cu_seqlens`` (int64 ``[B + 1]`` when built here) and ``token_idx [B * S]`` int64 on ``input_ids``' device.

    Raises:
        ValueError: ``input_ids`` not 2-D; ``positions`` given without ``cp_group``, or missing / of the wrong shape
            with it; ``cu_seqlens`` with more than one row.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    dev = input_ids.device
    if cp_group is None:
        if positions is not None:
            raise ValueError(
                "positions is only for context parallelism (the absolute positions of this CP rank's columns); "
                "this model has no cp_group, so every row is positions 0..S-1: drop positions"
            )
        cp = 1
    else:
        cp = dist.get_world_size(cp_group)
        if positions is None or positions.dim() not in (1, 2) or positions.shape[-1] != seq:
            got = None if positions is None else tuple(positions.shape)
            raise ValueError(
                f"context-parallel forward needs positions [S] or [B, S] with S={seq} (the absolute positions of "
                f"this rank's columns in rows of cp*S = {cp * seq} tokens), got {got}; pass the positions from "
                "moe_rl.distributed.parallelize.shard_for_context_parallel"
            )
    row = seq * cp
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch + 1, device=dev, dtype=torch.int64) * row
    elif batch != 1:
        raise ValueError(
            f"cu_seqlens packs sequences into one row: input_ids must be [1, T], got {tuple(input_ids.shape)}"
        )
    if positions is None:
        return cu_seqlens, torch.arange(batch * seq, device=dev)
    start = torch.arange(batch, device=dev, dtype=torch.int64)[:, None] * row
    return cu_seqlens, (start + positions.to(device=dev, dtype=torch.int64).expand(batch, seq)).reshape(-1)


def as_per_layer(x: Any, n: int, name: str, what: str) -> list[Tensor | None] | None:
    """One entry per layer from a per-layer list/tuple (``None`` when ``x`` is None), or ``None`` when ``x`` is a
    single stacked tensor (the caller checks and splits that layout).

    Args:
        x: None, a list/tuple of ``n`` tensors-or-None, or a tensor.
        n: the number of decoder layers.
        name: the argument's name, for errors.
        what: the shape of one layer's tensor, for errors (e.g. ``"[B, S, K]"``).

    Raises:
        ValueError: a list of the wrong length.
        TypeError: ``x`` is neither None, a list/tuple nor a tensor.
    """
    if x is None:
        return [None] * n
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise ValueError(
                f"{name} is a list of {len(x)} per-layer tensors but the model has {n} decoder "
                f"layers; pass one {what} tensor (or None) per layer"
            )
        return list(x)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor or a list of per-layer tensors, got {type(x).__name__}")
    return None


def split_replay_ids(
    replay_ids: Tensor | Sequence[Tensor | None] | None, num_layers: int, batch: int, seq: int, top_k: int
) -> list[Tensor | None]:
    """Routed experts to replay, one ``[B, S, K]`` entry (or None) per decoder layer.

    Args:
        replay_ids: None; ``[B, S, L, K]`` integer expert ids (vLLM's ``routed_experts`` layout, dense layers'
            slices ignored by the caller); or a list of L ``[B, S, K]`` tensors / None.
        num_layers: L. batch, seq: B and S of the input ids. top_k: K.

    Returns:
        L entries: views ``replay_ids[:, :, i]`` of a stacked tensor, or the list's own entries.

    Raises:
        ValueError: a list of the wrong length, or a stacked tensor whose shape is not ``[B, S, L, K]``.
        TypeError: ``replay_ids`` is neither None, a list nor a tensor.
    """
    per_layer = as_per_layer(replay_ids, num_layers, "replay_ids", "[B, S, K]")
    if per_layer is not None:
        return per_layer
    expected = (batch, seq, num_layers, top_k)
    if tuple(replay_ids.shape) != expected:
        raise ValueError(
            f"replay_ids has shape {tuple(replay_ids.shape)} but the model expects [B, S, L, K] = {expected}"
        )
    return [replay_ids[:, :, i] for i in range(num_layers)]


def check_cu_seqlens(cu_seqlens: Tensor | list[int], batch: int, seq: int) -> list[int]:
    """``cu_seqlens`` (packed input: the ``[N + 1]`` boundaries ``0 = c_0 <= ... <= c_N = S`` of N sequences in the
    one row of ``input_ids [1, S]``) as a list of ints.

    Args:
        cu_seqlens: a list of ints or a 1-D integer tensor. batch, seq: B and S of ``input_ids``.

    Raises:
        ValueError: a tensor that is not 1-D integer; ``batch != 1``; boundaries that do not start at 0, decrease,
            or do not end at ``seq``.
    """
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences into one row: input_ids must be [1, S], got [{batch}, {seq}]")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"cu_seqlens={cu} must start at 0, not decrease and end at S={seq} (the packed row's "
                         "length); build it as [0, l_0, l_0 + l_1, ...]")
    return cu


def causal_lm_inputs(
    cfg: Any,
    input_ids: Tensor,
    replay_ids: Tensor | Sequence[Tensor | None] | None,
    cu_seqlens: Tensor | list[int] | None,
) -> tuple[int, int, list[Tensor | None], list[int] | None]:
    """The checked inputs of a causal LM's ``hidden_states``: ``(B, S, per-layer replay ids, cu_seqlens)``.

    Args:
        cfg: the config (``num_hidden_layers``, ``num_experts_per_tok``).
        input_ids: ``[B, S]`` token ids.
        replay_ids: as :func:`split_replay_ids` takes them.
        cu_seqlens: None, or the packed row's boundaries as :func:`check_cu_seqlens` takes them.

    Returns:
        ``B``, ``S``, :func:`split_replay_ids` (L entries) and :func:`check_cu_seqlens` (None when not packed).

    Raises:
        ValueError: ``input_ids`` not 2-D, ``replay_ids`` of the wrong shape, or bad ``cu_seqlens``.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    per_layer = split_replay_ids(replay_ids, cfg.num_hidden_layers, batch, seq, cfg.num_experts_per_tok)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, batch, seq)
    return batch, seq, per_layer, cu


def packed_causal_sdpa(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, cu_seqlens: list[int] | None) -> Tensor:
    """Causal grouped-query attention, scale ``Dh**-0.5``: queries ``[B, H, S, Dh]``, keys and values ``[B, Hkv, S,
    Dh]`` (``Hkv`` divides ``H``) -> ``[B, H, S, Dh]``. With ``cu_seqlens`` (``B = 1``, checked boundaries of N
    packed sequences, :func:`check_cu_seqlens`) attention is causal within each sequence only (block-diagonal: one
    SDPA per sequence, the arithmetic of that sequence alone in a row)."""
    sdpa = dict(is_causal=True, scale=q_BHSD.shape[-1] ** -0.5, enable_gqa=q_BHSD.shape[1] != k_BHSD.shape[1])
    if cu_seqlens is None:
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, **sdpa)
    return torch.cat([F.scaled_dot_product_attention(q_BHSD[:, :, a:b], k_BHSD[:, :, a:b], v_BHSD[:, :, a:b], **sdpa)
                      for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True) if b > a], dim=2)


class MoeCausalLMMixin:
    """``init_weights``, ``forward``, ``token_logprobs`` and ``set_experts_backend`` of a GLM-style causal LM (an
    ``nn.Module`` with ``config`` (``initializer_range``, ``tie_word_embeddings``), ``lm_head``, decoder layers that
    carry ``is_moe`` and, when MoE, ``mlp.experts``, and ``hidden_states(input_ids, **inputs)``, the final-normed
    ``[B, S, D]``).

    Subclasses build their modules with :meth:`_build_lm`, list their norm classes in ``_unit_norms`` (weights set
    to one) and override :meth:`_moe_capable_layers` when they have layers besides ``self.layers`` (e.g. MTP
    layers).
    """

    _unit_norms: tuple[type[nn.Module], ...] = (RMSNorm,)

    def _build_lm(self, cfg: Any, layers: Iterable[nn.Module]) -> None:
        """Register, in this order, ``config = cfg``, ``embed_tokens`` ``[V, D]`` (``padding_idx =
        pad_token_id``), ``layers`` (an ``nn.ModuleList`` of ``layers``, consumed after the embedding is built),
        the final :class:`RMSNorm` ``norm`` (``rms_norm_eps``) and the bias-free ``lm_head`` ``[V, D]``, which is
        ``embed_tokens``' matrix when ``cfg.tie_word_embeddings`` (Hugging Face field names)."""
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _moe_capable_layers(self) -> list[nn.Module]:
        return list(self.layers)  # type: ignore[attr-defined]

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialize every parameter and buffer, in module order, from the torch RNG (:meth:`_init_module` of
        each module). A tied ``lm_head`` is skipped (its matrix is the embedding, drawn as one)."""
        std = self.config.initializer_range  # type: ignore[attr-defined]
        tied = self.config.tie_word_embeddings  # type: ignore[attr-defined]
        for module in self.modules():  # type: ignore[attr-defined]
            if not (tied and module is self.lm_head):  # type: ignore[attr-defined]
                self._init_module(module, std)

    def _init_module(self, module: nn.Module, std: float) -> None:
        """Initialize ``module``'s own parameters: normal(0, ``std``) for every matrix, embedding, router and expert
        stack; zero biases and correction bias; unit norms (``_unit_norms``); default ``nn.LayerNorm``; zero
        pad-token embedding row. Other modules are left alone (their children are visited on their own);
        families override this for their own module kinds."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, self._unit_norms):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, (TopKRouter, GroupedExperts)):
            module.init_weights(std)

    def forward(self, input_ids: Tensor, **inputs: Any) -> Tensor:
        """``[B, S]`` int64 ids -> ``[B, S, V]`` fp32 logits: ``lm_head`` of :meth:`hidden_states` (``inputs``: its
        keyword arguments, passed on unchanged; another keyword: TypeError).

        Causal: position s sees tokens ``0..s`` only (of its own sequence with ``cu_seqlens``), so right padding
        does not change earlier logits.
        """
        return self.lm_head(self.hidden_states(input_ids, **inputs)).float()  # type: ignore[attr-defined]

    def token_logprobs(
        self,
        input_ids: Tensor,
        labels: Tensor,
        *,
        temperature: float | Tensor = 1.0,
        chunk_tokens: int | None = None,
        **inputs: Any,
    ) -> Tensor:
        """``[B, S]`` fp32 ``log softmax(logits / temperature)[labels]`` per column, optionally without ever holding
        the ``[B, S, V]`` logits (:func:`moe_rl.models.common.head.head_label_logprobs`).

        Args:
            input_ids: ``[B, S]`` int64 (as in ``hidden_states``).
            labels: ``[B, S]`` int64: column ``s`` gets the log-prob of ``labels[:, s]`` given ``input_ids[:, :s+1]``
                (the next token; any valid id where no label exists, e.g. the last column).
            temperature: the logits are divided by it (finite, > 0); or a ``[B, S]`` float tensor of per-token
                temperatures (packed samples sampled at different temperatures): the head runs once per distinct
                value on that value's tokens.
            chunk_tokens: ``None``: full logits (the numerics of ``forward`` + log-softmax); an int >= 1: the head
                and log-softmax run on that many tokens at a time, forward and backward.
            inputs: the other keyword arguments of the family's ``hidden_states`` (``positions``, ``replay_ids``,
                ...), passed on unchanged.

        Under FSDP2 (:func:`moe_rl.distributed.parallelize.parallelize_model`) this is registered as a forward
        method, so ``lm_head`` is unsharded as in ``forward``.

        Raises:
            TypeError: a non-number ``temperature``, a non-int ``chunk_tokens`` or a keyword ``hidden_states`` does
                not take.
            ValueError: bad ``labels`` shape or dtype, a per-token ``temperature`` of another shape, ``temperature
                <= 0``, ``chunk_tokens < 1``, ``lm_head`` not a plain bias-free ``nn.Linear``, or as
                ``hidden_states``.
        """
        from moe_rl.models.common.head import lm_head_label_logprobs

        lm_head = self.lm_head  # type: ignore[attr-defined]
        h = self.hidden_states(input_ids, **inputs)  # type: ignore[attr-defined]
        if not isinstance(temperature, Tensor):
            return lm_head_label_logprobs(h, lm_head, labels, temperature, chunk_tokens)
        if tuple(temperature.shape) != tuple(labels.shape):
            raise ValueError(f"a per-token temperature must have the labels' [B, S] shape {tuple(labels.shape)}, got "
                             f"{tuple(temperature.shape)}")
        out = h.new_zeros(labels.shape, dtype=torch.float32)
        for t in torch.unique(temperature).tolist():
            sel = temperature == t  # [B, S]
            lp = lm_head_label_logprobs(h[sel][None], lm_head, labels[sel][None], float(t), chunk_tokens)
            out = out.index_put((sel.nonzero(as_tuple=True)), lp[0])
        return out

    def set_experts_backend(self, backend: ExpertsBackend) -> None:
        """Switch every MoE layer's routed-expert backend (``"loop"`` or ``"grouped_mm"``).

        Raises:
            ValueError: another ``backend``.
        """
        if backend not in ("loop", "grouped_mm"):
            raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
        for layer in self._moe_capable_layers():
            if layer.is_moe:
                layer.mlp.experts.backend = backend
