"""Memory-bounded DeepSeek Sparse Attention: a streaming top-k lightning indexer and a recomputing sparse MLA.

Shape legend:
    Tq   query tokens of this call
    Tk   key rows; key row s holds token index s (as in :mod:`moe_rl.attention.dsa`)
    HI   indexer heads; DI indexer head dim
    K    ``index_topk``
    H    attention (query) heads
    Dk   latent key dim (kv_lora_rank + qk_rope_head_dim); Dv latent value dim (kv_lora_rank)
    cq   query rows per tile (``q_chunk_size``); ck key rows per indexer step (``k_chunk_size``)

This is the ``backend="torch"`` path of :func:`moe_rl.attention.dsa_attention` and
:func:`moe_rl.attention.dsa_cp_attention`; ``backend="dense"`` is the reference it is tested against. Same math
(DeepSeek-V3.2 report §2), different schedule: **no tensor has a ``[Tq, Tk]`` shape**.

Streaming top-k indexer (:func:`chunked_indexer_topk`). For each query tile ``[c0, c0 + cq)`` only the key range
``[min ks, max ke)`` of its windows is visited, in steps of ``ck`` keys. Each step scores
``I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s])`` for the ``[cq, ck]`` block (temporary ``[cq, HI, ck]``),
masks keys outside each query's window with ``-inf`` and merges the block's candidates into the running best
set of the tile (at most K per query) by one top-k over ``[cq, K + ck]`` candidates. The order is total:
descending score, **equal scores broken by the lower absolute key index**, the rule of
:func:`moe_rl.attention.select_topk`. Because the order is total, the top-K of a union equals the top-K of
(top-K of one part) united with the other part, so the streaming result is the dense one for every chunking
(fp32: the score's order-preserving integer bits and the complement of the key index packed into one int64 key;
fp64: a stable sort over ``[best | block]``, whose positions are already in ascending key order, since blocks
are visited left to right). Afterwards slots ``>= min(K, visible keys)`` hold ``-1`` (NVIDIA-NeMo/Automodel PR #3035), as in the dense
reference. A NaN score inside a window raises ValueError as there.

Sparse attention (:class:`SparseLatentAttentionFn`). Forward per query tile: gather the selected latent rows
``[cq, K, Dk]``, logits ``[cq, H, K]``, softmax with per-row log-sum-exp, ``out = P V``. Saved for backward: the
inputs ``q``, ``kv``, the merged indices ``[Tq, K]`` and ``lse [Tq, H]``, nothing per key. Backward per tile
recomputes the gather and ``P = exp(scale q.c - lse)`` and applies the softmax backward of FlashAttention-2
(Dao, arXiv 2307.08691, Alg. 2): ``dP = dO V^T``, ``dS = P (dP - rowsum(P dP) + dlse)``, ``dq = scale dS C``,
``dC = scale dS^T q + P^T dO`` (value part), scatter-added into ``dkv`` rows (``index_add_``).

Memory (fp32 accumulation, 4 bytes; indices int64, 8 bytes) beyond the inputs and outputs:

* indexer: ``Tq K 8`` (the result) + per step ``cq HI ck 4 + 3 cq (K + ck) 8``;
* attention forward: per tile ``cq K Dk 4 + 2 cq H K 4``; saved ``Tq K 8 + Tq H 4``;
* attention backward: ``Tk Dk 4`` (dkv) + ``Tq H Dk 4`` (dq) + per tile ``2 cq K Dk 4 + 4 cq H K 4``.

So the peak is O(T * K) plus per-tile terms set by the chunk sizes; the dense reference holds ``[Tq, Tk]`` fp32
scores (and, with autograd, the ``[Tq, H, K]`` probabilities and ``[Tq, K, Dk]`` gathered rows of every query).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from moe_rl.attention.core import _softmax_stats, acc_dtype

__all__ = [
    "DEFAULT_ATTN_CHUNK",
    "DEFAULT_K_CHUNK",
    "DEFAULT_Q_CHUNK",
    "DSA_BACKENDS",
    "DSABackend",
    "SparseLatentAttentionFn",
    "check_chunk_size",
    "check_dsa_backend",
    "chunked_indexer_topk",
    "sparse_latent_attention_chunked",
]

DSABackend = Literal["dense", "torch", "flashmla"]
DSA_BACKENDS: tuple[str, ...] = ("dense", "torch", "flashmla")
DEFAULT_Q_CHUNK = 128
"""Query rows per indexer tile."""
DEFAULT_K_CHUNK = 2048
"""Key rows per indexer step."""
DEFAULT_ATTN_CHUNK = 128
"""Query rows per sparse-attention tile."""


def check_dsa_backend(backend: object, name: str = "backend") -> str:
    """Validate a DSA backend name; returns it.

    Raises:
        ValueError: not one of :data:`DSA_BACKENDS` (``"dense"``: the ``[Tq, Tk]`` reference; ``"torch"``: the
            memory-bounded chunked path of this module; ``"flashmla"``: FlashMLA's sparse forward on CUDA with
            this module's recomputing backward, :mod:`moe_rl.attention.dsa_vendor`).
    """
    if backend not in DSA_BACKENDS:
        raise ValueError(
            f"{name}={backend!r} is not a DSA backend; use 'torch' (memory-bounded chunked path), 'flashmla' "
            "(FlashMLA sparse kernel on an SM90/SM100 GPU, bf16) or 'dense' (the [Tq, Tk] reference)"
        )
    return backend  # type: ignore[return-value]


def check_chunk_size(name: str, value: object) -> int:
    """Validate a chunk size: a positive Python int (bool refused). Returns it.

    Raises:
        ValueError: naming the argument, the value and the rule.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int (rows per chunk, >= 1); pass e.g. {name}=128")
    return value


def _check_topk(index_topk: object) -> int:
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk={index_topk!r} must be an int >= 1 (keys kept per query); GLM-5 uses 2048")
    return index_topk


def _check_indexer_shapes(index_q: object, index_weights: object, index_k: object, ks: object, ke: object) -> None:
    """Shapes of :func:`chunked_indexer_topk`'s inputs (a wrong ``index_weights`` would otherwise broadcast)."""
    for name, t in (("index_q", index_q), ("index_weights", index_weights), ("index_k", index_k), ("ks", ks),
                    ("ke", ke)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if index_q.dim() != 3 or index_weights.dim() != 2 or index_k.dim() != 2:
        raise ValueError("chunked_indexer_topk expects index_q [Tq, HI, DI], index_weights [Tq, HI], index_k [Tk, DI]; "
                         f"got {tuple(index_q.shape)}, {tuple(index_weights.shape)}, {tuple(index_k.shape)}")
    if index_weights.shape != index_q.shape[:2]:
        raise ValueError(f"index_weights {tuple(index_weights.shape)} must be [Tq, HI] = {tuple(index_q.shape[:2])} "
                         "(one weight per query and indexer head)")
    if index_k.shape[1] != index_q.shape[2]:
        raise ValueError(f"index_k head dim {index_k.shape[1]} != index_q head dim {index_q.shape[2]} (DI)")
    Tq = index_q.shape[0]
    for name, t in (("ks", ks), ("ke", ke)):
        if t.dim() != 1 or t.shape[0] != Tq or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a [Tq={Tq}] int32/int64 tensor of key-window bounds "
                             f"(moe_rl.attention.key_windows), got {tuple(t.shape)} {t.dtype}")


def _check_sparse_inputs(q: object, kv: object, topk_indices: object, valid: object, v_head_dim: object) -> None:
    """Shapes, dtypes and index range of :func:`sparse_latent_attention_chunked`'s inputs (one host sync)."""
    for name, t in (("q", q), ("kv", kv), ("topk_indices", topk_indices)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"sparse attention expects q [Tq, H, Dk] and kv [Tk, Dk] with equal Dk; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}")
    if q.dtype != kv.dtype:
        raise TypeError(f"q is {q.dtype} but kv is {kv.dtype}; pass both in one dtype (e.g. kv.to({q.dtype}))")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or not 0 < v_head_dim <= kv.shape[-1]:
        raise ValueError(f"v_head_dim={v_head_dim!r} must be an int in [1, Dk={kv.shape[-1]}] (the value is "
                         "kv[:, :v_head_dim])")
    if topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices must be an int32/int64 tensor, got {topk_indices.dtype}")
    Tq, Tk = q.shape[0], kv.shape[0]
    if topk_indices.dim() != 2 or topk_indices.shape[0] != Tq:
        raise ValueError(f"topk_indices must be [Tq={Tq}, K], got {tuple(topk_indices.shape)}")
    if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                              or valid.shape != topk_indices.shape):
        raise ValueError(f"valid must be a bool tensor of shape {tuple(topk_indices.shape)} (one flag per slot), got "
                         f"{tuple(valid.shape) if isinstance(valid, Tensor) else type(valid).__name__}"
                         f"{' ' + str(valid.dtype) if isinstance(valid, Tensor) else ''}")
    if topk_indices.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_indices))
        if lo < -1 or hi >= Tk:
            raise ValueError(f"topk_indices must lie in [-1, Tk={Tk}) (-1 = no key), got range [{lo}, {hi}]")


