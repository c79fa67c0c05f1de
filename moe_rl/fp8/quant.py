"""FP8 (E4M3) block-scaled quantization: torch reference, functional.

Source: DeepSeek-V3 technical report (arXiv 2412.19437, §3.3 "FP8 training") and the semantics of DeepGEMM's
reference quantizers ``per_token_cast_to_fp8`` (1x128) and ``per_block_cast_to_fp8`` (128x128) in
``deep_gemm/utils/math.py``. The code here is our own.

Shape legend:
    M   rows of the tensor (tokens for activations, output features N for a weight)
    K   columns (the GEMM's contraction dimension in the forward pass)
    bm, bk  block (tile) size along M and K; (1, 128), (128, 128) or (128, 1)
    Mb  number of row blocks,    Mb = ceil(M / bm)
    Kb  number of column blocks, Kb = ceil(K / bk)

Recipe, per block ``B`` of ``x``::

    amax  = max(|x[B]|, amax_floor)            # fp32
    scale = amax / FP8_MAX                     # FP8_MAX = torch.finfo(float8_e4m3fn).max = 448
    scale = 2 ** ceil(log2(scale))  if ue8m0   # power of two rounded UP, so x / scale never exceeds 448
    codes = clamp(x / scale, -FP8_MAX, FP8_MAX).to(float8_e4m3fn)      # round-to-nearest-even
    x    ~= codes.float() * scale              # dequantize

Choices (documented contract):

* **Partial tail blocks** (M or K not a multiple of the block): the tail block gets its own scale computed
  from its valid elements only (vllm-project/compressed-tensors PR #547). The scale grid is ``[ceil(M/bm), ceil(K/bk)]``; :func:`dequantize`
  always uses the *configured* block size, never one derived from shapes, and returns the original shape.
* **amax floor** = :data:`AMAX_FLOOR` = ``1e-12`` (not DeepGEMM's test-helper ``1e-4``): an all-zero block
  gets a finite positive scale ``1e-12 / 448`` and all-zero codes, never ``0/0 = NaN`` (THUDM/slime PR #2256). ``1e-4`` would
  flush legitimately tiny blocks (e.g. late-training gradients with amax < 1e-4 lose all but their largest
  values) to zero; ``1e-12 / 448`` is still a normal fp32 number, so UE8M0 packing stays valid. Callers can
  pass ``amax_floor=1e-4`` to match DeepGEMM bit for bit.
* **Non-finite input** (inf or NaN): **raise** ``ValueError`` naming the tensor and the count of non-finite
  values. Silently propagating would either write NaN codes (``NaN`` survives the clamp) or saturate ``inf`` to
  ±448 — a wrong value with no error, the failure mode of THUDM/slime PR #2256. Callers that must quantize such tensors have to
  clean them first.
* **Saturation**: codes are clamped to ±FP8_MAX before the cast (with an fp32 scale ``x / scale`` can round a
  hair above 448).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from moe_rl.fp8._common import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, _check_2d, _check_finite

__all__ = [
    "AMAX_FLOOR",
    "FP8_DTYPE",
    "FP8_MAX",
    "dequantize",
    "quantize_128x1",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_blocks",
    "sqnr_db",
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any((not isinstance(b, int)) or b < 1 for b in block):
        raise ValueError(f"block={block!r}: must be a pair of positive ints (bm, bk), e.g. (1, 128) or (128, 128)")
    return block[0], block[1]


def _round_scale_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales UP to a power of two, exactly: ``2 ** ceil(log2(scale))``.

    Uses ``frexp`` (scale = m * 2**e with m in [0.5, 1)) instead of ``log2`` so exact powers of two stay put.
    """
    mant, exp = torch.frexp(scale)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(scale), exp)


