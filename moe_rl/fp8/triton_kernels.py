"""Triton kernels for FP8 (E4M3) block scaling: 1x128 quantization and the block-scaled NT GEMM.

Semantics are those of the torch references in :mod:`moe_rl.fp8.quant` and :mod:`moe_rl.fp8.gemm` (DeepSeek-V3,
arXiv 2412.19437 §3.3; DeepGEMM's ``per_token_cast_to_fp8`` and ``fp8_gemm_nt``). The code here is our own.

Shape legend:
    M   rows of ``a`` / of the tensor being quantized (tokens)
    N   rows of ``b`` (output features)
    K   contraction dimension (K-major operands)
    SK  ceil(K / 128) scale columns

Kernels:

* :func:`quantize_1x128_triton`: one program per ``(row, 128-column group)``: ``amax = max(|x|, floor)``,
  ``scale = amax / 448`` (optionally rounded up to a power of two, UE8M0, by integer bit arithmetic, exact),
  ``q = clamp(x / scale, ±448)`` and the E4M3 cast. ``return_scaled=True`` also returns ``q`` in fp32 (before the
  cast), so tests can compare the kernel's arithmetic bit for bit without trusting a cast.
* :func:`fp8_block_gemm_triton`: ``out[M, N] = (a * sA) @ (b * sB).T`` with fp32 accumulation. Tiles of
  ``BLOCK_M x BLOCK_N``; the K loop steps 128 at a time (one scale block), computes the raw fp8 x fp8 partial sum
  with ``tl.dot`` into fp32 and *promotes* it into the fp32 accumulator multiplied by ``sA[m, k] * sB[n, k]``:
  the DeepSeek-V3 promotion scheme (partial sums of at most 128 products before scaling). Recipes
  ``(gran_m, gran_n, 128)`` with any ``gran_m``, ``gran_n`` (``(1, 128, 128)`` Fprop/Dgrad, ``(1, 1, 128)``
  Wgrad).

Triton is imported lazily: this module imports without it, and every entry point raises ImportError with
install instructions when it is missing (pytorch/ao guards its kernels the same way). Operands must be CUDA
tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set *before* triton is first imported (the interpreter; for
tests only, ~1.4 ms per program instance, and with known cast bugs: see ``tests/fp8/test_fp8_triton.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from moe_rl._triton import check_kernel_device, import_triton, triton_available
from moe_rl.fp8._common import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, _check_2d, _check_finite

__all__ = [
    "fp8_block_gemm_triton",
    "fp8_grouped_gemm_triton",
    "quantize_128x128_triton",
    "quantize_1x128_triton",
    "triton_available",
]

_TRITON_INSTALL = (
    "the triton backend needs Triton (`pip install triton`, a dependency of moe_rl on Linux; version 3.7.1 is "
    "tested). On CPU use backend='torch'."
)

QUANT_GROUP = 128
"""Quantization group along K (1x128) and the GEMM's K step (one scale block)."""


def _triton() -> tuple[Any, Any]:
    return import_triton(_TRITON_INSTALL)


def _check_device(*tensors: torch.Tensor) -> None:
    check_kernel_device("backend='triton'", *tensors)


