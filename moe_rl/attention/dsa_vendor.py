"""Vendor-kernel backends for DeepSeek Sparse Attention: FlashMLA sparse prefill/decode, DeepGEMM indexer logits.

Shape legend:
    Tq   query tokens of this call
    Tk   key rows; key row s holds token index s (as in :mod:`moe_rl.attention.dsa`)
    H    attention (query) heads; Hp the head count handed to FlashMLA (64 or 128, zero-padded)
    Dk   latent key dim (576 = kv_lora_rank 512 + rope 64 for DeepSeek-V3.2 / GLM-5; FlashMLA also takes 512)
    Dv   latent value dim (kv_lora_rank = 512; the first Dv dims of the latent row)
    K    ``index_topk``; Kp = K rounded up to a multiple of 128 (the slots added hold ``-1``)
    HI   indexer heads; HIp the count handed to DeepGEMM (32 or 64, zero-padded); DI indexer head dim
    cq   query rows per indexer tile (``q_chunk_size``); span = keys the tile's windows cover

Nothing here imports a vendor package at module import: ``flash_mla`` / ``deep_gemm`` are imported inside the
functions, and a missing one raises ImportError with install instructions (never a silent fallback to the torch
path). Shapes the kernels cannot take raise ValueError naming the rule; where an exact transformation exists it is
applied instead (zero query heads, ``-1`` index slots, zero indexer heads: none changes a result).

FlashMLA (github.com/deepseek-ai/FlashMLA, ``flash_mla/flash_mla_interface.py`` and ``csrc/api/sparse_fwd.h``,
``csrc/api/sparse_decode.h``; reference semantics in its ``tests/ref.py``):

* ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None)
  -> (out, max_logits, lse)``: ``q [s_q, h_q, d_qk]`` bf16, ``kv [s_kv, h_kv, d_qk]`` bf16, ``indices
  [s_q, h_kv, topk]`` int32 (invalid = ``-1`` or ``>= s_kv``); ``d_qk`` in {512, 576}, ``d_v == 512``,
  ``h_q`` in {64, 128}, ``topk`` a multiple of 128 (SM90 asserts ``topk % (2 * 64) == 0``; SM100 64 or 128);
  returns ``out [s_q, h_q, d_v]`` bf16, ``max_logits [s_q, h_q]`` fp32 and ``lse [s_q, h_q]`` fp32, the natural
  log-sum-exp of ``sm_scale * q . k`` over the valid indices; a row with no valid index gets ``out = 0`` and
  ``lse = +inf`` (ours: ``-inf``; mapped here). Forward only: FlashMLA has no sparse backward.
* ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
  num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, ...)``: sparse decode
  when ``indices [b, s_q, topk]`` int32 is given; then ``is_fp8_kvcache=True`` and ``causal=False`` are required,
  ``block_table`` / ``cache_seqlens`` may be None, and ``indices`` hold ``page * page_block_size + offset``.
  ``k_cache [num_blocks, page_block_size, 1, 656]`` in the DeepSeek-V3.2 FP8 layout per token: 512 float8_e4m3
  (latent, 4 tiles of 128), 4 fp32 dequantisation scales (one per tile), 64 bf16 (rope part, unquantised).
  ``tile_scheduler_metadata`` comes from ``get_mla_metadata()``. Returns ``out [b, s_q, h_q, 512]`` bf16 and
  ``lse [b, h_q, s_q]`` fp32 (``+inf`` for a query with no valid index).

DeepGEMM (github.com/deepseek-ai/DeepGEMM, ``csrc/apis/attention.hpp``, README "V3.2 MQA kernels for the
indexer", reference ``tests/test_attention.py::ref_fp8_mqa_logits``):

* ``fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
  max_seqlen_k=0, logits_dtype=torch.float32)`` (current name; ``q`` is a pair ``(q_fp8, None)`` for FP8) and the
  legacy ``fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
  max_seqlen_k=0)`` (``q`` the bare tensor): ``q [seq_len, num_heads, head_dim]`` float8_e4m3 (no scale),
  ``kv = (k_fp8 [seq_len_kv, head_dim] float8_e4m3, k_scale [seq_len_kv] fp32)``, ``weights [seq_len, num_heads]``
  fp32, ``ks``/``ke [seq_len]`` int32; ``num_heads`` in {32, 64} on SM90 ({8, 16, 32, 64} on SM100),
  ``head_dim`` in {32, 64, 128}. Returns ``logits [seq_len, seq_len_kv]`` fp32 with
  ``logits[i, j] = sum_h weights[i, h] * ReLU(q[i, h] . (k_fp8[j] * k_scale[j]))`` for ``j`` in
  ``[ks[i], ke[i])`` and ``-inf`` elsewhere (``clean_logits=True``). Forward only, no gradient.

How our tensors map (the adapters below):

* Sparse attention: ``q [Tq, H, Dk]`` -> FlashMLA ``q [Tq, Hp, Dk]`` (heads zero-padded to 64/128, or groups
  of 128 heads; the padded heads' outputs are dropped); ``kv [Tk, Dk]`` -> ``[Tk, 1, Dk]``; ``topk_indices [Tq, K]``
  int64 (``-1`` = none, ``valid=False`` slots set to ``-1``) -> int32 ``[Tq, 1, Kp]``. An added ``-1`` slot
  changes nothing (its logit is ``-inf``), nor does a zero query head (heads are independent in MQA).
* Indexer: per tile of ``cq`` queries, ``q_I`` is cast to FP8 with one power-of-two scale per (token, head)
  folded into the weights (``ReLU(a x) = a ReLU(x)`` for ``a > 0``, as DeepSeek-V3.2's inference code does),
  ``k_I`` once per row with a power-of-two scale (DeepGEMM's ``kv`` pair); only the tile's key span
  ``[min ks, max ke)`` is passed, with window bounds shifted into it. The tile's ``[cq, span]`` logits go through
  :func:`moe_rl.attention.select_topk` (descending score, **equal scores broken by the lower key index**,
  ``-1`` fill), so the result is the one our torch indexer gives for the same FP8-rounded inputs.

Precision: the indexer runs on FP8 inputs (e4m3, 3 mantissa bits; power-of-two scales make the scaling itself
exact), so its scores differ from the fp32 torch indexer by the FP8 rounding of ``q_I`` and ``k_I`` and its
top-k may differ where scores are that close. Sparse attention runs in bf16 with fp32 accumulation; its output is
bf16.

Backward: :func:`flashmla_sparse_attention` runs FlashMLA forward and, when gradients are needed, the tiled
recomputing backward of :class:`moe_rl.attention.dsa_chunked.SparseLatentAttentionFn` (it needs only ``q``,
``kv``, the indices and the forward's ``lse``), so memory stays O(Tq K). The indexer and decode adapters are
forward only (their inputs get no gradient; the indexer's selection is not differentiable anyway).
"""

