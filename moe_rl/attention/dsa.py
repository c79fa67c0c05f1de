"""DeepSeek Sparse Attention (DSA): lightning indexer, deterministic top-k, sparse latent attention, indexer KL.

Shape legend:
    Tq   query tokens of this call
    Tk   key rows; **key row s holds token index s** of the packed stream (the keys cover ``[0, Tk)``;
         under context parallelism :func:`moe_rl.attention.dsa_cp_attention` gathers them into that order)
    HI   indexer heads (``index_n_heads``: 64 in DeepSeek-V3.2, 32 in GLM-5)
    DI   indexer head dim (``index_head_dim``, 128)
    K    ``index_topk`` (2048)
    H    attention (query) heads
    Dk   latent key dim = kv_lora_rank + qk_rope_head_dim (512 + 64 = 576)
    Dv   latent value dim = kv_lora_rank (the first Dv dims of the latent)

Math (DeepSeek-V3.2 report, ``DeepSeek_V3_2.pdf`` §2; github.com/deepseek-ai/DeepSeek-V3.2-Exp):

* Lightning indexer: ``I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])`` for keys ``s`` in the query's key
  window (:func:`moe_rl.attention.core.key_windows`: causal, per packed sequence), ``-inf`` elsewhere. The
  Hugging Face / reference scalings ``index_head_dim**-0.5 * index_n_heads**-0.5`` are folded into ``w`` by the
  caller (exact, since ``ReLU(a x) = a ReLU(x)`` for ``a > 0``); :class:`moe_rl.attention.DSAIndexer` does it.
* Top-k: the ``index_topk`` visible keys of largest ``I[t, :]``, ordered by score, **ties broken by the lower
  key index**; when fewer than ``index_topk`` keys are visible the remaining slots hold ``-1`` (NVIDIA-NeMo/Automodel PR #3035), so
  the width stays ``index_topk`` and downstream kernel shapes stay fixed.
* Sparse attention (MLA in MQA mode): all query heads share one latent key/value row per token
  ``c[s] = [kv_a_layernorm(c_kv[s]) | rope(k_pe[s])]``; ``out[t, h] = sum_{s in S_t} softmax_s(scale * q[t, h] . c[s])
  * c[s, :Dv]`` over the selected set ``S_t``. With every visible key selected this equals dense attention.
* Indexer warm-up loss: ``L_I = sum_t KL(p[t, :] || softmax(I[t, :]))`` where ``p`` is the main attention summed
  over heads and L1-normalised (detached); in the sparse stage both are restricted to ``S_t``.

Kernels: this module is the dense reference (``backend="dense"``: ``[Tq, Tk]`` indexer scores, autograd through
the gathered rows). :func:`dsa_attention` with ``backend="torch"`` runs the memory-bounded path of
:mod:`moe_rl.attention.dsa_chunked` (streaming top-k, tiled sparse attention recomputed in backward; O(Tq * K)
memory) with the same results.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from moe_rl.attention.core import _softmax_stats, acc_dtype, default_cu_seqlens, key_windows
from moe_rl.attention.dsa_chunked import (  # select_topk lives there (dsa_vendor needs it below dsa)
    DEFAULT_ATTN_CHUNK,
    DEFAULT_K_CHUNK,
    DEFAULT_Q_CHUNK,
    DSABackend,
    _check_topk,
    check_chunk_size,
    check_dsa_backend,
    chunked_indexer_topk,
    select_topk,
    sparse_latent_attention_chunked,
)

__all__ = [
    "DSAOutput",
    "IndexerOutput",
    "dsa_attention",
    "indexer_kl_loss",
    "indexer_kl_target",
    "lightning_indexer",
    "select_topk",
    "sparse_latent_attention",
]

IndexerBackend = Literal["torch", "triton", "deep_gemm"]


class IndexerOutput(NamedTuple):
    """``scores``: ``[Tq, Tk]`` fp32 indexer scores, ``-inf`` outside each key window.
    ``topk_indices``: ``[Tq, index_topk]`` int64 key rows (``-1`` = no key), or ``None`` when no
    ``index_topk`` was asked for."""

    scores: Tensor
    topk_indices: Tensor | None


class DSAOutput(NamedTuple):
    """Result of :func:`dsa_attention` / :func:`moe_rl.attention.dsa_cp_attention`.

    Fields:
        out: ``[Tq, H, Dv]`` in the query dtype.
        lse: ``[Tq, H]`` fp32 log-sum-exp over the selected keys (``-inf`` when none).
        topk_indices: ``[Tq, K]`` int64 selected key rows in token-index coordinates (``-1`` = none), the
            indexer's selection or the ones passed in; record these for DSA index replay.
        index_scores: ``[Tq, Tk]`` fp32 indexer scores when ``return_index_scores=True`` (for
            :func:`indexer_kl_loss`), else ``None``.
        num_dropped_indices: 0-d int64: passed-in indices that were outside their query's key window (a future
            or other-sequence key) and were therefore ignored. Always 0 for indexer selections.
    """

    out: Tensor
    lse: Tensor
    topk_indices: Tensor
    index_scores: Tensor | None
    num_dropped_indices: Tensor


def _default_q_token_idx(q_token_idx: Tensor | None, Tq: int, Tk: int, dev: torch.device, qn: str, kn: str) -> Tensor:
    """``q_token_idx`` checked to be ``[Tq]``, or its default ``arange(Tq) + Tk - Tq`` (the last Tq tokens).

    The default needs ``Tq <= Tk``: with more queries than keys the first ``Tq - Tk`` would get negative token
    indices, hence empty windows and a silent zero output. Padding query rows are legal only when named
    explicitly (``q_token_idx`` outside ``[0, cu_seqlens[-1])``, see :func:`moe_rl.attention.core.key_windows`).
    """
    if q_token_idx is None:
        if Tq > Tk:
            raise ValueError(f"{qn} has {Tq} rows but {kn} only {Tk}: by default the queries are the last Tq of the Tk "
                             f"tokens, which needs Tq <= Tk; pass the full {kn}, or q_token_idx [Tq] with the token "
                             "index of every query (padding rows outside [0, cu_seqlens[-1]))")
        return torch.arange(Tq, device=dev) + (Tk - Tq)
    if not isinstance(q_token_idx, Tensor) or q_token_idx.dim() != 1 or q_token_idx.shape[0] != Tq:
        raise ValueError(f"q_token_idx must be a [Tq={Tq}] integer tensor (token index of each query row), got "
                         f"{tuple(q_token_idx.shape) if isinstance(q_token_idx, Tensor) else type(q_token_idx).__name__}")
    return q_token_idx


def _default_chunk(HI: int, Tk: int) -> int:
    return max(1, (1 << 22) // max(1, HI * Tk))  # ~16 MiB of fp32 [chunk, HI, Tk] per step


def _check_indexer_inputs(index_q: Tensor, index_weights: Tensor, index_k: Tensor) -> None:
    if index_q.dim() != 3 or index_weights.dim() != 2 or index_k.dim() != 2:
        raise ValueError(
            "lightning indexer expects index_q [Tq, HI, DI], index_weights [Tq, HI], index_k [Tk, DI]; got "
            f"{tuple(index_q.shape)}, {tuple(index_weights.shape)}, {tuple(index_k.shape)}"
        )
    if index_weights.shape != index_q.shape[:2]:
        raise ValueError(f"index_weights {tuple(index_weights.shape)} must be [Tq, HI] = {tuple(index_q.shape[:2])}")
    if index_k.shape[1] != index_q.shape[2]:
        raise ValueError(f"index_k head dim {index_k.shape[1]} != index_q head dim {index_q.shape[2]}")


def lightning_indexer(
    index_q: Tensor,
    index_weights: Tensor,
    index_k: Tensor,
    *,
    index_topk: int | None = None,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_token_idx: Tensor | None = None,
    chunk_size: int | None = None,
    backend: IndexerBackend = "torch",
) -> IndexerOutput:
    """Lightning-indexer scores ``I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s])`` and optional top-k.

    Args:
        index_q: ``[Tq, HI, DI]`` indexer queries (fp32/bf16; math in fp32).
        index_weights: ``[Tq, HI]`` per-head weights ``w`` (scales already folded in).
        index_k: ``[Tk, DI]`` the single shared indexer key per token; row s = token index s.
        index_topk: when given, also select that many keys per query (:func:`select_topk`).
        causal: causal key windows (the DSA setting); False allows the whole packed sequence.
        cu_seqlens: ``[N + 1]`` packed-sequence boundaries; default one sequence of Tk tokens.
        q_token_idx: ``[Tq]`` token indices of the queries; default ``arange(Tq) + Tk - Tq``.
        chunk_size: queries per step (bounds the ``[chunk, HI, Tk]`` fp32 temporary); default ~16 MiB.
        backend: ``"torch"`` (differentiable, the reference) or ``"triton"`` (forward only,
            :func:`moe_rl.attention.triton_indexer.indexer_scores_triton`).

    Returns:
        :class:`IndexerOutput`.

    Raises:
        ValueError: bad shapes, ``index_topk`` not an int >= 1 (a bool is refused), ``chunk_size < 1``, a
            ``q_token_idx`` that is not ``[Tq]``, ``Tq > Tk`` without ``q_token_idx`` (the default places the
            queries at the last Tq of Tk tokens), unknown backend. ImportError: triton backend without triton.
    """
    _check_indexer_inputs(index_q, index_weights, index_k)
    if index_topk is not None:
        _check_topk(index_topk)
    if chunk_size is not None:
        check_chunk_size("chunk_size", chunk_size)
    Tq, HI, _ = index_q.shape
    Tk = index_k.shape[0]
    dev = index_q.device
    q_token_idx = _default_q_token_idx(q_token_idx, Tq, Tk, dev, "index_q", "index_k")
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(Tk, dev)
    ks, ke = key_windows(q_token_idx, cu_seqlens, causal=causal)
    if backend == "torch":
        chunk = chunk_size or _default_chunk(HI, Tk)
        k_idx = torch.arange(Tk, device=dev)
        acc = acc_dtype(index_q.dtype)
        kf = index_k.to(acc)
        parts = []
        for c0 in range(0, Tq, chunk):
            sl = slice(c0, c0 + chunk)
            s = torch.relu(torch.einsum("thd,sd->ths", index_q[sl].to(acc), kf))
            i_ts = torch.einsum("ths,th->ts", s, index_weights[sl].to(acc))
            vis = (k_idx[None, :] >= ks[sl, None]) & (k_idx[None, :] < ke[sl, None])
            parts.append(i_ts.masked_fill(~vis, -math.inf))
        scores = torch.cat(parts, dim=0) if parts else index_q.new_empty((0, Tk), dtype=torch.float32)
    elif backend == "triton":
        from moe_rl.attention.triton_indexer import indexer_scores_triton

        scores = indexer_scores_triton(index_q, index_weights, index_k, ks, ke)
    else:
        raise ValueError(f"backend={backend!r} is not supported; use 'torch' or 'triton'")
    topk = None
    if index_topk is not None:
        with torch.no_grad():
            topk = select_topk(scores, index_topk, ks=ks, ke=ke)
    return IndexerOutput(scores, topk)


def _check_topk_indices(topk_indices: Tensor, Tq: int, Tk: int, check_unique: bool) -> None:
    if not isinstance(topk_indices, Tensor) or topk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices must be an int32/int64 tensor, got {getattr(topk_indices, 'dtype', type(topk_indices))}")
    if topk_indices.dim() != 2 or topk_indices.shape[0] != Tq:
        raise ValueError(f"topk_indices must be [Tq={Tq}, index_topk], got {tuple(topk_indices.shape)}")
    if topk_indices.numel() and (int(topk_indices.min()) < -1 or int(topk_indices.max()) >= Tk):
        raise ValueError(
            f"topk_indices must lie in [-1, Tk={Tk}) (-1 = no key), got range "
            f"[{int(topk_indices.min())}, {int(topk_indices.max())}]"
        )
    if check_unique and topk_indices.numel():
        s = topk_indices.sort(dim=-1).values
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if bool(dup.any()):
            row = int(dup.any(dim=-1).nonzero()[0])
            raise ValueError(
                f"topk_indices row {row} repeats a key index ({topk_indices[row].tolist()[:16]}...); a key may be "
                "selected at most once (a repeat would count it twice in the softmax)"
            )


def sparse_latent_attention(
    q: Tensor,
    kv: Tensor,
    topk_indices: Tensor,
    *,
    v_head_dim: int,
    scale: float,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of every query head over its selected latent rows (MQA: one shared latent head).

    Args:
        q: ``[Tq, H, Dk]`` absorbed queries. kv: ``[Tk, Dk]`` latent rows (value = ``kv[:, :v_head_dim]``).
        topk_indices: ``[Tq, K]`` int key rows, ``-1`` = none.
        v_head_dim: Dv.
        scale: softmax scale.
        valid: optional ``[Tq, K]`` bool; False slots are ignored like ``-1``.

    Returns:
        ``(out [Tq, H, Dv] in q's dtype, lse [Tq, H] fp32)``; gradients flow to ``q`` and to the gathered
        rows of ``kv`` (index_select backward = scatter-add), none through ``-1`` slots.
    """
    ok = topk_indices >= 0
    if valid is not None:
        ok = ok & valid
    idx = topk_indices.clamp(min=0).long()
    acc = acc_dtype(q.dtype)
    # upcast before the gather: the scatter-add of the backward then accumulates in fp32 (one rounding per row)
    sel = kv.to(acc).index_select(0, idx.reshape(-1)).view(*idx.shape, kv.shape[-1])  # [Tq, K, Dk]
    scores = torch.einsum("thd,tkd->thk", q.to(acc), sel) * scale
    scores = scores.masked_fill(~ok[:, None, :], -math.inf)
    p, lse, _ = _softmax_stats(scores)
    out = torch.einsum("thk,tkd->thd", p, sel[..., :v_head_dim])
    return out.to(q.dtype), lse


