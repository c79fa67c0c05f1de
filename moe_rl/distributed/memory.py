"""Per-GPU memory plan of a training step, before booking a cluster.

Shape legend: ``T`` tokens per GPU per micro-batch (``micro_batch * seq_len / cp``), ``D`` hidden, ``V`` vocab,
``H``/``Hkv`` query/KV heads of width ``Dh`` (``R`` rotary dims), ``I`` dense MLP width, ``E`` routed experts of
width ``F``, ``K`` top_k, ``S`` shared experts; ``b`` bytes per activation element (4 fp32, 2 bf16).

:func:`plan_memory` gives, per GPU, at the step's high-water mark:

- **parameters**: FSDP2 keeps the sharded master copy in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` casts at all-gather time), so ``4 * params / (dp_shard * cp)`` bytes (experts are split over
  ``ep`` then sharded over ``dp_shard * cp / ep``: the same fraction); ``dp_replicate`` replicates.
- **gradients**: the same sharding, in the reduce dtype (fp32), counted whole (conservative: at the peak only
  the layers already back-propagated have theirs).
- **optimizer**: AdamW ``exp_avg`` and ``exp_avg_sq`` in fp32, sharded like the parameters; 0 with offload.
- **activations** saved for backward at the peak phase, and **working**, the gradients being computed there.
  Two phases compete: the output head's backward (every layer's saved activations still alive, plus the
  log-softmax output ``4 V`` and then its and the logits' gradients ``8 V`` per token, per ``loss_chunk_tokens``
  when the loss is chunked) and, with activation checkpointing, the backward of the largest layer (each layer's
  saved input ``b * D`` per token, that layer's recomputed activations, and its largest gradients).
- **fsdp_allgather**: the unsharded parameters of the largest layer in the param dtype, twice with FSDP2's
  one-layer prefetch, plus its unsharded gradient in the reduce dtype before the reduce-scatter (experts are
  gathered over their ``dp_shard * cp / ep`` group only).

``peak = sum of the components``. The allocator's fragmentation and the CUDA/NCCL context (~1-3 GB on an H200)
are not modelled and are kept free as ``reserve_bytes`` when checking a fit.

Per-token activation bytes (in a chain of layers, each layer's output counted, its input not) are those of this
library's own modules (``moe_rl.models.glm4_moe``: RMSNorm computed in fp32, SDPA attention, SwiGLU,
:class:`moe_rl.moe.MoE` with the ``grouped_mm`` experts), read off what autograd saves and checked with
:class:`moe_rl.distributed.meter.LiveBytesMeter` (``tests/distributed/test_memory.py``: the whole plan within
15% of the peak measured on 2 FSDP2 gloo ranks for two model shapes, fp32 and bf16, with and without
checkpointing; measured 0.98-1.13x):

- attention block (two RMSNorms + attention): ``b (3 H Dh + 2 Hkv Dh) + (16 + 2 b) D + 4 H + 8``, plus ``8 R``
  per position in bf16 (the rotary tables cast per call);
- dense SwiGLU: ``b (4 I + D)``;
- MoE: ``b (3 K D + 4 K F + 4 S F) + 4 E + 32 K + 4``, plus ``2 K D + 4 D`` in bf16 (fp32 router input and the
  fp32 copy of the expert outputs for the weighted sum);
- embedding output ``b D``, final norm ``b D + 4`` (``+ 4 D`` in bf16), the fp32 rotary tables ``8 R`` per
  position;
- GLM-5 MLA + DSA (``glm_moe_dsa``, :func:`_mla_block`): norms, latents, absorbed queries and the int64 ids of the
  ``index_topk`` selected keys, measured exactly on the model's block; it plans a fused sparse-MLA kernel (the
  torch reference sparse attention additionally saves ``index_topk * (4 Dk + 8 H + 1)`` bytes per token).

The seed's arithmetic: one fp32 all-gather of a whole layer of an 800B-parameter, 78-layer model is
``800e9 / 78 * 4 B ~ 41 GB``; :func:`layer_allgather_bytes` gives it, and with ``ep = 8`` the expert part
(97% of a GLM-5.1 MoE layer) shrinks 8x, the tokens travelling by dispatch instead (counted in activations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moe_rl.distributed.parallel_dims import ParallelDims

__all__ = ["ArchSpec", "LayerSpec", "MemoryPlan", "arch_spec", "layer_allgather_bytes", "plan_memory"]

Precision = Literal["fp32", "bf16"]
Checkpointing = Literal["none", "full"]

GiB = 1024**3


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: parameter counts and activation bytes per token as a function of ``b``."""

    dense_params: int
    """Parameters replicated across EP ranks (attention, norms, router, shared experts, dense MLP)."""
    expert_params: int
    """Routed-expert parameters (split over ``ep``)."""
    act_coeffs: tuple[float, float, float]
    """Activation bytes per token ``(c_b, c_4, c_bf16)``: ``c_b * b + c_4``, plus ``c_bf16`` in bf16 (the fp32 or
    cast copies that exist only when the activations are not fp32)."""
    pos_bytes_bf16: float = 0.0
    """Bytes per *position* (shared by the ``micro_batch`` sequences) saved only in bf16 (rotary tables)."""
    bwd_elems: float = 0.0
    """Elements per token of the largest gradients alive together inside this layer's backward (times ``b``):
    the MLP/MoE intermediate and its input rows, or the attention projections, whichever is larger."""

    def act_bytes_per_token(self, b: int, micro_batch: int = 1) -> float:
        """Saved bytes per token for activation element size ``b`` (4 or 2)."""
        return _act(self.act_coeffs, b) + (self.pos_bytes_bf16 / micro_batch if b != 4 else 0.0)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