from __future__ import annotations

import importlib
import math
import types
from typing import Any

import torch
from torch import Tensor

from moe_rl.attention.dsa_chunked import SparseLatentAttentionFn, check_chunk_size

__all__ = [
    "DEFAULT_VENDOR_ATTN_CHUNK",
    "DEFAULT_VENDOR_Q_CHUNK",
    "FLASHMLA_V32_FP8_BYTES_PER_TOKEN",
    "deepgemm_indexer_topk",
    "flashmla_sparse_attention",
    "flashmla_sparse_decode",
    "quantize_latent_kv_fp8_v32",
]

DEFAULT_VENDOR_Q_CHUNK = 512
"""Query rows per DeepGEMM indexer tile: the tile's ``[cq, span]`` fp32 logits plus ``select_topk``'s int64 keys
are ``cq * span * 12`` bytes (768 MiB at span = 131072)."""
DEFAULT_VENDOR_ATTN_CHUNK = 128
"""Query rows per tile of the recomputing backward (forward runs in one FlashMLA call)."""
FLASHMLA_V32_FP8_BYTES_PER_TOKEN = 656
"""Bytes per token of FlashMLA's DeepSeek-V3.2 FP8 sparse KV cache: 512 e4m3 + 4 fp32 scales + 64 bf16."""

