"""GLM-4.5 (``glm4_moe``) decoder-only MoE language model, written with ``moe_rl`` modules.

Shape legend:
    B   batch
    S   sequence length
    T   tokens, T = B * S
    D   hidden size
    H   query heads
    Hkv key/value heads
    Dh  head_dim
    V   vocabulary
    L   decoder layers
    K   experts per token

Architecture (Hugging Face ``transformers/models/glm4_moe/modeling_glm4_moe.py``, GLM-4.5 report
arXiv 2508.06471)::

    h = embed_tokens(ids)
    for layer in layers:                       # pre-norm residual blocks
        h = h + self_attn(input_layernorm(h))   # GQA, q/k/v bias, optional per-head qk RMSNorm,
                                                # partial rotary on the first R dims of each head
        h = h + mlp(post_attention_layernorm(h))   # dense SwiGLU (layers < first_k_dense_replace) or MoE
    logits = lm_head(norm(h))                  # returned in fp32

Our parameter names are the Hugging Face ones without the ``model.`` prefix, except the router
(``mlp.router`` here, ``mlp.gate`` in HF) and the stacked experts; ``moe_rl.models.glm4_moe.state_dict``
converts. Multi-token-prediction (MTP) layers are not part of this model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe_rl.models.common.decoder import (
    MoeCausalLMMixin,
    PreNormDecoderLayer,
    RMSNorm,
    causal_lm_inputs,
    packed_causal_sdpa,
)
from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.rope import apply_rotary, rope_cos_sin
from moe_rl.moe import ExpertsBackend

__all__ = ["GlmMoeAttention", "GlmMoeDecoderLayer", "GlmMoeForCausalLM", "RMSNorm"]


class GlmMoeAttention(nn.Module):
    """Causal grouped-query attention with q/k/v bias, optional qk RMSNorm and partial rotary (SDPA).

    Parameters: ``q_proj [H*Dh, D]``, ``k_proj``/``v_proj [Hkv*Dh, D]`` (with biases when
    ``attention_bias``), ``o_proj [D, H*Dh]`` (no bias), and ``q_norm``/``k_norm [Dh]`` when
    ``use_qk_norm``. Softmax scale is ``Dh**-0.5``.
    """

    def __init__(self, cfg: GlmMoeConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x_BSD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries ``[B, H, S, Dh]`` and keys, values ``[B, Hkv, S, Dh]`` (x's dtype)."""
        batch, seq, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(kv), S, Dh]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None,
                cu_seqlens: list[int] | None = None) -> Tensor:
        """``[B, S, D]`` hidden states and rotary tables ``[S, R]`` or ``[B, S, R]`` -> ``[B, S, D]``.

        ``positions`` (``[S]`` or ``[B, S]``, the ones the tables were built from) is unused here; the
        context-parallel attention of :mod:`moe_rl.distributed.parallelize` needs them as token indices.
        ``cu_seqlens`` (packed input, ``B = 1``): ``[N + 1]`` boundaries of the N sequences of the row; attention is
        causal within each sequence only (block-diagonal: one causal SDPA per sequence, the arithmetic of that
        sequence alone in a row).
        """
        batch, seq, _ = x_BSD.shape
        q, k, v = self.project_qkv(x_BSD, cos, sin)
        out = packed_causal_sdpa(q, k, v, cu_seqlens)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class GlmMoeDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: attention then a dense SwiGLU MLP or an :class:`moe_rl.moe.MoE` (``mlp``)."""

    def __init__(self, cfg: GlmMoeConfig, layer_idx: int, experts_backend: ExpertsBackend) -> None:
        super().__init__(cfg, layer_idx, experts_backend, GlmMoeAttention(cfg))

    def forward(
        self,
        h_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        replay_ids_BSK: Tensor | None = None,
        positions: Tensor | None = None,
        cu_seqlens: list[int] | None = None,
    ) -> Tensor:
        """One block; ``replay_ids_BSK`` (``[B, S, K]``) is used by MoE layers only, ``positions`` and ``cu_seqlens``
        by the attention (see :meth:`GlmMoeAttention.forward`)."""
        x_BSD = self.input_layernorm(h_BSD)
        if cu_seqlens is None:  # the context-parallel attention takes no cu_seqlens
            h_BSD = h_BSD + self.self_attn(x_BSD, cos, sin, positions)
        else:
            h_BSD = h_BSD + self.self_attn(x_BSD, cos, sin, positions, cu_seqlens=cu_seqlens)
        return self.mlp_residual(h_BSD, replay_ids_BSK)


class GlmMoeForCausalLM(MoeCausalLMMixin, nn.Module):
    """GLM-4.5 MoE causal LM: ``[B, S]`` int64 ids -> ``[B, S, V]`` fp32 logits.

    Attributes:
        embed_tokens: ``[V, D]`` embedding (``padding_idx = pad_token_id``, as in Hugging Face).
        layers: ``nn.ModuleList`` of :class:`GlmMoeDecoderLayer` (the unit for FSDP2 ``fully_shard``).
        norm: final RMSNorm.
        lm_head: ``[V, D]`` output head, tied to ``embed_tokens`` when ``tie_word_embeddings``.

    Args:
        cfg: the architecture.
        experts_backend: routed-expert compute, ``"loop"`` (reference, any dtype/size) or
            ``"grouped_mm"`` (``torch._grouped_mm``; fp32/bf16, D and F multiples of 16 bytes). Can be
            switched later with :meth:`set_experts_backend`.

    Initialization is deterministic given the torch RNG state: normal(0, ``initializer_range``) for every
    matrix and the router, zero biases, zero correction bias, unit norms, zero pad-token embedding row.
    """

    def __init__(self, cfg: GlmMoeConfig, *, experts_backend: ExpertsBackend = "loop") -> None:
        super().__init__()
        self._build_lm(cfg, (GlmMoeDecoderLayer(cfg, i, experts_backend) for i in range(cfg.num_hidden_layers)))
        self.init_weights()

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        positions: Tensor | None = None,
        replay_ids: Tensor | list[Tensor | None] | None = None,
        cu_seqlens: Tensor | list[int] | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[B, S, D]`` (the input of ``lm_head``).

        Args:
            input_ids: ``[B, S]`` int64 token ids.
            positions: optional ``[S]`` or ``[B, S]`` rotary positions; default ``0..S-1`` (with ``cu_seqlens``:
                restarting at 0 in each packed sequence). Without ``cu_seqlens`` attention is causal over the whole
                row. Under context parallelism
                (:func:`moe_rl.distributed.parallelize.parallelize_model`) ``input_ids`` holds this rank's columns
                and ``positions`` their absolute positions, which the attention also uses as token indices.
            replay_ids: optional ``[B, S, L, K]`` integer routed-expert ids per token and layer (vLLM's
                ``routed_experts`` layout, dense layers' slices ignored) to replay in every MoE layer, or a
                list of L per-layer ``[B, S, K]`` tensors (None for dense or not-replayed layers). Sentinel
                rows (-1 pad fill, -2 own routing) as in :func:`moe_rl.moe.router.topk_route`.
            cu_seqlens: optional packed input (sequence packing): ``[N + 1]`` ints (list or 1-D integer tensor),
                ``0 = c_0 <= c_1 <= ... <= c_N = S``, the boundaries of N sequences concatenated in the one row of
                ``input_ids [1, S]``. Attention is causal within each sequence (block-diagonal) and the default
                positions restart at 0 in each, so every sequence gets the hidden states it would get alone. Not for
                context parallelism (its attention takes no boundaries).

        Raises:
            ValueError: ``input_ids`` is not 2-D, ``replay_ids`` has the wrong shape, or ``cu_seqlens`` is not a
                valid boundary list for ``input_ids [1, S]``.
        """
        cfg = self.config
        batch, seq, per_layer, cu = causal_lm_inputs(cfg, input_ids, replay_ids, cu_seqlens)
        if positions is None and cu is None:
            positions = torch.arange(seq, device=input_ids.device)
        elif positions is None:
            starts = torch.tensor(cu[:-1], device=input_ids.device)
            counts = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:], strict=True)], device=input_ids.device)
            positions = torch.arange(seq, device=input_ids.device) - torch.repeat_interleave(starts, counts)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        h_BSD = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            if cu is None:
                h_BSD = layer(h_BSD, cos, sin, per_layer[i] if layer.is_moe else None, positions)
            else:
                h_BSD = layer(h_BSD, cos, sin, per_layer[i] if layer.is_moe else None, positions, cu_seqlens=cu)
        return self.norm(h_BSD)

    def parallelize(self, dims, mesh, **kwargs):
        """Apply EP, CP, activation checkpointing and FSDP2 in place with
        :func:`moe_rl.models.glm4_moe.parallelize.parallelize_glm4_moe` (``kwargs``: its keyword arguments); returns ``self``. The
        generic :func:`moe_rl.distributed.parallelize.parallelize_model` calls this."""
        from moe_rl.models.glm4_moe.parallelize import parallelize_glm4_moe

        return parallelize_glm4_moe(self, dims, mesh, **kwargs)