@dataclass(frozen=True)
class ArchSpec:
    """What the planner needs to know about a model."""

    name: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    embed_params: int
    """Input embedding (and, untied, the output head) plus the final norm."""
    head_act_coeffs: tuple[float, float, float]
    """Final norm + head input, per token (logits are in the transient)."""
    active_params: int
    """Parameters used per token: everything but the unselected routed experts; embedding and head excluded."""
    rotary_dim: int = 0
    """R: the fp32 cos/sin tables ``[S, R]`` are computed once per forward (8 R bytes per position)."""

    @property
    def total_params(self) -> int:
        return self.embed_params + sum(layer.params for layer in self.layers)

    @property
    def expert_params(self) -> int:
        return sum(layer.expert_params for layer in self.layers)


def _act(coeffs: tuple[float, float, float], b: int) -> float:
    """Bytes per token of ``(c_b, c_4, c_bf16)``: ``c_b * b + c_4``, plus ``c_bf16`` when ``b == 2``."""
    c_b, c_4, c_bf16 = coeffs
    return c_b * b + c_4 + (c_bf16 if b != 4 else 0.0)


def _add(*terms: tuple[float, float, float]) -> tuple[float, float, float]:
    return tuple(sum(t[i] for t in terms) for i in range(3))  # type: ignore[return-value]


def _attn_block(d: int, h: int, hkv: int, dh: int) -> tuple[float, float, float]:
    """Two RMSNorms + GQA attention of ``moe_rl.models.glm4_moe`` (input included when saved)."""
    return (3.0 * h * dh + 2.0 * hkv * dh + 2.0 * d, 4.0 * h + 8.0 + 16.0 * d, 0.0)


def _mlp(d: int, i: int) -> tuple[float, float, float]:
    return (4.0 * i + d, 0.0, 0.0)


def _moe(d: int, f: int, e: int, k: int, s: int) -> tuple[float, float, float]:
    return (3.0 * k * d + 4.0 * k * f + 4.0 * s * f, 4.0 * e + 32.0 * k + 4.0, 2.0 * k * d + 4.0 * d)


