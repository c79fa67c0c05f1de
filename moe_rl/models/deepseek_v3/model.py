"""DeepSeek-V3 / Kimi-K2 (``deepseek_v3``) MoE language model: MLA attention (no DSA), DeepSeek-V3 MoE.

Shape legend: B batch, S sequence length, T = B * S tokens of the packed row-major stream, D hidden size, V
vocabulary, L decoder layers, K routed experts per token (as in :mod:`moe_rl.models.common.decoder`).

Architecture (Hugging Face ``transformers/models/deepseek_v3/modeling_deepseek_v3.py``; DeepSeek-V3 report
arXiv 2412.19437 §2.1)::

    h = embed_tokens(ids)
    for i, layer in enumerate(layers):                # pre-norm residual blocks
        h = h + self_attn(input_layernorm(h))           # MLA, YaRN rotary on the rope dims
        h = h + mlp(post_attention_layernorm(h))        # dense SwiGLU (i < first_k_dense_replace) or MoE
    logits = lm_head(norm(h))                          # fp32

Attention is :class:`moe_rl.attention.MultiheadLatentAttention` without an indexer (its dense form: per-head keys
``[c_kv W_UK^T | k_pe]``, values ``c_kv W_UV^T``), with YaRN inverse frequencies and cos/sin attention factor
(:class:`moe_rl.attention.YarnRope`) and the softmax scale ``qk_head_dim ** -0.5 * mscale(factor,
mscale_all_dim) ** 2`` (transformers' ``yarn_apply_mscale``). The two latent norms use eps 1e-6 (transformers'
``DeepseekV3RMSNorm`` default, not ``rms_norm_eps``). The MoE is :class:`moe_rl.moe.MoE` with the DeepSeek-V3
router (:func:`moe_rl.models.common.decoder.glm_mlp`: fp32 sigmoid scores, ``e_score_correction_bias`` for the
selection only, group-limited top-k over ``n_group`` groups scored by their top-2 experts, ``norm_topk_prob``
renormalisation with +1e-20, ``routed_scaling_factor``) and ``n_shared_experts`` shared experts. Parameter names
are the Hugging Face ones without ``model.``, except the router (``mlp.router`` here, ``mlp.gate`` in HF);
:mod:`moe_rl.models.deepseek_v3.state_dict` converts.

No MTP module: as transformers' ``DeepseekV3ForCausalLM``, the checkpoint's MTP layers (``model.layers.{L + m}``)
are dropped on load.

Replay (R3): ``replay_ids`` fixes the routed experts of every MoE layer (vLLM ``routed_experts`` layout
``[B, S, L, K]``, dense layers' slices ignored, or a list of L ``[B, S, K]`` / None).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor, nn

from moe_rl.attention.mla import MLAConfig, MultiheadLatentAttention
from moe_rl.models.common.decoder import (
    MLA_UNIT_NORMS,
    MoeCausalLMMixin,
    PreNormDecoderLayer,
    split_replay_ids,
    token_stream,
)
from moe_rl.models.common.decoder import mla_config as common_mla_config
from moe_rl.models.deepseek_v3.config import DeepseekV3Config
from moe_rl.moe import ExpertsBackend

__all__ = ["DeepseekV3DecoderLayer", "DeepseekV3ForCausalLM", "mla_config"]

def mla_config(cfg: DeepseekV3Config) -> MLAConfig:
    """The :class:`MLAConfig` of a ``deepseek_v3`` layer: plain MLA (no DSA indexer), YaRN from
    ``cfg.rope_scaling``, softmax scale :attr:`DeepseekV3Config.softmax_scale`."""
    return common_mla_config(
        cfg, rope_yarn=cfg.rope_scaling, rope_interleave=cfg.rope_interleave, softmax_scale=cfg.softmax_scale,
        index_topk=None,
    )


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: MLA attention, then a dense SwiGLU MLP or an :class:`moe_rl.moe.MoE` (``mlp``).

    ``forward(h [T, D], *, cu_seqlens, token_idx, replay_ids=None, cp_group=None, cp_method=None)`` -> ``h [T, D]``.
    ``replay_ids`` ``[T, K]`` is used by MoE layers only; ``cp_method`` (``"ring"`` / ``"ulysses"``) with ``cp_group``.
    """

    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, experts_backend: ExpertsBackend) -> None:
        super().__init__(cfg, layer_idx, experts_backend, MultiheadLatentAttention(mla_config(cfg)))

    def forward(
        self,
        h_TD: Tensor,
        *,
        cu_seqlens: Tensor,
        token_idx: Tensor,
        replay_ids: Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
        cp_method: str | None = None,
    ) -> Tensor:
        attn = self.self_attn(
            self.input_layernorm(h_TD), cu_seqlens=cu_seqlens, token_idx=token_idx, cp_group=cp_group,
            cp_method=cp_method,
        )
        return self.mlp_residual(h_TD + attn.hidden, replay_ids)


