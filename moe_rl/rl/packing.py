"""Sequence packing: samples into rows of at most ``seq_len`` tokens, balanced over data-parallel ranks.

Shape legend:
    B   samples of the global batch, each of ``l_i`` tokens (prompt + completion)
    R   data-parallel ranks
    M   micro-batches per rank (the same on every rank)
    T   tokens of one packed row (micro-batch), ``T <= seq_len``; ``cu_seqlens`` ``[n + 1]`` its sample boundaries

A packed micro-batch is one row ``[1, T]`` holding whole samples back to back; attention is causal within each
sample only and positions restart at 0 in each (``cu_seqlens``), so a sample's log-probs are those it would get
alone in a padded row, with no padding computed.

Algorithm (:func:`plan_packing`), deterministic:

1. truncation: a sample longer than ``seq_len`` keeps its first ``seq_len`` tokens (the trainer cuts its loss mask,
   log-probs, versions and routed-expert rows at the same column; counted in :attr:`PackPlan.truncated`);
2. first-fit decreasing bin packing into rows of capacity ``seq_len`` (samples by length, longest first, ties by
   index; each into the first row with room);
3. while the row count is not a multiple of ``R`` and a row holds two or more samples, the row of highest cost
   among those is split in two (its samples, longest first, each to the lighter half): more rows of real work
   instead of empty ones;
4. ``M = ceil(rows / R)``; the remaining ``M * R - rows`` slots are empty micro-batches (a rank runs a forward and
   backward on a 1-token pad row that carries no loss token, so FSDP's collectives stay in lockstep; they exist
   only when every row holds a single sample and ``R`` does not divide the row count);
5. balance: rows by cost, highest first (ties by first sample index), each to the rank of lowest total cost that
   has fewer than ``M`` rows (ties: lowest rank), the longest-processing-time rule with a per-rank count.

Cost of a row (:func:`row_cost`): ``sum_i (l_i^2 + linear * l_i)`` over its samples: causal attention's work grows with
``l^2`` per sample (block-diagonal, so packing does not add cross-sample terms), the projections and experts with
``l``; ``linear`` is the ratio of per-token linear work to per-token-pair attention work (the trainer derives it
from the model config). Source of the scheme: the packing and attention-aware balancing of prime-rl's and
Megatron's data loaders (facts only; this is our own implementation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PackedMicroBatch", "PackPlan", "plan_packing", "row_cost"]


def row_cost(lengths: Sequence[int], linear: float = 0.0) -> float:
    """``sum_i (l_i^2 + linear * l_i)``: the attention-aware compute cost of a packed row (arbitrary units)."""
    return float(sum(int(x) * int(x) + linear * int(x) for x in lengths))


@dataclass(frozen=True)
class PackedMicroBatch:
    """One packed row: the samples it holds, in order.

    Attributes:
        samples: batch indices of the samples (ascending); empty for a no-loss filler micro-batch.
        lengths: their token counts after truncation (same order).
    """

    samples: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """``T``: tokens of the row (``cu_seqlens[-1]``)."""
        return sum(self.lengths)

    @property
    def cu_seqlens(self) -> list[int]:
        """``[n + 1]`` sample boundaries in the row: ``[0, l_0, l_0 + l_1, ...]``."""
        out = [0]
        for x in self.lengths:
            out.append(out[-1] + x)
        return out

    @property
    def is_filler(self) -> bool:
        """True for an empty micro-batch (no sample, no loss)."""
        return not self.samples


@dataclass(frozen=True)
class PackPlan:
    """Output of :func:`plan_packing`.

    Attributes:
        seq_len: row capacity in tokens.
        ranks: ``R`` tuples of ``M`` micro-batches each (the same ``M`` on every rank).
        lengths: ``[B]`` each sample's tokens after truncation.
        truncated: indices of the samples cut to ``seq_len``.
        linear: the linear cost coefficient used for balancing.
    """

    seq_len: int
    ranks: tuple[tuple[PackedMicroBatch, ...], ...]
    lengths: tuple[int, ...]
    truncated: tuple[int, ...]
    linear: float

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0])

    def rank_cost(self, rank: int) -> float:
        """Total :func:`row_cost` of ``rank``'s micro-batches."""
        return sum(row_cost(mb.lengths, self.linear) for mb in self.ranks[rank])


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return value


