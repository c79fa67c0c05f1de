"""YaRN rotary scaling (Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models", arXiv
2309.00071) in DeepSeek's variant (``mscale`` / ``mscale_all_dim``), as transformers' ``_compute_yarn_parameters``
and ``yarn_apply_mscale`` compute it for DeepSeek-V3 and Kimi-K2 checkpoints.

Shape legend:
    Dr  rotary width (``qk_rope_head_dim``)

:class:`YarnRope` holds the Hugging Face ``rope_parameters`` of ``rope_type="yarn"``; :func:`yarn_inv_freq` gives the
``[Dr / 2]`` inverse frequencies and the cos/sin attention factor; :func:`yarn_softmax_mscale` the multiplier of
the softmax scale. :class:`moe_rl.attention.MLAConfig` takes a :class:`YarnRope` as ``rope_yarn``.

This module imports torch only inside :func:`yarn_inv_freq` (configs import :class:`YarnRope` torch-free).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from moe_rl.config import BaseConfig

__all__ = ["YarnRope", "yarn_inv_freq", "yarn_softmax_mscale"]


class YarnRope(BaseConfig):
    """YaRN rotary scaling (Hugging Face ``rope_parameters`` / ``rope_scaling`` with ``rope_type="yarn"``; field
    names and defaults as transformers' ``_compute_yarn_parameters``)."""

    factor: float = Field(gt=0)
    """Context extension factor s (DeepSeek-V3: 40, Kimi-K2: 32)."""
    original_max_position_embeddings: int = Field(ge=1)
    """Pre-training context the ramp is computed for (4096 in both)."""
    beta_fast: float = Field(default=32.0, gt=0)
    """Rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = Field(default=1.0, gt=0)
    """Rotations below which a frequency is divided by ``factor`` (interpolated)."""
    mscale: float | None = None
    """DeepSeek's numerator ``mscale`` of the cos/sin attention factor (None: YaRN's ``0.1 ln s + 1``)."""
    mscale_all_dim: float | None = None
    """DeepSeek's denominator ``mscale``; also squares into the softmax scale (:func:`yarn_softmax_mscale`)."""
    attention_factor: float | None = Field(default=None, gt=0)
    """Explicit cos/sin factor (overrides the ``mscale`` rule)."""
    truncate: bool = True
    """Round the correction range outwards to whole dims (transformers' default)."""


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_mscale(yarn: YarnRope | None) -> float:
    """Multiplier of the attention softmax scale under YaRN: ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``
    when ``mscale_all_dim`` is set and non-zero (transformers' ``yarn_apply_mscale`` of DeepSeek-V3), else 1."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    m = _yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
    return m * m


def yarn_inv_freq(dim: int, theta: float, yarn: YarnRope, device: Any = None) -> tuple[Any, float]:
    """``([dim / 2] fp32 inverse frequencies, cos/sin attention factor)`` of YaRN for a rotary width ``dim``.

    Frequencies whose wavelength fits ``beta_fast`` rotations into the original context are kept, those below
    ``beta_slow`` rotations are divided by ``factor``, with a linear ramp between (computed in fp32 as transformers
    does, so the tables are bit-equal to its ``DeepseekV3RotaryEmbedding``).
    """
    import torch

    factor = yarn.factor
    if yarn.attention_factor is not None:
        att = float(yarn.attention_factor)
    elif yarn.mscale and yarn.mscale_all_dim:
        att = float(_yarn_get_mscale(factor, yarn.mscale) / _yarn_get_mscale(factor, yarn.mscale_all_dim))
    else:
        att = _yarn_get_mscale(factor)
    omax = yarn.original_max_position_embeddings

    def corr_dim(rot: float) -> float:
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(yarn.beta_fast), corr_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, att
