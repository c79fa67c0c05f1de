"""ShardPlan.unshard input forms: list of cp shards, concatenation along dim, torch.stack; clear errors otherwise."""

from __future__ import annotations

import pytest
import torch

from moe_rl.attention.layout import make_shard_plan


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_unshard_accepts_list_concat_and_stack(layout):
    plan = make_shard_plan(7, 2, layout)  # padded to 8 (zigzag) / 8 (contiguous), Tl = 4
    x = torch.arange(7 * 3).view(7, 3)
    parts = [plan.shard(x, r) for r in range(plan.cp)]
    assert torch.equal(plan.unshard(parts), x)
    assert torch.equal(plan.unshard(torch.cat(parts)), x)  # all_gather_into_tensor form
    assert torch.equal(plan.unshard(torch.stack(parts)), x)  # [cp, Tl, 3]
    # a non-zero row dim: shards of [3, T] along dim 1, stacked at dim 1 -> [3, cp, Tl]
    xt = x.T.contiguous()
    parts_t = [plan.shard(xt, r, dim=1) for r in range(plan.cp)]
    assert torch.equal(plan.unshard(torch.stack(parts_t, dim=1), dim=1), xt)
    assert torch.equal(plan.unshard(torch.stack(parts_t, dim=1), dim=-2), xt)
    # 1-D stream: stacked [cp, Tl]
    v = torch.arange(7.0)
    assert torch.equal(plan.unshard(torch.stack([plan.shard(v, r) for r in range(2)])), v)


def test_unshard_errors_say_how_to_call_it():
    plan = make_shard_plan(8, 2, "zigzag")
    x = torch.arange(8.0)
    with pytest.raises(ValueError, match=r"shape \(3, 4\).*cp\*Tl = 2\*4 = 8.*list of the cp shards"):
        plan.unshard(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"list of 1 shards; pass one per rank \(cp=2\)"):
        plan.unshard([plan.shard(x, 0)])
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        plan.shard(x)  # shard needs the rank (the old docs wrote unshard(shard(x)))
