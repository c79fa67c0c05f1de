"""Review regressions for EP low-latency mode (``moe_rl.moe.ep.low_latency``).

``check_across_ranks=True`` agrees on "some rank has bad input" with one ``all_reduce``. The flag must work for
wide-EP groups (R >= 64 ranks, e.g. decode EP over 8+ nodes: a ``1 << rank`` int64 bit mask overflows for ranks
>= 63, so a bad rank raised ``RuntimeError: Overflow`` instead of taking part in the collective, and every other rank
hung) and live on the inputs' device (an NCCL-only group cannot reduce a CPU tensor). One process stands in for
rank ``r`` of ``R``: ``get_rank`` / ``get_world_size`` are patched, and ``all_reduce`` adds the one-hot ``[R]`` flags
the other bad ranks contribute (the flag's encoding: element ``r`` counts rank ``r``'s problem).
"""

import re

import pytest
import torch

import moe_rl.moe.ep.low_latency as ll


def _fake_group(monkeypatch, rank: int, world: int, other_bad: list[int], seen: list):
    def all_reduce(t, op=None, group=None):
        seen.append((t.device, tuple(t.shape)))
        for r in other_bad:
            t[r] += 1

    monkeypatch.setattr(ll.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(ll.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(ll.dist, "all_reduce", all_reduce)


@pytest.mark.parametrize("world,rank", [(64, 63), (256, 200), (4, 2)])
def test_bad_rank_in_wide_group_raises_value_error(monkeypatch, world, rank):
    seen: list = []
    _fake_group(monkeypatch, rank, world, other_bad=[0, world - 1], seen=seen)
    x = torch.randn(5, 16)  # T=5 > M=4 on this rank
    ids = torch.zeros(5, 1, dtype=torch.int64)
    expect = sorted({0, rank, world - 1})
    with pytest.raises(ValueError, match=re.escape(f"bad input on rank(s) {expect}; this rank: x_TH has T=5")):
        ll._validate(x, ids, None, num_experts=world, max_tokens_per_rank=4, use_fp8=False,
                     check_across_ranks=True)
    assert seen == [(x.device, (world,))]


@pytest.mark.parametrize("world,rank", [(128, 70), (4, 1)])
def test_good_rank_names_other_bad_ranks_and_clean_step_passes(monkeypatch, world, rank):
    seen: list = []
    _fake_group(monkeypatch, rank, world, other_bad=[world - 1], seen=seen)
    x = torch.randn(2, 16)
    ids = torch.tensor([[0, 1], [2, world - 1]])
    with pytest.raises(ValueError, match=rf"bad input on rank\(s\) \[{world - 1}\]$"):
        ll._validate(x, ids, None, num_experts=world, max_tokens_per_rank=4, use_fp8=False, check_across_ranks=True)
    _fake_group(monkeypatch, rank, world, other_bad=[], seen=seen)
    assert ll._validate(x, ids, None, num_experts=world, max_tokens_per_rank=4, use_fp8=False,
                        check_across_ranks=True) == world
    assert len(seen) == 2 and all(d == x.device for d, _ in seen)