def dsa_attention(
    q: Tensor,
    kv: Tensor,
    *,
    v_head_dim: int,
    scale: float | None = None,
    topk_indices: Tensor | None = None,
    index_q: Tensor | None = None,
    index_weights: Tensor | None = None,
    index_k: Tensor | None = None,
    index_topk: int | None = None,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_token_idx: Tensor | None = None,
    return_index_scores: bool = False,
    check_indices: bool = True,
    indexer_backend: IndexerBackend = "torch",
    backend: DSABackend = "dense",
    q_chunk_size: int = DEFAULT_Q_CHUNK,
    k_chunk_size: int = DEFAULT_K_CHUNK,
    attn_chunk_size: int = DEFAULT_ATTN_CHUNK,
) -> DSAOutput:
    """DSA: sparse MLA (MQA-mode latent) attention over the top-k keys of the lightning indexer, or over
    precomputed / replayed ``topk_indices``.

    Exactly one selection source must be given: ``topk_indices`` (replay; the indexer does not run), or the
    indexer inputs ``index_q``, ``index_weights``, ``index_k`` and ``index_topk``.

    Args:
        q: ``[Tq, H, Dk]`` absorbed queries ``[q_nope W_UK | rope(q_pe)]`` (fp32/bf16).
        kv: ``[Tk, Dk]`` latent rows ``[kv_a_layernorm(c_kv) | rope(k_pe)]``; row s = token index s.
        v_head_dim: Dv (= kv_lora_rank): the value is ``kv[:, :Dv]``.
        scale: softmax scale; default ``Dk ** -0.5`` (MLA uses ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``;
            pass it).
        topk_indices: ``[Tq, K]`` int32/int64 key rows in token-index coordinates, ``-1`` = none (the stable
            contract for DSA index replay: the same tensor :attr:`DSAOutput.topk_indices` returns). Indices
            outside their query's key window are ignored and counted in ``num_dropped_indices``.
        index_q, index_weights, index_k, index_topk: lightning-indexer inputs (:func:`lightning_indexer`).
        causal, cu_seqlens, q_token_idx: key windows (:func:`moe_rl.attention.core.key_windows`); default one
            causal sequence with the queries being the last Tq tokens.
        return_index_scores: also return the indexer scores (differentiable, for :func:`indexer_kl_loss`).
        check_indices: validate passed-in ``topk_indices`` (range always; uniqueness per row here, one sort).
        indexer_backend: ``"torch"`` or ``"triton"``: how indexer scores are computed (the whole ``[Tq, Tk]``
            matrix with ``backend="dense"``, one ``[q_chunk_size, k_chunk_size]`` block at a time with
            ``backend="torch"``).
        backend: ``"dense"`` (this reference: ``[Tq, Tk]`` indexer scores, autograd through the gathered
            ``[Tq, K, Dk]`` rows) or ``"torch"``, the memory-bounded path of :mod:`moe_rl.attention.dsa_chunked`
            (streaming top-k indexer, tiled sparse attention recomputed in backward; O(Tq * K) memory). Same
            results: equal indices for equal scores, outputs and gradients within fp32 summation-order rounding.
        q_chunk_size, k_chunk_size: ``backend="torch"``: query rows per indexer tile and key rows per indexer
            step (positive ints; validated, and unused, with ``backend="dense"``).
        attn_chunk_size: ``backend="torch"``: query rows per sparse-attention tile (positive int; validated, and
            unused, with ``backend="dense"``).

    Returns:
        :class:`DSAOutput`.

    Raises:
        ValueError: both or neither selection source, bad shapes (``index_q`` rows != ``q`` rows, ``index_k``
            rows != ``kv`` rows, ``q_token_idx`` not ``[Tq]``), ``Tq > Tk`` without ``q_token_idx`` (the default
            places the queries at the last Tq of Tk tokens; padding query rows must be named by ``q_token_idx``),
            out-of-range or repeated indices, an unknown ``backend``, a chunk size < 1 (checked for every backend),
            ``index_topk`` not an int >= 1 (a bool is refused), or ``backend="torch"`` with
            ``return_index_scores=True`` (the full score matrix is what that backend never builds).
        ImportError: ``indexer_backend="triton"`` without Triton.
        TypeError: non-integer ``topk_indices``, or ``q`` and ``kv`` of different dtypes.
    """
    check_dsa_backend(backend)
    # chunk sizes are validated for every backend (the dense one ignores them, but a bad value is a caller bug)
    for name, val in (("q_chunk_size", q_chunk_size), ("k_chunk_size", k_chunk_size),
                      ("attn_chunk_size", attn_chunk_size)):
        check_chunk_size(name, val)
    if index_topk is not None:
        _check_topk(index_topk)
    if backend in ("torch", "flashmla"):
        if return_index_scores:
            raise ValueError(f"return_index_scores=True needs the [Tq, Tk] indexer score matrix, which backend={backend!r} "
                             "never builds; use backend='dense' for the indexer KL warm-up")
        if indexer_backend not in ("torch", "triton", "deep_gemm"):
            raise ValueError(f"indexer_backend={indexer_backend!r} is not supported; use 'torch', 'triton' or 'deep_gemm'")
    if q.dim() != 3 or kv.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"dsa_attention expects q [Tq, H, Dk] and kv [Tk, Dk]; got {tuple(q.shape)}, {tuple(kv.shape)}")
    if q.dtype != kv.dtype:
        raise TypeError(f"dsa_attention needs q and kv of one dtype; got q {q.dtype} and kv {kv.dtype}: cast one "
                        f"(e.g. kv.to({q.dtype}))")
    if not 0 < v_head_dim <= kv.shape[-1]:
        raise ValueError(f"v_head_dim={v_head_dim} must be in [1, Dk={kv.shape[-1]}]")
    Tq, Tk = q.shape[0], kv.shape[0]
    dev = q.device
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_token_idx = _default_q_token_idx(q_token_idx, Tq, Tk, dev, "q", "kv")
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(Tk, dev)
    indexer_given = [x is not None for x in (index_q, index_weights, index_k, index_topk)]
    if topk_indices is not None and any(indexer_given):
        raise ValueError("pass either topk_indices (replay) or the indexer inputs (index_q, index_weights, "
                         "index_k, index_topk), not both")
    scores = None
    ks, ke = key_windows(q_token_idx, cu_seqlens, causal=causal)
    if topk_indices is None:
        if not all(indexer_given):
            raise ValueError("dsa_attention needs topk_indices, or all of index_q, index_weights, index_k and "
                             f"index_topk (given: {dict(zip(('index_q', 'index_weights', 'index_k', 'index_topk'), indexer_given, strict=True))})")
        _check_indexer_inputs(index_q, index_weights, index_k)
        if index_k.shape[0] != Tk:
            raise ValueError(f"index_k has {index_k.shape[0]} rows but kv has {Tk}; both must cover the same keys")
        if index_q.shape[0] != Tq:
            raise ValueError(f"index_q {tuple(index_q.shape)} has {index_q.shape[0]} rows but q {tuple(q.shape)} has "
                             f"{Tq}; both hold the same queries (row t of each is query t)")
        if backend in ("torch", "flashmla"):
            if indexer_backend == "deep_gemm":
                from moe_rl.attention.dsa_vendor import deepgemm_indexer_topk

                topk_indices = deepgemm_indexer_topk(index_q, index_weights, index_k, index_topk, ks=ks, ke=ke,
                                                     q_chunk_size=q_chunk_size)
            else:
                topk_indices = chunked_indexer_topk(index_q, index_weights, index_k, index_topk, ks=ks, ke=ke,
                                                    q_chunk_size=q_chunk_size, k_chunk_size=k_chunk_size,
                                                    score_backend=indexer_backend)
        else:
            ind = lightning_indexer(index_q, index_weights, index_k, index_topk=index_topk, causal=causal,
                                    cu_seqlens=cu_seqlens, q_token_idx=q_token_idx, backend=indexer_backend)
            scores, topk_indices = ind.scores, ind.topk_indices
        valid = None
        dropped = torch.zeros((), dtype=torch.int64, device=dev)
    else:
        _check_topk_indices(topk_indices, Tq, Tk, check_indices)
        topk_indices = topk_indices.long()
        valid = (topk_indices >= ks[:, None]) & (topk_indices < ke[:, None])
        dropped = ((topk_indices >= 0) & ~valid).sum()
    if backend == "flashmla":
        from moe_rl.attention.dsa_vendor import flashmla_sparse_attention

        out, lse = flashmla_sparse_attention(q, kv, topk_indices, v_head_dim=v_head_dim, scale=scale, valid=valid,
                                             chunk_size=attn_chunk_size)
    elif backend == "torch":
        out, lse = sparse_latent_attention_chunked(q, kv, topk_indices, v_head_dim=v_head_dim, scale=scale,
                                                   valid=valid, chunk_size=attn_chunk_size)
    else:
        out, lse = sparse_latent_attention(q, kv, topk_indices, v_head_dim=v_head_dim, scale=scale, valid=valid)
    return DSAOutput(out, lse, topk_indices, scores if return_index_scores else None, dropped)