def _ordered_bits(scores: Tensor) -> Tensor:
    """fp32 scores -> int64 in ``[-2^31, 2^31)`` with the same order (``-0.0`` and ``+0.0`` equal)."""
    b = (scores.contiguous() + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


_LOW = (1 << 32) - 1


@torch.no_grad()
def chunked_indexer_topk(
    index_q: Tensor,
    index_weights: Tensor,
    index_k: Tensor,
    index_topk: int,
    *,
    ks: Tensor,
    ke: Tensor,
    q_chunk_size: int = DEFAULT_Q_CHUNK,
    k_chunk_size: int = DEFAULT_K_CHUNK,
    score_backend: Literal["torch", "triton"] = "torch",
) -> Tensor:
    """Top-``index_topk`` keys of the lightning indexer per query, streamed over key blocks (no ``[Tq, Tk]``).

    Args:
        index_q: ``[Tq, HI, DI]`` indexer queries (fp32/bf16 -> fp32 math; fp64 -> fp64).
        index_weights: ``[Tq, HI]`` per-head weights (scales folded in).
        index_k: ``[Tk, DI]`` indexer keys; row s = token index s.
        index_topk: K >= 1.
        ks, ke: ``[Tq]`` int64 key windows (:func:`moe_rl.attention.core.key_windows`).
        q_chunk_size: query rows per tile (>= 1).
        k_chunk_size: key rows per step (>= 1).
        score_backend: how each ``[cq, ck]`` block is scored: ``"torch"`` (einsum) or ``"triton"``
            (:func:`moe_rl.attention.triton_indexer.indexer_scores_triton` on the block; CUDA tensors, or CPU
            under ``TRITON_INTERPRET=1``). The merge is the same torch code for both.

    Returns:
        ``[Tq, K]`` int64, equal to ``select_topk(lightning_indexer(...).scores, K)`` whenever both compute
        the same scores: per row the ``min(K, visible)`` best keys by descending score, equal scores by
        ascending key index, then ``-1``. No gradient.

    Raises:
        ValueError: ``index_topk < 1``, a chunk size < 1, an unknown ``score_backend``, inputs not of the shapes
            above (``ks``/``ke`` must be int32/int64), or a NaN score inside a key window.
        TypeError: an input that is not a tensor. ImportError: ``score_backend="triton"`` without Triton.
    """
    if score_backend not in ("torch", "triton"):
        raise ValueError(f"score_backend={score_backend!r} must be 'torch' or 'triton'")
    if score_backend == "triton":
        from moe_rl.attention.triton_indexer import indexer_scores_triton
    K = _check_topk(index_topk)
    _check_indexer_shapes(index_q, index_weights, index_k, ks, ke)
    cq = check_chunk_size("q_chunk_size", q_chunk_size)
    ck = check_chunk_size("k_chunk_size", k_chunk_size)
    Tq, HI, _ = index_q.shape
    Tk = index_k.shape[0]
    dev = index_q.device
    acc = acc_dtype(index_q.dtype)
    packed = acc == torch.float32
    kf = index_k.to(acc)
    ke_c = torch.minimum(ke, torch.full_like(ke, Tk))
    n_vis = (ke_c - ks).clamp(min=0)
    out = torch.full((Tq, K), -1, dtype=torch.int64, device=dev)
    if Tq == 0:
        return out
    # every tile's visited key range [lo, hi) in one host transfer (no per-step device sync)
    n_t = -(-Tq // cq)
    pad = n_t * cq - Tq
    lo_all = torch.cat([ks, ks.new_full((pad,), Tk)]).view(n_t, cq).amin(1)
    hi_all = torch.cat([ke_c, ke_c.new_zeros(pad)]).view(n_t, cq).amax(1)
    bounds = torch.stack([lo_all, hi_all], 1).tolist()
    nan_seen = torch.zeros((), dtype=torch.bool, device=dev)
    for tile, c0 in enumerate(range(0, Tq, cq)):
        c1 = min(c0 + cq, Tq)
        ks_c, ke_cc = ks[c0:c1], ke_c[c0:c1]
        lo, hi = bounds[tile]
        if hi <= lo:
            continue
        q_t = index_q[c0:c1].to(acc)
        w_t = index_weights[c0:c1].to(acc)
        best_key = best_val = best_idx = None
        for k0 in range(lo, hi, ck):
            k1 = min(k0 + ck, hi)
            if score_backend == "triton":  # block-relative windows; the kernel stores -inf outside them
                blk = indexer_scores_triton(index_q[c0:c1], index_weights[c0:c1], index_k[k0:k1], ks_c - k0,
                                            ke_cc - k0)
            else:
                s = torch.relu(torch.einsum("thd,sd->ths", q_t, kf[k0:k1]))
                blk = torch.einsum("ths,th->ts", s, w_t)  # [cq, ck]
                del s
            k_idx = torch.arange(k0, k1, device=dev)
            vis = (k_idx[None, :] >= ks_c[:, None]) & (k_idx[None, :] < ke_cc[:, None])
            nan_seen |= torch.isnan(blk).logical_and(vis).any()
            blk = blk.masked_fill(~vis, -math.inf)
            if packed:
                key = _ordered_bits(blk) * (1 << 32) + (_LOW - k_idx)[None, :]
                cand = key if best_key is None else torch.cat([best_key, key], dim=1)
                kk = min(K, cand.shape[1])
                best_key = cand.topk(kk, dim=1, sorted=False).values if kk < cand.shape[1] else cand
            else:  # fp64: [best | block] positions are in ascending key order; a stable sort keeps it on ties
                idx_b = k_idx[None, :].expand(c1 - c0, -1)
                val = blk if best_val is None else torch.cat([best_val, blk], dim=1)
                idx = idx_b if best_idx is None else torch.cat([best_idx, idx_b], dim=1)
                kk = min(K, val.shape[1])
                order = torch.sort(val + 0.0, dim=1, descending=True, stable=True).indices[:, :kk]
                best_val, best_idx = val.gather(1, order), idx.gather(1, order)
        if packed:
            best_key = best_key.sort(dim=1, descending=True).values
            sel = _LOW - (best_key & _LOW)
        else:
            sel = best_idx
        kk = sel.shape[1]
        slot = torch.arange(kk, device=dev)[None, :]
        out[c0:c1, :kk] = torch.where(slot < n_vis[c0:c1, None], sel, torch.full_like(sel, -1))
    if bool(nan_seen):
        raise ValueError("indexer scores contain NaN inside a key window; check the indexer inputs for NaN/inf")
    return out


def _tile_probs(q_t: Tensor, sel: Tensor, ok: Tensor, scale: float) -> Tensor:
    s = torch.einsum("thd,tkd->thk", q_t, sel) * scale
    return s.masked_fill(~ok[:, None, :], -math.inf)


class SparseLatentAttentionFn(torch.autograd.Function):
    """Sparse MQA-latent attention over selected rows, per query tile, recomputing in backward.

    ``apply(q [Tq, H, Dk], kv [Tk, Dk], idx [Tq, K] int64 (-1 = none), v_head_dim, scale, chunk)`` ->
    ``(out [Tq, H, Dv] in q's dtype, lse [Tq, H] fp32/fp64)``. Saves ``q``, ``kv``, ``idx``, ``lse`` only.
    Gradients: ``q``, ``kv`` (and through ``lse``, as the dense reference's ``lse`` is differentiable).
    """

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, idx: Tensor, v_head_dim: int, scale: float, chunk: int):
        Tq, H, _ = q.shape
        acc = acc_dtype(q.dtype)
        out = torch.empty(Tq, H, v_head_dim, dtype=acc, device=q.device)
        lse = torch.empty(Tq, H, dtype=acc, device=q.device)
        K = idx.shape[1]
        for c0 in range(0, Tq, chunk):
            c1 = min(c0 + chunk, Tq)
            i = idx[c0:c1]
            ok = i >= 0
            sel = kv.index_select(0, i.clamp(min=0).reshape(-1)).view(c1 - c0, K, kv.shape[-1]).to(acc)
            p, lse[c0:c1], _ = _softmax_stats(_tile_probs(q[c0:c1].to(acc), sel, ok, scale))
            out[c0:c1] = torch.einsum("thk,tkd->thd", p, sel[..., :v_head_dim])
        ctx.save_for_backward(q, kv, idx, lse)
        ctx.v_head_dim, ctx.scale, ctx.chunk = v_head_dim, scale, chunk
        ctx.mark_non_differentiable(idx)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_lse: Tensor | None):
        q, kv, idx, lse = ctx.saved_tensors
        Dv, scale, chunk = ctx.v_head_dim, ctx.scale, ctx.chunk
        Tq, H, Dk = q.shape
        K = idx.shape[1]
        acc = acc_dtype(q.dtype)
        need_q, need_kv = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dq = torch.zeros(Tq, H, Dk, dtype=acc, device=q.device) if need_q else None
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device) if need_kv else None
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        for c0 in range(0, Tq, chunk):
            c1 = min(c0 + chunk, Tq)
            i = idx[c0:c1]
            ok = i >= 0
            flat = i.clamp(min=0).reshape(-1)
            sel = kv.index_select(0, flat).view(c1 - c0, K, Dk).to(acc)
            q_t = q[c0:c1].to(acc)
            p = torch.exp(_tile_probs(q_t, sel, ok, scale) - lse_safe[c0:c1, :, None])  # [cq, H, K]
            ds = torch.zeros_like(p)
            if d_out is not None:
                do = d_out[c0:c1].to(acc)
                dp = torch.einsum("thd,tkd->thk", do, sel[..., :Dv])
                ds = p * (dp - (p * dp).sum(-1, keepdim=True))
                del dp
            if d_lse is not None:
                ds = ds + p * d_lse[c0:c1, :, None].to(acc)
            ds = ds * scale
            if need_q:
                dq[c0:c1] = torch.einsum("thk,tkd->thd", ds, sel)
            if need_kv:
                dsel = torch.einsum("thk,thd->tkd", ds, q_t)
                if d_out is not None:
                    dsel[..., :Dv] += torch.einsum("thk,thd->tkd", p, do)
                dkv.index_add_(0, flat, dsel.reshape(-1, Dk))
        return (dq.to(q.dtype) if need_q else None, dkv.to(kv.dtype) if need_kv else None, None, None, None, None)


