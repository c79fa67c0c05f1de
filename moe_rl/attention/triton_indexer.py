"""Triton kernel for the DSA lightning-indexer scores (forward only).

Shape legend:
    Tq  queries; Tk key rows (row s = token index s); HI indexer heads; DI indexer head dim

``I[t, s] = sum_j w[t, j] * ReLU(q[t, j, :] . k[s, :])`` inside the key window ``ks[t] <= s < ke[t]``, ``-inf``
outside: the semantics of :func:`moe_rl.attention.lightning_indexer` (``backend="torch"``), whose fp32 einsum is
the reference. One program per ``BLOCK_M x BLOCK_N`` tile of ``[Tq, Tk]``; a tile with no visible key (e.g. above
the causal diagonal) stores ``-inf`` without computing; otherwise it loops over the HI heads, computing the
``[BLOCK_M, DI] x [DI, BLOCK_N]`` dot in fp32, ReLU, and accumulating ``w[:, j] * relu`` in fp32. Inputs are
upcast to fp32 before ``tl.dot``. (DeepSeek's production indexer quantizes q/k to FP8 after a Hadamard rotation;
this kernel keeps the inputs' precision, as the Hugging Face reference does.)

Triton is imported lazily: the module imports without it, and :func:`indexer_scores_triton` raises ImportError
with install text when it is missing. Tensors must be CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``
set before triton is first imported (tests only).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from moe_rl._triton import check_kernel_device, import_triton, triton_available

__all__ = ["indexer_scores_triton", "triton_available"]

_TRITON_INSTALL = "the triton indexer backend needs Triton (`pip install triton`); on CPU use backend='torch'."


def _triton() -> tuple[Any, Any]:
    return import_triton(_TRITON_INSTALL)


_tile: Any = None
"""The device function :func:`moe_rl._triton_device.tile_2d`, bound by :func:`_kernel` when Triton imports (a module
global: Triton's interpreter looks a kernel's names up in its module's globals only)."""


@functools.cache
def _kernel() -> Any:
    global _tile
    triton, tl = _triton()
    from moe_rl._triton_device import tile_2d  # imports triton

    _tile = tile_2d

    @triton.jit
    def _indexer_scores_kernel(
        q_ptr, w_ptr, k_ptr, ks_ptr, ke_ptr, out_ptr,
        Tq, Tk, HI, DI,
        stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_ks, stride_kd, stride_ot, stride_os,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        rm, rn, m_ok, n_ok = _tile(Tq, Tk, BLOCK_M, BLOCK_N)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < DI
        ks = tl.load(ks_ptr + rm, mask=m_ok, other=0)
        ke = tl.load(ke_ptr + rm, mask=m_ok, other=0)
        vis = (rn[None, :] >= ks[:, None]) & (rn[None, :] < ke[:, None]) & m_ok[:, None] & n_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        n_vis = tl.sum(vis.to(tl.int32), axis=1)
        if tl.max(n_vis, axis=0) > 0:  # skip tiles with no visible key (causal upper triangle, other sequences)
            k = tl.load(k_ptr + rn[None, :] * stride_ks + rd[:, None] * stride_kd,
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
            for j in range(0, HI):
                q = tl.load(q_ptr + rm[:, None] * stride_qt + j * stride_qh + rd[None, :] * stride_qd,
                            mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
                w = tl.load(w_ptr + rm * stride_wt + j * stride_wh, mask=m_ok, other=0.0).to(tl.float32)
                s = tl.dot(q, k, out_dtype=tl.float32)
                acc += w[:, None] * tl.maximum(s, 0.0)
        res = tl.where(vis, acc, float("-inf"))
        tl.store(out_ptr + rm[:, None] * stride_ot + rn[None, :] * stride_os, res, mask=m_ok[:, None] & n_ok[None, :])

    return _indexer_scores_kernel


def indexer_scores_triton(
    index_q: Tensor,
    index_weights: Tensor,
    index_k: Tensor,
    ks: Tensor,
    ke: Tensor,
    *,
    block_m: int = 32,
    block_n: int = 32,
) -> Tensor:
    """Lightning-indexer scores with the Triton kernel.

    Args:
        index_q: ``[Tq, HI, DI]`` fp32/bf16. index_weights: ``[Tq, HI]``. index_k: ``[Tk, DI]``.
        ks, ke: ``[Tq]`` int key windows (:func:`moe_rl.attention.core.key_windows`).
        block_m, block_n: tile sizes (powers of two >= 16).

    Returns:
        ``[Tq, Tk]`` fp32, ``-inf`` outside the windows. No autograd.

    Raises:
        ImportError: triton missing. ValueError: tensors not on CUDA (and not interpreting), bad tile sizes.
    """
    triton, _ = _triton()
    check_kernel_device("indexer_scores_triton", index_q, index_weights, index_k, ks, ke)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16")
    Tq, HI, DI = index_q.shape
    Tk = index_k.shape[0]
    out = torch.empty((Tq, Tk), dtype=torch.float32, device=index_q.device)
    if Tq == 0 or Tk == 0:
        return out
    ks32, ke32 = ks.to(torch.int32).contiguous(), ke.to(torch.int32).contiguous()
    grid = (triton.cdiv(Tq, block_m), triton.cdiv(Tk, block_n))
    _kernel()[grid](
        index_q, index_weights, index_k, ks32, ke32, out,
        Tq, Tk, HI, DI,
        index_q.stride(0), index_q.stride(1), index_q.stride(2), index_weights.stride(0), index_weights.stride(1),
        index_k.stride(0), index_k.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(DI)),
    )  # fmt: skip
    return out