@torch.no_grad()
def indexer_kl_target(
    q: Tensor,
    kv: Tensor,
    *,
    scale: float,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_token_idx: Tensor | None = None,
) -> Tensor:
    """Warm-up target ``p[t, :]``: dense latent attention probabilities summed over heads, L1-normalised.

    Args:
        q: ``[Tq, H, Dk]``; kv: ``[Tk, Dk]``; windows as in :func:`dsa_attention`.

    Returns:
        ``[Tq, Tk]`` fp32, rows sum to 1 (0 for a row with no visible key); no gradient.
    """
    Tq, Tk = q.shape[0], kv.shape[0]
    dev = q.device
    if q_token_idx is None:
        q_token_idx = torch.arange(Tq, device=dev) + (Tk - Tq)
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(Tk, dev)
    ks, ke = key_windows(q_token_idx, cu_seqlens, causal=causal)
    k_idx = torch.arange(Tk, device=dev)
    vis = (k_idx[None, :] >= ks[:, None]) & (k_idx[None, :] < ke[:, None])
    acc = acc_dtype(q.dtype)
    s = torch.einsum("thd,sd->hts", q.to(acc), kv.to(acc)) * scale
    p, _, _ = _softmax_stats(s.masked_fill(~vis[None], -math.inf))
    p = p.sum(0)
    return p / p.sum(-1, keepdim=True).clamp_min(1e-30)


