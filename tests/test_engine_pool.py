"""Engine faults without vLLM: the router's availability mask, re-queued drops, per-engine cores and the
``EnginePool`` (death during a request or a load, rejoin at the current version). The end-to-end run that kills a
real engine is ``tests/test_e2e_engine_faults.py``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from moe_rl.inference import RequestRouter, RouterConfig
from moe_rl.inference.client import Completion
from moe_rl.rl.buffer import AsyncRolloutBuffer
from moe_rl.runtime.engine_pool import EngineDied, EnginePool, _Slot, engine_cores


# ---------------------------------------------------------------------------------------------- router
@pytest.mark.parametrize("policy", ["score", "round_robin", "least_loaded"])
def test_router_never_chooses_an_unavailable_engine(policy):
    r = RequestRouter(RouterConfig(block_size=4, policy=policy), 3)
    r.set_available(1, False)
    chosen = []
    for k in range(12):
        d = r.route([1, 2, 3, k], "s")
        r.on_start(d.engine, f"r{k}", 8, decision=d)
        chosen.append(d.engine)
    assert set(chosen) == {0, 2} and r.stats()["available"] == [True, False, True]
    r.set_available(1, True)
    d = r.route([9, 9], "s")  # the idle engine that came back is the least loaded
    assert d.engine == 1 or policy == "round_robin"


def test_router_moves_a_session_off_an_unavailable_engine_and_refuses_when_none_is_left():
    r = RequestRouter(RouterConfig(block_size=4), 2)
    first = r.route([1, 2, 3], "s", session_id="a").engine
    r.set_available(first, False)
    d = r.route([1, 2, 3, 4], "s", session_id="a")
    assert d.engine != first and d.sticky == "break"
    r.set_available(1 - first, False)
    with pytest.raises(RuntimeError, match="no engine is available"):
        r.route([1], "s")
    with pytest.raises(ValueError, match="available=1 must be True or False"):
        r.set_available(0, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- buffer
def test_a_group_failed_with_requeue_is_dropped_and_its_prompt_retried():
    buf = AsyncRolloutBuffer(1, max_retries=1)
    buf.start(0, 0, 8, prompt="p")
    buf.fail(0, "engine_died", requeue=True)
    c = buf.counters
    c.check()
    assert (c.started, c.dropped, c.dropped_by_reason, c.retried) == (8, 8, {"engine_died": 8}, 1)
    assert buf.next_retry() == ("p", 1)
    buf.start(1, 0, 8, prompt="p", retries=1)
    buf.fail(1, "engine_died", requeue=True)  # retries spent: abandoned, not re-queued
    assert buf.next_retry() is None and buf.counters.abandoned == 1
    buf.start(2, 0, 8, prompt="q")
    buf.fail(2, "error")  # the default rule: only staleness re-queues
    assert buf.next_retry() is None


# ---------------------------------------------------------------------------------------------- cores
def test_engine_cores_split_the_cores_and_share_only_when_too_few():
    assert [engine_cores([0, 1], i, 2) for i in range(2)] == [[0], [1]]
    assert [engine_cores([0, 1, 2, 3], i, 2) for i in range(2)] == [[0, 2], [1, 3]]
    assert [engine_cores([0], i, 2) for i in range(2)] == [[0], [0]]
    assert engine_cores(None, 1, 2) is None
    assert engine_cores([5], 0, 1) == [5]


# ---------------------------------------------------------------------------------------------- pool
class _Server:
    def __init__(self, pid: int):
        self.pid = pid
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class _Client:
    """A fake engine: ``version`` loaded; ``dies`` kills its server when the next call arrives."""

    return_routed_experts = False

    def __init__(self, server: _Server, version: int = 0):
        self.server, self.version, self.calls = server, version, []
        self.routed_experts_counts = {"complete": 0}
        self.dies = False
        self.hold: asyncio.Event | None = None

    async def _call(self, what: str):
        self.calls.append(what)
        if self.hold is not None:
            await self.hold.wait()
        if self.dies:
            self.server.code = -9
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    async def generate(self, prompt_ids, n, max_tokens, temperature, **options):
        await self._call("generate")
        return [Completion([self.version], [0.0], "length")] * n, 0

    async def load_sharded(self, path, version):
        await self._call(f"load {version}")
        self.version = version
        return {"version": version, "reload_s": 0.01 * version, "path": path}

    async def weight_version(self):
        await self._call("weight_version")
        return self.version

    async def aclose(self):
        pass


def _pool(n: int = 2) -> EnginePool:
    slots = [_Slot(i, _Server(100 + i)) for i in range(n)]
    for s in slots:
        s.client = _Client(s.server)
    pool = EnginePool(slots, block_size=4)
    for s in slots:
        pool.set_live(s.index)
    return pool


def test_a_request_on_a_dying_engine_raises_engine_died_and_routing_skips_it():
    async def main():
        pool = _pool()
        pool.slots[1].client.dies = True
        results = await asyncio.gather(*(pool.generate([1, 2, k], 1, 2, 1.0, cache_salt="s") for k in range(4)),
                                       return_exceptions=True)
        died = [r for r in results if isinstance(r, EngineDied)]
        assert died and all(d.engine == 1 and d.exit_code == -9 for d in died)
        assert pool.live() == [0] and pool.counts["deaths"] == 1
        assert pool.events[0]["event"] == "died" and pool.events[0]["detected_by"] == "request"
        sent = len(pool.slots[1].client.calls)
        for k in range(4):  # everything now goes to engine 0
            comps, _ = await pool.generate([3, 4, k], 1, 2, 1.0)
            assert comps[0].token_ids == [0]
        assert len(pool.slots[1].client.calls) == sent
        assert pool.fault_counters() == {"engines_live": 1, "engine_deaths": 1, "engine_restarts": 0,
                                         "engine_restart_failures": 0}

    asyncio.run(main())


def test_a_load_that_loses_an_engine_succeeds_and_a_restarted_engine_rejoins_at_the_current_version():
    async def main():
        pool = _pool()
        pool.slots[1].client.dies = True
        info = await pool.load_sharded("/w/step_3", 3)  # engine 1 dies during the load: not a failed load
        assert info["version"] == 3 and pool.version == 3 and pool.live() == [0]
        # the restarted engine (fresh server at version 0) replays the load, then its probe must say 3
        s = pool.slots[1]
        s.server, s.generation, s.state = _Server(200), 1, "restarting"
        s.client = _Client(s.server)
        event = await pool.rejoin(1)
        assert s.client.calls == ["load 3", "weight_version"]
        assert (event["version"], event["served_version"], event["current_version"]) == (3, 3, 3)
        assert pool.live() == [0, 1] and s.requests == 0 and round(s.t_live, 3) == event["t_live"]
        assert await pool.weight_version() == 3

    asyncio.run(main())


def test_a_rejoin_that_is_overtaken_by_a_newer_version_loads_that_one_before_it_serves():
    async def main():
        pool = _pool()
        await pool.load_sharded("/w/step_1", 1)
        s = pool.slots[1]
        s.server.code = -9
        pool.mark_dead(1, -9, "process_exit")
        s.server, s.generation, s.state = _Server(200), 1, "restarting"
        s.client = _Client(s.server)
        s.client.hold = asyncio.Event()
        rejoin = asyncio.create_task(pool.rejoin(1))
        await asyncio.sleep(0.01)  # the restarted engine is loading version 1 ...
        await pool.load_sharded("/w/step_2", 2)  # ... when the run moves to version 2 (engine 0 only)
        s.client.hold.set()
        event = await rejoin
        assert s.client.calls == ["load 1", "load 2", "weight_version"]
        assert event["version"] == event["served_version"] == 2 and event["loads"] == 2

    asyncio.run(main())


def test_a_rejoin_whose_probe_disagrees_is_refused():
    async def main():
        pool = _pool(1)
        await pool.load_sharded("/w/step_4", 4)
        s = pool.slots[0]
        pool.mark_dead(0, -9, "process_exit")
        s.state, s.client = "restarting", _Client(s.server)

        async def stuck(path, version):  # the load "succeeds" but the engine keeps its old weights
            return {"version": version}

        s.client.load_sharded = stuck
        with pytest.raises(RuntimeError, match="serves weights version 0 after loading version 4"):
            await pool.rejoin(0)
        assert pool.live() == []

    asyncio.run(main())


def test_several_engines_need_the_filesystem_transport(tmp_path):
    from moe_rl.runtime.config import RLConfig

    with pytest.raises(ValueError, match="inference.num_engines=2 needs trainer.weight_transport='filesystem'"):
        RLConfig(output_dir=tmp_path / "r", inference={"num_engines": 2}, trainer={"weight_transport": "broadcast"})
    assert RLConfig(output_dir=tmp_path / "r", inference={"num_engines": 2}).inference.num_engines == 2
