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
- **activations** saved for backward at the peak phase, and **working**, the gradients or transients there.
  For ``glm_moe_dsa`` two more phases compete, the DSA attention's forward (the indexer: ``[Tq, Tk]`` scores with
  the dense reference, bounded tiles with the memory-bounded path) and its backward, each with the layer inputs
  saved so far and the attention block's own activations; and the **optimizer step** (no activations; with
  offload the AdamW state is back on the GPU; AdamW's foreach update adds one fp32 copy of the local shard).
  The rest is the original pair: the output head's backward (every layer's saved activations still alive, plus the
  log-softmax output ``4 V`` and then its and the logits' gradients ``8 V`` per token, per ``loss_chunk_tokens``
  when the loss is chunked) and, with activation checkpointing, the backward of the largest layer (each layer's
  saved input ``b * D`` per token, that layer's recomputed activations, and its largest gradients).
- **fsdp_allgather**: the unsharded parameters of the largest layer in the param dtype, twice with FSDP2's
  one-layer prefetch, plus its unsharded gradient in the reduce dtype before the reduce-scatter (experts are
  gathered over their ``dp_shard * cp / ep`` group only).

``peak = sum of the components``. What the trainer runs is read by :func:`trainer_plan_inputs` (dtype, DSA kernel,
checkpointing, offload, FP8, CP; the MTP layer, not run by ``token_logprobs``, has no gradient or optimizer state).
Validated against :class:`moe_rl.distributed.meter.LiveBytesMeter` peaks of a scaled-down GLM-5 through
``parallelize_model`` at cp 1/2/4 and 4 sequence lengths: planned / measured 0.944-1.099
(``benchmarks/memory_validation.py``; ``docs/memory.md``). The allocator's fragmentation and the CUDA/NCCL context (~1-3 GB on an H200)
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
- GLM-5 MLA + DSA (``glm_moe_dsa``): norms, projections and latents (:func:`_mla_block`) plus what the DSA
  kernel the trainer runs saves (:func:`_dsa_saved`; ``Dk`` latent key width, ``K = index_topk``): the dense
  reference ``4 H Dk + 5 H + K (4 Dk + 8 H + 9)`` (fp32 queries, gathered fp32 rows, probabilities), the
  memory-bounded path ``b H Dk + b Dk Tk / Tq + 8 K + 4 H`` (its inputs, ids and log-sum-exp); the block measured
  exactly and the whole model within 1% for both (``tests/models/test_glm_moe_dsa.py``).
- DeepSeek-V3 / Kimi-K2 plain MLA (``deepseek_v3``, :func:`mla_arch_spec`): the same norms, projections and
  latents, then the dense form (per-head keys ``[c_kv W_UK^T | k_pe]``, values ``c_kv W_UV^T``): the attention
  saves ``q``, ``k`` (``2 H (Dn + Dr)``), ``v`` and ``o_proj``'s input (``2 H Dv``), the fp32 output and
  log-sum-exp (``4 H Dv + 4 H``, the output shared with ``o_proj``'s input in fp32) (:func:`_mla_dense_block`).
  The attention kernels materialise fp32 scores (no flash kernel): under CP the ring attention computes one
  ``[H, Tq, Tk]`` block per hop (``Tq = Tk = T``) with at most 3 (forward) / 5 (backward) fp32 copies alive, plus
  the bool mask; without CP the reference attention over the whole packed stream saves the probabilities and
  exponentials ``8 H T`` per token (plus the mask and fp32 copies of q, k, v) and holds 2 / 4 more copies as
  transients (:func:`_dense_attn_saved`, :func:`_dense_attn_transient`). Read off the code, not yet measured with
  ``LiveBytesMeter``: the O(T^2) terms dominate at long sequences, and they are exact counts of the tensors.

- Nemotron-H / Nemotron-3 (``nemotron_h``, :func:`hybrid_arch_spec`): one mixer per layer, each kind planned on
  its own: Mamba-2 (:func:`_mamba_mixer`: projections, conv, the SSD scan's fp32 decays and chunk states
  ``[nchunks, H, P, N]``, the gated norm; :func:`_ssd_chunk_bytes` the chunk-level decays, quadratic in the chunks
  per sequence; under CP the state correction of :func:`moe_rl.ssm.ssd_scan_cp`), GQA attention (fused SDPA without
  CP; the ring attention's fp32 score blocks as transients under CP, as for ``deepseek_v3``), the squared-ReLU MLP
  and the latent MoE (:func:`_hybrid_moe`). The per-token coefficients of every kind measured exactly with
  ``LiveBytesMeter`` (``tests/models/test_nemotron_h_memory.py``).

The seed's arithmetic: one fp32 all-gather of a whole layer of an 800B-parameter, 78-layer model is
``800e9 / 78 * 4 B ~ 41 GB``; :func:`layer_allgather_bytes` gives it, and with ``ep = 8`` the expert part
(97% of a GLM-5.1 MoE layer) shrinks 8x, the tokens travelling by dispatch instead (counted in activations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, runtime_checkable

from moe_rl.distributed.parallel_dims import ParallelDims

__all__ = [
    "ArchSpec",
    "AttnKernel",
    "GqaShape",
    "HybridMambaShape",
    "LayerSpec",
    "MemoryPlan",
    "MlaDsaShape",
    "MlaShape",
    "MoEDecoderShape",
    "PlanInputs",
    "arch_spec",
    "gqa_arch_spec",
    "hybrid_arch_spec",
    "layer_allgather_bytes",
    "mla_arch_spec",
    "mla_dsa_arch_spec",
    "plan_memory",
    "trainer_plan_inputs",
]

Precision = Literal["fp32", "bf16"]
Checkpointing = Literal["none", "full"]
AttnKernel = Literal["dense", "chunked"]
"""DSA attention of a ``glm_moe_dsa`` layer: ``"dense"`` the torch reference (``[Tq, Tk]`` indexer scores and
autograd through the gathered ``[Tq, K, Dk]`` rows: O(T^2) per layer), ``"chunked"`` the memory-bounded path
(:mod:`moe_rl.attention.dsa_chunked`: streaming top-k, tiled attention recomputed in backward: O(T * K))."""
_DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16"}
# GlmMoeDsaConfig.attn_backend -> planner kernel (the model's "torch" backend is the memory-bounded path)
_MODEL_ATTN_KERNEL = {"dense": "dense", "torch": "chunked"}

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
    mtp: bool = False
    """A multi-token-prediction layer: built and sharded, but not run by the trainer's ``token_logprobs`` (no
    activations, no gradient, no optimizer state)."""
    own_indexer: bool = True
    """DSA layers: runs its own lightning indexer (an IndexCache ``"shared"`` layer reuses the previous top-k)."""
    bwd_bytes_fp32: float = 0.0
    """Bytes per token of fp32 gradients alive in this layer's backward on top of ``b * bwd_elems`` (the Mamba-2
    scan's fp32 chunk states and decays)."""
    ssm_heads: int = 0
    """Mamba-2 layers: SSM heads ``H`` (0 otherwise); with :attr:`ssm_chunk` they give the scan's per-sequence
    chunk-level terms, quadratic in the chunks per sequence (:func:`_ssd_chunk_bytes`)."""
    ssm_chunk: int = 0
    """Mamba-2 layers: the SSD scan's chunk length ``Lc``."""
    ssm_inner: int = 0
    """Mamba-2 layers: the inner width ``I = H P``."""
    kind: str = ""
    """Layer kind where a family has several (``nemotron_h``: ``mamba``, ``attention``, ``mlp``, ``moe``)."""
    fp8_dense_bytes: float | None = None
    """FP8 training: bytes of the e4m3 copies (1 B per weight) and fp32 scales (4 B per 128 x 128 block, tail
    blocks included) of the replicated weights the conversion runs in FP8 (linears; router, norms, biases and
    convolutions excluded), which each forward saves for backward; ``None``: ``dense_params * (1 + 4 / 128^2)``,
    an upper bound (every dense parameter counted)."""
    fp8_expert_bytes: float | None = None
    """FP8 training: the same bytes for all ``E`` routed experts' weights (``/ ep`` per rank; 128 x 128 blocks per
    expert); ``None``: ``expert_params * (1 + 4 / 128^2)``."""

    def act_bytes_per_token(self, b: int, micro_batch: int = 1) -> float:
        """Saved bytes per token for activation element size ``b`` (4 or 2)."""
        return _act(self.act_coeffs, b) + (self.pos_bytes_bf16 / micro_batch if b != 4 else 0.0)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


@dataclass(frozen=True)
class DsaDims:
    """Sizes of one DSA attention: ``H`` query heads, ``Dk = kv_lora_rank + qk_rope_head_dim`` latent key width,
    ``Dv = kv_lora_rank``, ``HI`` x ``DI`` indexer heads, ``K = index_topk``."""

    H: int
    Dk: int
    Dv: int
    HI: int
    DI: int
    K: int


@dataclass(frozen=True)
class DenseAttnDims:
    """Sizes of one dense attention (``deepseek_v3``: MLA expanded per head; ``nemotron_h``: its GQA layers):
    ``H`` query heads, ``Dqk`` query / key width (``qk_nope_head_dim + qk_rope_head_dim``), ``Dv`` value width.
    ``sdpa_without_cp``: without CP the model calls ``F.scaled_dot_product_attention`` (a fused kernel on CUDA:
    output and log-sum-exp only, counted in the block's coefficients), not the O(T^2) reference; under CP the ring
    attention's fp32 score blocks are planned as for ``deepseek_v3``."""

    H: int
    Dqk: int
    Dv: int
    sdpa_without_cp: bool = False


def _dense_attn_saved(d: DenseAttnDims, cp: int, tokens: int) -> float:
    """Bytes per query token that the dense attention kernel saves beyond :func:`_mla_dense_block`.

    ``cp > 1`` (:func:`moe_rl.attention.ring_attention`, a custom autograd function): nothing more (q, k, v, the
    output and log-sum-exp are in the block's coefficients). ``cp == 1`` (:func:`moe_rl.attention.attention_reference`,
    autograd through every op over the whole packed stream of ``tokens`` keys): the exponentials and the
    probabilities ``[H, T, T]`` in fp32 (``8 H T``), the bool visibility mask (``T``), and the fp32 copies of q, k
    and v the scores are computed from (``4 H (2 Dqk + Dv)``; counted in fp32 too, where the q copy is q itself)."""
    if cp > 1 or d.sdpa_without_cp:
        return 0.0
    return (8.0 * d.H + 1.0) * tokens + 4.0 * d.H * (2.0 * d.Dqk + d.Dv)


def _dense_attn_transient(d: DenseAttnDims, cp: int, tokens: int, backward: bool) -> float:
    """Peak bytes alive inside one layer's dense attention beyond its saved tensors (``Tq = Tk = tokens``).

    Ring (``cp > 1``), one ``[H, Tq, Tk]`` block per hop: forward 3 fp32 copies (the masked scores, ``exp(s - m)``
    and the probabilities) plus the bool mask ``Tq Tk``; backward 5 (the scores, the probabilities, ``dP``,
    ``dP - delta`` and ``dS``) plus the mask. Reference (``cp == 1``): forward 2 copies beyond the saved
    exponentials and probabilities (the masked scores and ``s - m``), backward 4 (the gradients of the
    probabilities, of the exponentials, of the scores and their masked copy)."""
    t2 = float(tokens) * tokens
    if cp > 1:
        return (4.0 * (5 if backward else 3) * d.H + 1.0) * t2
    if d.sdpa_without_cp:
        return 0.0
    return 4.0 * (4 if backward else 2) * d.H * t2


# Bytes of the DSA attention: what its sparse attention saves for backward (``_mla_block`` plans the rest of the
# block) and its transients. Tq = local queries of one sequence, Tk = the keys (the whole padded sequence under CP:
# every rank all-gathers the latent), b = activation bytes. Read off the code (moe_rl.attention.dsa / dsa_chunked)
# and checked with LiveBytesMeter: the attention block exactly and the whole model within 1%
# (tests/models/test_glm_moe_dsa.py), the peak of parallelized training steps (tests/distributed/test_memory.py;
# docs/memory.md has the table).
_DENSE_INDEXER_BYTES_PER_QK = 49.0
"""Dense indexer + ``select_topk`` transient per (query, key): the fp32 ``[Tq, Tk]`` scores and their per-chunk
parts (4 + 4), the visibility mask (1), the masked copy (4), the order-preserving int64 keys and the three int64
temporaries that build them (4 + 8 + 8 + 8 + 8)."""
_DENSE_INDEXER_BYTES_PER_QHK = 5.5
"""Dense indexer: the ``[chunk, HI, Tk]`` fp32 einsum / ReLU temporaries (chunk bounded to ~16 MiB per copy)."""


def _dsa_saved(d: DsaDims, kernel: str, b: int, tq: int = 1, tk: int = 1) -> float:
    """Bytes per query token that the DSA sparse attention saves for backward (the indexer runs without grad).

    Both kernels save the int64 top-k ids ``[Tq, K]`` (``8 K``). dense (:func:`moe_rl.attention.sparse_latent_attention`,
    autograd through every op, fp32 math): the fp32 absorbed queries ``[Tq, H, Dk]`` (``4 H Dk``: the queries
    themselves in fp32, their fp32 copy in bf16), the gathered fp32 latent rows ``[Tq, K, Dk]`` (``4 K Dk``), the
    bool key mask ``[Tq, 1, K]`` (``K``), the exponentials and the probabilities ``[Tq, H, K]`` (``8 H K``), the
    softmax denominators ``[Tq, H, 1]`` in fp32 and their bool non-empty flags (``5 H``). chunked
    (:class:`moe_rl.attention.dsa_chunked.SparseLatentAttentionFn`, recomputing in backward): its inputs, the
    absorbed queries ``b H Dk`` and the concatenated latent ``[Tk, Dk]`` (``b Dk Tk / Tq``: under CP the
    all-gathered keys of the whole sequence), and the fp32 log-sum-exp ``[Tq, H]`` (``4 H``). Under CP
    (``Tk > Tq``) both also keep the int64 ``[Tk]`` order that sorts the all-gathered rows (``8 Tk / Tq``)."""
    per_key_row = 8.0 * tk / tq if tk > tq else 0.0
    if kernel == "chunked":
        return b * d.H * d.Dk + b * d.Dk * tk / tq + 8.0 * d.K + 4.0 * d.H + per_key_row
    return 4.0 * d.H * d.Dk + 5.0 * d.H + d.K * (8.0 + 4.0 * d.Dk + 8.0 * d.H + 1.0) + per_key_row


def _dsa_saved_after_indexer(d: DsaDims, kernel: str, b: int) -> float:
    """The part of :func:`_dsa_saved` that does not exist yet while the indexer runs (dense: everything but the
    queries and the ids, which are its inputs and its result; chunked: the log-sum-exp only)."""
    if kernel == "chunked":
        return 4.0 * d.H
    return 5.0 * d.H + d.K * (4.0 * d.Dk + 8.0 * d.H + 1.0)


def _dsa_forward_transient(d: DsaDims, kernel: str, tq: int, tk: int) -> float:
    """Peak bytes alive inside one sequence's DSA forward beyond its saved tensors (indexer or attention tile).

    dense: ``49 Tq Tk + 5.5 min(Tq, chunk) HI Tk`` (:data:`_DENSE_INDEXER_BYTES_PER_QK`; ``chunk`` is the
    dense indexer's default ``2**22 / (HI Tk)`` rows). chunked (``cq = min(Tq, 128)`` query rows per tile,
    ``ck = min(Tk, 2048)`` keys per indexer step, :mod:`moe_rl.attention.dsa_chunked`'s defaults): the top-k
    result ``8 Tq K`` plus the larger of the indexer step ``4 cq HI ck + 24 cq (K + ck)`` and the attention tile
    ``4 cq K (Dk + Dv) + 12 cq H K`` (gathered rows, the value slice, logits and probabilities)."""
    if kernel == "dense":
        chunk = max(1, (1 << 22) // max(1, d.HI * tk))
        return _DENSE_INDEXER_BYTES_PER_QK * tq * tk + _DENSE_INDEXER_BYTES_PER_QHK * min(tq, chunk) * d.HI * tk
    from moe_rl.attention.dsa_chunked import DEFAULT_ATTN_CHUNK, DEFAULT_K_CHUNK, DEFAULT_Q_CHUNK

    cq, ck, ca = min(tq, DEFAULT_Q_CHUNK), min(tk, DEFAULT_K_CHUNK), min(tq, DEFAULT_ATTN_CHUNK)
    step = 4.0 * cq * d.HI * ck + 24.0 * cq * (d.K + ck)
    tile = 4.0 * ca * d.K * (d.Dk + d.Dv) + 12.0 * ca * d.H * d.K
    return 8.0 * tq * d.K + max(step, tile)


def _dsa_backward_transient(d: DsaDims, kernel: str, tq: int, tk: int, b: int) -> float:
    """Peak bytes of one sequence's DSA backward beyond the saved tensors.

    dense: the fp32 gradients of the gathered rows (two ``[Tq, K, Dk]``) and of the scores ``[Tq, H, K]``:
    ``Tq K (8 Dk + 5 H)``. chunked: ``dkv [Tk, Dk]``, ``dq [Tq, H, Dk]`` and the finite LSE in fp32, plus the larger
    of one tile's temporaries, ``12 cq K Dk + 24 cq H K`` (the recomputed gather, its gradient, probabilities and
    their gradients; ``+ 2 cq K Dk`` in bf16 for the gather before its fp32 cast), and the bf16 casts of ``dq`` and
    ``dkv`` made on return ``2 (Tq H Dk + Tk Dk)``."""
    if kernel == "dense":
        return tq * d.K * (8.0 * d.Dk + 5.0 * d.H)
    from moe_rl.attention.dsa_chunked import DEFAULT_ATTN_CHUNK

    ca = min(tq, DEFAULT_ATTN_CHUNK)
    base = 4.0 * tk * d.Dk + 4.0 * tq * d.H * d.Dk + 4.0 * tq * d.H
    tile = (12.0 + (2.0 if b != 4 else 0.0)) * ca * d.K * d.Dk + 24.0 * ca * d.H * d.K
    ret = 2.0 * (tq * d.H * d.Dk + tk * d.Dk) if b != 4 else 0.0
    return base + max(tile, ret)


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
    dsa: DsaDims | None = None
    """``glm_moe_dsa``: the sizes the DSA attention's memory depends on (None for GQA models)."""
    attn_act_coeffs: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Activation bytes per token of the attention block alone (two norms + attention, as in ``act_coeffs``)."""
    dense_attn: DenseAttnDims | None = None
    """``deepseek_v3``: the sizes the dense (O(T^2)-score) attention's memory depends on (None otherwise)."""

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
    """Two RMSNorms + MLA of ``moe_rl.models.glm_moe_dsa`` around its DSA sparse attention, input and output
    included when saved (as in :func:`_attn_block`), read off what autograd saves and checked with
    :class:`moe_rl.distributed.meter.LiveBytesMeter` (``tests/models/test_glm_moe_dsa.py``: with
    :func:`_dsa_saved` the block exact in fp32 and bf16 for both kernels, the whole model within 1%). Per token:

    - ``b``: the layer input (D; an fp32 copy instead in bf16), the input norm's normalized value and output
      (2 D), the residual sum, its normalized value and the block output (3 D; the residual sum an fp32 copy in
      bf16), the q / kv down-projection outputs (Cq + Ckv + Dr; fp32 copies in bf16), the q latent norm (2 Cq),
      the kv latent norm (Ckv), the rotary tables (Dr), ``q_b_proj``'s output H (Dn + Dr), the latent attention
      output and ``o_proj``'s input H (Ckv + Dv);
    - fp32 always: four norm rsqrt 16;
    - bf16 only: the fp32 copies the norms make (4 D + 2 Cq + 2 Ckv, net of the b-sized tensors they replace).

    Not included: what the sparse attention itself saves (queries, latent rows, ids, softmax state), which
    depends on the kernel: :func:`_dsa_saved`. The indexer runs without grad."""
    d, h, ql, kvl = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    per_b = 6.0 * d + 3.0 * ql + 2.0 * kvl + 2.0 * dr + h * (dn + dr) + h * (kvl + dv)
    per_4 = 16.0
    return (per_b, per_4, 4.0 * d + 2.0 * ql + 2.0 * kvl)


def _mla_dense_block(c) -> tuple[float, float, float]:
    """Two RMSNorms + plain MLA in its dense form (``deepseek_v3``), input and output included when saved: the
    norms, projections and latents of :func:`_mla_block`, then, instead of the latent attention output, what the
    dense form saves per token: ``q`` and ``k`` (``2 H (Dn + Dr)``, the concatenations the kernel saves), ``v``
    (``H Dv``), ``o_proj``'s input (``H Dv``), and from the attention kernel the fp32 log-sum-exp (``4 H``) and,
    in bf16 only, its fp32 output (``4 H Dv``; in fp32 it is ``o_proj``'s input itself). The O(T^2) part is
    :func:`_dense_attn_saved`."""
    d, h, ql, kvl = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    per_b = 6.0 * d + 3.0 * ql + 2.0 * kvl + 2.0 * dr + 3.0 * h * (dn + dr) + 2.0 * h * dv
    return (per_b, 16.0 + 4.0 * h, 4.0 * d + 2.0 * ql + 2.0 * kvl + 4.0 * h * dv)


@runtime_checkable
class MoEDecoderShape(Protocol):
    """The sizes of an MoE decoder the planner reads, shared by every attention kind (a family's config has them as
    fields; duck typing, nothing is imported from the model families)."""

    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_hidden_layers: int
    intermediate_size: int
    """Width of the dense MLP of the non-MoE layers."""
    n_routed_experts: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    n_shared_experts: int

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` is an MoE layer (else a dense SwiGLU MLP)."""
        ...


@runtime_checkable
class GqaShape(MoEDecoderShape, Protocol):
    """An MoE decoder with grouped-query attention (``glm4_moe``: two RMSNorms, GQA with optional q/k norm and
    bias, SwiGLU / :class:`moe_rl.moe.MoE`)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    use_qk_norm: bool
    rotary_dim: int


@runtime_checkable
class MlaShape(MoEDecoderShape, Protocol):
    """An MoE decoder with multi-head latent attention (``deepseek_v3``: plain MLA, computed in its dense form)."""

    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@runtime_checkable
class MlaDsaShape(MlaShape, Protocol):
    """An MoE decoder with multi-head latent attention and DSA sparse attention (``glm_moe_dsa``), optionally with
    multi-token-prediction layers."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int

    def has_indexer(self, layer_idx: int) -> bool:
        """Whether DSA layer ``layer_idx`` runs its own lightning indexer (an IndexCache layer reuses the top-k)."""
        ...


def arch_spec(model_config) -> ArchSpec:
    """The planner's :class:`ArchSpec` of a model configuration.

    Dispatch without importing a model family: an :class:`ArchSpec` is returned as is; any other object must have
    an ``arch_spec()`` method (each family's config provides one, built with :func:`gqa_arch_spec`,
    :func:`mla_arch_spec`, :func:`mla_dsa_arch_spec` or :func:`hybrid_arch_spec`).

    Raises:
        TypeError: ``model_config`` is neither an ``ArchSpec`` nor has an ``arch_spec()`` method.
    """
    if isinstance(model_config, ArchSpec):
        return model_config
    method = getattr(model_config, "arch_spec", None)
    if not callable(method):
        raise TypeError(
            f"model_config must be an ArchSpec or a model config with an arch_spec() method (GlmMoeConfig, "
            f"GlmMoeDsaConfig, DeepseekV3Config, NemotronHConfig), got {type(model_config).__name__}; give the "
            "family's config an arch_spec() built with moe_rl.distributed.memory.gqa_arch_spec, mla_arch_spec, "
            "mla_dsa_arch_spec or hybrid_arch_spec"
        )
    spec = method()
    if not isinstance(spec, ArchSpec):
        raise TypeError(f"{type(model_config).__name__}.arch_spec() must return an ArchSpec, got "
                        f"{type(spec).__name__}")
    return spec


def _require(shape: object, protocol: type, what: str) -> None:
    if not isinstance(shape, protocol):
        missing = [n for n in _protocol_members(protocol) if not hasattr(shape, n)]
        raise TypeError(f"{what} needs a {protocol.__name__} (fields {sorted(_protocol_members(protocol))}); "
                        f"{type(shape).__name__} lacks {missing}")


def _protocol_members(protocol: type) -> set[str]:
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass in (Protocol, object, Generic):
            continue
        names |= set(getattr(klass, "__annotations__", {}))
        names |= {n for n, v in vars(klass).items() if callable(v) and not n.startswith("_")}
    return names


def gqa_arch_spec(shape: GqaShape, name: str = "glm4_moe") -> ArchSpec:
    """Parameter counts and activation coefficients of an MoE decoder with GQA attention (``glm4_moe``).

    Args:
        shape: the sizes (:class:`GqaShape`, e.g. a ``GlmMoeConfig``).
        name: the architecture name the plan reports.

    Raises:
        TypeError: ``shape`` lacks a field of :class:`GqaShape`.
    """
    _require(shape, GqaShape, "gqa_arch_spec")
    c = shape
    d = c.hidden_size
    h, hkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    bias = (h + 2 * hkv) * dh if c.attention_bias else 0
    attn_p = d * (h + 2 * hkv) * dh + bias + h * dh * d + (2 * dh if c.use_qk_norm else 0) + 2 * d
    attn_a = _attn_block(d, h, hkv, dh)
    attn_heads_elems = h * dh + hkv * dh
    pos = 8.0 * c.rotary_dim  # bf16 only: the rotary tables cast per call, per position
    return _decoder_arch_spec(c, name, attn_p, attn_a, attn_heads_elems, pos, idx_p=0, mtp_layers=0, dsa=None)


def _mla_heads_elems(c) -> int:
    """Per-token elements of MLA's q heads ``H (dn + dr)`` and k/v heads ``H (dn + dr + dv)``: the
    ``attn_heads_elems`` of :func:`_decoder_arch_spec` (the attention's largest gradients in backward)."""
    h, dn, dr, dvh = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    return h * (dn + dr) + h * (dn + dr + dvh)


def _mla_params(c) -> int:
    """Parameters of one MLA attention (q down/up with the q latent norm, kv down with the kv latent norm, kv up,
    output projection; no biases)."""
    d, h, ql, kvl = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    dn, dr, dvh = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    return d * ql + ql + ql * h * (dn + dr) + d * (kvl + dr) + kvl + kvl * h * (dn + dvh) + h * dvh * d


def mla_arch_spec(shape: MlaShape, name: str = "deepseek_v3") -> ArchSpec:
    """Parameter counts and activation coefficients of an MoE decoder with plain MLA attention computed in its
    dense form (``deepseek_v3``: DeepSeek-V3, Kimi-K2; no DSA indexer; the MTP layers are not built, so none is
    counted).

    Args:
        shape: the sizes (:class:`MlaShape`, e.g. a ``DeepseekV3Config``).
        name: the architecture name the plan reports.

    Raises:
        TypeError: ``shape`` lacks a field of :class:`MlaShape`.
    """
    _require(shape, MlaShape, "mla_arch_spec")
    c = shape
    attn_p = _mla_params(c) + 2 * c.hidden_size
    spec = _decoder_arch_spec(c, name, attn_p, _mla_dense_block(c), _mla_heads_elems(c), 0.0, idx_p=0, mtp_layers=0,
                              dsa=None)
    from dataclasses import replace

    return replace(spec, dense_attn=DenseAttnDims(H=c.num_attention_heads, Dqk=c.qk_nope_head_dim + c.qk_rope_head_dim,
                                                  Dv=c.v_head_dim))


def mla_dsa_arch_spec(shape: MlaDsaShape, name: str = "glm_moe_dsa") -> ArchSpec:
    """Parameter counts and activation coefficients of an MoE decoder with MLA + DSA attention and MTP layers
    (``glm_moe_dsa``).

    Args:
        shape: the sizes (:class:`MlaDsaShape`, e.g. a ``GlmMoeDsaConfig``).
        name: the architecture name the plan reports.

    Raises:
        TypeError: ``shape`` lacks a field of :class:`MlaDsaShape`.
    """
    _require(shape, MlaDsaShape, "mla_dsa_arch_spec")
    c = shape
    d = c.hidden_size
    h, ql, kvl, dr = c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    ni, di = c.index_n_heads, c.index_head_dim
    mla_p = _mla_params(c)
    idx_p = ql * ni * di + d * di + 2 * di + d * ni  # wq_b, wk, k_norm (weight + bias), weights_proj
    attn_p = mla_p + idx_p + 2 * d
    attn_a = _mla_block(c)
    pos = 0.0  # MLA builds its rotary tables per token inside the block: counted in _mla_block
    dsa = DsaDims(H=h, Dk=kvl + dr, Dv=kvl, HI=ni, DI=di, K=c.index_topk)
    return _decoder_arch_spec(c, name, attn_p, attn_a, _mla_heads_elems(c), pos, idx_p=idx_p,
                              mtp_layers=c.num_nextn_predict_layers, dsa=dsa)


@runtime_checkable
class HybridMambaShape(Protocol):
    """A hybrid Mamba-2 / attention / MoE decoder (``nemotron_h``: Nemotron-H, Nemotron-3): one mixer per layer
    after a pre-norm (``layer_kind(i)`` one of ``mamba``, ``attention``, ``mlp``, ``moe``), GQA attention without
    positional encoding, squared-ReLU MLPs and latent MoE (routed experts in ``moe_latent_size``, or the hidden
    width when None)."""

    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mlp_bias: bool
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None

    def layer_kind(self, layer_idx: int) -> str:
        """``"mamba"``, ``"attention"``, ``"mlp"`` or ``"moe"`` for layer ``layer_idx``."""
        ...


def _dual(fp32: float, bf16: float) -> tuple[float, float, float]:
    """Coefficients ``(c_b, c_4, c_bf16)`` of a term worth ``fp32`` bytes per token in fp32 and ``bf16`` in bf16."""
    return (fp32 / 4.0, 0.0, bf16 - fp32 / 2.0)


def _hybrid_norm(d: int) -> tuple[float, float, float]:
    """The pre-norm of a ``nemotron_h`` layer (``NemotronHRMSNorm``: fp32 math, the weight applied before the
    cast), per token: its fp32 normalized value ``4 D`` and rsqrt ``4``, its output ``b D``, the fp32 copy of the
    input ``4 D`` in bf16; and in fp32 the layer's own output ``4 D`` (the next norm saves its input itself: in a
    chain each layer's output counted, its input not). fp32 ``12 D + 4``, bf16 ``10 D + 4``."""
    return _dual(12.0 * d + 4.0, 10.0 * d + 4.0)


def _mamba_mixer(c) -> tuple[float, float, float]:
    """Bytes per token that autograd keeps for one :class:`moe_rl.ssm.Mamba2Mixer` (``ssd_scan``, no CP), beyond
    the chunk-level terms of :func:`_ssd_chunk_bytes`. ``I = H P`` inner width, ``Cd = I + 2 G N`` conv width,
    ``Lc`` chunk length, ``Gn`` gated-norm groups (``n_groups``):

    - projections and conv: fp32 ``4 (I + 2 Cd + H)`` (the ``in_proj`` output, kept whole by its ``z`` view, and the
      conv's padded input) ``+ 8 Cd`` (conv output, SiLU output); bf16 ``4 I`` (the fp32 ``z``) ``+ 2 Cd`` (padded
      input) ``+ 6 Cd`` (conv output, the fp32 ``x | B | C``); the discretized step ``12 H`` (softplus input,
      output, clamp output, fp32);
    - the SSD scan (fp32 always): the intra-chunk decays ``[H, Lc, Lc]`` and their product with ``C B^T`` (``8 H
      Lc``), ``C B^T`` (``4 G Lc``), ``exp`` of the cumulative log-decay (``4 H``), the discretized input, the
      off-diagonal product and its contiguous copy (``12 H P``), the ``B``-decay product (``4 H N``), the chunk
      states and the chunk start states ``[nchunks, H, P, N]`` (``8 H P N / Lc``), contiguous copies of ``B`` and
      ``C`` (``12 G N``; ``8 G N`` in bf16, where the fp32 casts are already contiguous);
    - the gated RMSNorm: the scan output, ``silu(z)``, the product and its normalized value in fp32 (``16 I``),
      its output ``b I`` (``out_proj``'s input) and the rsqrt per group (``4 Gn``).

    Read off :mod:`moe_rl.ssm.mamba2` / :mod:`moe_rl.ssm.ssd` and checked with
    :class:`moe_rl.distributed.meter.LiveBytesMeter` (``tests/models/test_nemotron_h_memory.py``)."""
    h, p, g, n, lc = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.chunk_size
    i = h * p
    cd = i + 2 * g * n
    ssd = 8.0 * h * lc + 4.0 * g * lc + 4.0 * h + 12.0 * h * p + 4.0 * h * n + 8.0 * h * p * n / lc
    fp32 = 4.0 * (i + 2 * cd + h) + 8.0 * cd + 12.0 * h + ssd + 12.0 * g * n + 20.0 * i + 4.0 * g
    bf16 = 4.0 * i + 8.0 * cd + 12.0 * h + ssd + 8.0 * g * n + 18.0 * i + 4.0 * g
    return _dual(fp32, bf16)


def _ssd_chunk_bytes(heads: int, chunk: int, seq_tokens: int) -> float:
    """Bytes per token of one Mamba-2 layer that depend on the sequence length: the inter-chunk decay matrix
    ``exp(segment_sum)`` ``[H, c + 1, c + 1]`` in fp32 and its two bool masks, ``(4 H + 2) (c + 1)^2`` per sequence of
    ``seq_tokens`` local tokens (``c = ceil(seq_tokens / Lc)`` chunks). Read off the code, checked with
    ``LiveBytesMeter``."""
    chunks = -(-seq_tokens // chunk)
    return (4.0 * heads + 2.0) * (chunks + 1) ** 2 / seq_tokens


def _hybrid_moe(c) -> tuple[float, float, float]:
    """Bytes per token of one ``nemotron_h`` latent MoE mixer (``L`` = ``moe_latent_size`` or ``D``; ``F``, ``Fs``
    routed / shared widths): the gathered expert inputs and their fp32 outputs (``b K L + 4 K L``), the expert
    intermediate (``2 b K F``: ReLU and its square), the unweighted outputs once more in the activation dtype
    (``b K L``), the weighted sum (``b L``, kept by ``fc2_latent_proj``: latent only), the shared expert (``2 b Fs``), the router (fp32 scores and their
    copies ``12 E``; ids, weights and the sort's indices ``24 K + 4``) and in bf16 its fp32 input (``4 D``). Read
    off :mod:`moe_rl.models.nemotron_h.moe` and checked with ``LiveBytesMeter``."""
    d, e, k = c.hidden_size, c.n_routed_experts, c.num_experts_per_tok
    f, fs = c.moe_intermediate_size, c.moe_shared_expert_intermediate_size
    lw = c.moe_latent_size or d
    return (2.0 * k * lw + 2.0 * k * f + (lw if c.moe_latent_size else 0) + 2.0 * fs,
            4.0 * k * lw + 24.0 * k + 12.0 * e + 4.0, 4.0 * d)


def _fp8_weight_bytes(out_features: int, in_features: int, count: int = 1) -> float:
    """Bytes of the FP8 copy of ``count`` weights ``[out_features, in_features]`` as :mod:`moe_rl.fp8` makes it
    (``quantize_128x128``; ``quantize_128x128_grouped`` per expert): 1 B per e4m3 code plus one fp32 scale per
    128 x 128 block, partial tail blocks included: ``count (N K + 4 ceil(N / 128) ceil(K / 128))``."""
    return float(count * (out_features * in_features + 4 * -(-out_features // 128) * -(-in_features // 128)))


def hybrid_arch_spec(shape: HybridMambaShape, name: str = "nemotron_h") -> ArchSpec:
    """Parameter counts and activation coefficients of a hybrid Mamba-2 / attention / latent-MoE decoder
    (``nemotron_h``), per layer kind:

    - ``mamba``: ``in_proj [I + Cd + H, D]`` (+ bias), the depthwise conv ``[Cd, 1, K]`` (+ bias), ``dt_bias``,
      ``A_log``, ``D`` (``3 H``), the gated norm ``I``, ``out_proj [D, I]`` (+ bias); activations
      :func:`_mamba_mixer` plus the per-sequence :func:`_ssd_chunk_bytes`;
    - ``attention``: ``q/k/v/o`` without bias (``D (H + 2 Hkv) Dh + H Dh D``); SDPA (fused) saves q, k, v, the
      output and the fp32 log-sum-exp, ``b (2 H Dh + 2 Hkv Dh) + 4 H``; under CP the ring attention's fp32 score
      blocks are the phase transients (:class:`DenseAttnDims` with ``sdpa_without_cp``);
    - ``mlp``: ``up [I, D]``, ``down [D, I]`` (+ biases); squared ReLU keeps ``2 b I``;
    - ``moe``: router ``[E, D]`` (its correction bias is a buffer), routed experts ``2 E F L`` (split over EP),
      shared expert ``2 D Fs``, latent projections ``2 D L`` (+ biases); :func:`_hybrid_moe`;

    FP8 copies (:attr:`LayerSpec.fp8_dense_bytes` / :attr:`LayerSpec.fp8_expert_bytes`, :func:`_fp8_weight_bytes`):
    the weights :func:`moe_rl.moe.convert_model_to_fp8` runs in FP8, Mamba-2 ``in_proj`` / ``out_proj``, ``q/k/v/o``,
    the MLP's and shared expert's ``up`` / ``down``, the latent projections and the routed experts' ``up_proj
    [E, F, L]`` / ``down_proj [E, L, F]``; not the router, the norms, the conv, biases or the head;

    each layer's pre-norm ``D`` (:func:`_hybrid_norm`). Embedding and head ``V D`` each (one when tied) plus the
    final norm. Active parameters: everything but the unselected routed experts, embedding and head excluded.

    Raises:
        TypeError: ``shape`` lacks a field of :class:`HybridMambaShape`.
    """
    _require(shape, HybridMambaShape, "hybrid_arch_spec")
    c = shape
    d, v = c.hidden_size, c.vocab_size
    h, hkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hm, pm, g, n, kc = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel
    im = hm * pm
    cd = im + 2 * g * n
    e, k, f, fs = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, \
        c.moe_shared_expert_intermediate_size
    lat = c.moe_latent_size
    lw = lat or d
    mb = 1 if c.mlp_bias else 0
    norm = _hybrid_norm(d)
    mamba_p = (d * (im + cd + hm) + (im + cd + hm) * (1 if c.use_bias else 0) + cd * kc
               + (cd if c.use_conv_bias else 0) + 3 * hm + im + im * d + (d if c.use_bias else 0) + d)
    attn_p = d * (h + 2 * hkv) * dh + h * dh * d + d
    mlp_p = 2 * d * c.intermediate_size + mb * (c.intermediate_size + d) + d
    moe_dense_p = (e * d + 2 * d * fs + mb * (fs + d) + (2 * d * lat + mb * (lat + d) if lat else 0) + d)
    expert_p = 2 * e * f * lw
    fw = _fp8_weight_bytes
    mamba_8 = fw(im + cd + hm, d) + fw(d, im)
    attn_8 = fw(h * dh, d) + 2 * fw(hkv * dh, d) + fw(d, h * dh)
    mlp_8 = fw(c.intermediate_size, d) + fw(d, c.intermediate_size)
    moe_8 = fw(fs, d) + fw(d, fs) + (fw(lat, d) + fw(d, lat) if lat else 0.0)
    expert_8 = fw(f, lw, e) + fw(lw, f, e)
    attn_a = _add(norm, _dual(4.0 * (2 * h * dh + 2 * hkv * dh) + 4.0 * h, 2.0 * (2 * h * dh + 2 * hkv * dh) + 4.0 * h))
    attn_bwd = 2.0 * (h * dh + hkv * dh) + d
    layers = []
    active = 0
    for i in range(c.num_hidden_layers):
        kind = c.layer_kind(i)
        if kind == "mamba":
            fp32_bwd = 8.0 * hm * pm * n / c.chunk_size + 8.0 * hm * c.chunk_size + 8.0 * hm * pm
            spec = LayerSpec(mamba_p, 0, _add(norm, _mamba_mixer(c)), 0.0, float(im + cd + hm + d),
                             bwd_bytes_fp32=fp32_bwd, ssm_heads=hm, ssm_chunk=c.chunk_size, ssm_inner=im,
                             kind=kind, fp8_dense_bytes=mamba_8, fp8_expert_bytes=0.0)
        elif kind == "attention":
            spec = LayerSpec(attn_p, 0, attn_a, 0.0, attn_bwd, kind=kind, fp8_dense_bytes=attn_8,
                             fp8_expert_bytes=0.0)
        elif kind == "mlp":
            spec = LayerSpec(mlp_p, 0, _add(norm, (2.0 * c.intermediate_size, 0.0, 0.0)), 0.0,
                             2.0 * c.intermediate_size + d, kind=kind, fp8_dense_bytes=mlp_8, fp8_expert_bytes=0.0)
        elif kind == "moe":
            spec = LayerSpec(moe_dense_p, expert_p, _add(norm, _hybrid_moe(c)), 0.0,
                             max(k * (2.0 * f + lw) + d, 2.0 * fs + d), kind=kind, fp8_dense_bytes=moe_8,
                             fp8_expert_bytes=expert_8)
        else:
            raise ValueError(f"layer {i}: layer_kind={kind!r} is not one of mamba, attention, mlp, moe")
        layers.append(spec)
        active += spec.dense_params + (2 * k * f * lw if kind == "moe" else 0)
    embed = v * d * (1 if c.tie_word_embeddings else 2) + d
    # the embedding output (fp32: kept by the first pre-norm) and the final norm, which keeps what a pre-norm keeps
    head = _hybrid_norm(d)
    return ArchSpec(name, d, v, tuple(layers), embed, head, active, rotary_dim=0, dsa=None, attn_act_coeffs=attn_a,
                    dense_attn=DenseAttnDims(H=h, Dqk=dh, Dv=dh, sdpa_without_cp=True))


def _decoder_arch_spec(c, name: str, attn_p: int, attn_a: tuple[float, float, float], attn_heads_elems: int,
                       pos: float, *, idx_p: int, mtp_layers: int, dsa: DsaDims | None) -> ArchSpec:
    """The layers of an MoE decoder around an attention block of ``attn_p`` parameters and ``attn_a`` activation
    coefficients (``idx_p``: DSA indexer parameters, absent from IndexCache ``"shared"`` layers)."""
    d, v = c.hidden_size, c.vocab_size
    embed = v * d * (1 if c.tie_word_embeddings else 2) + d
    layers = []
    active = 0
    e, f, k, s = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok, c.n_shared_experts
    moe_dense_p = attn_p + e * d + 3 * d * s * f
    # largest gradients alive together in a layer's backward: the expert intermediate [T*K, 2F] and rows [T*K, D],
    # or the attention's q/k/v/output gradients plus the input gradient, or the dense MLP's [T, 2I] and [T, D]
    attn_bwd = 2.0 * attn_heads_elems + d
    moe_bwd = max(attn_bwd, k * (2.0 * f + d))
    for i in range(c.num_hidden_layers):
        # an IndexCache "shared" DSA layer (indexer_types) has no indexer weights of its own
        no_idx = idx_p if dsa is not None and not c.has_indexer(i) else 0
        if c.is_moe_layer(i):
            layers.append(
                LayerSpec(moe_dense_p - no_idx, 3 * e * d * f, _add(attn_a, _moe(d, f, e, k, s)), pos, moe_bwd,
                          own_indexer=not no_idx)
            )
            active += moe_dense_p - no_idx + 3 * k * d * f
        else:
            dense = attn_p - no_idx + 3 * d * c.intermediate_size
            bwd = max(attn_bwd, 2.0 * c.intermediate_size + d)
            layers.append(LayerSpec(dense, 0, _add(attn_a, _mlp(d, c.intermediate_size)), pos, bwd,
                                    own_indexer=not no_idx))
            active += dense
    for _ in range(mtp_layers):  # MTP: enorm, hnorm, shared_head.norm, eh_proj
        layers.append(  # [D, 2D] and an MoE layer with its own indexer
            LayerSpec(moe_dense_p + 3 * d + 2 * d * d, 3 * e * d * f,
                      _add(attn_a, _moe(d, f, e, k, s), (2.0 * d, 16.0 * d, 0.0)), pos, moe_bwd, mtp=True)
        )
    # embedding output + the fp32 rotary tables (per position, counted per token at micro_batch 1) + final norm;
    # the logits side is planned per loss chunk (plan_memory)
    head = (2.0 * d, 4.0, 4.0 * d)
    return ArchSpec(name, d, v, tuple(layers), embed, head, active, rotary_dim=int(pos // 8), dsa=dsa,
                    attn_act_coeffs=attn_a)


def _ssm_seq_bytes(layer: LayerSpec, seq_len: int, cp: int) -> float:
    """A Mamba-2 layer's bytes per token that depend on the sequence and the CP degree: :func:`_ssd_chunk_bytes`
    over this rank's ``seq_len / cp`` tokens of each sequence, and under CP the state correction of
    :func:`moe_rl.ssm.ssd_scan_cp` on ranks > 0 (``C h_in`` ``[Tl, H, P]`` and ``exp`` of the cumulative log-decay
    and the log-decay ``[Tl, H]``, fp32: ``4 I + 8 H``; read off the code, not measured). 0 for other layers."""
    if not layer.ssm_heads:
        return 0.0
    extra = 4.0 * layer.ssm_inner + 8.0 * layer.ssm_heads if cp > 1 else 0.0
    return _ssd_chunk_bytes(layer.ssm_heads, layer.ssm_chunk, seq_len // cp) + extra


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
    attn_kernel: AttnKernel = "dense",
    fp8: bool = False,
    fp8_experts: bool = False,
    run_mtp: bool = False,
) -> MemoryPlan:
    """Plan per-GPU memory of one training micro-step (forward + backward) and the optimizer step.

    Args:
        model_config: a model config with an ``arch_spec()`` method (``GlmMoeConfig``, ``GlmMoeDsaConfig``) or an
            :class:`ArchSpec` (see :func:`arch_spec`).
        parallel_dims: the layout (:class:`ParallelDims`).
        seq_len: tokens per sequence (split over ``cp``).
        micro_batch: sequences per micro-batch per data-parallel rank.
        precision: ``"bf16"`` (FSDP2 mixed precision: bf16 compute and all-gathers, fp32 master weights,
            gradients and optimizer state) or ``"fp32"`` (everything fp32).
        activation_checkpointing: ``"none"`` or ``"full"`` (every decoder layer checkpointed).
        optimizer_offload: AdamW state on the host between steps (0 GPU bytes for it during forward/backward; the
            step itself brings it back, see the ``optimizer_step`` phase).
        fsdp_prefetch: FSDP2's forward/backward prefetch of the next layer (two unsharded layers at once).
        loss_chunk_tokens: compute the head + loss in chunks of this many tokens (``None``: all at once).
        optimizer_states: fp32 tensors per parameter in the optimizer (AdamW: 2).
        attn_kernel: ``glm_moe_dsa`` only: the DSA attention the trainer runs (:data:`AttnKernel`).
        fp8: FP8 linears: the e4m3 copies of one unsharded layer's FP8 weights (1 byte per weight plus one fp32
            scale per 128 x 128 block) live through its backward; counted in ``fsdp_allgather`` (an upper bound:
            every non-expert parameter of the layer counted, the router and norms included). Not validated on CPU.
        fp8_experts: the routed experts are FP8 too (their ``1 / ep`` share of the layer).
        run_mtp: the step runs the MTP layers (the RL trainer's ``token_logprobs`` does not: they then hold their
            fp32 master shard only, no gradient, no optimizer state, no activations).

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: ``seq_len`` not divisible by ``parallel_dims.cp``, ``parallel_dims.ep`` not dividing the
            config's ``n_routed_experts``, non-positive sizes, a negative ``optimizer_states``, or an unknown precision / checkpointing mode / attention kernel; the message names
            the value and the rule.
        TypeError: ``parallel_dims`` not a :class:`ParallelDims`, a size that is not an int (a bool or a float is
            refused), or a flag that is not a bool.
    """
    if not isinstance(parallel_dims, ParallelDims):
        raise TypeError(f"parallel_dims must be a ParallelDims, got {type(parallel_dims).__name__}; build it with "
                        "ParallelDims(dp_replicate=..., dp_shard=..., cp=..., ep=...)")
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("optimizer_states", optimizer_states),
                        ("loss_chunk_tokens", loss_chunk_tokens)):
        if value is None and name == "loss_chunk_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int (a count of tokens, sequences or optimizer tensors)")
    for name, value in (("optimizer_offload", optimizer_offload), ("fsdp_prefetch", fsdp_prefetch), ("fp8", fp8),
                        ("fp8_experts", fp8_experts), ("run_mtp", run_mtp)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be a bool (True or False)")
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len={seq_len} and micro_batch={micro_batch} must be >= 1")
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states={optimizer_states} must be >= 0 (fp32 tensors per parameter; AdamW: 2)")
    experts = getattr(model_config, "n_routed_experts", None)  # an ArchSpec does not carry it
    if parallel_dims.ep > 1 and isinstance(experts, int) and experts % parallel_dims.ep:
        raise ValueError(f"ep={parallel_dims.ep} must divide the model's n_routed_experts={experts} (each EP rank holds "
                         "n_routed_experts / ep experts; the trainer refuses other layouts); change ep")
    if seq_len % parallel_dims.cp:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by cp={parallel_dims.cp} (each CP rank holds seq_len / cp tokens)"
        )
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} must be 'fp32' or 'bf16'")
    if activation_checkpointing not in ("none", "full"):
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r} must be 'none' or 'full'")
    if attn_kernel not in ("dense", "chunked"):
        raise ValueError(f"attn_kernel={attn_kernel!r} must be 'dense' (the [T, T] reference) or 'chunked' (the "
                         "memory-bounded DSA path)")
    if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 1 or None (tokens per head/loss chunk)")
    arch = arch_spec(model_config)
    b = 4 if precision == "fp32" else 2
    pd = parallel_dims
    shard = pd.fsdp_size
    tokens = micro_batch * seq_len // pd.cp
    run = [layer for layer in arch.layers if run_mtp or not layer.mtp]
    trained = float(arch.embed_params + sum(layer.params for layer in run))

    params = 4.0 * arch.total_params / shard
    grads = 4.0 * trained / shard
    optim_bytes = 4.0 * optimizer_states * trained / shard
    optim = 0.0 if optimizer_offload else optim_bytes

    # DSA: what the sparse attention the trainer runs saves per token (beyond _mla_block), and its per-sequence
    # transients; tk = the padded, all-gathered key stream under CP, tq = one sequence's local queries
    dsa = arch.dsa
    tk = -(-seq_len // (2 * pd.cp)) * 2 * pd.cp if pd.cp > 1 else seq_len
    tq = tk // pd.cp
    extra_saved = _dsa_saved(dsa, attn_kernel, b, tq, tk) if dsa is not None else 0.0
    late_saved = _dsa_saved_after_indexer(dsa, attn_kernel, b) if dsa is not None else 0.0
    dense = arch.dense_attn
    if dense is not None:  # plain MLA, dense form: O(T^2) scores (Tq = Tk = tokens: ring hop or whole stream)
        extra_saved = _dense_attn_saved(dense, pd.cp, tokens)
        # the exponentials and probabilities (cp == 1) do not exist yet while the scores are computed
        late_saved = extra_saved - _dense_attn_saved(dense, pd.cp, 0) if pd.cp == 1 else 0.0
    per_layer = [layer.act_bytes_per_token(b, micro_batch) + extra_saved + _ssm_seq_bytes(layer, seq_len, pd.cp)
                 for layer in run]
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
    layer_bwd = tokens * max(b * layer.bwd_elems + layer.bwd_bytes_fp32 for layer in run)
    attn_fwd = attn_bwd = 0.0
    # the attention block's own saved bytes (its MoE / MLP part is not alive yet in its forward, already freed in
    # its backward)
    attn_saved = tokens * (_act(arch.attn_act_coeffs, b) + extra_saved)
    if dsa is not None:
        attn_fwd = _dsa_forward_transient(dsa, attn_kernel, tq, tk)
        attn_bwd = micro_batch * _dsa_backward_transient(dsa, attn_kernel, tq, tk, b)
    elif dense is not None:
        attn_fwd = _dense_attn_transient(dense, pd.cp, tokens, backward=False)
        attn_bwd = _dense_attn_transient(dense, pd.cp, tokens, backward=True)

    # FSDP all-gather of the largest layer in the param dtype (twice with prefetch) + its unsharded gradient in
    # the reduce dtype before the reduce-scatter; experts are gathered only over their efsdp group
    def unsharded(layer: LayerSpec, nbytes: float) -> float:
        return nbytes * (layer.dense_params + layer.expert_params / pd.ep)

    biggest = max(run, key=lambda lyr: unsharded(lyr, 1))
    one_gather = unsharded(biggest, b)
    gather = one_gather * (2 if fsdp_prefetch else 1) + unsharded(biggest, 4) if shard > 1 else 0.0
    if fp8:  # e4m3 weights (1 B) + fp32 block scales (4 B per 128 x 128) of one unsharded layer
        per_weight = 1.0 + 4.0 / 128**2
        dense8, exp8 = biggest.fp8_dense_bytes, biggest.fp8_expert_bytes
        gather += biggest.dense_params * per_weight if dense8 is None else dense8
        if fp8_experts:
            gather += (biggest.expert_params * per_weight if exp8 is None else exp8) / pd.ep
    # the candidate high-water marks: the head's backward (all saved activations still alive), the backward of
    # the largest layer (with checkpointing: its recomputed activations on top of the saved inputs), the forward
    # (or recompute) of the largest layer's DSA attention (its indexer / tile transients), and the optimizer step
    # (no activations; offloaded state back on the device; AdamW's foreach temporaries, one fp32 copy)
    before = layer_saved if activation_checkpointing == "full" else layer_saved - tokens * per_layer[-1]
    phases = {
        "output_head_backward": (layer_saved + head_saved, head_bwd),
        "layer_backward": (layer_saved + recompute, layer_bwd),
    }
    if dsa is not None or dense is not None:  # the attention's forward and backward transients (DSA: indexer,
        # tiles; dense MLA: the fp32 score blocks), the MoE part not alive
        phases["attention_forward"] = (before + attn_saved - late_saved * tokens, attn_fwd)
        phases["attention_backward"] = (before + attn_saved, attn_bwd)
    opt_work = (optim_bytes if optimizer_offload else 0.0) + 4.0 * trained / shard
    phases["optimizer_step"] = (0.0, opt_work)
    # every training phase also holds the FSDP all-gather buffers; the optimizer step does not
    phase = max(phases, key=lambda name: sum(phases[name]) + (gather if name != "optimizer_step" else 0.0))
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
            "fsdp_allgather": gather if phase != "optimizer_step" else 0.0,
        },
        peak_phase=phase,
        details={
            "total_params": float(arch.total_params),
            "trained_params": trained,
            "active_params": float(arch.active_params),
            "act_bytes_per_token_per_layer_max": float(max(per_layer)),
            "dsa_saved_bytes_per_token": float(extra_saved) if dsa is not None else 0.0,
            "dsa_forward_transient_bytes": float(attn_fwd) if dsa is not None else 0.0,
            "dsa_backward_transient_bytes": float(attn_bwd) if dsa is not None else 0.0,
            "attention_saved_bytes_per_token": float(extra_saved),
            "attention_forward_transient_bytes": float(attn_fwd),
            "attention_backward_transient_bytes": float(attn_bwd),
            "layer_allgather_bytes": float(one_gather),
            "fsdp_allgather_bytes": float(gather),
            **{f"{name}_bytes": float(sum(v)) for name, v in phases.items()},
            **{f"{name}_activation_bytes": float(v[0]) for name, v in phases.items()},
            "tokens_per_gpu": float(tokens),
            "bytes_per_activation": float(b),
            "layers": float(len(run)),
        },
    )


@dataclass(frozen=True)
class PlanInputs:
    """Everything :func:`plan_memory` reads, resolved from the config the trainer executes
    (:func:`trainer_plan_inputs`), so the dry run and the trainer cannot disagree."""

    model_config: Any
    parallel_dims: ParallelDims
    seq_len: int
    micro_batch: int = 1
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    activation_checkpointing: Checkpointing = "full"
    optimizer_offload: bool = False
    loss_chunk_tokens: int | None = None
    attn_kernel: AttnKernel = "dense"
    fp8: bool = False
    fp8_experts: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_PRECISION:
            raise ValueError(f"trainer.dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
        if self.attn_kernel not in ("dense", "chunked"):
            raise ValueError(f"attn_kernel={self.attn_kernel!r} must be 'dense' or 'chunked'")

    @property
    def precision(self) -> Precision:
        return _DTYPE_PRECISION[self.dtype]  # type: ignore[return-value]

    def plan(self, **changes: Any) -> MemoryPlan:
        """:func:`plan_memory` of these inputs (``changes`` replace fields first, e.g. ``attn_kernel="dense"``)."""
        from dataclasses import replace

        x = replace(self, **changes) if changes else self
        return plan_memory(
            x.model_config, x.parallel_dims, x.seq_len, x.micro_batch, x.precision, x.activation_checkpointing,
            x.optimizer_offload, loss_chunk_tokens=x.loss_chunk_tokens, attn_kernel=x.attn_kernel, fp8=x.fp8,
            fp8_experts=x.fp8_experts,
        )

    def describe(self) -> str:
        """One line: what the plan assumes."""
        d = self.parallel_dims
        dsa = f", DSA {self.attn_kernel}" if arch_spec(self.model_config).dsa is not None else ""
        fp8 = f", fp8 linears{' + experts' if self.fp8_experts else ''}" if self.fp8 else ""
        return (f"{d.dp_replicate}x{d.dp_shard}x{d.cp} (dp_replicate x dp_shard x cp), ep={d.ep}; seq "
                f"{self.seq_len} x {self.micro_batch}; {self.dtype}{dsa}; AC {self.activation_checkpointing}; "
                f"optimizer_offload={str(self.optimizer_offload).lower()}; loss chunk {self.loss_chunk_tokens}{fp8}")


def trainer_plan_inputs(
    model_config,
    trainer,
    *,
    gpus_per_node: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
) -> PlanInputs:
    """The planner inputs of the trainer that ``trainer`` configures (the one mapping from config to plan).

    Args:
        model_config: the ``GlmMoeDsaConfig`` / ``GlmMoeConfig`` the trainer builds; its ``attn_backend`` (when
            the field exists) selects the DSA kernel (``"dense"`` -> dense, ``"torch"`` -> chunked), else dense.
        trainer: a cluster ``TrainerLayout`` (``moe_rl.launch.config``; needs ``gpus_per_node``) or the CPU
            ``TrainerConfig`` (``moe_rl.runtime.trainer.config``; needs ``seq_len``): read are ``dtype``, the layout, the
            activation checkpointing, ``optimizer_offload`` (cluster only), ``loss_chunk_tokens``, ``fp8``.
        gpus_per_node: GPUs per trainer node (``TrainerLayout``).
        seq_len, micro_batch: override the layout's (required for ``TrainerConfig``, which has no sequence length).

    Raises:
        ValueError: a missing argument, an unknown dtype or attention backend, or a layout the GPUs do not divide.
        TypeError: ``trainer`` is neither kind of config.
    """
    if hasattr(trainer, "parallel_dims") and hasattr(trainer, "num_nodes"):  # cluster TrainerLayout
        if gpus_per_node is None:
            raise ValueError("gpus_per_node is required for a cluster TrainerLayout (cluster.gpus_per_node)")
        dims = trainer.parallel_dims(gpus_per_node)
        ac = trainer.activation_checkpointing
        offload = bool(trainer.optimizer_offload)
        fp8 = bool(trainer.fp8)
        fp8_experts = fp8  # the cluster trainer converts linears and grouped experts (EP keeps them FP8)
        seq = trainer.seq_len if seq_len is None else seq_len
        mb = trainer.micro_batch if micro_batch is None else micro_batch
    elif hasattr(trainer, "parallel") and hasattr(trainer, "nproc_per_node"):  # CPU TrainerConfig
        if seq_len is None:
            raise ValueError("seq_len is required for a TrainerConfig (the longest packed row: prompt + completion)")
        dims = trainer.parallel.dims(trainer.nproc_per_node)
        ac = "full" if trainer.parallel.activation_checkpointing else "none"
        offload = bool(getattr(trainer, "optimizer_offload", False))
        fp8 = bool(trainer.fp8.enabled)
        fp8_experts = fp8 and bool(trainer.fp8.experts)
        seq, mb = seq_len, 1 if micro_batch is None else micro_batch
    else:
        raise TypeError(f"trainer must be a cluster TrainerLayout or a TrainerConfig, got {type(trainer).__name__}")
    backend = getattr(model_config, "attn_backend", "dense")
    if backend not in _MODEL_ATTN_KERNEL:
        raise ValueError(f"model attn_backend={backend!r} is unknown to the memory planner; expected one of "
                         f"{sorted(_MODEL_ATTN_KERNEL)}")
    return PlanInputs(model_config, dims, seq, mb, trainer.dtype, ac, offload,
                      getattr(trainer, "loss_chunk_tokens", None), _MODEL_ATTN_KERNEL[backend], fp8, fp8_experts)
