"""The orchestrator against a simulated engine and trainer (no vLLM, no torch model): thousands of
asynchronous events with random latencies. Checks the staleness bound, the rollout accounting invariant,
the salt per start version, and that the loop never stalls."""

import asyncio
import json
import random
from dataclasses import dataclass

import pytest

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer
from moe_rl.inference.weights import MARKER, version_dir
from moe_rl.rl.batch import batch_path, read_batch
from moe_rl.rl.orchestrator import Orchestrator, OrchestratorConfig, RunPaths


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


class FakeEngine:
    def __init__(self, rng: random.Random, max_latency: float):
        self.rng = rng
        self.version = 0
        self.max_latency = max_latency
        self.salts: list[tuple[str, int]] = []
        self.cache: set[str] = set()

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        self.salts.append((cache_salt, self.version))
        await asyncio.sleep(self.rng.random() * self.max_latency)
        comps = []
        for _ in range(n):
            k = self.rng.randint(1, max_tokens)
            comps.append(FakeCompletion([self.rng.randint(3, 12) for _ in range(k - 1)] + [2], [-0.5] * k))
        key = f"{cache_salt}|{tuple(prompt_ids)}"
        cached = 64 if key in self.cache else 0
        self.cache.add(key)
        return comps, cached

    async def update_weights(self, path, version):
        await asyncio.sleep(self.rng.random() * 0.002)
        self.version = version
        return {"version": version}

    async def weight_version(self):
        return self.version


async def fake_trainer(paths: RunPaths, max_steps: int, rng: random.Random, max_step_s: float):
    for step in range(max_steps):
        while not batch_path(paths.batches, step).exists():
            await asyncio.sleep(0.001)
        b = read_batch(batch_path(paths.batches, step))
        await asyncio.sleep(rng.random() * max_step_s)
        d = version_dir(paths.weights, step + 1)
        d.mkdir(parents=True)
        (d / MARKER).write_text("{}")
        report = {"step": step, "loss": 0.0, "mismatch_kl": 0.0, "masked_frac": 0.0, "grad_norm": 1.0, "lr": 1.0,
                  "idle_s": 0.0, "compute_s": 0.001, "publish_s": 0.0, "tokens": int(b.input_ids.numel())}
        paths.trainer_step(step).write_text(json.dumps(report))


@pytest.mark.parametrize("max_off, max_latency, max_step_s, seed",
                         [(0, 0.01, 0.002, 0), (1, 0.02, 0.003, 1), (1, 0.002, 0.02, 2), (3, 0.03, 0.001, 3)])
def test_orchestrator_simulated(tmp_path, max_off, max_latency, max_step_s, seed):
    rng = random.Random(seed)
    paths = RunPaths(tmp_path)
    version_dir(paths.weights, 0).mkdir(parents=True)
    (version_dir(paths.weights, 0) / MARKER).write_text("{}")
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    cfg = OrchestratorConfig(batch_size=8, group_size=2, max_inflight=12, max_off_policy_steps=max_off,
                             engine_probe=True)
    engine = FakeEngine(rng, max_latency)
    steps = 60
    orch = Orchestrator(cfg, task, engine, paths, max_steps=steps, seed=seed, run_id="sim")

    async def main():
        trainer = asyncio.create_task(fake_trainer(paths, steps, rng, max_step_s))
        summary = await asyncio.wait_for(orch.run(), timeout=120)
        await trainer
        return summary

    summary = asyncio.run(main())
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert r["staleness_max"] <= max_off
        assert r["rollouts_started"] == r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_inflight"]
    assert summary["rollouts_trained"] == steps * 8
    assert summary["rollouts_started"] == (summary["rollouts_trained"] + summary["rollouts_dropped"]
                                           + summary["rollouts_inflight_at_exit"])
    # every request carried the salt of the version served when it was sent
    for salt, version in engine.salts:
        assert salt.endswith(f"-v{version}-float32"), (salt, version)
    events = [json.loads(x) for x in paths.engine_events.read_text().splitlines()]
    assert all(e["probe_cached_tokens_new_salt"] == 0 and e["probe_cached_tokens_same_salt"] == 64 for e in events)
