"""The orchestrator against a simulated engine and trainer (no vLLM, no torch model): thousands of
asynchronous events with random latencies. Checks the staleness bound, the rollout accounting invariant,
the salt per start version, and that the loop never stalls."""

import asyncio
import json
import random

import pytest
from _fake_engine import FakeCompletion, FakeEngine, finish_step, publish_folder_version

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer
from moe_rl.rl.batch import batch_path, read_batch
from moe_rl.rl.token_versions import normalize_segments
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths


class SaltEngine(FakeEngine):
    """``FakeEngine`` that logs each request's salt and version, reports a prefix-cache hit when a (salt, prompt)
    pair repeats, and gives each completion version segments (a weight update during the request switches the
    tokens after a random point to the newest version)."""

    def __init__(self, rng: random.Random, max_latency: float):
        super().__init__(rng, max_latency)
        self.salts: list[tuple[str, int]] = []
        self.cache: set[str] = set()

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        self.salts.append((cache_salt, self.version))
        comps, _ = await super().generate(prompt_ids, n, max_tokens, temperature, cache_salt, seed)
        key = f"{cache_salt}|{tuple(prompt_ids)}"
        cached = 64 if key in self.cache else 0
        self.cache.add(key)
        return comps, cached

    def completion(self, k: int, v0: int) -> FakeCompletion:
        switch = self.rng.randint(0, k - 1)
        segments = [(v0, 0)] if self.version == v0 else normalize_segments([(v0, 0), (self.version, switch)], k)
        return FakeCompletion([self.rng.randint(3, 12) for _ in range(k - 1)] + [2], [-0.5] * k,
                              version_segments=segments)


VERSION_ERRORS: list = []
MIXED_TOKENS = [0]


async def fake_trainer(paths: RunPaths, max_steps: int, rng: random.Random, max_step_s: float):
    for step in range(max_steps):
        while not batch_path(paths.batches, step).exists():
            await asyncio.sleep(0.001)
        b = read_batch(batch_path(paths.batches, step))
        # per-token versions reached the trainer: within [version_start, step] on every loss token
        tv = b.token_versions[b.loss_mask]
        start = b.version_start[:, None].expand_as(b.loss_mask)[b.loss_mask]
        if not (tv.numel() and bool((tv <= step).all()) and bool((tv >= start).all())):
            VERSION_ERRORS.append((step, b.token_versions.tolist()))
        MIXED_TOKENS[0] += int((tv > start).sum())
        await asyncio.sleep(rng.random() * max_step_s)
        finish_step(paths, step, int(b.input_ids.numel()))


@pytest.mark.parametrize("max_off, max_latency, max_step_s, seed",
                         [(0, 0.01, 0.002, 0), (1, 0.02, 0.003, 1), (1, 0.002, 0.02, 2), (3, 0.03, 0.001, 3)])
def test_orchestrator_simulated(tmp_path, max_off, max_latency, max_step_s, seed):
    rng = random.Random(seed)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    cfg = OrchestratorConfig(batch_size=8, group_size=2, max_inflight=12, max_off_policy_steps=max_off,
                             engine_probe=True)
    engine = SaltEngine(rng, max_latency)
    steps = 60
    orch = Orchestrator(cfg, task, engine, paths, max_steps=steps, seed=seed, run_id="sim")

    async def main():
        trainer = asyncio.create_task(fake_trainer(paths, steps, rng, max_step_s))
        summary = await asyncio.wait_for(orch.run(), timeout=120)
        await trainer
        return summary

    VERSION_ERRORS.clear()
    MIXED_TOKENS[0] = 0
    summary = asyncio.run(main())
    assert VERSION_ERRORS == []
    if max_off > 0 and max_latency > max_step_s:  # requests long enough to overlap weight updates
        assert MIXED_TOKENS[0] > 0, "some trained tokens should come from a version newer than their start"
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


async def checking_trainer(paths: RunPaths, max_steps: int, rng: random.Random, max_step_s: float, max_off: int,
                           policy: str, seen: dict):
    """A fake trainer that checks every batch: each loss token is at most ``max_off`` versions old (its own
    version under ``mask``, its rollout's start version otherwise)."""
    for step in range(max_steps):
        while not batch_path(paths.batches, step).exists():
            await asyncio.sleep(0.001)
        b = read_batch(batch_path(paths.batches, step))
        age = step - b.token_versions[b.loss_mask]
        start_age = step - b.version_start
        seen["max_token_age"] = max(seen.get("max_token_age", 0), int(age.max()))
        seen["max_start_age"] = max(seen.get("max_start_age", 0), int(start_age.max()))
        completion = (b.token_versions >= 0).sum()  # completion positions (prompt and padding are -1)
        seen["masked"] = seen.get("masked", 0) + int(completion - b.loss_mask.sum())
        seen["samples"] = seen.get("samples", 0) + b.num_samples
        await asyncio.sleep(rng.random() * max_step_s)
        finish_step(paths, step, int(b.input_ids.numel()))


@pytest.mark.parametrize("policy, partial, admission, max_ahead, max_off, seed", [
    ("withhold", "survivors", "inflight", None, 1, 5),
    ("mask", "survivors", "queued", 1, 2, 6),
    ("mask", "drop_group", "inflight", None, 1, 7),
    ("drop", "drop_group", "queued", 1, 3, 8),
])
def test_orchestrator_policies(tmp_path, policy, partial, admission, max_ahead, max_off, seed):
    """Slow requests (up to 30 ms) against fast trainer steps (<= 1 ms): rollouts routinely outlive the bound."""
    rng = random.Random(seed)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    cfg = OrchestratorConfig(batch_size=8, group_size=2, max_inflight=12, max_off_policy_steps=max_off,
                             off_policy_policy=policy, partial_groups=partial, admission=admission,
                             max_ahead=max_ahead, max_retries=1, engine_probe=False)
    engine = SaltEngine(rng, 0.03)
    steps = 40
    orch = Orchestrator(cfg, task, engine, paths, max_steps=steps, seed=seed, run_id="sim")
    seen: dict = {}

    async def main():
        trainer = asyncio.create_task(checking_trainer(paths, steps, rng, 0.001, max_off, policy, seen))
        summary = await asyncio.wait_for(orch.run(), timeout=120)
        await trainer
        return summary

    s = asyncio.run(main())
    assert seen["max_token_age"] <= max_off
    if policy != "mask":
        assert seen["max_start_age"] <= max_off
    assert s["steps"] == steps and s["rollouts_trained"] == seen["samples"]
    assert s["rollouts_started"] == (s["rollouts_trained"] + s["rollouts_dropped"] + s["rollouts_withheld"]
                                     + s["rollouts_inflight_at_exit"])
    stale_drops = {k: v for k, v in s["rollouts_dropped_by_reason"].items() if k.startswith("stale")}
    if policy == "drop":
        assert s["rollouts_withheld"] == 0
    else:
        assert stale_drops == {}, "withhold/mask never cancel or discard for staleness"
    if policy == "withhold":
        assert s["rollouts_withheld"] > 0 and s["masked_tokens"] == 0
    if policy == "mask":
        assert s["masked_tokens"] == seen["masked"]  # every masked token is counted
    assert s["groups_retried"] + s["groups_abandoned"] >= (s["rollouts_withheld"] > 0)
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    for r in records:
        assert r["rollouts_started"] == (r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_withheld"]
                                         + r["rollouts_inflight"])
    assert (tmp_path / "rollouts.jsonl").exists()
