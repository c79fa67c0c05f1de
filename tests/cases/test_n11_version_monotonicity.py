"""N11: weight-version monotonicity across failover and resume.

moe_rl's version bookkeeping lives in three places, each tested here with the case's numbers:

* the rollout buffer (:class:`moe_rl.rl.buffer.AsyncRolloutBuffer`): groups stamped v40, v41, v42, max staleness 2,
  consumed at v43: v40 (staleness 3) is dropped, v41 (2) and v42 (1) are trained; a negative staleness or a
  consuming version that goes back raises;
* the publisher (:class:`moe_rl.weights.filesystem.WeightPublisher` / ``ShardedVersionWriter``), whose folder is the
  durable record: a trainer that failed over or resumed with a counter that went back (57 -> 1, or republishing 1
  after a resume at 10) is refused; the next version it may publish is ``latest + 1`` (43 after 42); a multi-chunk
  (sharded) write that fails at chunk 2 publishes nothing and the latest version stays 42;
* the engine (:class:`moe_rl.weights.engine.WeightSyncExtension`, vLLM's worker mix-in, exercised without
  vLLM: the version check runs before any weight is touched): a version <= the one it serves is refused and the
  engine keeps advertising its version.

The main job's ``--resume`` is tested end to end in ``tests/test_e2e_resume.py`` (fresh engines, versions above
the checkpoint, a fresh salt namespace per segment); here "resume" is a new publisher on the same weights folder.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from moe_rl.rl.buffer import AsyncRolloutBuffer, RolloutGroup, Sample, staleness
from moe_rl.weights.filesystem import ShardedVersionWriter, WeightPublisher, latest_published

HF_CONFIG = {"model_type": "toy"}


def _group(gid: int, version: int) -> RolloutGroup:
    s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-0.1, -0.2], reward=1.0)
    return RolloutGroup(group_id=gid, version_start=version, cache_salt=f"v{version}", samples=[s],
                        version_end=version)


def _buffer_with(versions: list[int]) -> AsyncRolloutBuffer:
    buf = AsyncRolloutBuffer(max_off_policy_steps=2, policy="drop")
    for gid, v in enumerate(versions):
        buf.start(gid, v, 1)
        buf.put(_group(gid, v))
    return buf


def test_n11_staleness_at_v43_rejects_v40_accepts_v41_v42():
    assert [staleness(v, 43) for v in (40, 41, 42)] == [3, 2, 1]
    buf = _buffer_with([40, 41, 42])
    taken = buf.take(2, consume_version=43)
    assert [g.version_start for g in taken] == [41, 42]
    assert buf.counters.dropped_by_reason == {"stale_queued": 1}
    assert dict(buf.staleness_hist) == {2: 1, 1: 1}


def test_n11_negative_staleness_raises():
    with pytest.raises(ValueError, match="negative staleness"):
        staleness(42, 1)  # the failed-over trainer's counter restarted at 1
    buf = _buffer_with([40, 41, 42])
    with pytest.raises(ValueError, match="negative staleness"):
        buf.take(1, consume_version=1)  # would otherwise admit every group (negative <= bound)


def test_n11_observed_version_decrease_raises():
    buf = _buffer_with([40, 41, 42, 42])
    assert len(buf.take(1, consume_version=43)) == 1
    with pytest.raises(ValueError, match="below the version of an earlier batch"):
        buf.take(1, consume_version=42)
    assert len(buf.take(1, consume_version=43)) == 1  # the same version again is fine


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).view(2, 3)}


def test_n11_publisher_continues_after_failover(tmp_path):
    cell0 = WeightPublisher(tmp_path, HF_CONFIG)
    for v in (40, 41, 42):
        cell0.publish(_state(), v)
    cell1 = WeightPublisher(tmp_path, HF_CONFIG)  # failover: a fresh process whose counter restarted
    with pytest.raises(ValueError, match="below the latest published version 42.*publish 43"):
        cell1.publish(_state(), 1)
    with pytest.raises(ValueError, match="already published"):
        cell1.publish(_state(), 42)
    assert latest_published(tmp_path) + 1 == 43
    cell1.publish(_state(), 43)
    assert latest_published(tmp_path) == 43


def test_n11_resume_after_rollout_10_never_republishes_an_old_version(tmp_path):
    pub = WeightPublisher(tmp_path, HF_CONFIG)
    for v in range(0, 12):  # rollout 10 trained on v10, the checkpoint's step published v11
        pub.publish(_state(), v)
    resumed = WeightPublisher(tmp_path, HF_CONFIG)
    with pytest.raises(ValueError, match="already published"):
        resumed.publish(_state(), 1)
    for v in range(0, 11):  # old versions garbage-collected: the folder still refuses going back
        shutil.rmtree(tmp_path / f"step_{v}")
    with pytest.raises(ValueError, match="below the latest published version 11"):
        resumed.publish(_state(), 1)
    with pytest.raises(ValueError, match="below the latest published version 11"):
        ShardedVersionWriter(tmp_path, 1, HF_CONFIG)
    resumed.publish(_state(), latest_published(tmp_path) + 1)
    assert latest_published(tmp_path) == 12


def test_n11_failed_multi_chunk_update_publishes_nothing(tmp_path):
    WeightPublisher(tmp_path, HF_CONFIG).publish(_state(), 42)
    w = ShardedVersionWriter(tmp_path, 43, HF_CONFIG, max_shard_bytes=24)  # one 24-byte tensor per shard
    w.add("a", torch.zeros(6))  # chunk 1 written
    with pytest.raises(ValueError, match="added twice"):
        w.add("a", torch.ones(6))  # chunk 2 fails
    assert latest_published(tmp_path) == 42  # the engine keeps seeing v42; v43 has no STABLE marker
    with pytest.raises(ValueError, match="already published|below"):
        WeightPublisher(tmp_path, HF_CONFIG).publish(_state(), 41)
    WeightPublisher(tmp_path, HF_CONFIG).publish(_state(), 43)  # a full update of 43 then succeeds
    assert latest_published(tmp_path) == 43


def test_n11_engine_rejects_a_version_not_above_the_one_it_holds(tmp_path):
    from moe_rl.weights.engine import WeightSyncExtension

    (tmp_path / "model.safetensors").write_bytes(b"")
    engine = WeightSyncExtension()
    engine._moe_rl_weight_version = 42
    for v in (1, 41, 42):
        with pytest.raises(ValueError, match=f"version {v} refused: this engine already serves version 42"):
            engine.reload_and_repack(str(tmp_path), v)
        assert engine.weight_version() == 42  # still advertises what it serves
    fresh = WeightSyncExtension()  # initial weights count as version 0
    with pytest.raises(ValueError, match="already serves version 0"):
        fresh.reload_and_repack(str(tmp_path), 0)
