"""Sequence packing plans (``moe_rl.rl.packing.plan_packing``): property test of the invariants over random lengths,
ranks and ``seq_len``, plus small exact cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.rl.packing import PackedMicroBatch, plan_packing, row_cost


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(2, 120), min_size=1, max_size=40), ranks=st.integers(1, 8),
       seq_len=st.integers(2, 200), linear=st.sampled_from([0.0, 1.0, 64.0]))
def test_plan_invariants(lengths, ranks, seq_len, linear):
    plan = plan_packing(lengths, seq_len, ranks, linear=linear)
    m = plan.micro_batches_per_rank
    assert len(plan.ranks) == ranks
    assert all(len(r) == m for r in plan.ranks)  # every rank the same number of micro-batches
    assert m == -(-sum(1 for r in plan.ranks for mb in r if not mb.is_filler) // ranks)
    seen = []
    fillers = 0
    for r in plan.ranks:
        for mb in r:
            assert mb.num_tokens <= seq_len
            assert mb.cu_seqlens[-1] == mb.num_tokens == sum(mb.lengths)  # sum(lengths) == len(tokens)
            assert list(mb.samples) == sorted(mb.samples)
            assert mb.lengths == tuple(min(lengths[i], seq_len) for i in mb.samples)  # lengths preserved
            seen.extend(mb.samples)
            fillers += mb.is_filler
    assert sorted(seen) == list(range(len(lengths)))  # every sample exactly once
    assert plan.lengths == tuple(min(x, seq_len) for x in lengths)
    assert plan.truncated == tuple(i for i, x in enumerate(lengths) if x > seq_len)
    if fillers:  # empty micro-batches only when no row could be split and ranks do not divide the rows
        assert fillers < ranks
        assert all(len(mb.samples) == 1 for r in plan.ranks for mb in r if not mb.is_filler)
    # balance (longest-processing-time with a per-rank count): no rank exceeds the mean by more than one row
    costs = [plan.rank_cost(r) for r in range(ranks)]
    biggest = max(row_cost(mb.lengths, linear) for r in plan.ranks for mb in r)
    assert max(costs) <= sum(costs) / ranks + biggest + 1e-9


def test_small_exact_plan():
    plan = plan_packing([5, 3, 4, 2, 8], seq_len=8, num_ranks=2)
    # FFD: 8 | 5+3 | 4+2 -> 3 rows; split the costlier multi-sample row (5+3: 34 > 4+2: 20) -> 4 rows, 2 per rank
    rows = sorted(mb.samples for r in plan.ranks for mb in r)
    assert rows == [(0,), (1,), (2, 3), (4,)]
    assert [len(r) for r in plan.ranks] == [2, 2]
    assert plan.ranks[0][0] == PackedMicroBatch((4,), (8,))  # costliest row first, to rank 0
    assert plan.ranks[1][0].samples == (0,)  # 25 next, to the lighter rank 1
    assert PackedMicroBatch((2, 3), (4, 2)).cu_seqlens == [0, 4, 6]


def test_truncation_and_fillers():
    plan = plan_packing([10, 3], seq_len=6, num_ranks=3)
    assert plan.truncated == (0,) and plan.lengths == (6, 3)
    assert [len(r) for r in plan.ranks] == [1, 1, 1]
    assert sum(mb.is_filler for r in plan.ranks for mb in r) == 1  # two single-sample rows for three ranks


@pytest.mark.parametrize("args, match", [
    (([], 8, 1), "lengths is empty"), (([1], 8, 1), r"lengths\[0\]=1 must be an int >= 2"),
    (([4], 1, 1), "seq_len=1 must be an int >= 2"), (([4], 8, 0), "num_ranks=0"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        plan_packing(*args)
    with pytest.raises(ValueError, match="linear"):
        plan_packing([4], 8, 1, linear=-1.0)
