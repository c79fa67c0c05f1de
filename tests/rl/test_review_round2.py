"""Review regressions (round 2) for the main job's Mooncake weight transport (``Orchestrator._announcement_watcher``).

The final version is announced as a store version with a folder copy (``filesystem_copy``). If the store lost it
and the engine's first folder load failed transiently, the watcher waited for a ``filesystem`` re-announcement that
never comes (the trainer holds no copy to republish: it wrote the folder already, and has usually exited), so the
run ended in the stall timeout although the folder copy was there. It must retry the folder copy, as it retries a
failed ``filesystem`` version.
"""

import random

from _fake_engine import (
    StoreEngine,
    final_version_lost_trainer,
    publish_folder_version,
    run_with_trainer,
    store_publisher,
    store_source,
)

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths


def test_final_store_version_with_folder_copy_is_retried_after_a_failed_load(tmp_path):
    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    store, pub = store_publisher(paths.weights, final_version=2)

    class FolderOnceBroken(StoreEngine):
        folder_failures = 0

        async def update_weights(self, path, version):
            if version == 2 and self.folder_failures == 0:
                self.folder_failures += 1
                raise RuntimeError("engine busy (folder reload timed out)")
            return await super().update_weights(path, version)

    engine = FolderOnceBroken(rng, 0.002, store)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=8)
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=2,
                        store=store_source())

    s = run_with_trainer(orch, final_version_lost_trainer(paths, pub, store, orch))["weight_transport"]
    assert engine.folder_failures == 1
    assert s["versions_loaded"] == {"1": "mooncake", "2": "filesystem"}
    assert s["versions_failed"] == {} and s["versions_not_loaded_at_exit"] == []
    # one load fell back from the store to the folder (the successful retry); not a trainer republish
    assert s["engine_load_fallbacks"] == 1 and s["versions_republished"] == []
    assert engine.loads[-1] == (2, "filesystem")


def test_chained_budget_holds_the_largest_running_sum():
    """The last turn's answer sums ``num_turns + 1`` operands (``a + b`` plus one per later turn); the budget check
    must admit exactly the configs whose ``max_new_tokens`` hold its digits plus ``<eos>`` (it used ``num_turns``
    operands: ``num_turns=1`` accepted ``max_new_tokens=2`` for ``9+9=18<eos>``)."""
    import pytest

    from moe_rl.envs import ChainedAdditionTaskConfig, ChainedProblem

    for num_turns in range(1, 9):
        for nd in (1, 2, 3):
            top = 10**nd - 1
            p = ChainedProblem(top, top, (top,) * (num_turns - 1))  # every operand at its largest
            need = len(p.turn_answer(num_turns - 1)) + 1  # digits + <eos>
            cfg = ChainedAdditionTaskConfig(num_turns=num_turns, num_digits=nd, max_new_tokens=need)
            assert cfg.max_new_tokens == need
            with pytest.raises(ValueError, match=f"max_new_tokens >= {need}"):
                ChainedAdditionTaskConfig(num_turns=num_turns, num_digits=nd, max_new_tokens=need - 1)
