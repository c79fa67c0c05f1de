"""Test scaffolding for the ``p2p`` weight transport: a state dict cut as two trainer ranks would own it."""

from __future__ import annotations


def row_half_pieces(sd: dict) -> list[list]:
    """``[rank 0 pieces, rank 1 pieces]``: each tensor of ``sd`` split in two row halves (rank 0 owns the first)."""
    from moe_rl.weights.regions import Piece

    ranks: list = [[], []]
    for name, t in sd.items():
        h = t.shape[0] // 2
        ranks[0].append(Piece(name, tuple(t.shape), (0,) * t.dim(), t[:h]))
        ranks[1].append(Piece(name, tuple(t.shape), (h,) + (0,) * (t.dim() - 1), t[h:]))
    return ranks