_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TOPK_ALIGN = 128  # FlashMLA sparse kernels: topk % 128 == 0 on SM90 (2 * B_TOPK), % 64 or % 128 on SM100
_FLASHMLA_HEADS = (64, 128)
_FLASHMLA_DQK = (512, 576)
_FLASHMLA_DV = 512
_DEEPGEMM_HEADS = (32, 64)  # SM90's set; SM100 also takes 8 and 16, which we pad to 32 (exact, zero weights)
_DEEPGEMM_DIMS = (32, 64, 128)

_FLASH_MLA_INSTALL = (
    "needs FlashMLA (https://github.com/deepseek-ai/FlashMLA) on an SM90/SM100 GPU with CUDA >= 12.8 (12.9 for "
    "SM100): `git clone https://github.com/deepseek-ai/FlashMLA.git && cd FlashMLA && git submodule update --init "
    "--recursive && pip install -v .`. On CPU, or without it, use backend='torch'."
)
_DEEP_GEMM_INSTALL = (
    "needs DeepGEMM (https://github.com/deepseek-ai/DeepGEMM) on an SM90/SM100 GPU with CUDA >= 12.3: "
    "`pip install 'moe_rl[gpu]'` or build it from source (`git clone --recursive "
    "https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh`). On CPU, or without it, use "
    "indexer_backend='torch'."
)
_MQA_LOGITS_NAMES = ("fp8_fp4_mqa_logits", "fp8_mqa_logits")  # current name first, then the legacy one


