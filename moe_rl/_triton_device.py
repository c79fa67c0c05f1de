"""Triton device functions shared by the kernels of ``moe_rl.fp8.triton_kernels`` and
``moe_rl.attention.triton_indexer`` (called from inside a ``@triton.jit`` kernel; Triton inlines them).

This module imports Triton at import time, so that its functions see ``triton.language`` as a module global (Triton's
interpreter, ``TRITON_INTERPRET=1``, requires it of every device function). Import it only after
:func:`moe_rl._triton.import_triton` succeeded, from a kernel module's lazy kernel factory; nothing imports it at
package import time.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["block_scaled_k_loop", "tile_2d"]


@triton.jit
def tile_2d(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``BLOCK_M x BLOCK_N`` tile of an ``[M, N]`` output owned by program ``(program_id(0), program_id(1))``.

    Returns ``(rows [BLOCK_M], cols [BLOCK_N], row_ok, col_ok)``: the tile's int32 row and column indices and the
    bool masks ``rows < M``, ``cols < N`` (a tile may overhang the edges). ``BLOCK_M``, ``BLOCK_N``: constexpr
    powers of two.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def block_scaled_k_loop(
    a_rows, b_cols, sa_rows, sb_cols, a_ok, b_ok,
    K, stride_ak, stride_bk, stride_sak, stride_sbk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``acc [BLOCK_M, BLOCK_N]`` fp32 ``= sum_kb (A[:, kb] @ B[kb, :]) * sA[:, kb] * sB[kb, :]`` over the
    ``BLOCK_K``-wide K blocks ``kb`` (one scale column each): the DeepSeek-V3 promotion scheme (arXiv 2412.19437
    §3.3), each raw fp8 partial dot of at most ``BLOCK_K`` products is scaled and added to the fp32 accumulator.

    Args (pointers are per row of the tile, at ``k = 0`` / scale column 0):
        a_rows: ``[BLOCK_M]`` pointers to the tile's rows of ``a`` (e4m3 codes, K-major, stride ``stride_ak``).
        b_cols: ``[BLOCK_N]`` pointers to the rows of ``b`` that give the tile's columns (``b`` is ``[N, K]``).
        sa_rows, sb_cols: ``[BLOCK_M]`` / ``[BLOCK_N]`` pointers to the fp32 scale rows of those rows (strides
            ``stride_sak``, ``stride_sbk`` per K block).
        a_ok, b_ok: bool row masks; a masked row loads zeros and scale 0, so it contributes 0.
        UPCAST: cast the fp8 tiles to fp16 before ``tl.dot`` (exact; GPUs without fp8 MMA, before SM 8.9).
    """
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_rows[:, None] + k[None, :] * stride_ak,
                    mask=a_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK] e4m3
        b = tl.load(b_cols[None, :] + k[:, None] * stride_bk,
                    mask=k_ok[:, None] & b_ok[None, :], other=0.0)  # [BK, BN] e4m3 (b.T tile)
        if UPCAST:  # e4m3 -> fp16 is exact
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        partial = tl.dot(a, b, out_dtype=tl.float32)  # <= BLOCK_K products per element, fp32
        sa = tl.load(sa_rows + kb * stride_sak, mask=a_ok, other=0.0)  # [BM] fp32
        sb = tl.load(sb_cols + kb * stride_sbk, mask=b_ok, other=0.0)  # [BN] fp32
        acc += partial * (sa[:, None] * sb[None, :])  # promotion into the fp32 accumulator
    return acc
