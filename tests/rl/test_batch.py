"""Training-batch packing, sharding and the atomic on-disk transport."""

import pytest
import torch

from moe_rl.rl.batch import build_batch, read_batch, write_batch
from moe_rl.rl.buffer import RolloutGroup, Sample


def test_build_batch_alignment_and_advantages(tmp_path):
    g0 = RolloutGroup(0, 3, "s", [Sample([1, 4, 5], [6, 2], [-0.1, -0.2], reward=1.0),
                                  Sample([1, 4, 5], [7, 8, 2], [-0.3, -0.4, -0.5], reward=0.0)])
    g1 = RolloutGroup(1, 4, "s", [Sample([1, 9], [2], [-0.7], reward=0.5), Sample([1, 9], [3], [-0.9], reward=0.5)])
    g0.samples[1].version_segments = [(3, 0), (5, 2)]  # a weight update landed before its third token
    b = build_batch([g0, g1], step=5, pad_id=0)
    assert b.input_ids.tolist()[1] == [1, 4, 5, 7, 8, 2]
    assert b.input_ids.tolist()[0] == [1, 4, 5, 6, 2, 0]
    # position t predicts token t+1: completion of sample 1 starts at input index 3 -> mask index 2
    assert b.loss_mask.tolist()[1] == [False, False, True, True, True]
    assert b.inference_logprobs[1, 2:].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert b.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert b.version_start.tolist() == [3, 3, 4, 4]
    # per predicted position: -1 at prompt/padding, else the version that sampled the token
    assert b.token_versions.tolist() == [[-1, -1, 3, 3, -1], [-1, -1, 3, 3, 5], [-1, 4, -1, -1, -1],
                                         [-1, 4, -1, -1, -1]]
    assert torch.equal(b.token_versions >= 0, b.loss_mask)
    path = write_batch(b, tmp_path)
    r = read_batch(path)
    assert r.step == 5 and not list(tmp_path.glob("*.tmp"))
    for name in ("input_ids", "loss_mask", "inference_logprobs", "advantages", "version_start", "rewards",
                 "token_versions"):
        assert torch.equal(getattr(r, name), getattr(b, name)), name
    s = r.shard(1, 2)
    assert torch.equal(s.input_ids, b.input_ids[2:])
    assert torch.equal(s.token_versions, b.token_versions[2:])
    with pytest.raises(ValueError, match="strictly increase"):
        g0.samples[0].version_segments = [(3, 0), (3, 1)]
        build_batch([g0], step=5, pad_id=0)
    with pytest.raises(ValueError, match="world_size=3"):
        r.shard(0, 3)


def test_build_batch_applies_train_mask_of_mask_policy():
    """A user loop with AsyncRolloutBuffer(policy="mask") + build_batch trains only tokens within the bound."""
    from moe_rl.rl.buffer import AsyncRolloutBuffer

    buf = AsyncRolloutBuffer(1, policy="mask")
    buf.start(0, 0, 2)
    # sample 0: tokens 0-1 sampled by version 0, tokens 2-3 by version 2; sample 1: all by version 2
    buf.put(RolloutGroup(0, 0, "s", [Sample([1, 2], [3, 4, 5, 6], [-0.1] * 4, reward=1.0,
                                            version_segments=[(0, 0), (2, 2)]),
                                     Sample([1, 2], [7, 8], [-0.2] * 2, reward=0.0, version_segments=[(2, 0)])]))
    groups = buf.take(1, consume_version=2)  # age of version-0 tokens = 2 > 1: masked
    assert groups[0].samples[0].train_mask == [False, False, True, True]
    b = build_batch(groups, step=2, pad_id=0)
    # predicted positions: prompt of 2 tokens -> completion token j at position 1 + j
    assert b.loss_mask.tolist() == [[False, False, False, True, True], [False, True, True, False, False]]
    # token_versions still describe every completion token; only the loss mask drops the stale ones
    assert b.token_versions.tolist()[0] == [-1, 0, 0, 2, 2]
    bad = RolloutGroup(1, 0, "s", [Sample([1], [2, 3], [-0.1, -0.1], train_mask=[True])])
    with pytest.raises(ValueError, match="train_mask has 1 entries but its completion has 2 tokens"):
        build_batch([bad], step=0, pad_id=0)