def _import(module: str, what: str, install: str) -> Any:
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as e:  # OSError: a built extension whose CUDA libraries cannot load
        raise ImportError(f"{what} {install} (import {module} failed: {e})") from e


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def _pow2_scale(amax: Tensor) -> Tensor:
    """Power-of-two scale ``2^ceil(log2(amax / 448))`` (amax clamped to 1e-4, as DeepGEMM's FP8 casts): dividing
    by it and multiplying back are exact, and ``|x| / scale <= 448``."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(1e-4) / _FP8_MAX)))


def _fp8_dtype() -> torch.dtype:
    dt = getattr(torch, "float8_e4m3fn", None)
    if dt is None:  # pragma: no cover - torch < 2.1
        raise ImportError("the vendor DSA backends need torch.float8_e4m3fn (torch >= 2.1)")
    return dt


# --------------------------------------------------------------------------------------------- FlashMLA


def _check_flashmla_inputs(q: Tensor, kv: Tensor, v_head_dim: int, *, where: str) -> None:
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"{where}: expects q [Tq, H, Dk] and kv [Tk, Dk] with equal Dk; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}")
    dk = q.shape[-1]
    if dk not in _FLASHMLA_DQK:
        raise ValueError(f"{where}: head dim Dk={dk} is not supported by FlashMLA's sparse kernels (d_qk must be "
                         f"576 = 512 latent + 64 rope, or 512); use backend='torch' for other sizes")
    if v_head_dim != _FLASHMLA_DV:
        raise ValueError(f"{where}: v_head_dim={v_head_dim} is not supported by FlashMLA's sparse kernels (d_v must "
                         "be 512, the kv_lora_rank of DeepSeek-V3.2 / GLM-5); use backend='torch' for other sizes")
    for name, t in (("q", q), ("kv", kv)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{where}: {name} is {t.dtype}; FlashMLA's sparse kernels take bfloat16 only (cast with "
                            f"{name}.to(torch.bfloat16), or use backend='torch' for fp32/fp64)")
    if q.device != kv.device:
        raise ValueError(f"{where}: q is on {q.device} and kv on {kv.device}; both must be on the same CUDA device")


def _prep_indices(topk_indices: Tensor, valid: Tensor | None, Tq: int, Tk: int, where: str) -> Tensor:
    """int64 ``[Tq, K]`` with ``-1`` for none / invalid; checks shape and range."""
    if not isinstance(topk_indices, Tensor) or topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: topk_indices must be an int32/int64 tensor, got "
                        f"{getattr(topk_indices, 'dtype', type(topk_indices))}")
    if topk_indices.dim() != 2 or topk_indices.shape[0] != Tq or topk_indices.shape[1] < 1:
        raise ValueError(f"{where}: topk_indices must be [Tq={Tq}, K >= 1], got {tuple(topk_indices.shape)}")
    idx = topk_indices.long()
    if valid is not None:
        if valid.shape != idx.shape or valid.dtype != torch.bool:
            raise ValueError(f"{where}: valid must be a bool tensor of shape {tuple(idx.shape)}, got "
                             f"{valid.dtype} {tuple(valid.shape)}")
        idx = torch.where(valid, idx, torch.full_like(idx, -1))
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= Tk):
        raise ValueError(f"{where}: topk_indices must lie in [-1, Tk={Tk}) (-1 = no key), got range "
                         f"[{int(idx.min())}, {int(idx.max())}]")
    return idx


def _padded_indices_i32(idx: Tensor) -> Tensor:
    """``[Tq, K]`` int64 -> ``[Tq, 1, Kp]`` int32, Kp = K rounded up to 128, added slots ``-1``."""
    Tq, K = idx.shape
    kp = _ceil_to(K, _TOPK_ALIGN)
    out = torch.full((Tq, 1, kp), -1, dtype=torch.int32, device=idx.device)
    out[:, 0, :K] = idx.to(torch.int32)
    return out


def _head_groups(H: int) -> list[tuple[int, int, int]]:
    """``(h0, h1, Hp)`` per FlashMLA call: heads ``[h0, h1)`` padded with zero heads to Hp in {64, 128}."""
    groups = []
    for h0 in range(0, H, 128):
        h1 = min(h0 + 128, H)
        groups.append((h0, h1, 64 if h1 - h0 <= 64 else 128))
    return groups


def _pad_heads(q: Tensor, h0: int, h1: int, hp: int) -> Tensor:
    part = q[:, h0:h1]
    if h1 - h0 == hp:
        return part.contiguous()
    return torch.cat([part, part.new_zeros(q.shape[0], hp - (h1 - h0), q.shape[2])], dim=1)


def _flashmla_prefill_call(fm: Any, q: Tensor, kv: Tensor, idx: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One forward over all heads: ``(out [Tq, H, 512] bf16, lse [Tq, H] fp32, -inf for no key)``."""
    Tq, H, _ = q.shape
    ind = _padded_indices_i32(idx)
    kv3 = kv.contiguous().view(kv.shape[0], 1, kv.shape[1])
    outs, lses = [], []
    for h0, h1, hp in _head_groups(H):
        o, _max_logits, lse = fm.flash_mla_sparse_fwd(_pad_heads(q, h0, h1, hp), kv3, ind, scale, _FLASHMLA_DV)
        outs.append(o[:, : h1 - h0])
        lses.append(lse[:, : h1 - h0])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    lse = lse.float()
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)  # FlashMLA: +inf = no key
    return out.contiguous(), lse.contiguous()


class FlashMLASparseFn(torch.autograd.Function):
    """FlashMLA sparse prefill forward, tiled recomputing backward of :class:`SparseLatentAttentionFn`.

    ``apply(q [Tq, H, Dk] bf16, kv [Tk, Dk] bf16, idx [Tq, K] int64 (-1 = none), v_head_dim, scale, chunk)`` ->
    ``(out [Tq, H, Dv] bf16, lse [Tq, H] fp32)``. Saves ``q``, ``kv``, ``idx``, ``lse`` only (as the torch path).
    """

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, idx: Tensor, v_head_dim: int, scale: float, chunk: int):
        fm = _import("flash_mla", "backend='flashmla'", _FLASH_MLA_INSTALL)
        out, lse = _flashmla_prefill_call(fm, q, kv, idx, scale)
        ctx.save_for_backward(q, kv, idx, lse)
        ctx.v_head_dim, ctx.scale, ctx.chunk = v_head_dim, scale, chunk
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_lse: Tensor | None):
        # The torch path's backward needs exactly what was saved here (q, kv, idx, lse) and the same attributes.
        proxy = types.SimpleNamespace(saved_tensors=ctx.saved_tensors, v_head_dim=ctx.v_head_dim, scale=ctx.scale,
                                      chunk=ctx.chunk, needs_input_grad=ctx.needs_input_grad)
        return SparseLatentAttentionFn.backward(proxy, d_out, d_lse)