def quantize_blocks(
    x: torch.Tensor,
    block: tuple[int, int],
    *,
    ue8m0: bool = False,
    amax_floor: float = AMAX_FLOOR,
    name: str = "x",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to E4M3 with one fp32 scale per ``block`` tile (the generic form).

    Args:
        x: ``[M, K]`` float tensor (fp32/bf16/fp16). Must be finite.
        block: ``(bm, bk)`` tile size; tail tiles are partial and get their own scale.
        ue8m0: round each scale up to a power of two (UE8M0-representable, as DeepSeek-V3.1 / SM100).
        amax_floor: lower bound on each tile's amax (> 0), so all-zero tiles get a finite scale.
        name: tensor name used in error messages.

    Returns:
        ``(codes, scales)``: codes ``[M, K]`` ``float8_e4m3fn``; scales ``[ceil(M/bm), ceil(K/bk)]`` fp32, all
        finite and > 0.

    Raises:
        ValueError: ``x`` is not 2-D, ``block`` is invalid, ``amax_floor <= 0``, or ``x`` has inf/NaN values
            (the message names ``name`` and the count).
    """
    bm, bk = _check_block(block)
    _check_2d(x, name)
    if not (amax_floor > 0 and math.isfinite(amax_floor)):
        raise ValueError(f"amax_floor={amax_floor!r}: must be a finite number > 0 (default {AMAX_FLOOR})")
    _check_finite(x, name)
    M, K = x.shape
    Mb, Kb = _ceil_div(M, bm), _ceil_div(K, bk)
    x_f = x.float()
    # Zero padding does not change a tile's amax (|0| <= amax), so tail tiles use their valid elements only.
    x_pad = torch.nn.functional.pad(x_f, (0, Kb * bk - K, 0, Mb * bm - M))
    x_tiles = x_pad.view(Mb, bm, Kb, bk)
    amax = x_tiles.abs().amax(dim=(1, 3)).clamp_min(amax_floor)  # [Mb, Kb]
    scales = amax / FP8_MAX
    if ue8m0:
        scales = _round_scale_ue8m0(scales)
    q = (x_tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = q.view(Mb * bm, Kb * bk)[:M, :K].to(FP8_DTYPE)
    return codes, scales


def _quantize_layout(x: torch.Tensor, block: tuple[int, int], fn: str, backend: str, *, ue8m0: bool,
                     amax_floor: float, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The one backend dispatch of the named layouts (:func:`quantize_1x128`, :func:`quantize_128x128`,
    :func:`quantize_128x1`): ``"torch"`` runs :func:`quantize_blocks` with ``block``; ``"triton"`` runs the layout's
    kernel (128x1 is the 1x128 kernel on the transposed view ``x.T``, its results transposed back: views whose
    ``.T`` is contiguous, the layout Wgrad consumes).

    Raises:
        ValueError: any other ``backend`` (the message names ``fn``), or as :func:`quantize_blocks`.
    """
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend={backend!r}: {fn} supports 'torch' and 'triton'")
    if backend == "torch":
        return quantize_blocks(x, block, ue8m0=ue8m0, amax_floor=amax_floor, name=name)
    # lazy: imports triton
    from moe_rl.fp8.triton_kernels import quantize_1x128_triton, quantize_128x128_triton

    opts = dict(ue8m0=ue8m0, amax_floor=amax_floor, name=name)
    if block == (128, 128):
        return quantize_128x128_triton(x, **opts)  # type: ignore[return-value,arg-type]
    if block == (1, 128):
        return quantize_1x128_triton(x, **opts)  # type: ignore[return-value,arg-type]
    _check_2d(x, name)
    codes_t, scales_t = quantize_1x128_triton(x.T, **opts)  # type: ignore[misc,arg-type]
    return codes_t.T, scales_t.T


def quantize_1x128(
    x: torch.Tensor,
    *,
    ue8m0: bool = False,
    amax_floor: float = AMAX_FLOOR,
    name: str = "x",
    backend: Literal["torch", "triton"] = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, 128-channel groups along K (DeepSeek-V3 activations; DeepGEMM ``per_token_cast_to_fp8``).

    Args:
        x: ``[M, K]`` activations (M tokens).
        backend: ``"torch"`` (reference) or ``"triton"``
            (:func:`moe_rl.fp8.triton_kernels.quantize_1x128_triton`: CUDA, same results).

    Returns:
        codes ``[M, K]`` e4m3fn, scales ``[M, ceil(K/128)]`` fp32. See :func:`quantize_blocks`.
    """
    return _quantize_layout(x, (1, 128), "quantize_1x128", backend, ue8m0=ue8m0, amax_floor=amax_floor, name=name)


def quantize_128x128(
    w: torch.Tensor,
    *,
    ue8m0: bool = False,
    amax_floor: float = AMAX_FLOOR,
    name: str = "w",
    backend: Literal["torch", "triton"] = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks (DeepSeek-V3 weights; DeepGEMM ``per_block_cast_to_fp8``).

    Args:
        w: ``[N, K]`` weight (``nn.Linear`` layout).
        backend: ``"torch"`` (reference) or ``"triton"``
            (:func:`moe_rl.fp8.triton_kernels.quantize_128x128_triton`: CUDA, same results).

    Returns:
        codes ``[N, K]`` e4m3fn, scales ``[ceil(N/128), ceil(K/128)]`` fp32. The transposed weight's blocks are
        ``(codes.T, scales.T)``, which is how Dgrad reuses them.
    """
    return _quantize_layout(w, (128, 128), "quantize_128x128", backend, ue8m0=ue8m0, amax_floor=amax_floor,
                            name=name)


def quantize_128x1(
    x: torch.Tensor,
    *,
    ue8m0: bool = False,
    amax_floor: float = AMAX_FLOOR,
    name: str = "x",
    backend: Literal["torch", "triton"] = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 128 along M (tokens), one per column: the Wgrad operand layout.

    For ``dW = dY^T @ X`` the contraction runs over tokens, so both ``dY [T, N]`` and ``X [T, K]`` are grouped
    along T. ``(codes.T, scales.T)`` is exactly the 1x128 quantization of ``x.T`` (DeepGEMM recipe (1, 1, 128)).

    Args:
        x: ``[M, K]``.
        backend: ``"torch"`` (reference) or ``"triton"`` (the 1x128 kernel run on the transposed view ``x.T``;
            the results are then transposed views whose ``.T`` is contiguous, the layout Wgrad consumes).

    Returns:
        codes ``[M, K]`` e4m3fn, scales ``[ceil(M/128), K]`` fp32.
    """
    return _quantize_layout(x, (128, 1), "quantize_128x1", backend, ue8m0=ue8m0, amax_floor=amax_floor, name=name)


_LUT: dict[torch.device, torch.Tensor] = {}


def _codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """``codes.float()`` bit for bit, via a 256-entry table (``torch.take``): ~2x faster than the cast on CPU."""
    if codes.device.type != "cpu":
        return codes.float()
    lut = _LUT.get(codes.device)
    if lut is None:
        lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
        _LUT[codes.device] = lut
    return torch.take(lut, codes.contiguous().view(torch.uint8).long())


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: ``codes.float() * scale`` of each element's tile.

    Args:
        codes: ``[M, K]`` ``float8_e4m3fn``.
        scales: ``[ceil(M/bm), ceil(K/bk)]`` fp32.
        block: ``(bm, bk)``, the block the codes were quantized with. It is never derived from the shapes
            (vllm-project/compressed-tensors PR #547: ``ceil(1000/8) = 125`` would mis-apply every scale after the first band).
        out_dtype: dtype of the result (the product is formed in fp32, then cast).

    Returns:
        ``[M, K]`` tensor of ``out_dtype``: the original shape, no padding.

    Raises:
        ValueError: shapes are not 2-D or ``scales`` does not match ``ceil(M/bm) x ceil(K/bk)``.
    """
    bm, bk = _check_block(block)
    _check_2d(codes, "codes")
    _check_2d(scales, "scales")
    M, K = codes.shape
    want = (_ceil_div(M, bm), _ceil_div(K, bk))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales: shape {tuple(scales.shape)} does not match codes {tuple(codes.shape)} with block "
            f"{(bm, bk)}; expected {want} = (ceil(M/bm), ceil(K/bk))"
        )
    Mb, Kb = want
    c = _codes_to_float(codes)
    if Mb * bm != M or Kb * bk != K:  # partial tail tiles: pad, scale with the configured block, slice back
        c = torch.nn.functional.pad(c, (0, Kb * bk - K, 0, Mb * bm - M))
    x = (c.view(Mb, bm, Kb, bk) * scales.float()[:, None, :, None]).view(Mb * bm, Kb * bk)
    return x[:M, :K].to(out_dtype)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(||ref|| / ||ref - approx||)`` in dB (torchao convention).

    Returns ``inf`` when the two are equal. Computed in float64.
    """
    ref64, app64 = ref.detach().double(), approx.detach().double()
    noise = torch.linalg.vector_norm(ref64 - app64)
    signal = torch.linalg.vector_norm(ref64)
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(signal / noise))
