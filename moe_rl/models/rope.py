"""Rotary position embeddings (RoPE) with partial rotation, in Hugging Face's ``rotate_half`` convention.

Shape legend:
    B  batch
    S  sequence length
    H  heads
    Dh head_dim
    R  rotary dims per head, R = int(Dh * partial_rotary_factor), even

Convention (transformers ``apply_rotary_pos_emb`` with ``rotate_half``; vLLM ``get_rope`` with
``is_neox_style=True``): the first R dims of each head are split into halves ``[x1 | x2]`` of size R/2, and
pair ``(x1[i], x2[i])`` is rotated by angle ``pos * theta^(-2i/R)``. Dims ``[R, Dh)`` pass through
unchanged. This is NOT the interleaved (GPT-J / ``rotate_every_two``) pairing.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rotary", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """``[R/2]`` fp32 inverse frequencies ``theta^(-2i/R)`` (computed like transformers, in fp32)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables for the given positions.

    Args:
        positions: ``[S]`` or ``[B, S]`` integer positions.
        rotary_dim: R.
        theta: rotary base.

    Returns:
        ``(cos, sin)``, each fp32 shaped ``[..., S, R]`` (the R/2 frequencies repeated twice).
    """
    inv_freq = rope_inv_freq(rotary_dim, theta, device=positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BHSD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R dims of every head.

    Args:
        x_BHSD: ``[B, H, S, Dh]`` queries or keys.
        cos: ``[S, R]`` or ``[B, S, R]`` from :func:`rope_cos_sin` (cast to ``x``'s dtype here).
        sin: same shape as ``cos``.

    Returns:
        ``[B, H, S, Dh]`` in ``x``'s dtype.
    """
    rotary_dim = cos.shape[-1]
    if cos.dim() == 3:  # [B, S, R] -> [B, 1, S, R]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x_BHSD.dtype), sin.to(x_BHSD.dtype)
    x_rot, x_pass = x_BHSD[..., :rotary_dim], x_BHSD[..., rotary_dim:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)