def _mla_block(c) -> tuple[float, float, float]:
    """Two RMSNorms + MLA + DSA of ``moe_rl.models.glm_moe_dsa``, input and output included when saved (as in
    :func:`_attn_block`), read off what autograd saves and checked with
    :class:`moe_rl.distributed.meter.LiveBytesMeter` (``tests/models/test_glm_moe_dsa.py``: the block exact in
    fp32 and bf16, the whole model within 1%). Per token, ``Dk = kv_lora_rank + qk_rope_head_dim``:

    - ``b``: the layer input (D; an fp32 copy instead in bf16), the input norm's normalized value and output
      (2 D), the residual sum, its normalized value and the block output (3 D; the residual sum an fp32 copy in
      bf16), the q / kv down-projection outputs (Cq + Ckv + Dr; fp32 copies in bf16), the q latent norm (2 Cq),
      the kv latent norm (Ckv), the rotary tables (Dr), ``q_b_proj``'s output H (Dn + Dr), the latent attention
      output and ``o_proj``'s input H (Ckv + Dv);
    - fp32 always: the absorbed queries 4 H Dk, softmax statistics 5 H, four norm rsqrt 16, and the int64
      gather ids of the selected keys ``8 index_topk``;
    - bf16 only: the fp32 copies the norms make (4 D + 2 Cq + 2 Ckv, net of the b-sized tensors they replace).

    Not included: the torch reference sparse attention also saves the gathered fp32 latent rows ``[T, K, Dk]``
    and two ``[T, H, K]`` fp32 score/probability tensors, ``K (4 Dk + 8 H + 1)`` bytes per token (5.8 MB per
    token per layer at GLM-5 sizes): GPU training needs a fused sparse-MLA kernel (FlashMLA) that keeps
    only q, the latent, the output and the LSE, which is what this plans. The indexer runs without grad."""
    d, h, ql, kvl = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    per_b = 6.0 * d + 3.0 * ql + 2.0 * kvl + 2.0 * dr + h * (dn + dr) + h * (kvl + dv)
    per_4 = 16.0 + 8.0 * c.index_topk + 4.0 * h * (kvl + dr) + 5.0 * h
    return (per_b, per_4, 4.0 * d + 2.0 * ql + 2.0 * kvl)