def plan_packing(lengths: Sequence[int], seq_len: int, num_ranks: int, *, linear: float = 0.0) -> PackPlan:
    """Pack samples of ``lengths`` tokens into rows of at most ``seq_len`` tokens over ``num_ranks`` data ranks.

    Args:
        lengths: ``[B]`` tokens per sample (prompt + completion), each >= 2 (a sample predicts at least one token).
        seq_len: row capacity in tokens, >= 2; longer samples are truncated to it.
        num_ranks: data-parallel ranks ``R`` >= 1.
        linear: linear cost coefficient of :func:`row_cost` (finite, >= 0).

    Returns:
        The :class:`PackPlan` (algorithm in the module docstring): every sample in exactly one micro-batch of one
        rank, every micro-batch ``<= seq_len`` tokens, every rank ``M`` micro-batches.

    Raises:
        ValueError: no samples, a length < 2, ``seq_len < 2``, ``num_ranks < 1`` or a bad ``linear``.
    """
    _check_int("seq_len", seq_len, 2)
    _check_int("num_ranks", num_ranks, 1)
    if isinstance(linear, bool) or not isinstance(linear, (int, float)) or not math.isfinite(linear) or linear < 0:
        raise ValueError(f"linear={linear!r} must be a finite number >= 0 (per-token cost in attention-pair units)")
    if len(lengths) == 0:
        raise ValueError("plan_packing: lengths is empty; a batch needs at least one sample")
    for i, x in enumerate(lengths):
        if isinstance(x, bool) or not isinstance(x, int) or x < 2:
            raise ValueError(f"plan_packing: lengths[{i}]={x!r} must be an int >= 2 (prompt + completion tokens)")
    cut = [min(int(x), seq_len) for x in lengths]
    truncated = tuple(i for i, x in enumerate(lengths) if x > seq_len)

    # 2. first-fit decreasing
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(cut)), key=lambda i: (-cut[i], i)):
        for j, r in enumerate(room):
            if cut[i] <= r:
                bins[j].append(i)
                room[j] -= cut[i]
                break
        else:
            bins.append([i])
            room.append(seq_len - cut[i])

    def cost(b: list[int]) -> float:
        return row_cost([cut[i] for i in b], linear)

    # 3. split multi-sample rows until R divides the row count (or nothing can be split)
    while len(bins) % num_ranks:
        multi = [j for j, b in enumerate(bins) if len(b) >= 2]
        if not multi:
            break
        j = max(multi, key=lambda j: (cost(bins[j]), -min(bins[j])))
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(bins[j], key=lambda i: (-cut[i], i)):
            (halves[0] if cost(halves[0]) <= cost(halves[1]) else halves[1]).append(i)
        bins[j:j + 1] = [halves[0], halves[1]]

    # 4-5. balance with the same count on every rank
    m = -(-len(bins) // num_ranks)
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for b in sorted(bins, key=lambda b: (-cost(b), min(b))):
        r = min((r for r in range(num_ranks) if len(ranks[r]) < m), key=lambda r: (totals[r], r))
        ranks[r].append(sorted(b))
        totals[r] += cost(b)
    out = []
    for rows in ranks:
        mbs = [PackedMicroBatch(tuple(b), tuple(cut[i] for i in b)) for b in rows]
        mbs += [PackedMicroBatch((), ())] * (m - len(rows))
        out.append(tuple(mbs))
    return PackPlan(seq_len, tuple(out), tuple(cut), truncated, float(linear))