def flashmla_sparse_attention(
    q: Tensor,
    kv: Tensor,
    topk_indices: Tensor,
    *,
    v_head_dim: int,
    scale: float,
    valid: Tensor | None = None,
    chunk_size: int = DEFAULT_VENDOR_ATTN_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Sparse MQA-latent attention through FlashMLA's ``flash_mla_sparse_fwd`` (same contract as
    :func:`moe_rl.attention.sparse_latent_attention`).

    Source: github.com/deepseek-ai/FlashMLA ``flash_mla.flash_mla_sparse_fwd`` (see the module docstring for its
    arguments). Heads are zero-padded to 64/128 (more than 128: groups of 128), indices padded to a multiple of
    128 with ``-1``; FlashMLA's ``lse = +inf`` for a query without keys is returned as ``-inf``.

    Args:
        q: ``[Tq, H, Dk]`` bf16 absorbed queries on a CUDA device (SM90/SM100), Dk in {576, 512}.
        kv: ``[Tk, Dk]`` bf16 latent rows; the value is ``kv[:, :512]``.
        topk_indices: ``[Tq, K]`` int32/int64 key rows in ``[-1, Tk)``, ``-1`` = none (any K >= 1).
        v_head_dim: Dv; must be 512.
        scale: softmax scale (FlashMLA's ``sm_scale``).
        valid: optional ``[Tq, K]`` bool; False slots are ignored like ``-1``.
        chunk_size: query rows per tile of the recomputing backward (>= 1).

    Returns:
        ``(out [Tq, H, 512] bf16, lse [Tq, H] fp32 natural log, -inf for a query with no key)``; differentiable
        in ``q`` and ``kv`` (and through ``lse``) by recomputation in torch (memory O(Tq K) as
        ``backend="torch"``).

    Raises:
        ValueError: Dk not in {512, 576}, ``v_head_dim != 512``, bad index shape or range, a chunk size < 1.
        TypeError: q or kv not bfloat16, non-integer indices.
        ImportError: ``flash_mla`` not installed (with install instructions).
    """
    where = "flashmla_sparse_attention"
    _check_flashmla_inputs(q, kv, v_head_dim, where=where)
    chunk = check_chunk_size("attn_chunk_size", chunk_size)
    idx = _prep_indices(topk_indices, valid, q.shape[0], kv.shape[0], where)
    return FlashMLASparseFn.apply(q, kv, idx.contiguous(), v_head_dim, float(scale), chunk)


@torch.no_grad()
def quantize_latent_kv_fp8_v32(kv: Tensor, *, page_block_size: int = 64) -> Tensor:
    """Latent rows -> FlashMLA's DeepSeek-V3.2 FP8 sparse KV cache (656 bytes per token).

    Layout (FlashMLA ``flash_mla_with_kvcache`` docstring, ``tests/quant.py::quantize_k_cache``, V32_FP8Sparse):
    per token 512 float8_e4m3 (latent dims 0..511, 4 tiles of 128), 4 fp32 scales (tile t dequantises as
    ``fp8 * scale[t]``; power of two ``2^ceil(log2(amax_t / 448))``), then 64 bf16 (rope dims 512..575, as is).

    Args:
        kv: ``[Tk, 576]`` latent rows (any float dtype; the rope part is stored in bf16).
        page_block_size: tokens per page (>= 1); token s sits in page ``s // page_block_size`` at offset
            ``s % page_block_size``, so its FlashMLA index is s itself.

    Returns:
        ``[ceil(Tk / page_block_size), page_block_size, 1, 656]`` float8_e4m3fn; rows past Tk are zero.

    Raises:
        ValueError: ``kv`` not ``[Tk, 576]`` or a page size < 1.
    """
    if kv.dim() != 2 or kv.shape[1] != 576:
        raise ValueError(f"quantize_latent_kv_fp8_v32: kv must be [Tk, 576] (512 latent + 64 rope), got "
                         f"{tuple(kv.shape)}; FlashMLA's FP8 sparse cache has no other V3.2 layout")
    bs = check_chunk_size("page_block_size", page_block_size)
    fp8 = _fp8_dtype()
    Tk = kv.shape[0]
    n_pages = max(1, -(-Tk // bs))
    buf = torch.zeros(n_pages * bs, FLASHMLA_V32_FP8_BYTES_PER_TOKEN, dtype=torch.uint8, device=kv.device)
    nope = kv[:, :512].float().view(Tk, 4, 128)
    sf = _pow2_scale(nope.abs().amax(-1))  # [Tk, 4]
    buf[:Tk, :512] = (nope / sf[..., None]).reshape(Tk, 512).to(fp8).view(torch.uint8)
    buf[:Tk, 512:528] = sf.contiguous().view(torch.uint8).view(Tk, 16)
    buf[:Tk, 528:] = kv[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8).view(Tk, 128)
    return buf.view(fp8).view(n_pages, bs, 1, FLASHMLA_V32_FP8_BYTES_PER_TOKEN)


@torch.no_grad()
def flashmla_sparse_decode(
    q: Tensor,
    kv_cache: Tensor,
    topk_indices: Tensor,
    *,
    scale: float,
    v_head_dim: int = _FLASHMLA_DV,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sparse decode through FlashMLA's ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``.

    Each of the Tq queries is one batch entry of one new token (``b = Tq, s_q = 1``); its indices are token rows
    of the cache (with pages of consecutive tokens, FlashMLA's ``page * page_block_size + offset`` is the token
    index). Forward only (inference).

    Args:
        q: ``[Tq, H, 576]`` bf16 absorbed queries (CUDA).
        kv_cache: ``[num_pages, page_block_size, 1, 656]`` float8_e4m3fn from :func:`quantize_latent_kv_fp8_v32`.
        topk_indices: ``[Tq, K]`` int32/int64 token rows in ``[-1, num_pages * page_block_size)``, ``-1`` = none.
        scale: softmax scale. v_head_dim: must be 512.
        valid: optional ``[Tq, K]`` bool; False slots are ignored like ``-1``.

    Returns:
        ``(out [Tq, H, 512] bf16, lse [Tq, H] fp32, -inf for a query with no key)``.

    Raises:
        ValueError: q not ``[Tq, H, 576]``, ``v_head_dim != 512``, a cache not in the 656-byte layout, bad indices.
        TypeError: q not bfloat16. ImportError: ``flash_mla`` not installed.
    """
    where = "flashmla_sparse_decode"
    if q.dim() != 3 or q.shape[-1] != 576:
        raise ValueError(f"{where}: q must be [Tq, H, 576] (the FP8 sparse decode cache is the V3.2 576-dim "
                         f"layout), got {tuple(q.shape)}")
    if v_head_dim != _FLASHMLA_DV:
        raise ValueError(f"{where}: v_head_dim={v_head_dim} must be 512 for FlashMLA's sparse decode")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"{where}: q is {q.dtype}; FlashMLA's sparse decode takes bfloat16 queries")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != FLASHMLA_V32_FP8_BYTES_PER_TOKEN:
        raise ValueError(f"{where}: kv_cache must be [num_pages, page_block_size, 1, 656] (FlashMLA's V3.2 FP8 "
                         f"layout; build it with quantize_latent_kv_fp8_v32), got {tuple(kv_cache.shape)}")
    fm = _import("flash_mla", "flashmla_sparse_decode", _FLASH_MLA_INSTALL)
    Tq, H, _ = q.shape
    idx = _prep_indices(topk_indices, valid, Tq, kv_cache.shape[0] * kv_cache.shape[1], where)
    ind = _padded_indices_i32(idx).view(Tq, 1, -1)  # [b = Tq, s_q = 1, Kp]
    outs, lses = [], []
    for h0, h1, hp in _head_groups(H):
        qg = _pad_heads(q, h0, h1, hp).view(Tq, 1, hp, 576)
        meta, _ = fm.get_mla_metadata()
        o, lse = fm.flash_mla_with_kvcache(qg, kv_cache, None, None, _FLASHMLA_DV, meta, None, softmax_scale=scale,
                                           causal=False, is_fp8_kvcache=True, indices=ind)
        outs.append(o[:, 0, : h1 - h0])  # [b, s_q, hp, 512] -> [Tq, h, 512]
        lses.append(lse[:, : h1 - h0, 0])  # [b, hp, s_q] -> [Tq, h]
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    lse = (torch.cat(lses, dim=1) if len(lses) > 1 else lses[0]).float()
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)
    return out.contiguous(), lse.contiguous()