def arch_spec(model_config) -> ArchSpec:
    """Parameter counts and activation coefficients of a ``GlmMoeConfig`` (glm4_moe) or ``GlmMoeDsaConfig``.

    Raises:
        TypeError: another config type.
    """
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

    c = model_config
    if not isinstance(c, (GlmMoeConfig, GlmMoeDsaConfig)):
        raise TypeError(
            f"model_config must be a GlmMoeConfig or GlmMoeDsaConfig, got {type(model_config).__name__}"
        )
    d, v = c.hidden_size, c.vocab_size
    embed = v * d * (1 if c.tie_word_embeddings else 2) + d
    layers = []
    active = 0
    if isinstance(c, GlmMoeConfig):
        h, hkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = (h + 2 * hkv) * dh if c.attention_bias else 0
        attn_p = d * (h + 2 * hkv) * dh + bias + h * dh * d + (2 * dh if c.use_qk_norm else 0) + 2 * d
        attn_a = _attn_block(d, h, hkv, dh)
        attn_heads_elems = h * dh + hkv * dh
        pos = 8.0 * c.rotary_dim  # bf16 only: the rotary tables cast per call, per position
        name = "glm4_moe"
    else:
        h, ql, kvl = c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
        dn, dr, dvh = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        ni, di = c.index_n_heads, c.index_head_dim
        mla_p = d * ql + ql + ql * h * (dn + dr) + d * (kvl + dr) + kvl + kvl * h * (dn + dvh) + h * dvh * d
        idx_p = ql * ni * di + d * di + 2 * di + d * ni  # wq_b, wk, k_norm (weight + bias), weights_proj
        attn_p = mla_p + idx_p + 2 * d
        attn_a = _mla_block(c)
        attn_heads_elems = h * (dn + dr) + h * (dn + dr + dvh)
        pos = 0.0  # MLA builds its rotary tables per token inside the block: counted in _mla_block
        name = "glm_moe_dsa"
    e, f, k, s = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.n_shared_experts
    moe_dense_p = attn_p + e * d + 3 * d * s * f
    # largest gradients alive together in a layer's backward: the expert intermediate [T*K, 2F] and rows [T*K, D],
    # or the attention's q/k/v/output gradients plus the input gradient, or the dense MLP's [T, 2I] and [T, D]
    attn_bwd = 2.0 * attn_heads_elems + d
    moe_bwd = max(attn_bwd, k * (2.0 * f + d))
    for i in range(c.num_hidden_layers):
        # an IndexCache "shared" DSA layer (indexer_types) has no indexer weights of its own
        no_idx = idx_p if name == "glm_moe_dsa" and not c.has_indexer(i) else 0
        if c.is_moe_layer(i):
            layers.append(
                LayerSpec(moe_dense_p - no_idx, 3 * e * d * f, _add(attn_a, _moe(d, f, e, k, s)), pos, moe_bwd)
            )
            active += moe_dense_p - no_idx + 3 * k * d * f
        else:
            dense = attn_p - no_idx + 3 * d * c.intermediate_size
            bwd = max(attn_bwd, 2.0 * c.intermediate_size + d)
            layers.append(LayerSpec(dense, 0, _add(attn_a, _mlp(d, c.intermediate_size)), pos, bwd))
            active += dense
    for _ in range(getattr(c, "num_nextn_predict_layers", 0)):  # MTP: enorm, hnorm, shared_head.norm, eh_proj
        layers.append(  # [D, 2D] and an MoE layer with its own indexer
            LayerSpec(moe_dense_p + 3 * d + 2 * d * d, 3 * e * d * f,
                      _add(attn_a, _moe(d, f, e, k, s), (2.0 * d, 16.0 * d, 0.0)), pos, moe_bwd)
        )
    # embedding output + the fp32 rotary tables (per position, counted per token at micro_batch 1) + final norm;
    # the logits side is planned per loss chunk (plan_memory)
    head = (2.0 * d, 4.0, 4.0 * d)
    return ArchSpec(name, d, v, tuple(layers), embed, head, active, rotary_dim=int(pos // 8))


def layer_allgather_bytes(total_params: float, num_layers: int, dtype_bytes: int = 4) -> float:
    """Bytes of one FSDP all-gather of a whole (average) layer: ``total_params / num_layers * dtype_bytes``.

    The seed's arithmetic: 800e9 / 78 * 4 B = 41.0e9 B (~41 GB, "about 40 GB").
    """
    return total_params / num_layers * dtype_bytes


@dataclass
class MemoryPlan:
    """Per-GPU bytes of a training step; see the module docstring for each component."""

    arch: str
    parallel_dims: ParallelDims
    tokens_per_gpu: int
    components: dict[str, float]
    """Bytes per GPU at the peak: parameters, gradients, optimizer, activations (saved for backward at that
    moment), working (gradients being computed there), fsdp_allgather (unsharded layer buffers)."""
    peak_phase: str
    """Where the peak is: ``"output_head_backward"`` or ``"layer_backward"``."""
    details: dict[str, float] = field(default_factory=dict)
    reserve_bytes: float = 3 * GiB
    """CUDA context, NCCL buffers and allocator fragmentation, not modelled; kept free when checking a fit."""

    @property
    def peak_bytes(self) -> float:
        """Sum of all components."""
        return float(sum(self.components.values()))

    def fits(self, gpu_bytes: float) -> bool:
        """Whether ``peak_bytes + reserve_bytes <= gpu_bytes``."""
        return self.peak_bytes + self.reserve_bytes <= gpu_bytes

    def report(self, gpu_bytes: float | None = None) -> str:
        """A markdown table of the components (GiB and share of the peak), and the verdict for ``gpu_bytes``."""
        lines = ["| component | GiB per GPU | share |", "|---|---:|---:|"]
        peak = self.peak_bytes
        for name, value in self.components.items():
            lines.append(f"| {name} | {value / GiB:.2f} | {100 * value / peak:.1f}% |")
        lines.append(f"| **peak** | **{peak / GiB:.2f}** | 100% |")
        if gpu_bytes is not None:
            margin = gpu_bytes - peak - self.reserve_bytes
            verdict = "fits" if margin >= 0 else "does NOT fit"
            lines.append("")
            lines.append(
                f"{verdict} in {gpu_bytes / GiB:.1f} GiB with {self.reserve_bytes / GiB:.1f} GiB reserved: "
                f"margin {margin / GiB:+.2f} GiB"
            )
        return "\n".join(lines)


def plan_memory(
    model_config,
    parallel_dims: ParallelDims,
    seq_len: int,
    micro_batch: int = 1,
    precision: Precision = "bf16",
    activation_checkpointing: Checkpointing = "full",
    optimizer_offload: bool = False,
    *,
    fsdp_prefetch: bool = True,
    loss_chunk_tokens: int | None = None,
    optimizer_states: int = 2,
) -> MemoryPlan:
    """Plan per-GPU memory of one training micro-step (forward + backward) and the optimizer step.

    Args:
        model_config: ``GlmMoeConfig`` or ``GlmMoeDsaConfig``.
        parallel_dims: the layout (:class:`ParallelDims`).
        seq_len: tokens per sequence (split over ``cp``).
        micro_batch: sequences per micro-batch per data-parallel rank.
        precision: ``"bf16"`` (FSDP2 mixed precision: bf16 compute and all-gathers, fp32 master weights,
            gradients and optimizer state) or ``"fp32"`` (everything fp32).
        activation_checkpointing: ``"none"`` or ``"full"`` (every decoder layer checkpointed).
        optimizer_offload: AdamW state on the host (0 GPU bytes for it).
        fsdp_prefetch: FSDP2's forward/backward prefetch of the next layer (two unsharded layers at once).
        loss_chunk_tokens: compute the head + loss in chunks of this many tokens (``None``: all at once).
        optimizer_states: fp32 tensors per parameter in the optimizer (AdamW: 2).

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: ``seq_len`` not divisible by ``parallel_dims.cp``, non-positive sizes, or an unknown
            precision / checkpointing mode; the message names the value and the rule.
    """
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len={seq_len} and micro_batch={micro_batch} must be >= 1")
    if seq_len % parallel_dims.cp:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by cp={parallel_dims.cp} (each CP rank holds seq_len / cp tokens)"
        )
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} must be 'fp32' or 'bf16'")
    if activation_checkpointing not in ("none", "full"):
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r} must be 'none' or 'full'")
    if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 1 or None")
    arch = arch_spec(model_config)
    b = 4 if precision == "fp32" else 2
    pd = parallel_dims
    shard = pd.fsdp_size
    tokens = micro_batch * seq_len // pd.cp

    params = 4.0 * arch.total_params / shard
    grads = 4.0 * arch.total_params / shard
    optim = 0.0 if optimizer_offload else 4.0 * optimizer_states * arch.total_params / shard

    per_layer = [layer.act_bytes_per_token(b, micro_batch) for layer in arch.layers]
    head_act = _act(arch.head_act_coeffs, b)
    # logits side of the head, per loss chunk: the fp32 log-softmax output (the logits themselves are not saved)
    head_tokens = tokens if loss_chunk_tokens is None else min(tokens, loss_chunk_tokens)
    logits_saved = head_tokens * arch.vocab_size * 4.0
    positions = seq_len // pd.cp
    head_act += 8.0 * arch.rotary_dim * positions / tokens
    if activation_checkpointing == "none":
        layer_saved = tokens * sum(per_layer)
        recompute = 0.0
    else:  # each checkpointed layer keeps its input; one layer's activations exist again while it is recomputed
        layer_saved = tokens * len(per_layer) * b * arch.hidden_size
        recompute = tokens * max(per_layer)
    head_saved = tokens * head_act + logits_saved
    head_bwd = 2.0 * logits_saved  # gradients of the log-softmax output and of the fp32 logits (8 V per token)
    layer_bwd = tokens * b * max(layer.bwd_elems for layer in arch.layers)

    # FSDP all-gather of the largest layer in the param dtype (twice with prefetch) + its unsharded gradient in
    # the reduce dtype before the reduce-scatter; experts are gathered only over their efsdp group
    def unsharded(layer: LayerSpec, nbytes: int) -> float:
        return nbytes * (layer.dense_params + layer.expert_params / pd.ep)

    biggest = max(arch.layers, key=lambda lyr: unsharded(lyr, 1))
    one_gather = unsharded(biggest, b)
    gather = one_gather * (2 if fsdp_prefetch else 1) + unsharded(biggest, 4) if shard > 1 else 0.0
    # the two candidate high-water marks: the head's backward (all saved activations still alive) and the
    # backward of the largest layer (with checkpointing: its recomputed activations on top of the saved inputs)
    phases = {
        "output_head_backward": (layer_saved + head_saved, head_bwd),
        "layer_backward": (layer_saved + recompute, layer_bwd),
    }
    phase = max(phases, key=lambda name: sum(phases[name]))
    acts, work = phases[phase]
    return MemoryPlan(
        arch=arch.name,
        parallel_dims=pd,
        tokens_per_gpu=tokens,
        components={
            "parameters": params,
            "gradients": grads,
            "optimizer": optim,
            "activations": acts,
            "working": work,
            "fsdp_allgather": gather,
        },
        peak_phase=phase,
        details={
            "total_params": float(arch.total_params),
            "active_params": float(arch.active_params),
            "act_bytes_per_token_per_layer_max": float(max(per_layer)),
            "layer_allgather_bytes": float(one_gather),
            "output_head_backward_bytes": float(sum(phases["output_head_backward"])),
            "layer_backward_bytes": float(sum(phases["layer_backward"])),
            "tokens_per_gpu": float(tokens),
            "bytes_per_activation": float(b),
            "layers": float(len(arch.layers)),
        },
    )


