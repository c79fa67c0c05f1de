"""``InferenceClient``: ``VllmClient`` satisfies it, a fake second engine does too, and ``push_weights`` (written
against the protocol only) drives both kinds: pause -> update -> resume on every engine, failures reported, the
skew check run. No server needed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from moe_rl.inference import Completion, VllmClient
from moe_rl.inference.protocol import InferenceClient
from moe_rl.inference.version_skew import VersionSkewMonitor
from moe_rl.weights.push import push_weights


class FakeEngine:
    """A second ``InferenceClient``: records calls; ``generate`` echoes the prompt reversed."""

    def __init__(self, fail_update: bool = False):
        self.version, self.paused, self.fail_update = 0, False, fail_update
        self.calls: list[str] = []

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       cache_salt: str | None = None, seed: int | None = None,
                       stop_token_ids: list[int] | None = None,
                       extra_body: dict[str, Any] | None = None) -> tuple[list[Completion], int]:  # fmt: skip
        self.calls.append(f"generate:{cache_salt}")
        toks = list(reversed(prompt_ids))[:max_tokens]
        return [Completion(toks, [0.0] * len(toks), "length", [(self.version, 0)]) for _ in range(n)], 0

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        self.calls.append(f"update:{version}:paused={self.paused}")
        if self.fail_update:
            raise RuntimeError(f"cannot read {path}")
        self.version = version
        return {"version": version}

    async def weight_version(self) -> int:
        return self.version

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        self.calls.append(f"pause:{mode}:{clear_cache}")
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(f"reset:{reset_running_requests}")
        return True

    async def health(self) -> bool:
        return True


class MissingPause(FakeEngine):
    pause = None  # type: ignore[assignment]


def test_vllm_client_and_fake_satisfy_protocol():
    async def make() -> VllmClient:
        return VllmClient("http://127.0.0.1:1")

    client = asyncio.run(make())
    try:
        assert isinstance(client, InferenceClient)
    finally:
        asyncio.run(client.aclose())
    assert isinstance(FakeEngine(), InferenceClient)
    assert not isinstance(object(), InferenceClient)
    assert not isinstance(MissingPause(), InferenceClient)  # one method missing is enough to fail


def test_vllm_client_pause_rejects_unknown_mode():
    async def body():
        async with VllmClient("http://127.0.0.1:1") as client:
            with pytest.raises(ValueError, match="mode='drain' must be 'keep', 'wait' or 'abort'"):
                await client.pause(mode="drain")

    asyncio.run(body())


def test_push_weights_through_the_protocol_only():
    good, bad = FakeEngine(), FakeEngine(fail_update=True)
    monitor = VersionSkewMonitor(max_skew=0)

    async def body():
        first = await push_weights({"good": good, "bad": bad}, "/w/step_3", 3, reset_prefix_cache=True,
                                   monitor=monitor)  # fmt: skip
        (comp,), _ = await good.generate([1, 2, 3], n=1, max_tokens=2, temperature=0.0, cache_salt="v3")
        return first, comp, await good.is_paused(), await bad.is_paused()

    first, comp, good_paused, bad_paused = asyncio.run(body())
    assert good.calls[:4] == ["pause:keep:False", "update:3:paused=True", "reset:True", "resume"]
    assert bad.calls == ["pause:keep:False", "update:3:paused=True", "resume"]  # resumed despite the failure
    assert not good_paused and not bad_paused
    assert first["results"] == {"good": {"version": 3, "prefix_cache_reset": True}}
    assert first["errors"] == {"bad": "RuntimeError: cannot read /w/step_3"}
    assert not first["skew"].ok and first["skew"].lagging == {"bad": 3} and first["skew"].skew == 3
    assert comp.token_ids == [3, 2] and comp.version_segments == [(3, 0)]
    assert monitor.stats["violations"] == 1
    with pytest.raises(ValueError, match="pause_mode='soft'"):
        asyncio.run(push_weights({"good": good}, "/w", 1, pause_mode="soft"))


def test_push_without_pause():
    e = FakeEngine()
    out = asyncio.run(push_weights({"e": e}, "/w/step_1", 1, pause_mode=None))
    assert e.calls == ["update:1:paused=False"] and out["skew"].ok and out["errors"] == {}