# --------------------------------------------------------------------------------------------- DeepGEMM


def _mqa_logits_fn(dg: Any) -> tuple[Any, str]:
    for name in _MQA_LOGITS_NAMES:
        fn = getattr(dg, name, None)
        if fn is not None:
            return fn, name
    raise ImportError(f"deep_gemm ({getattr(dg, '__version__', 'unknown version')}) exports none of "
                      f"{_MQA_LOGITS_NAMES}; indexer_backend='deep_gemm' " + _DEEP_GEMM_INSTALL)


@torch.no_grad()
def deepgemm_indexer_topk(
    index_q: Tensor,
    index_weights: Tensor,
    index_k: Tensor,
    index_topk: int,
    *,
    ks: Tensor,
    ke: Tensor,
    q_chunk_size: int = DEFAULT_VENDOR_Q_CHUNK,
) -> Tensor:
    """Top-``index_topk`` keys of the lightning indexer per query, logits from DeepGEMM's FP8 MQA-logits kernel.

    Source: github.com/deepseek-ai/DeepGEMM ``deep_gemm.fp8_fp4_mqa_logits`` (legacy ``fp8_mqa_logits``; see
    the module docstring). Per tile of ``cq`` queries: FP8 cast of ``index_q`` (power-of-two scale per token and
    head, folded into the weights), one ``[cq, span]`` logits block over the tile's key span, then
    :func:`moe_rl.attention.select_topk` on it (ties to the lower key index, ``-1`` fill). Memory: the result
    ``Tq K`` int64, the FP8 keys ``Tk (DI + 4)`` bytes, and per tile ``cq span`` x (4 logits + 8 sort keys + 5
    masks) bytes.

    Args:
        index_q: ``[Tq, HI, DI]`` indexer queries (any float dtype; cast to FP8 here), CUDA.
        index_weights: ``[Tq, HI]`` per-head weights (scales folded in).
        index_k: ``[Tk, DI]`` indexer keys; row s = token index s.
        index_topk: K >= 1.
        ks, ke: ``[Tq]`` int key windows (:func:`moe_rl.attention.core.key_windows`).
        q_chunk_size: query rows per tile (>= 1).

    Returns:
        ``[Tq, K]`` int64: per row the ``min(K, visible)`` best keys of the FP8 logits, descending, equal scores by
        ascending key index, then ``-1``. No gradient.

    Raises:
        ValueError: bad shapes, ``index_topk < 1``, a chunk size < 1, HI > 64 or DI not in {32, 64, 128}
            (DeepGEMM's limits), a NaN logit inside a window.
        ImportError: ``deep_gemm`` missing or exporting neither API name (with install instructions).
    """
    from moe_rl.attention.dsa_chunked import select_topk

    where = "deepgemm_indexer_topk"
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk={index_topk!r} must be an int >= 1 (keys kept per query); GLM-5 uses 2048")
    cq = check_chunk_size("q_chunk_size", q_chunk_size)
    if index_q.dim() != 3 or index_weights.dim() != 2 or index_k.dim() != 2 or \
            index_weights.shape != index_q.shape[:2] or index_k.shape[1] != index_q.shape[2]:
        raise ValueError(f"{where}: expects index_q [Tq, HI, DI], index_weights [Tq, HI], index_k [Tk, DI]; got "
                         f"{tuple(index_q.shape)}, {tuple(index_weights.shape)}, {tuple(index_k.shape)}")
    Tq, HI, DI = index_q.shape
    if ks.shape != (Tq,) or ke.shape != (Tq,):
        raise ValueError(f"{where}: ks and ke must be [Tq={Tq}], got {tuple(ks.shape)}, {tuple(ke.shape)}")
    if HI > _DEEPGEMM_HEADS[-1]:
        raise ValueError(f"{where}: {HI} indexer heads; DeepGEMM's MQA-logits kernel takes at most 64 (32 or 64 "
                         "on SM90); use indexer_backend='torch'")
    if DI not in _DEEPGEMM_DIMS:
        raise ValueError(f"{where}: indexer head dim DI={DI}; DeepGEMM's MQA-logits kernel takes 32, 64 or 128; "
                         "use indexer_backend='torch'")
    dg = _import("deep_gemm", "indexer_backend='deep_gemm'", _DEEP_GEMM_INSTALL)
    fn, name = _mqa_logits_fn(dg)
    fp8 = _fp8_dtype()
    dev = index_q.device
    Tk = index_k.shape[0]
    hip = 32 if HI <= 32 else 64
    K = index_topk
    out = torch.full((Tq, K), -1, dtype=torch.int64, device=dev)
    if Tq == 0 or Tk == 0:
        return out
    kf = index_k.float()
    k_sf = _pow2_scale(kf.abs().amax(-1))  # [Tk]
    k_fp8 = (kf / k_sf[:, None]).to(fp8).contiguous()
    ks64, ke64 = ks.to(torch.int64), torch.minimum(ke.to(torch.int64), torch.full_like(ke, Tk, dtype=torch.int64))
    n_t = -(-Tq // cq)
    pad = n_t * cq - Tq
    lo_src = torch.where(ke64 > ks64, ks64, torch.full_like(ks64, Tk))  # empty windows do not widen a span
    lo_all = torch.cat([lo_src, ks64.new_full((pad,), Tk)]).view(n_t, cq).amin(1)
    hi_all = torch.cat([ke64, ke64.new_zeros(pad)]).view(n_t, cq).amax(1)
    bounds = torch.stack([lo_all, hi_all], 1).tolist()  # one host transfer
    for tile, c0 in enumerate(range(0, Tq, cq)):
        c1 = min(c0 + cq, Tq)
        lo, hi = bounds[tile]
        if hi <= lo:
            continue
        q_t = index_q[c0:c1].float()
        q_sf = _pow2_scale(q_t.abs().amax(-1))  # [cq, HI]
        q8 = (q_t / q_sf[..., None]).to(fp8)
        w = index_weights[c0:c1].float() * q_sf  # exact: power-of-two factors
        if hip != HI:  # zero heads: ReLU(0) * 0 adds nothing
            q8 = torch.cat([q8, torch.zeros(c1 - c0, hip - HI, DI, dtype=fp8, device=dev)], dim=1)
            w = torch.cat([w, w.new_zeros(c1 - c0, hip - HI)], dim=1)
        ks_t = (ks64[c0:c1] - lo).clamp(min=0)
        ke_t = (ke64[c0:c1] - lo).clamp(min=0)
        ke_t = torch.maximum(ke_t, ks_t)  # empty windows stay empty
        kv_pair = (k_fp8[lo:hi], k_sf[lo:hi].contiguous())
        q_arg = (q8.contiguous(), None) if name == "fp8_fp4_mqa_logits" else q8.contiguous()
        logits = fn(q_arg, kv_pair, w.contiguous(), ks_t.to(torch.int32).contiguous(),
                    ke_t.to(torch.int32).contiguous(), True, 0)  # [cq, span], -inf outside windows
        sel = select_topk(logits.float(), K, ks=ks_t, ke=ke_t)
        out[c0:c1] = torch.where(sel >= 0, sel + lo, sel)
        del logits, sel
    return out
