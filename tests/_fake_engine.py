"""Test doubles for the orchestrator's engine and the trainer's weight store, shared by the orchestrator tests.

Tests import this module as ``from _fake_engine import ...`` (``tests/conftest.py`` puts ``tests/`` on
``sys.path``). Nothing here loads weights or runs a model:

- :class:`FakeCompletion`: the fields of ``moe_rl.inference.Completion`` the orchestrator reads.
- :class:`FakeEngine`: random-latency random completions; ``update_weights`` by path sets the served version.
- :class:`FlakyStore` + :func:`store_publisher`: a stand-in for ``MooncakeWeightTransport`` (versions in a dict
  until ``die()``) behind the real ``RunWeightPublisher`` with its filesystem fallback.
- :class:`StoreEngine`: ``FakeEngine`` plus the worker RPC ``update_weights_from_mooncake`` reading a store.
- :func:`store_source`, :func:`trainer_report`, :func:`run_with_trainer`: the orchestrator side's plumbing.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    version_segments: list | None = None
    routed_experts: object = None


def completion(ids: list[int], finish: str = "stop", logprob: float = -0.5) -> FakeCompletion:
    """A completion of ``ids`` ending with ``finish``, every token at log-prob ``logprob``."""
    return FakeCompletion(list(ids), [logprob] * len(ids), finish)


class FakeEngine:
    """Random-latency completions (no weights): ``k`` in ``[1, max_tokens]`` tokens ending in EOS id 2, logprob
    -0.5 each; ``update_weights`` by path sets the served version."""

    def __init__(self, rng: random.Random, max_latency: float):
        self.rng = rng
        self.version = 0
        self.max_latency = max_latency

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt, seed):
        v0 = self.version
        await asyncio.sleep(self.rng.random() * self.max_latency)
        return [self.completion(self.rng.randint(1, max_tokens), v0) for _ in range(n)], 0

    def completion(self, k: int, v0: int) -> FakeCompletion:
        """One completion of ``k`` tokens for a request sent under version ``v0`` (no version segments here)."""
        return FakeCompletion([self.rng.randint(3, 12) for _ in range(k - 1)] + [2], [-0.5] * k)

    async def update_weights(self, path, version):
        await asyncio.sleep(self.rng.random() * 0.002)
        self.version = version
        return {"version": version}

    async def weight_version(self):
        return self.version


class FlakyStore:
    """A stand-in for ``MooncakeWeightTransport``: holds versions in a dict until ``die()``, then raises like a
    store whose master is gone (``StoreError`` is a ``RuntimeError``)."""

    name = "mooncake"

    def __init__(self):
        self.data: dict[int, dict] = {}
        self.alive = True
        self.gc_failures = 0

    def die(self):
        self.alive = False
        self.data.clear()  # a dead master loses every object

    def publish(self, sd, version):
        if not self.alive:
            raise RuntimeError("Mooncake batch_is_exist(...) failed with code -900 RPC_FAIL (master unreachable)")
        self.data[version] = dict(sd)
        return {"transport": "mooncake", "version": version}

    def is_published(self, version):
        return version in self.data

    def load(self, version):
        return list(self.data[version].items())


def store_publisher(root: Path, final_version: int):
    """``(store, publisher)``: a :class:`FlakyStore` first, the folder ``root`` as fallback, in the real
    ``RunWeightPublisher`` (mode ``"mooncake"``)."""
    from moe_rl.weights.fallback import FallbackWeightTransport, FilesystemWeightTransport
    from moe_rl.weights.publisher import RunWeightPublisher

    store = FlakyStore()
    fs = FilesystemWeightTransport(root, {"model_type": "toy"})
    chain = FallbackWeightTransport([store, fs], retry_after_s=3600.0)
    return store, RunWeightPublisher("mooncake", root, fs, chain=chain, final_version=final_version)


class StoreEngine(FakeEngine):
    """``FakeEngine`` plus the worker RPC ``update_weights_from_mooncake`` reading a :class:`FlakyStore`; every
    load is logged in ``loads`` as ``(version, source)``."""

    def __init__(self, rng: random.Random, max_latency: float, store: FlakyStore):
        super().__init__(rng, max_latency)
        self.store = store
        self.loads: list[tuple[int, str]] = []

    async def update_weights_from_mooncake(self, store_config, model, version, shard="0of1"):
        assert (model, shard) == ("policy", "0of1")
        await asyncio.sleep(self.rng.random() * 0.002)
        if not self.store.alive or version not in self.store.data:
            raise RuntimeError(f"worker: version {version} not in the store")
        self.version = version
        self.loads.append((version, "mooncake"))
        return {"version": version}

    async def update_weights(self, path, version):
        out = await super().update_weights(path, version)
        self.loads.append((version, "filesystem"))
        return out


def store_source():
    """The orchestrator's ``StoreSource`` for model ``"policy"`` (ports nothing listens on: the engine reads)."""
    from moe_rl.inference.mooncake.store import StoreClientConfig
    from moe_rl.weights.mooncake import StoreSource

    return StoreSource(StoreClientConfig(master_address="127.0.0.1:1", metadata_url="http://127.0.0.1:2/metadata"),
                       "policy")