def indexer_kl_loss(
    index_scores: Tensor,
    target: Tensor,
    *,
    topk_indices: Tensor | None = None,
    reduction: Literal["sum", "mean"] = "sum",
) -> Tensor:
    """``L_I = sum_t KL(p[t, :] || softmax(I[t, :]))`` (DeepSeek-V3.2 indexer warm-up / sparse-stage loss).

    Args:
        index_scores: ``[Tq, Tk]`` fp32 indexer scores (``-inf`` outside windows), differentiable.
        target: ``[Tq, Tk]`` fp32 target distribution (:func:`indexer_kl_target`); treated as constant.
        topk_indices: ``[Tq, K]`` (``-1`` = none): sparse stage, both distributions restricted to (and
            renormalised over) the selected keys. ``None``: dense warm-up over the visible keys.
        reduction: ``"sum"`` over queries (the paper's) or ``"mean"`` over queries with at least one key.

    Returns:
        0-d fp32 loss; rows with no key contribute 0.
    """
    if index_scores.shape != target.shape:
        raise ValueError(f"index_scores {tuple(index_scores.shape)} and target {tuple(target.shape)} must match")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction={reduction!r} must be 'sum' or 'mean'")
    acc = acc_dtype(index_scores.dtype)
    scores = index_scores.to(acc)
    p = target.detach().to(acc)
    keep = torch.isfinite(scores)
    if topk_indices is not None:
        sel = torch.zeros_like(keep)
        ok = topk_indices >= 0
        sel.scatter_(1, topk_indices.clamp(min=0).long(), ok)
        keep = keep & sel
    p = torch.where(keep, p, torch.zeros_like(p))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    rows = keep.any(-1)
    masked = scores.masked_fill(~keep, -math.inf).masked_fill(~rows[:, None], 0.0)  # empty rows: no NaN
    logq = torch.where(keep, torch.log_softmax(masked, dim=-1), torch.zeros_like(scores))
    term = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - logq), torch.zeros_like(p))
    per_row = term.sum(-1)
    per_row = torch.where(rows, per_row, torch.zeros_like(per_row))
    if reduction == "sum":
        return per_row.sum()
    return per_row.sum() / rows.sum().clamp_min(1)
