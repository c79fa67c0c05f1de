"""FP8 constants and input checks shared by the quantizers (``quant``) and their Triton kernels (not public)."""

from __future__ import annotations

import torch

__all__ = ["AMAX_FLOOR", "FP8_DTYPE", "FP8_MAX"]

FP8_DTYPE = torch.float8_e4m3fn
"""Storage dtype of the codes (E4M3, finite-only "fn" variant, as DeepSeek-V3 uses for all GEMM operands)."""

FP8_MAX: float = float(torch.finfo(FP8_DTYPE).max)
"""Largest finite E4M3 magnitude (448.0), taken from ``torch.finfo``, never hard-coded."""

AMAX_FLOOR: float = 1e-12
"""Lower bound on a block's amax before computing the scale (``moe_rl.fp8.quant``'s module docstring says why 1e-12)."""


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [M, K], got shape {tuple(x.shape)}")


def _check_finite(x: torch.Tensor, name: str) -> None:
    n_bad = int((~torch.isfinite(x)).sum())
    if n_bad:
        raise ValueError(
            f"{name}: {n_bad} non-finite value(s) (inf/NaN) in a tensor of shape {tuple(x.shape)}; FP8 block "
            "quantization refuses them (NaN would become NaN codes, inf would silently saturate to 448). "
            "Fix the producer or sanitize the tensor before quantizing."
        )
