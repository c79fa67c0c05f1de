"""Training-batch packing, sharding and the atomic on-disk transport."""

import pytest
import torch

from moe_rl.rl.batch import build_batch, read_batch, write_batch
from moe_rl.rl.buffer import RolloutGroup, Sample


def test_build_batch_alignment_and_advantages(tmp_path):
    g0 = RolloutGroup(0, 3, "s", [Sample([1, 4, 5], [6, 2], [-0.1, -0.2], reward=1.0),
                                  Sample([1, 4, 5], [7, 8, 2], [-0.3, -0.4, -0.5], reward=0.0)])
    g1 = RolloutGroup(1, 4, "s", [Sample([1, 9], [2], [-0.7], reward=0.5), Sample([1, 9], [3], [-0.9], reward=0.5)])
    b = build_batch([g0, g1], step=5, pad_id=0)
    assert b.input_ids.tolist()[1] == [1, 4, 5, 7, 8, 2]
    assert b.input_ids.tolist()[0] == [1, 4, 5, 6, 2, 0]
    # position t predicts token t+1: completion of sample 1 starts at input index 3 -> mask index 2
    assert b.loss_mask.tolist()[1] == [False, False, True, True, True]
    assert b.inference_logprobs[1, 2:].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert b.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert b.version_start.tolist() == [3, 3, 4, 4]
    path = write_batch(b, tmp_path)
    r = read_batch(path)
    assert r.step == 5 and not list(tmp_path.glob("*.tmp"))
    for name in ("input_ids", "loss_mask", "inference_logprobs", "advantages", "version_start", "rewards"):
        assert torch.equal(getattr(r, name), getattr(b, name)), name
    s = r.shard(1, 2)
    assert torch.equal(s.input_ids, b.input_ids[2:])
    with pytest.raises(ValueError, match="world_size=3"):
        r.shard(0, 3)
