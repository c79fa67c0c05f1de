"""A scripted (fully deterministic) run of the orchestrator that reproduces a lost wake-up: the last queued group
goes stale while the engine jumps two versions at once, nothing is in flight and the trainer waits for the
last batch. The batcher's ``take`` drops the stale group, which frees a batch slot the producer had counted as
pending; the producer must be woken to refill it, or the run never ends (seen once in CI as a 120 s hang of
``test_orchestrator_simulated[3-0.03-0.001-3]``).

Timeline (max_off_policy_steps=3, one group per batch, 5 steps; ``A`` is group 3):

====  =========================================  ==============================================================
 v    event                                      buffer / batches
====  =========================================  ==============================================================
 0    admission starts groups 0..3 (b0..b3)      -
 0    0, 1 finish                                b0 = [0], b1 = [1]; batch 2 waits for v1 (``may_take``)
 0    2 finishes                                 queue [2]
 1    trainer publishes v1                       X (group 4) starts; b2 = [2]; batch 3 waits for v2
 1    X, then A finish                           queue [X, A]: A now lands in batch 4, past its bound 0+3
 2    trainer publishes v2                       b3 = [X]; queue [A]; batch 4 waits for v3
 4    trainer publishes v3 and v4 together       producer wakes first (capacity 1 - 1 = 0, A counted);
                                                 batcher drops A (4 - 0 > 3): queue empty, nothing in flight
====  =========================================  ==============================================================

With the wake-up, the producer re-runs A's prompt (a retry) under v4 and batch 4 is formed from it.
"""

import asyncio
import json

from _fake_engine import FakeCompletion, publish_folder_version, trainer_report

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer
from moe_rl.rl.batch import batch_path
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths

STEP_TIMEOUT_S = 20.0  # generous: every wait below is for an event that takes milliseconds when the code is right


class ScriptedEngine:
    """Each ``generate`` call blocks until the test releases it (by call index)."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[asyncio.Future, str, int]] = []  # (future, cache_salt, version at send)

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append((fut, cache_salt, self.version))
        await fut
        return [FakeCompletion([5, 6, 2], [-0.5, -0.5, -0.5]) for _ in range(n)], 0

    def release(self, i: int) -> None:
        self.calls[i][0].set_result(None)

    async def update_weights(self, path, version):
        self.version = version
        return {"version": version}

    async def weight_version(self):
        return self.version


def _publish(paths: RunPaths, *versions: int) -> None:
    """The trainer's side, synchronously (no await in between, so the watcher sees all versions at once)."""
    for v in versions:
        step = v - 1
        publish_folder_version(paths, v)
        paths.trainer_step(step).write_text(json.dumps(trainer_report(step, 1)))


async def _until(cond, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STEP_TIMEOUT_S
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {STEP_TIMEOUT_S}s waiting for: {what}")
        await asyncio.sleep(0.002)


def test_stale_last_group_with_version_jump_does_not_hang(tmp_path):
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    cfg = OrchestratorConfig(batch_size=2, group_size=2, max_inflight=8, max_off_policy_steps=3,
                             engine_probe=False, stall_timeout_s=60.0)
    engine = ScriptedEngine()
    steps = 5
    orch = Orchestrator(cfg, task, engine, paths, max_steps=steps, seed=0, run_id="scripted")
    has_batch = lambda n: batch_path(paths.batches, n).exists()  # noqa: E731

    async def script() -> None:
        await _until(lambda: len(engine.calls) == 4, "groups 0..3 started under v0")
        assert len(engine.calls) == 4  # admission: batches 0..min(0+3, 4) = 4 slots, no more
        engine.release(0)
        await _until(lambda: has_batch(0), "batch 0")
        engine.release(1)
        await _until(lambda: has_batch(1), "batch 1")
        engine.release(2)
        await _until(lambda: orch.buffer.num_queued_groups == 1, "group 2 queued")
        assert not has_batch(2)  # may_take(2, engine_version=0) is False
        _publish(paths, 1)
        await _until(lambda: len(engine.calls) == 5 and has_batch(2), "X started under v1 and batch 2 formed")
        assert engine.calls[4][2] == 1
        engine.release(4)  # X finishes before A: A is pushed past its last usable batch (3)
        await _until(lambda: orch.buffer.num_queued_groups == 1, "X queued")
        engine.release(3)
        await _until(lambda: orch.buffer.num_queued_groups == 2, "A queued behind X")
        _publish(paths, 2)
        await _until(lambda: has_batch(3) and orch.buffer.num_queued_groups == 1, "batch 3 = [X], A left queued")
        assert orch.state.engine_version == 2 and len(engine.calls) == 5
        _publish(paths, 3, 4)  # the engine jumps 2 -> 4: one notification unblocks both producer and batcher
        await _until(lambda: len(engine.calls) == 6, "the producer refills the slot A's drop freed")
        assert engine.calls[5][2] == 4
        assert orch.buffer.counters.dropped_by_reason.get("stale_queued") == 2  # A's 2 samples, counted
        engine.release(5)
        await _until(lambda: has_batch(4), "batch 4")
        _publish(paths, 5)

    async def main() -> dict:
        driver = asyncio.create_task(script())
        run = asyncio.create_task(orch.run())
        done, _ = await asyncio.wait({driver, run}, timeout=120, return_when=asyncio.FIRST_EXCEPTION)
        if driver in done:
            driver.result()  # re-raise the script's assertion
        summary = await asyncio.wait_for(run, timeout=60)
        return summary

    summary = asyncio.run(main())
    assert summary["steps"] == steps
    # nothing lost: 6 groups x 2 samples = 5 trained groups + A dropped stale in the queue
    assert summary["rollouts_started"] == 12
    assert summary["rollouts_trained"] == 10
    assert summary["rollouts_dropped_by_reason"] == {"stale_queued": 2}
    assert summary["rollouts_inflight_at_exit"] == 0
    assert summary["groups_retried"] == 1  # A's prompt went again