class DeepseekV3ForCausalLM(MoeCausalLMMixin, nn.Module):
    """DeepSeek-V3 / Kimi-K2 causal LM: ``[B, S]`` int64 ids -> ``[B, S, V]`` fp32 logits.

    Attributes:
        embed_tokens: ``[V, D]`` (``padding_idx = pad_token_id``).
        layers: ``nn.ModuleList`` of L :class:`DeepseekV3DecoderLayer` (the unit for FSDP2 ``fully_shard``).
        norm: final RMSNorm. lm_head: ``[V, D]`` (tied to ``embed_tokens`` when ``tie_word_embeddings``).
        cp_group, cp_method: context parallelism (``None``: none); set by
            :func:`moe_rl.models.deepseek_v3.parallelize.parallelize_deepseek_v3`: every layer then runs ring or
            Ulysses attention over ``cp_group`` and callers pass ``positions``.

    Args:
        cfg: the architecture (any size; :meth:`DeepseekV3Config.deepseek_v3`, :meth:`DeepseekV3Config.kimi_k2`).
        experts_backend: ``"loop"`` (reference) or ``"grouped_mm"``; see :meth:`set_experts_backend`.

    ``forward(input_ids, **inputs)`` (``[B, S, V]`` fp32 logits) and ``token_logprobs(input_ids, labels, *,
    temperature, chunk_tokens, **inputs)`` are :class:`~moe_rl.models.common.decoder.MoeCausalLMMixin`'s; their
    ``inputs`` are :meth:`hidden_states`' keyword arguments.

    Initialization is deterministic given the torch RNG: normal(0, ``initializer_range``) for every matrix,
    router and expert stack; unit norms; zero biases and correction bias; zero pad-token row.
    """

    _unit_norms = MLA_UNIT_NORMS

    def __init__(self, cfg: DeepseekV3Config, *, experts_backend: ExpertsBackend = "loop") -> None:
        super().__init__()
        self._build_lm(cfg, (DeepseekV3DecoderLayer(cfg, i, experts_backend) for i in range(cfg.num_hidden_layers)))
        self.cp_group: dist.ProcessGroup | None = None
        self.cp_method: str | None = None
        self.init_weights()

    # ------------------------------------------------------------------ forward

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        replay_ids: Tensor | Sequence[Tensor | None] | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[B, S, D]`` (the input of ``lm_head``).

        Args:
            input_ids: ``[B, S]`` int64, one causal sequence per row (RoPE positions 0..S-1), unless ``cu_seqlens``.
            cu_seqlens, positions: the packed stream's ``[N + 1]`` sequence boundaries in one row (attention and
                RoPE restart in each), and under context parallelism only (``self.cp_group`` set) this rank's
                ``[S]`` / ``[B, S]`` absolute positions, as :func:`moe_rl.models.common.decoder.token_stream` reads
                them.
            replay_ids: routed experts to replay in the MoE layers, ``[B, S, L, K]`` (vLLM ``routed_experts``) or
                L ``[B, S, K]`` / None (:func:`moe_rl.models.common.decoder.split_replay_ids`).

        Raises:
            ValueError: bad shapes of ``input_ids``, ``replay_ids`` or ``positions``, or ``positions`` missing under
                CP / given without CP.
        """
        cfg = self.config
        cu, tok = token_stream(input_ids, cu_seqlens, positions, self.cp_group)
        batch, seq = input_ids.shape
        T = batch * seq
        replay = split_replay_ids(replay_ids, cfg.num_hidden_layers, batch, seq, cfg.num_experts_per_tok)
        h = self.embed_tokens(input_ids).reshape(T, -1)
        for layer, r in zip(self.layers, replay, strict=True):
            r = r.reshape(T, -1) if r is not None and layer.is_moe else None
            h = layer(h, cu_seqlens=cu, token_idx=tok, replay_ids=r, cp_group=self.cp_group,
                      cp_method=self.cp_method)
        return self.norm(h).view(batch, seq, -1)

    def parallelize(self, dims, mesh, **kwargs):
        """Apply EP, CP, activation checkpointing and FSDP2 in place with
        :func:`moe_rl.models.deepseek_v3.parallelize.parallelize_deepseek_v3` (``kwargs``: its keyword arguments);
        returns ``self``."""
        from moe_rl.models.deepseek_v3.parallelize import parallelize_deepseek_v3

        return parallelize_deepseek_v3(self, dims, mesh, **kwargs)