_tile: Any = None
_k_loop: Any = None
"""The kernels' device functions :func:`moe_rl._triton_device.tile_2d` and
:func:`~moe_rl._triton_device.block_scaled_k_loop` (both GEMMs), bound by :func:`_kernels` when Triton imports:
module globals, because Triton's interpreter looks a kernel's names up in its module's globals only."""


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    """Define (once) and return ``(quant_1x128, block_gemm, quant_tile, grouped_gemm)`` kernels."""
    global _tile, _k_loop
    triton, tl = _triton()
    from moe_rl._triton_device import block_scaled_k_loop, tile_2d  # imports triton

    _tile, _k_loop = tile_2d, block_scaled_k_loop

    @triton.jit
    def _quant_1x128_kernel(
        x_ptr, codes_ptr, scale_ptr, q_ptr,
        K, stride_xm, stride_xk, stride_cm, stride_ck, stride_sm, stride_sk,
        amax_floor, fp8_max,
        GROUP: tl.constexpr, UE8M0: tl.constexpr, STORE_Q: tl.constexpr,
    ):  # fmt: skip
        m = tl.program_id(0)
        kb = tl.program_id(1)
        offs = kb * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + m * stride_xm + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), amax_floor)  # padding 0 never exceeds a real |x|
        scale = amax / fp8_max
        if UE8M0:
            # Round a positive normal fp32 UP to a power of two: bump the exponent unless the mantissa is 0.
            bits = scale.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFFF) & -8388608  # -8388608 == 0xFF800000 as int32
            scale = bits.to(tl.float32, bitcast=True)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(scale_ptr + m * stride_sm + kb * stride_sk, scale)
        if STORE_Q:
            tl.store(q_ptr + m * stride_cm + offs * stride_ck, q, mask=mask)
        tl.store(codes_ptr + m * stride_cm + offs * stride_ck, q.to(codes_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _block_gemm_kernel(
        a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr,
        M, N, K,
        stride_am, stride_ak, stride_bn, stride_bk,
        stride_sam, stride_sak, stride_sbn, stride_sbk,
        stride_om, stride_on,
        GRAN_M: tl.constexpr, GRAN_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, m_ok, n_ok = _tile(M, N, BLOCK_M, BLOCK_N)
        acc = _k_loop(
            a_ptr + offs_m * stride_am, b_ptr + offs_n * stride_bn,
            sa_ptr + (offs_m // GRAN_M) * stride_sam, sb_ptr + (offs_n // GRAN_N) * stride_sbn, m_ok, n_ok,
            K, stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
        )  # fmt: skip
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out,
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _quant_tile_kernel(
        x_ptr, codes_ptr, scale_ptr, q_ptr,
        M, K, stride_xm, stride_xk, stride_cm, stride_ck, stride_sm, stride_sk,
        amax_floor, fp8_max,
        BM: tl.constexpr, BK: tl.constexpr, UE8M0: tl.constexpr, STORE_Q: tl.constexpr,
    ):  # fmt: skip
        # One program per (BM x BK) tile with ONE scale (128x128 weight blocks).
        mb = tl.program_id(0)
        kb = tl.program_id(1)
        rm = mb * BM + tl.arange(0, BM)
        rk = kb * BK + tl.arange(0, BK)
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), amax_floor)
        scale = amax / fp8_max
        if UE8M0:
            bits = scale.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFFF) & -8388608
            scale = bits.to(tl.float32, bitcast=True)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(scale_ptr + mb * stride_sm + kb * stride_sk, scale)
        offs = rm[:, None] * stride_cm + rk[None, :] * stride_ck
        if STORE_Q:
            tl.store(q_ptr + offs, q, mask=mask)
        tl.store(codes_ptr + offs, q.to(codes_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, ids_ptr,
        M, N, K,
        stride_am, stride_ak, stride_bg, stride_bn, stride_bk,
        stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
        stride_om, stride_on,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        # m-grouped contiguous: BLOCK_M divides 128, so every row tile belongs to one expert (or is padding).
        offs_m, offs_n, m_ok, n_ok = _tile(M, N, BLOCK_M, BLOCK_N)
        ids = tl.load(ids_ptr + offs_m, mask=m_ok, other=-1)
        g = tl.max(ids, axis=0)  # the tile's expert; -1 when the whole tile is padding
        row_ok = m_ok & (ids >= 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g >= 0:  # a: 1x128 scales (one row each); b: expert g's 128x128 blocks
            acc = _k_loop(
                a_ptr + offs_m * stride_am, b_ptr + g * stride_bg + offs_n * stride_bn,
                sa_ptr + offs_m * stride_sam, sb_ptr + g * stride_sbg + (offs_n // 128) * stride_sbn, row_ok, n_ok,
                K, stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
            )  # fmt: skip
        out = acc.to(out_ptr.dtype.element_ty)  # padding rows: acc stays 0
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out,
                 mask=m_ok[:, None] & n_ok[None, :])

    return _quant_1x128_kernel, _block_gemm_kernel, _quant_tile_kernel, _grouped_gemm_kernel


def _quant_setup(x: torch.Tensor, name: str, amax_floor: float, *, kernel: int) -> Any:
    """The quantize kernels' shared checks (2-D, ``amax_floor``, finite, device) and kernel ``kernel`` of
    :func:`_kernels`; Triton being missing raises its ImportError before the device check."""
    _check_2d(x, name)
    if not (amax_floor > 0 and amax_floor < float("inf")):
        raise ValueError(f"amax_floor={amax_floor!r}: must be a finite number > 0 (default {AMAX_FLOOR})")
    _check_finite(x, name)
    found = _kernels()[kernel]
    _check_device(x)
    return found


def _quant_outputs(x: torch.Tensor, scale_shape: tuple[int, int], return_scaled: bool):
    """Empty ``codes`` (e4m3fn, ``x``'s shape), ``scales`` (fp32, ``scale_shape``) and ``q`` (fp32 when
    ``return_scaled``, else ``codes`` as a placeholder the kernel does not write)."""
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    q = torch.empty(x.shape, dtype=torch.float32, device=x.device) if return_scaled else codes
    return codes, scales, q


def _quantize_launch(x: torch.Tensor, rows: int, ue8m0: bool, amax_floor: float, name: str,
                     return_scaled: bool) -> tuple[torch.Tensor, ...]:
    """The body of both quantizers: checks, outputs and one program per ``rows x 128`` block of ``x [M, K]``
    (``rows`` 1: the per-row 1x128 kernel; 128: the 128x128 tile kernel), then ``(codes, scales[, q])``."""
    kernel = _quant_setup(x, name, amax_floor, kernel=0 if rows == 1 else 2)
    M, K = x.shape
    SM, SK = -(-M // rows), -(-K // QUANT_GROUP)
    codes, scales, q = _quant_outputs(x, (SM, SK), return_scaled)
    if M and K:
        # the row kernel reads no M (one program per row) and names its group GROUP; the tile kernel BM x BK
        sizes, block = ((K,), {"GROUP": QUANT_GROUP}) if rows == 1 else ((M, K), {"BM": rows, "BK": QUANT_GROUP})
        kernel[(SM, SK)](
            x, codes, scales, q,
            *sizes, x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
            float(amax_floor), FP8_MAX,
            UE8M0=bool(ue8m0), STORE_Q=bool(return_scaled), **block,
        )  # fmt: skip
    return (codes, scales, q) if return_scaled else (codes, scales)


def quantize_1x128_triton(
    x: torch.Tensor,
    *,
    ue8m0: bool = False,
    amax_floor: float = AMAX_FLOOR,
    name: str = "x",
    return_scaled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`moe_rl.fp8.quant.quantize_1x128` (same contract, same errors).

    Args:
        x: ``[M, K]`` fp32/bf16/fp16 (any strides), CUDA (or CPU under ``TRITON_INTERPRET=1``). Must be finite.
        ue8m0: round scales up to powers of two.
        amax_floor: lower bound on each group's amax (> 0).
        name: tensor name used in error messages.
        return_scaled: also return ``q = clamp(x / scale, ±448)`` ``[M, K]`` fp32, the value the kernel casts to
            E4M3 (a debug output: it lets tests check the kernel without its fp8 cast).

    Returns:
        ``(codes [M, K] e4m3fn, scales [M, ceil(K/128)] fp32)``, plus ``q`` when ``return_scaled``.

    Raises:
        ValueError: not 2-D, inf/NaN values, bad ``amax_floor``, or tensors not on CUDA (outside the interpreter).
        ImportError: Triton missing.
    """
    return _quantize_launch(x, 1, ue8m0, amax_floor, name, return_scaled)


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    """The GEMM kernels cast their fp32 accumulator to fp32, bf16 or fp16 only (ValueError otherwise)."""
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype={out_dtype}: backend='triton' supports float32, bfloat16, float16")


def _gemm_output(
    a: torch.Tensor, M: int, N: int, K: int, out_dtype: torch.dtype, block_m: int, block_n: int
) -> tuple[torch.Tensor, tuple[int, int] | None, bool]:
    """The ``[M, N]`` output of a GEMM kernel and its launch: ``(out, grid, upcast)``.

    ``grid`` is None when there is nothing to launch: ``out`` is then already the result (empty when ``M`` or ``N``
    is 0, zeros when ``K`` is 0). ``upcast``: the device has no native FP8 ``tl.dot`` (before SM 8.9), so the
    kernel upcasts its tiles.
    """
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out, None, False
    if K == 0:
        return out.zero_(), None, False
    upcast = a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) < (8, 9)
    return out, (-(-M // block_m), -(-N // block_n)), upcast


def fp8_block_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Block-scaled FP8 NT GEMM in Triton; operands as :func:`moe_rl.fp8.gemm.fp8_block_gemm` (validated there).

    Args:
        a: ``[M, K]`` e4m3fn codes; a_scale ``[ceil(M/gran_m), SK]`` fp32.
        b: ``[N, K]`` e4m3fn codes; b_scale ``[ceil(N/gran_n), SK]`` fp32.
        out_dtype: fp32, bf16 or fp16 (cast from the fp32 accumulator in the kernel).
        recipe: ``(gran_m, gran_n, gran_k)``; ``gran_k`` must be 128.
        block_m, block_n: output tile (powers of two >= 16).

    Returns:
        ``[M, N]`` of ``out_dtype``.

    Raises:
        ValueError: ``gran_k != 128``, unsupported ``out_dtype``/tile, or tensors not on CUDA (outside the
            interpreter).
        ImportError: Triton missing.
    """
    gm, gn, gk = recipe
    if gk != QUANT_GROUP:
        raise ValueError(f"recipe={recipe}: backend='triton' supports gran_k == {QUANT_GROUP} only")
    _check_out_dtype(out_dtype)
    for nm, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{nm}={v}: must be a power of two >= 16 (tl.dot tile)")
    gemm_kernel = _kernels()[1]
    _check_device(a, a_scale, b, b_scale)
    M, K = a.shape
    N = b.shape[0]
    out, grid, upcast = _gemm_output(a, M, N, K, out_dtype, block_m, block_n)
    if grid is None:
        return out
    gemm_kernel[grid](
        a, b, a_scale, b_scale, out,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        out.stride(0), out.stride(1),
        GRAN_M=gm, GRAN_N=gn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=QUANT_GROUP, UPCAST=upcast,
    )  # fmt: skip
    return out


def quantize_128x128_triton(
    w: torch.Tensor,
    *,
    ue8m0: bool = False,
    amax_floor: float = AMAX_FLOOR,
    name: str = "w",
    return_scaled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`moe_rl.fp8.quant.quantize_128x128` (one program per 128x128 block).

    Args:
        w: ``[N, K]`` fp32/bf16/fp16, any strides, CUDA (or CPU under ``TRITON_INTERPRET=1``). Must be finite.
        ue8m0, amax_floor, name, return_scaled: as :func:`quantize_1x128_triton`.

    Returns:
        ``(codes [N, K] e4m3fn, scales [ceil(N/128), ceil(K/128)] fp32)``, plus ``q`` when ``return_scaled``.

    Raises:
        ValueError: not 2-D, inf/NaN values, bad ``amax_floor``, or tensors not on CUDA (outside the interpreter).
        ImportError: Triton missing.
    """
    return _quantize_launch(w, QUANT_GROUP, ue8m0, amax_floor, name, return_scaled)


def fp8_grouped_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    m_indices: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """m-grouped contiguous FP8 GEMM in Triton; operands as :func:`moe_rl.fp8.grouped.fp8_grouped_gemm`
    (validated there): ``a [M, K]`` 1x128, ``b [G, N, K]`` per-expert 128x128, ``m_indices [M]`` int32 (-1 rows
    give zeros).

    Args:
        block_m: row tile, a power of two in [16, 128] (divides the 128-row segment alignment).
        block_n: column tile, a power of two >= 16.

    Returns:
        ``[M, N]`` of ``out_dtype`` (fp32/bf16/fp16).

    Raises:
        ValueError: bad tiles/out_dtype, or tensors not on CUDA (outside the interpreter).
        ImportError: Triton missing.
    """
    _check_out_dtype(out_dtype)
    if block_m < 16 or block_m > QUANT_GROUP or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m}: must be a power of two in [16, {QUANT_GROUP}]")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: must be a power of two >= 16 (tl.dot tile)")
    kernel = _kernels()[3]
    _check_device(a, a_scale, b, b_scale, m_indices)
    M, K = a.shape
    N = b.shape[1]
    out, grid, upcast = _gemm_output(a, M, N, K, out_dtype, block_m, block_n)
    if grid is None:
        return out
    kernel[grid](
        a, b, a_scale, b_scale, out, m_indices,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=QUANT_GROUP, UPCAST=upcast,
    )  # fmt: skip
    return out
