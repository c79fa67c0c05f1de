"""GLM-5 / GLM-5.1 (``glm_moe_dsa``) MoE language model: MLA + DSA attention, DeepSeek-V3-style MoE, optional MTP.

Shape legend:
    B   batch (rows; each row is one sequence unless ``cu_seqlens`` packs several into one row)
    S   sequence length
    T   tokens of the packed stream, T = B * S (row-major: token index ``b * S + s``)
    D   hidden size
    V   vocabulary
    L   decoder layers (``num_hidden_layers``)
    K   routed experts per token (``num_experts_per_tok``)
    KI  DSA keys per query (``index_topk``)

Architecture (Hugging Face ``transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py``; GLM-5 report
arXiv 2602.15763; DeepSeek-V3.2 report for DSA; DeepSeek-V3 arXiv 2412.19437 §2.2 for MTP)::

    h = embed_tokens(ids)
    for i, layer in enumerate(layers):                # pre-norm residual blocks
        a, sel_i = self_attn(input_layernorm(h), topk_indices=replayed_i or sel_{i-1} if "shared")
        h = h + a                                       # MLA (absorbed, MQA mode) over the DSA top-k keys
        h = h + mlp(post_attention_layernorm(h))        # dense SwiGLU (i < first_k_dense_replace) or MoE
    logits = lm_head(norm(h))                          # fp32

    MTP depth k (optional, ``num_nextn_predict_layers``; predicts token t + k + 1 at position t):
        g = eh_proj(cat[enorm(embed_tokens(ids[t + k])), hnorm(h_{k-1}[t])])   h_0 = norm(h) (final-normed)
        h_k = decoder_layer(g)                          # an MoE layer with its own indexer
        mtp_logits_k = lm_head(shared_head.norm(h_k))    # embedding and head shared with the main model

Attention is :class:`moe_rl.attention.MultiheadLatentAttention` (every GLM-5 layer is a DSA layer; the indexer
runs without gradient, the RL setting: its parameters get no gradient from the LM loss and are meant to stay
frozen, prime-rl v0.6.0). The MoE is :class:`moe_rl.moe.MoE` (sigmoid router, noaux_tc correction bias,
``routed_scaling_factor``). HF hard-codes eps 1e-6 for the two MLA latent norms (``q_a_layernorm``,
``kv_a_layernorm``); so do we. Parameter names are the Hugging Face ones without ``model.``, except the router
(``mlp.router`` here, ``mlp.gate`` in HF) and the MTP layers (``mtp_layers.{j}`` here, ``model.layers.{L + j}``
in the checkpoint); :mod:`moe_rl.models.glm_moe_dsa.state_dict` converts.

Replay (R3 / index replay): ``replay_ids`` fixes the routed experts of every MoE layer (vLLM ``routed_experts``
layout), ``topk_indices`` fixes the DSA key selection of every layer (``[T, KI]`` in token-index coordinates, the
stable contract of :func:`moe_rl.attention.dsa_attention`). ``hidden_states(..., return_topk_indices=True)``
returns the selections each layer used, so they can be recorded and replayed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_rl.attention.mla import MLAConfig, MultiheadLatentAttention
from moe_rl.models.common.decoder import (
    MLA_UNIT_NORMS,
    MoeCausalLMMixin,
    PreNormDecoderLayer,
    RMSNorm,
    as_per_layer,
    split_replay_ids,
    token_stream,
)
from moe_rl.models.common.decoder import mla_config as common_mla_config
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
from moe_rl.moe import ExpertsBackend

__all__ = [
    "GlmMoeDsaDecoderLayer",
    "GlmMoeDsaForCausalLM",
    "GlmMoeDsaMTPLayer",
    "GlmMoeDsaOutput",
    "mla_config",
]

def mla_config(cfg: GlmMoeDsaConfig, *, own_indexer: bool = True) -> MLAConfig:
    """The :class:`MLAConfig` of one ``glm_moe_dsa`` layer (DSA on; ``own_indexer=False`` for a shared layer)."""
    return common_mla_config(
        cfg,
        index_topk=cfg.index_topk,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        indexer_rope_interleave=True,
        own_indexer=own_indexer,
        dsa_backend=cfg.attn_backend,
    )


class GlmMoeDsaOutput(NamedTuple):
    """``logits [B, S, V]`` fp32; ``topk_indices``: per decoder layer ``[T, KI]`` int64 DSA selection;
    ``mtp_logits``: per MTP depth k = 1, 2, ... ``[B, S - k, V]`` fp32 (row t predicts token t + k + 1)."""

    logits: Tensor
    topk_indices: list[Tensor]
    mtp_logits: list[Tensor]


class GlmMoeDsaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: MLA + DSA attention, then a dense SwiGLU MLP or an :class:`moe_rl.moe.MoE` (``mlp``).

    ``forward(h [T, D], *, cu_seqlens, token_idx, topk_indices=None, replay_ids=None, cp_group=None)`` ->
    ``(h [T, D], topk_indices [T, KI] int64)``. ``replay_ids`` ``[T, K]`` is used by MoE layers only.
    """

    def __init__(
        self,
        cfg: GlmMoeDsaConfig,
        layer_idx: int,
        experts_backend: ExpertsBackend,
        *,
        own_indexer: bool = True,
    ) -> None:
        super().__init__(
            cfg, layer_idx, experts_backend, MultiheadLatentAttention(mla_config(cfg, own_indexer=own_indexer))
        )

    @property
    def has_indexer(self) -> bool:
        return self.self_attn.indexer is not None

    def forward(
        self,
        h_TD: Tensor,
        *,
        cu_seqlens: Tensor,
        token_idx: Tensor,
        topk_indices: Tensor | None = None,
        replay_ids: Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> tuple[Tensor, Tensor]:
        attn = self.self_attn(
            self.input_layernorm(h_TD),
            cu_seqlens=cu_seqlens,
            token_idx=token_idx,
            topk_indices=topk_indices,
            cp_group=cp_group,
            cp_method="dsa_allgather" if cp_group is not None else None,
        )
        return self.mlp_residual(h_TD + attn.hidden, replay_ids), attn.topk_indices


class _SharedHead(nn.Module):
    """``shared_head.norm`` of an MTP layer (the head matrix itself is the main model's ``lm_head``)."""

    def __init__(self, cfg: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GlmMoeDsaMTPLayer(GlmMoeDsaDecoderLayer):
    """One multi-token-prediction depth (DeepSeek-V3 §2.2): an MoE decoder layer with its own DSA indexer plus
    ``enorm``, ``hnorm`` ``[D]``, ``eh_proj`` ``[D, 2D]`` (input ``[enorm(emb) | hnorm(h)]``) and
    ``shared_head.norm`` ``[D]``. Checkpoint names: ``model.layers.{num_hidden_layers + j}.<same>``."""

    def __init__(self, cfg: GlmMoeDsaConfig, layer_idx: int, experts_backend: ExpertsBackend) -> None:
        super().__init__(cfg, layer_idx, experts_backend, own_indexer=True)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = _SharedHead(cfg)


class GlmMoeDsaForCausalLM(MoeCausalLMMixin, nn.Module):
    """GLM-5 causal LM: ``[B, S]`` int64 ids -> ``[B, S, V]`` fp32 logits.

    Attributes:
        embed_tokens: ``[V, D]`` (``padding_idx = pad_token_id``).
        layers: ``nn.ModuleList`` of L :class:`GlmMoeDsaDecoderLayer` (the unit for FSDP2 ``fully_shard``).
        norm: final RMSNorm. lm_head: ``[V, D]`` (tied to ``embed_tokens`` when ``tie_word_embeddings``).
        mtp_layers: ``nn.ModuleList`` of ``num_nextn_predict_layers`` :class:`GlmMoeDsaMTPLayer` (empty when 0,
            or when built with ``with_mtp=False``).
        cp_group: the context-parallel process group (``None``: no CP). Set by
            :func:`moe_rl.distributed.parallelize.parallelize_model`; every DSA layer then runs
            :func:`moe_rl.attention.dsa_cp_attention` over it and callers pass ``positions``.

    Args:
        cfg: the architecture (any size; :meth:`GlmMoeDsaConfig.glm5_1` is GLM-5.1).
        experts_backend: ``"loop"`` (reference) or ``"grouped_mm"``; see :meth:`set_experts_backend`.
        with_mtp: build the MTP layers (default True when ``cfg.num_nextn_predict_layers > 0``). transformers'
            ``GlmMoeDsaForCausalLM`` drops them on load (``model.layers.78.*`` is ignored); build without them
            to load such a state dict.

    Initialization is deterministic given the torch RNG: normal(0, ``initializer_range``) for every matrix,
    router and expert stack; unit norms; zero biases and correction bias; zero pad-token row.
    """

    def __init__(
        self, cfg: GlmMoeDsaConfig, *, experts_backend: ExpertsBackend = "loop", with_mtp: bool = True
    ) -> None:
        super().__init__()
        self._build_lm(cfg, (
            GlmMoeDsaDecoderLayer(cfg, i, experts_backend, own_indexer=cfg.has_indexer(i))
            for i in range(cfg.num_hidden_layers)
        ))
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp_layers = nn.ModuleList(
            GlmMoeDsaMTPLayer(cfg, cfg.num_hidden_layers + j, experts_backend) for j in range(n_mtp)
        )
        self.cp_group: dist.ProcessGroup | None = None
        self.init_weights()

    _unit_norms = MLA_UNIT_NORMS

    def _moe_capable_layers(self) -> list[nn.Module]:
        return [*self.layers, *self.mtp_layers]

    def indexer_parameters(self) -> list[nn.Parameter]:
        """The DSA indexer parameters (``*.self_attn.indexer.*``): no gradient from the LM loss (the indexer
        runs under ``no_grad``); freeze them or train them with :func:`moe_rl.attention.indexer_kl_loss`."""
        return [p for n, p in self.named_parameters() if ".self_attn.indexer." in n]

    # ------------------------------------------------------------------ forward

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        replay_ids: Tensor | list[Tensor | None] | None = None,
        topk_indices: Tensor | list[Tensor | None] | None = None,
        return_topk_indices: bool = False,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Final-normed hidden states ``[B, S, D]`` (the input of ``lm_head``).

        Args:
            input_ids: ``[B, S]`` int64; each row is one causal sequence (RoPE positions 0..S-1).
            cu_seqlens: optional ``[N + 1]`` boundaries of N sequences packed in one row (``input_ids [1, T]``);
                attention and RoPE positions restart in each.
            replay_ids: routed experts to replay: ``[B, S, L, K]`` integer ids (vLLM ``routed_experts``; dense
                layers' slices ignored) or a list of L ``[B, S, K]`` tensors / None; sentinel rows as in
                :func:`moe_rl.moe.router.topk_route`.
            topk_indices: DSA selections to replay: ``[L, T, KI]`` or a list of L ``[T, KI]`` int tensors / None,
                key indices in token-index coordinates of the row-major stream (``b * S + s``), ``-1`` = none.
                A layer with a given selection skips its indexer; a ``"shared"`` layer without one reuses the
                previous layer's selection.
            return_topk_indices: also return the L ``[T, KI]`` int64 selections the layers used.
            positions: context parallelism only (``self.cp_group`` set): ``[S]`` or ``[B, S]`` int64 absolute
                positions of this rank's columns in rows of ``cp * S`` tokens (from
                :func:`moe_rl.distributed.parallelize.shard_for_context_parallel`); token indices are then
                ``b * cp * S + positions`` (with ``cu_seqlens``: ``[1, S]`` and global boundaries), and
                ``topk_indices`` are in those global coordinates.

        Raises:
            ValueError: bad shapes of ``input_ids``, ``replay_ids``, ``topk_indices`` or ``positions``, or
                ``positions`` missing under CP / given without CP.
        """
        cfg = self.config
        L = cfg.num_hidden_layers
        batch, seq = input_ids.shape if input_ids.dim() == 2 else (0, 0)
        cu, tok = token_stream(input_ids, cu_seqlens, positions, self.cp_group)
        T = batch * seq
        moe_replay = split_replay_ids(replay_ids, L, batch, seq, cfg.num_experts_per_tok)
        idx_replay = as_per_layer(topk_indices, L, "topk_indices", "[T, index_topk]")
        if idx_replay is None:
            if topk_indices.dim() != 3 or topk_indices.shape[:2] != (L, T):
                raise ValueError(
                    f"topk_indices has shape {tuple(topk_indices.shape)} but the model expects "
                    f"[L, T, index_topk] = ({L}, {T}, {cfg.index_topk})"
                )
            idx_replay = list(topk_indices.unbind(0))
        h = self.embed_tokens(input_ids).reshape(T, -1)
        used: list[Tensor] = []
        prev = None
        for i, layer in enumerate(self.layers):
            sel = idx_replay[i]
            if sel is None and not layer.has_indexer:
                sel = prev
            r = moe_replay[i]
            if r is not None and layer.is_moe:
                r = r.reshape(T, -1)
            h, prev = layer(
                h,
                cu_seqlens=cu,
                token_idx=tok,
                topk_indices=sel,
                replay_ids=r if layer.is_moe else None,
                cp_group=self.cp_group,
            )
            used.append(prev)
        h = self.norm(h).view(batch, seq, -1)
        return (h, used) if return_topk_indices else h

    def mtp_logits(self, input_ids: Tensor, hidden: Tensor) -> list[Tensor]:
        """Logits of every MTP depth (DeepSeek-V3 §2.2, chained).

        Args:
            input_ids: ``[B, S]`` the main model's ids (each row one sequence; no packing).
            hidden: ``[B, S, D]`` the main model's final-normed hidden states (:meth:`hidden_states`).

        Returns:
            list over depths k = 1..``num_nextn_predict_layers`` of ``[B, S - k, V]`` fp32 logits; row t predicts
            token ``t + k + 1`` (so the labels are ``input_ids[:, k + 1:]``, the last position has none).
            The MTP layers route and select keys on their own (no replay inputs).

        Raises:
            ValueError: the model was built without MTP layers, S is too short, or context parallelism is on.
        """
        if len(self.mtp_layers) == 0:
            raise ValueError("this model has no MTP layers (num_nextn_predict_layers=0 or with_mtp=False)")
        if self.cp_group is not None:
            raise ValueError(
                "MTP under context parallelism is not supported (the shift by k tokens crosses CP shards); "
                "compute the MTP loss with cp=1 or train without MTP (with_mtp=False)"
            )
        batch, seq = input_ids.shape
        if seq <= len(self.mtp_layers):
            raise ValueError(
                f"sequence length {seq} must exceed num_nextn_predict_layers={len(self.mtp_layers)}"
            )
        out, h_prev = [], hidden
        for k, layer in enumerate(self.mtp_layers, start=1):
            n = seq - k
            emb = layer.enorm(self.embed_tokens(input_ids[:, k:]))
            g = layer.eh_proj(torch.cat([emb, layer.hnorm(h_prev[:, :n])], dim=-1)).reshape(batch * n, -1)
            cu, tok = token_stream(input_ids[:, :n], None, None, self.cp_group)
            h_k, _ = layer(g, cu_seqlens=cu, token_idx=tok)
            h_prev = h_k.view(batch, n, -1)
            out.append(self.lm_head(layer.shared_head.norm(h_prev)).float())
        return out

    def parallelize(self, dims, mesh, **kwargs):
        """Apply EP, CP, activation checkpointing and FSDP2 in place with
        :func:`moe_rl.models.glm_moe_dsa.parallelize.parallelize_glm_moe_dsa` (``kwargs``: its keyword arguments); returns ``self``. The
        generic :func:`moe_rl.distributed.parallelize.parallelize_model` calls this."""
        from moe_rl.models.glm_moe_dsa.parallelize import parallelize_glm_moe_dsa

        return parallelize_glm_moe_dsa(self, dims, mesh, **kwargs)

    def forward(self, input_ids: Tensor, **inputs: Any) -> Tensor:
        """``[B, S]`` int64 ids -> ``[B, S, V]`` fp32 logits; ``inputs``: :meth:`hidden_states`'s keyword arguments
        (``cu_seqlens``, ``replay_ids``, ``topk_indices``, ``positions``), passed on unchanged (another keyword:
        TypeError; ``return_topk_indices`` is :meth:`forward_full`'s)."""
        if "return_topk_indices" in inputs:
            raise TypeError("forward: return_topk_indices is not an input of forward (logits only); call "
                            "forward_full for the DSA selections")
        return super().forward(input_ids, **inputs)

    def forward_full(
        self,
        input_ids: Tensor,
        *,
        replay_ids: Tensor | list[Tensor | None] | None = None,
        topk_indices: Tensor | list[Tensor | None] | None = None,
        positions: Tensor | None = None,
    ) -> GlmMoeDsaOutput:
        """Logits, the DSA selections used by every layer (to record for index replay) and, with MTP layers,
        the MTP logits (:meth:`mtp_logits`). ``positions``: as in :meth:`hidden_states` (MTP needs cp=1).
        Under FSDP2 (:func:`moe_rl.distributed.parallelize.parallelize_model`) this is registered as a forward
        method, so it can be called like ``forward``."""
        h, used = self.hidden_states(
            input_ids,
            replay_ids=replay_ids,
            topk_indices=topk_indices,
            return_topk_indices=True,
            positions=positions,
        )
        mtp = self.mtp_logits(input_ids, h) if len(self.mtp_layers) else []
        return GlmMoeDsaOutput(self.lm_head(h).float(), used, mtp)
