"""N10: a prefix-cache reset refused while requests run must fail loudly; salting needs no reset.

Engine side: a fake vLLM ``/reset_prefix_cache`` endpoint with vLLM 0.32's semantics (``Scheduler.reset_prefix_cache``:
with running requests holding blocks the reset is refused, ``{"success": false}``; with
``reset_running_requests=true`` the running requests are preempted back to the waiting queue, keep their generated
tokens, and the hash table empties), over a block pool of block size 16 whose block hashes are moe_rl's
:func:`moe_rl.inference.prefix_hash.prefix_block_hashes` (vLLM's own hash chain). Prefix P = 48 tokens = 3 blocks,
cached, and held by running request R1; weights go v1 -> v2; then R2 arrives with prefix P.

Library behaviour under test:

* :meth:`moe_rl.inference.VllmClient.reset_prefix_cache` raises ``PrefixCacheResetError`` when the engine refuses
  (and when its answer cannot confirm a reset), never returns False; with ``reset_running_requests=True`` the reset
  succeeds while R1 runs, R1 is requeued with its tokens, and R2 gets 0 cached tokens (never 48);
* :func:`moe_rl.weights.push.push_weights` resets with ``reset_running_requests=True`` and turns an engine whose
  reset does not complete into an error for that engine (and :class:`RoutedClient` raises too, in
  ``tests/inference/test_router.py``);
* salt policy (:func:`moe_rl.rl.cache_salt_for`): no reset; R2 carries the v2 salt, none of its block hashes equals a
  v1 block, so it gets 0 cached tokens while R1 keeps its v1 KV (its tokens are recorded as mixed-version by
  ``moe_rl.inference.token_versions``, covered in the inference tests).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from moe_rl.inference import PrefixCacheResetError, VllmClient
from moe_rl.inference.prefix_hash import hittable_blocks, prefix_block_hashes
from moe_rl.rl import cache_salt_for
from moe_rl.weights.push import push_weights

BS = 16
P = [1] + [3 + (7 * i) % 11 for i in range(47)]  # 48 tokens = 3 full blocks


class FakeVllmEngine:
    """The block-pool state vLLM keeps, behind an ``httpx.MockTransport``."""

    def __init__(self, salt: str | None = None) -> None:
        self.cached: set[bytes] = set(prefix_block_hashes(P, BS, salt))  # P's 3 blocks, computed under v1
        self.running = {"R1": {"tokens": P + [5, 6, 7, 8], "holds": len(self.cached) + 1}}  # + a decode block
        self.waiting: dict[str, dict] = {}
        self.answer: object = None  # override the JSON answer (a stub endpoint)

    def cached_tokens(self, prompt: list[int], salt: str | None) -> int:
        n = 0
        for h in prefix_block_hashes(prompt, BS, salt, max_blocks=hittable_blocks(len(prompt), BS)):
            if h not in self.cached:
                break
            n += 1
        return n * BS

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/reset_prefix_cache"
        if self.answer is not None:
            return httpx.Response(200, content=json.dumps(self.answer).encode())
        if request.url.params.get("reset_running_requests") == "true":
            self.waiting.update(self.running)  # preempted: tokens kept, KV recomputed later
            self.running.clear()
        if any(r["holds"] for r in self.running.values()):
            return httpx.Response(200, json={"success": False})
        self.cached.clear()
        return httpx.Response(200, json={"success": True})


def _client(engine: FakeVllmEngine) -> VllmClient:
    client = VllmClient("http://engine:8000")
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handle), base_url="http://engine:8000")
    return client


def test_n10_reset_refused_while_r1_runs_raises():
    engine = FakeVllmEngine()
    with pytest.raises(PrefixCacheResetError, match="pass reset_running_requests=True"):
        asyncio.run(_client(engine).reset_prefix_cache())
    assert engine.cached_tokens(P + [9, 9], None) == 48  # the refused reset left the stale KV in place


def test_n10_reset_with_running_requests_succeeds_and_r2_hits_nothing():
    engine = FakeVllmEngine()
    assert asyncio.run(_client(engine).reset_prefix_cache(reset_running_requests=True)) is True
    assert engine.cached == set()
    assert "R1" in engine.waiting and engine.waiting["R1"]["tokens"][-4:] == [5, 6, 7, 8]  # requeued, tokens kept
    assert engine.cached_tokens(P + [9, 9], None) == 0


@pytest.mark.parametrize("answer", [{}, {"success": "yes"}, []])
def test_n10_unconfirmed_reset_raises(answer):
    engine = FakeVllmEngine()
    engine.answer = answer
    with pytest.raises(PrefixCacheResetError, match="cannot be confirmed"):
        asyncio.run(_client(engine).reset_prefix_cache(reset_running_requests=True))


class _Engine:
    """An ``InferenceClient`` for ``push_weights``: update, then a reset that returns ``reset_result``."""

    def __init__(self, reset_result: object) -> None:
        self.version, self.reset_result, self.reset_calls = 1, reset_result, []

    async def update_weights(self, path: str, version: int) -> dict:
        self.version = version
        return {"version": version}

    async def weight_version(self) -> int:
        return self.version

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> object:
        self.reset_calls.append(reset_running_requests)
        if isinstance(self.reset_result, BaseException):
            raise self.reset_result
        return self.reset_result

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None: ...

    async def resume(self) -> None: ...

    async def generate(self, *a, **k): ...

    async def is_paused(self) -> bool:
        return False

    async def health(self) -> bool:
        return True


def test_n10_push_weights_turns_an_incomplete_reset_into_an_error():
    engines = {"ok": _Engine(True), "false": _Engine(False),
               "raises": _Engine(PrefixCacheResetError("blocks still held"))}
    out = asyncio.run(push_weights(engines, "/w/step_2", 2, reset_prefix_cache=True))
    assert all(e.reset_calls == [True] for e in engines.values())  # always with running requests preempted
    assert out["results"] == {"ok": {"version": 2, "prefix_cache_reset": True}}
    assert set(out["errors"]) == {"false", "raises"}
    assert out["errors"]["false"].startswith("PrefixCacheResetError")


def test_n10_salt_policy_needs_no_reset():
    v1, v2 = cache_salt_for(1), cache_salt_for(2)
    assert v1 != v2
    engine = FakeVllmEngine(salt=v1)  # P cached under v1's salt, R1 still running on its v1 KV
    assert engine.cached_tokens(P + [9, 9], v1) == 48  # the same version would hit all 3 blocks
    assert engine.cached_tokens(P + [9, 9], v2) == 0  # R2 under v2: no block of v1 matches
    assert set(prefix_block_hashes(P, BS, v2)).isdisjoint(prefix_block_hashes(P, BS, v1))
    assert "R1" in engine.running  # nothing was reset or preempted