def trainer_report(step: int, tokens: int, **extra: Any) -> dict[str, Any]:
    """A trainer step report with the fields the orchestrator reads (zero loss, 1 ms compute) plus ``extra``."""
    return {"step": step, "loss": 0.0, "mismatch_kl": 0.0, "masked_frac": 0.0, "grad_norm": 1.0, "lr": 1.0,
            "idle_s": 0.0, "compute_s": 0.001, "publish_s": 0.0, "tokens": tokens, **extra}


def run_with_trainer(orch, trainer, timeout_s: float = 60) -> dict[str, Any]:
    """Run ``orch.run()`` (at most ``timeout_s``) next to the coroutine ``trainer``; the orchestrator's summary."""

    async def main():
        t = asyncio.create_task(trainer)
        out = await asyncio.wait_for(orch.run(), timeout=timeout_s)
        await t
        return out

    return asyncio.run(main())


async def final_version_lost_trainer(paths, pub, store: FlakyStore, orch) -> None:
    """A two-step trainer whose store receives the final version 2 (announced with a folder copy) and loses it
    before the engine asks; it serves republish requests while it waits for a batch, as ``rl_trainer`` does, and
    exits after the final step (``serve_requests`` is never called again)."""
    import json

    import torch

    from moe_rl.rl.batch import batch_path

    for step in range(2):
        while not batch_path(paths.batches, step).exists():
            pub.serve_requests()
            await asyncio.sleep(0.001)
        if step == 1:
            while orch.state.engine_version < 1:
                await asyncio.sleep(0.001)
        pub.publish({"w": torch.zeros(2)}, step + 1)
        if step == 1:
            store.data.clear()
        paths.trainer_step(step).write_text(json.dumps(trainer_report(step, 1, weight_transport=pub.stats())))


def publish_folder_version(paths, version: int) -> None:
    """Write the weights folder of ``version`` under ``paths.weights`` as published (its marker, no tensors) and
    announce it, as the trainer's rank 0 does (``moe_rl.weights.announce``)."""
    from moe_rl.weights.announce import write_announcement
    from moe_rl.weights.filesystem import MARKER, version_dir

    d = version_dir(paths.weights, version)
    d.mkdir(parents=True)
    (d / MARKER).write_text("{}")
    write_announcement(paths.weights, version, "filesystem", filesystem_copy=True, path=d, layout="hf")


def finish_step(paths, step: int, tokens: int) -> None:
    """The trainer's end of ``step``: version ``step + 1`` published as a folder, then the step report."""
    import json

    publish_folder_version(paths, step + 1)
    paths.trainer_step(step).write_text(json.dumps(trainer_report(step, tokens)))
