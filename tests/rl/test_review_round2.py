"""Review regressions (round 2) for the main job's Mooncake weight transport (``Orchestrator._announcement_watcher``).

The final version is announced as a store version with a folder copy (``filesystem_copy``). If the store lost it
and the engine's first folder load failed transiently, the watcher waited for a ``filesystem`` re-announcement that
never comes (the trainer holds no copy to republish: it wrote the folder already, and has usually exited), so the
run ended in the stall timeout although the folder copy was there. It must retry the folder copy, as it retries a
failed ``filesystem`` version.
"""

import asyncio
import json
import random
from types import SimpleNamespace

import torch

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer
from moe_rl.inference.weights import MARKER, version_dir
from moe_rl.rl.batch import batch_path
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths
from moe_rl.runtime.weight_transport import StoreSource


class FlakyStore:
    """Stand-in for ``MooncakeWeightTransport`` (as in ``test_weight_transport.py``): versions in a dict."""

    name = "mooncake"

    def __init__(self):
        self.data: dict[int, dict] = {}
        self.gc_failures = 0

    def publish(self, sd, version):
        self.data[version] = dict(sd)
        return {"transport": "mooncake", "version": version}


def _publisher(root, final_version):
    from moe_rl.inference.mooncake.fallback import FallbackWeightTransport, FilesystemWeightTransport
    from moe_rl.runtime.trainer.publish import RunWeightPublisher

    store = FlakyStore()
    fs = FilesystemWeightTransport(root, {"model_type": "toy"})
    chain = FallbackWeightTransport([store, fs], retry_after_s=3600.0)
    return store, RunWeightPublisher("mooncake", root, fs, chain=chain, final_version=final_version)


class StoreEngine:
    """Fake engine: completions without weights, ``update_weights_from_mooncake`` reads a :class:`FlakyStore`,
    ``update_weights`` loads a folder; every load is logged as ``(version, source)``."""

    def __init__(self, rng, store):
        self.rng, self.store, self.version, self.loads = rng, store, 0, []

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        await asyncio.sleep(self.rng.random() * 0.002)
        out = []
        for _ in range(n):
            k = self.rng.randint(1, max_tokens)
            out.append(SimpleNamespace(token_ids=[self.rng.randint(3, 12) for _ in range(k - 1)] + [2],
                                       logprobs=[-0.5] * k, finish_reason="stop"))
        return out, 0

    async def update_weights_from_mooncake(self, store_config, model, version, shard="0of1"):
        if version not in self.store.data:
            raise RuntimeError(f"worker: version {version} not in the store")
        self.version = version
        self.loads.append((version, "mooncake"))
        return {"version": version}

    async def update_weights(self, path, version):
        self.version = version
        self.loads.append((version, "filesystem"))
        return {"version": version}

    async def weight_version(self):
        return self.version


def test_final_store_version_with_folder_copy_is_retried_after_a_failed_load(tmp_path):
    from moe_rl.inference.mooncake.store import StoreClientConfig

    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    version_dir(paths.weights, 0).mkdir(parents=True)
    (version_dir(paths.weights, 0) / MARKER).write_text("{}")
    store, pub = _publisher(paths.weights, final_version=2)

    class FolderOnceBroken(StoreEngine):
        folder_failures = 0

        async def update_weights(self, path, version):
            if version == 2 and self.folder_failures == 0:
                self.folder_failures += 1
                raise RuntimeError("engine busy (folder reload timed out)")
            return await super().update_weights(path, version)

    engine = FolderOnceBroken(rng, store)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=8)
    src = StoreSource(StoreClientConfig(master_address="127.0.0.1:1", metadata_url="http://127.0.0.1:2/metadata"),
                      "policy")
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=2,
                        store=src)

    async def trainer():
        for step in range(2):
            while not batch_path(paths.batches, step).exists():
                pub.serve_requests()  # as rl_trainer does while it waits
                await asyncio.sleep(0.001)
            if step == 1:
                while orch.state.engine_version < 1:
                    await asyncio.sleep(0.001)
            pub.publish({"w": torch.zeros(2)}, step + 1)
            if step == 1:
                store.data.clear()  # the store loses the final version before the engine asks
            paths.trainer_step(step).write_text(json.dumps({
                "step": step, "loss": 0.0, "mismatch_kl": 0.0, "masked_frac": 0.0, "grad_norm": 1.0, "lr": 1.0,
                "idle_s": 0.0, "compute_s": 0.001, "publish_s": 0.0, "tokens": 1, "weight_transport": pub.stats()}))
        # the trainer exits here (serve_requests is never called again), as after the final step

    async def main():
        t = asyncio.create_task(trainer())
        out = await asyncio.wait_for(orch.run(), timeout=60)
        await t
        return out

    s = asyncio.run(main())["weight_transport"]
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
