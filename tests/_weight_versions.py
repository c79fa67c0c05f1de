"""Shared by the weight-delta tests: successive weight versions in which a few elements change."""

from __future__ import annotations

from collections.abc import Callable

import torch


def changed_version(sd: dict[str, torch.Tensor], gen: torch.Generator, *, frac: float, share: float,
                    new_values: Callable[[torch.Tensor, int], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next version of ``sd``: each tensor is picked with probability ``share`` (drawn from ``gen``) and about
    ``frac`` of its elements (at least one, at random positions) get ``new_values(flat, k)`` (``flat``: the tensor's
    old values, 1-D; ``k`` values of its dtype); the other tensors and elements keep theirs. ``sd`` is not changed."""
    out = {}
    for n, t in sd.items():
        t = t.clone()
        if torch.rand((), generator=gen) < share:
            flat = t.reshape(-1)
            k = max(1, int(frac * flat.numel()))
            idx = torch.randperm(flat.numel(), generator=gen)[:k]
            flat[idx] = new_values(flat, k)
        out[n] = t
    return out