def sparse_latent_attention_chunked(
    q: Tensor,
    kv: Tensor,
    topk_indices: Tensor,
    *,
    v_head_dim: int,
    scale: float,
    valid: Tensor | None = None,
    chunk_size: int = DEFAULT_ATTN_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Memory-bounded :func:`moe_rl.attention.sparse_latent_attention` (same arguments and results).

    Args:
        q: ``[Tq, H, Dk]`` (fp32/bf16, or fp64; math in fp32, fp64 for fp64). kv: ``[Tk, Dk]`` in q's dtype
            (value = ``kv[:, :v_head_dim]``).
        topk_indices: ``[Tq, K]`` int32/int64 key rows in ``[-1, Tk)``, ``-1`` = none; a row should not repeat a
            key (a repeat counts it twice in the softmax; :func:`moe_rl.attention.dsa_attention` checks this).
        v_head_dim: Dv, in ``[1, Dk]``. scale: softmax scale.
        valid: optional ``[Tq, K]`` bool; False slots are ignored like ``-1``.
        chunk_size: query rows per tile (>= 1).

    Returns:
        ``(out [Tq, H, Dv] in q's dtype, lse [Tq, H] fp32 (fp64 for fp64 inputs))``; differentiable in ``q``
        and ``kv`` (and through ``lse``) by :class:`SparseLatentAttentionFn`.

    Raises:
        ValueError: ``chunk_size`` < 1, shapes other than the above, ``v_head_dim`` outside ``[1, Dk]``, indices
            outside ``[-1, Tk)``, a ``valid`` that is not a ``[Tq, K]`` bool tensor.
        TypeError: non-tensor inputs, non-integer ``topk_indices``, ``q`` and ``kv`` of different dtypes.
    """
    chunk = check_chunk_size("attn_chunk_size", chunk_size)
    _check_sparse_inputs(q, kv, topk_indices, valid, v_head_dim)
    idx = topk_indices.long()
    if valid is not None:
        idx = torch.where(valid, idx, torch.full_like(idx, -1))
    return SparseLatentAttentionFn.apply(q, kv, idx.contiguous(), v_head_dim, float(scale), chunk)


def _ordered_key(scores: Tensor) -> Tensor:
    """Map fp32 scores to int64 keys with the same order, ties broken by the lower column index."""
    f = scores.float().contiguous() + 0.0  # -0.0 -> +0.0 so equal scores stay equal
    b = f.view(torch.int32).to(torch.int64)
    ordered = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)  # IEEE-754 bits -> order-preserving signed ints
    col = torch.arange(f.shape[-1], device=f.device, dtype=torch.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - col)


@torch.no_grad()
def select_topk(scores: Tensor, index_topk: int, *, ks: Tensor, ke: Tensor) -> Tensor:
    """Deterministic top-``index_topk`` of each row over its visible keys, ``-1``-filled.

    Args:
        scores: ``[Tq, Tk]`` fp32, ``-inf`` outside the windows.
        index_topk: K >= 1; the output width is always K even if ``Tk < K`` (NVIDIA-NeMo/Automodel PR #3035).
        ks, ke: ``[Tq]`` int64 key windows (key row s = token index s).

    Returns:
        ``[Tq, K]`` int64: per row, the ``min(K, visible)`` best keys ordered by descending score, equal
        scores by ascending key index, then ``-1`` in every remaining slot. Indices are unique and inside the
        window.

    Raises:
        ValueError: ``index_topk`` not an int >= 1 (a bool is refused), ``scores`` not ``[Tq, Tk]``, ``ks``/``ke``
            not ``[Tq]``, or a NaN score inside a window.
    """
    _check_topk(index_topk)
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a [Tq, Tk] tensor, got "
                         f"{tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__}")
    for name, t in (("ks", ks), ("ke", ke)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != scores.shape[0]:
            raise ValueError(f"{name} must be a [Tq={scores.shape[0]}] integer tensor of key-window bounds, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    Tq, Tk = scores.shape
    kk = min(index_topk, Tk)
    n_vis = (torch.minimum(ke, torch.full_like(ke, Tk)) - ks).clamp(min=0)  # [Tq]
    out = torch.full((Tq, index_topk), -1, dtype=torch.int64, device=scores.device)
    if kk == 0 or Tq == 0:
        return out
    vis = (torch.arange(Tk, device=scores.device)[None, :] >= ks[:, None]) & (
        torch.arange(Tk, device=scores.device)[None, :] < ke[:, None]
    )
    if bool(torch.isnan(scores).logical_and(vis).any()):
        raise ValueError("indexer scores contain NaN inside a key window; check the indexer inputs for NaN/inf")
    masked = scores.masked_fill(~vis, -math.inf)
    if masked.dtype == torch.float64:  # no room for the column in an int64 key: stable sort (ties keep index order)
        idx = torch.sort(masked + 0.0, dim=-1, descending=True, stable=True).indices[:, :kk]
    else:
        idx = _ordered_key(masked).topk(kk, dim=-1, sorted=True).indices  # unique keys: deterministic order
    slot = torch.arange(kk, device=scores.device)[None, :]
    out[:, :kk] = torch.where(slot < n_vis[:, None], idx, torch.full_like(idx, -1))
    return out