def _main(argv: list[str] | None = None) -> int:
    import argparse

    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

    models = {"glm5_1": GlmMoeDsaConfig.glm5_1, "glm45_air": GlmMoeConfig.glm45_air, "tiny": GlmMoeConfig.tiny_debug}
    p = argparse.ArgumentParser(description="Per-GPU memory plan of a training step (moe_rl.distributed.memory)")
    p.add_argument("--model", choices=sorted(models), default="glm5_1")
    p.add_argument("--nodes", type=int, nargs="+", default=[28], help="trainer nodes (one plan per value)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-gb", type=float, default=141.0, help="GPU memory in GB (1e9 bytes); H200: 141")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--ac", choices=["full", "none"], default="full")
    p.add_argument("--loss-chunk-tokens", type=int, default=None)
    p.add_argument("--optimizer-offload", action="store_true")
    a = p.parse_args(argv)
    if a.gpu_gb <= 0:
        p.error(f"--gpu-gb {a.gpu_gb} must be > 0 (GPU memory in GB, e.g. 141 for an H200)")
    for name in ("gpus_per_node", "seq_len", "micro_batch", "cp", "ep", "dp_replicate"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if min(a.nodes) < 1:
        p.error(f"--nodes {a.nodes}: every value must be >= 1")
    cfg = models[a.model]()
    spec = arch_spec(cfg)
    print(f"# {a.model}: {spec.total_params / 1e9:.3g}B parameters ({spec.active_params / 1e9:.3g}B active, "
          "embedding and head excluded)\n")
    for nodes in a.nodes:
        world = nodes * a.gpus_per_node
        if world % (a.dp_replicate * a.cp):
            p.error(f"{world} GPUs are not divisible by dp_replicate*cp = {a.dp_replicate * a.cp}")
        try:
            dims = ParallelDims(
                dp_replicate=a.dp_replicate, dp_shard=world // (a.dp_replicate * a.cp), cp=a.cp, ep=a.ep
            )
            plan = plan_memory(cfg, dims, a.seq_len, a.micro_batch, a.precision, a.ac, a.optimizer_offload,
                               loss_chunk_tokens=a.loss_chunk_tokens)
        except ValueError as err:
            p.error(str(err))
        print(f"## {nodes} nodes x {a.gpus_per_node} GPUs: dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} "
              f"cp={dims.cp} ep={dims.ep}; seq {a.seq_len} x {a.micro_batch}, {a.precision}, AC {a.ac}, "
              f"loss chunk {a.loss_chunk_tokens}; peak in {plan.peak_phase}\n")
        print(plan.report(a.gpu_gb * 1e9))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
