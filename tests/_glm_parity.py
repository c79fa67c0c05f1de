"""Scaffolding shared by the GLM family parity tests (ours against transformers through a checkpoint)."""

from __future__ import annotations

import torch


@torch.no_grad()
def randomize_for_parity(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: norms 1 + 0.1 N, biases 0.1 N, matrices N / sqrt(fan_in), selection bias 0.3 N.

    The noaux_tc correction bias (a buffer) is randomized too, so that it changes which experts are picked.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def random_ids(vocab_size: int, batch: int, seq: int) -> torch.Tensor:
    """``[batch, seq]`` int64 token ids, uniform over the vocabulary, from a fixed seed (7)."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7))
