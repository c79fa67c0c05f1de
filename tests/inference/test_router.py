"""``RequestRouter`` / ``RoutedClient`` / ``prefix_hash``.

Fast tests (no server): block hashes bit-identical to vLLM's own hasher (salt in block 0 only), the score formula
against hand-computed values, the LRU cache model, sticky sessions and their break on overload, round-robin and
least-loaded, config and hook errors, and ``RoutedClient`` over fake engines. The slow test starts 2 real vLLM
CPU servers and checks that the router's predicted prefix hits are the servers' reported ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import os
from fractions import Fraction
from types import SimpleNamespace

import pytest

from moe_rl.inference.client import Completion
from moe_rl.inference.prefix_hash import (
    cached_blocks_after,
    extend_block_hashes,
    hittable_blocks,
    prefix_block_hashes,
)
from moe_rl.inference.protocol import PrefixCacheResetError
from moe_rl.inference.routed_client import RoutedClient
from moe_rl.inference.router import RequestRouter, RouterConfig
from moe_rl.rl.salt import cache_salt_for


# ---------------------------------------------------------------------------- block hashes vs vLLM
@pytest.fixture(scope="module")
def vllm_hashes():
    """``vllm_hashes(token_ids, salt, block_size)``: vLLM's request block hasher (default sha256 algorithm)."""
    pytest.importorskip("vllm")
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")  # CacheConfig.prefix_caching_hash_algo's default
    init_none_hash(fn)

    def hashes(token_ids: list[int], salt: str | None, block_size: int) -> list[bytes]:
        # the Request attributes the hasher reads (vllm.v1.request.Request)
        req = SimpleNamespace(block_hashes=[], num_tokens=len(token_ids), all_token_ids=token_ids, mm_features=[],
                              cache_salt=salt, lora_request=None, prompt_embeds=None)  # fmt: skip
        return list(get_request_block_hasher(block_size, fn)(req))

    return hashes


@pytest.mark.vllm
@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("salt", [None, "", "v1", cache_salt_for(7, run_id="r")])
def test_block_hashes_equal_vllm(vllm_hashes, block_size, salt):
    for n in (0, 3, 4, 9, 32, 100, 257):
        ids = [(7 * i + 3) % 29 for i in range(n)]
        ours = prefix_block_hashes(ids, block_size, salt)
        assert ours == vllm_hashes(ids, salt, block_size), (n, block_size, salt)
        assert len(ours) == n // block_size


@pytest.mark.vllm
def test_salt_enters_block_0_only_and_chains(vllm_hashes):
    """vLLM's chain for salt v2 equals ours for v2; swapping in v1's block 0 and re-chaining reproduces v1 exactly,
    i.e. the salt lives in block 0 and later blocks differ only through the parent hash."""
    ids = list(range(1, 13))
    v1, v2 = vllm_hashes(ids, "v1", 4), vllm_hashes(ids, "v2", 4)
    assert all(a != b for a, b in zip(v1, v2, strict=True))  # a different salt: no block is reusable
    rechained = extend_block_hashes(v1[:1], ids, 4, cache_salt="ignored after block 0")
    assert rechained == v1
    assert prefix_block_hashes(ids, 4, "") == prefix_block_hashes(ids, 4, None) == vllm_hashes(ids, None, 4)


def test_pythonhashseed_changes_root(monkeypatch):
    ids = list(range(8))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a = prefix_block_hashes(ids, 4)
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert prefix_block_hashes(ids, 4) != a  # vLLM derives NONE_HASH from PYTHONHASHSEED when set


def test_hash_helpers():
    ids = list(range(1, 20))
    full = prefix_block_hashes(ids, 4, "s")
    assert extend_block_hashes(full[:2], ids, 4, "s") == full
    assert prefix_block_hashes(ids, 4, "s", max_blocks=2) == full[:2]
    a, b = (
        prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "s"),
        prefix_block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, "s"),
    )
    assert a[0] == b[0] and a[1] != b[1]
    # the last prompt token is always recomputed; the last sampled token's KV never exists
    assert [hittable_blocks(p, 32) for p in (0, 1, 32, 33, 64, 65)] == [0, 0, 0, 1, 1, 2]
    assert [cached_blocks_after(n, 32) for n in (32, 33, 64, 65)] == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="block_size=0"):
        prefix_block_hashes(ids, 0)
    with pytest.raises(ValueError, match="max_blocks=-1"):
        prefix_block_hashes(ids, 4, max_blocks=-1)
    with pytest.raises(ValueError, match="5 known block hashes"):
        extend_block_hashes(full + full[:1], ids, 4)
    with pytest.raises(TypeError, match="cache_salt must be a str"):
        prefix_block_hashes(ids, 4, cache_salt=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- router state helpers
def _finish(router: RequestRouter, engine: int, rid: str, seq: list[int], salt: str | None = None) -> None:
    router.on_start(engine, rid, len(seq), seq[:1], salt)
    router.on_finish(engine, rid, [seq])


def test_score_formula_hand_computed():
    """Engine 0 caches the 2 hittable blocks of the prompt and holds T=30 tokens / Q=2 requests; engine 1 holds
    T=10 / Q=1. P=9, B=(9-1)//4=2. With w=(1, 0.5, 0.5): mean T=20, mean Q=1.5,
    score0 = 1 - 0.5*30/(20+9) - 0.5*2/(1.5+1), score1 = 0 - 0.5*10/29 - 0.5*1/2.5."""
    r = RequestRouter(
        RouterConfig(block_size=4, w_reuse=1.0, w_load=0.5, w_queue=0.5, sticky_sessions=False), 2
    )
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    _finish(r, 0, "warm", prompt[:8] + [1])  # 9 tokens -> (9-1)//4 = 2 cached blocks: the prompt's first two
    r.on_start(0, "a", 20, [20, 21])
    r.on_start(0, "b", 10, [22])
    r.on_start(1, "c", 10, [23])
    d = r.route(prompt, None)
    assert d.hittable_blocks == 2 and d.predicted_hit_blocks == [2, 0]
    f = Fraction
    want0 = 1 - f(1, 2) * f(30, 29) - f(1, 2) * f(2, 1) / f(5, 2)
    want1 = 0 - f(1, 2) * f(10, 29) - f(1, 2) * f(1, 1) / f(5, 2)
    assert d.scores == pytest.approx([float(want0), float(want1)], rel=1e-12, abs=1e-15)
    assert d.engine == 0  # 0.0828 > -0.372
    # heavier load on engine 0 flips it: T0 = 30 + 60 = 90, Q0 = 3 -> mean T 50, mean Q 2
    r.on_start(0, "d", 60, [24])
    d2 = r.route(prompt, None)
    want0 = 1 - f(1, 2) * f(90, 59) - f(1, 2) * f(3, 3)
    want1 = 0 - f(1, 2) * f(10, 59) - f(1, 2) * f(1, 3)
    assert d2.scores == pytest.approx([float(want0), float(want1)], rel=1e-12, abs=1e-15)
    assert d2.engine == 1


def test_salt_isolates_predicted_reuse():
    r = RequestRouter(RouterConfig(block_size=4, sticky_sessions=False), 2)
    seq = list(range(1, 14))  # 13 tokens -> 3 cached blocks
    _finish(r, 1, "x", seq, salt="v1")
    assert r.route(seq[:13], "v1").predicted_hit_blocks == [0, 3]
    assert r.route(seq[:13], "v2").predicted_hit_blocks == [0, 0]  # other salt: nothing reusable
    assert r.route(seq[:13], None).predicted_hit_blocks == [0, 0]
    assert r.route(seq[:13], "v1").engine == 1


def test_output_blocks_enter_the_model_for_the_next_turn():
    """Turn 1: 6-token prompt + 5 output tokens -> (11-1)//4 = 2 blocks cached. Turn 2 = those 11 tokens + 4 new:
    B = (15-1)//4 = 3 hittable, 2 predicted."""
    r = RequestRouter(RouterConfig(block_size=4), 2)
    p1 = [1, 2, 3, 4, 5, 6]
    d1 = r.route(p1, "s", "sess")
    r.on_start(d1.engine, "t1", 16, decision=d1)
    out = [7, 8, 9, 10, 11]
    r.on_finish(d1.engine, "t1", [p1 + out], cached_tokens=0)
    p2 = p1 + out + [12, 13, 14, 15]
    d2 = r.route(p2, "s", "sess")
    assert d2.engine == d1.engine and d2.sticky == "hit"
    assert d2.hittable_blocks == 3 and d2.predicted_hit_blocks[d1.engine] == 2
    r.on_start(d2.engine, "t2", 20, decision=d2)
    r.on_finish(d2.engine, "t2", [p2 + [1]], cached_tokens=8)  # the engine agrees: 8 tokens = 2 blocks
    s = r.stats()
    assert s["predicted_hit_blocks"] == 2 and s["hittable_blocks"] == 1 + 3
    assert (s["observed_requests"], s["observed_cached_blocks"], s["observed_exact"]) == (2, 2, 2)
    assert s["inflight_tokens"] == [0, 0] and s["queue_depth"] == [0, 0] and s["finished"] == 2


def test_lru_capacity_eviction():
    r = RequestRouter(RouterConfig(block_size=4, cache_capacity_blocks=3, sticky_sessions=False), 1)
    a = [1] * 9  # 2 cached blocks
    b = [2] * 9
    _finish(r, 0, "a", a)
    _finish(r, 0, "b", b)  # 4 blocks > 3: a's block 0 (least recently used) is evicted
    s = r.stats()
    assert s["cached_blocks"] == [3] and s["evicted_blocks"] == [1]
    assert r.route(a, None).predicted_hit_blocks == [0]  # the chain breaks at the missing block 0
    assert r.route(b, None).predicted_hit_blocks == [2]
    _finish(r, 0, "a2", a)  # re-inserting a touches it; now b's oldest block goes
    assert r.route(a, None).predicted_hit_blocks == [2]
    assert r.route(b, None).predicted_hit_blocks == [0]
    r.reset_engine_cache(0)
    assert r.stats()["cached_blocks"] == [0]


def test_sticky_session_and_break_on_overload():
    cfg = RouterConfig(block_size=4, policy="least_loaded", overload_factor=1.5, overload_min_queue=2)
    r = RequestRouter(cfg, 2)
    d = r.route([1, 2, 3], None, "s")
    assert (d.engine, d.sticky) == (0, "new")
    # engine 0: T=30, Q=2; engine 1: T=10, Q=1 -> mean 20, 30 > 1.5*20 is false: stays pinned although
    # least_loaded alone would pick engine 1
    r.on_start(0, "a", 20, [9])
    r.on_start(0, "b", 10, [9])
    r.on_start(1, "c", 10, [9])
    d = r.route([1, 2, 3, 4], None, "s")
    assert (d.engine, d.sticky) == (0, "hit")
    assert r.route([1, 2], None).engine == 1  # no session: least loaded
    # T0 = 50 > 1.5 * mean(50, 10) = 45 and Q0 = 3 >= 2: overloaded -> break, the session moves to engine 1
    r.on_start(0, "d", 20, [9])
    d = r.route([1, 2, 3, 4, 5], None, "s")
    assert (d.engine, d.sticky) == (1, "break")
    assert r.route([1], None, "s").engine == 1  # pinned to the new engine
    s = r.stats()
    assert (s["sticky_new"], s["sticky_hits"], s["sticky_breaks"]) == (1, 2, 1)
    assert r.end_session("s") and not r.end_session("s")
    assert r.stats()["sessions"] == 0 and r.stats()["sessions_ended"] == 1


def test_one_big_request_does_not_break_stickiness():
    r = RequestRouter(RouterConfig(block_size=4, policy="least_loaded"), 2)
    assert r.route([1], None, "s").engine == 0
    r.on_start(0, "huge", 10_000, [9])  # Q0 = 1 < overload_min_queue = 2
    assert r.route([1], None, "s").sticky == "hit"


def test_max_sessions_evicts_oldest():
    r = RequestRouter(RouterConfig(block_size=4, policy="round_robin", max_sessions=2), 3)
    for s in ("a", "b", "c"):
        r.route([1], None, s)
    assert r.stats()["sessions"] == 2 and r.stats()["sessions_evicted"] == 1
    assert r.route([1], None, "a").sticky == "new"  # forgotten


def test_round_robin_ignores_cache_and_load():
    r = RequestRouter(RouterConfig(block_size=4, policy="round_robin", sticky_sessions=False), 3)
    seq = list(range(1, 14))
    _finish(r, 2, "w", seq)
    r.on_start(0, "busy", 1000, [5])
    assert [r.choose(seq, None) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert r.stats()["routed"] == [3, 2, 2]


def test_ties_fill_idle_engines_in_turn_and_least_loaded():
    r = RequestRouter(RouterConfig(block_size=4, sticky_sessions=False), 3)
    assert [r.choose([1, 2], None) for _ in range(4)] == [0, 1, 2, 0]  # equal scores: fewest routed first
    ll = RequestRouter(RouterConfig(block_size=4, policy="least_loaded", sticky_sessions=False), 3)
    ll.on_start(0, "a", 5, [1])
    ll.on_start(1, "b", 3, [1])
    ll.on_start(2, "c", 3, [1])
    ll.on_start(2, "d", 1, [1])  # engine 2: T=4 > engine 1: T=3
    assert ll.choose([1], None) == 1


def test_failed_request_releases_load_without_inserting():
    r = RequestRouter(RouterConfig(block_size=4), 1)
    r.on_start(0, "x", 40, [1, 2, 3, 4, 5])  # prompt block [1..4] inserted at start
    r.on_finish(0, "x", [list(range(1, 14))], failed=True)
    s = r.stats()
    assert (
        s["failed"] == 1 and s["finished"] == 0 and s["inflight_tokens"] == [0] and s["cached_blocks"] == [1]
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"cache_capacity_blocks": 0}, "cache_capacity_blocks"),
        ({"w_load": -1.0}, "w_load"),
        ({"overload_factor": 1.0}, "overload_factor"),
        ({"overload_min_queue": 0}, "overload_min_queue"),
        ({"policy": "random"}, "policy"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"w_reuse": 0.0, "w_load": 0.0, "w_queue": 0.0}, "w_reuse = w_load = w_queue = 0"),
        ({"w_queue": True}, "w_queue"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)


def test_hook_errors():
    with pytest.raises(ValueError, match="num_engines=0"):
        RequestRouter(RouterConfig(), 0)
    r = RequestRouter(RouterConfig(block_size=4), 2)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        r.route([], None)
    with pytest.raises(ValueError, match=r"engine=2 must be an int in \[0, 2\)"):
        r.on_start(2, "x", 5, [1])
    with pytest.raises(ValueError, match="n_tokens=0"):
        r.on_start(0, "x", 0, [1])
    with pytest.raises(ValueError, match="pass decision="):
        r.on_start(0, "x", 5)
    r.on_start(0, "x", 5, [1])
    with pytest.raises(ValueError, match="already in flight"):
        r.on_start(1, "x", 5, [1])
    with pytest.raises(ValueError, match="started on engine 0, not engine=1"):
        r.on_finish(1, "x")
    r.on_finish(0, "x")
    with pytest.raises(ValueError, match="is not in flight"):
        r.on_finish(0, "x")


# ---------------------------------------------------------------------------- RoutedClient over fake engines
class _FakeEngine:
    """Answers like ``VllmClient.generate``: n completions of ``max_tokens`` copies of its index, and the
    ``cached_tokens`` it is told to report; can be told to fail."""

    def __init__(self, index: int):
        self.index, self.calls, self.cached, self.fail = index, [], 0, False

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt=None, seed=None,
                       stop_token_ids=None, extra_body=None):  # fmt: skip
        self.calls.append({"prompt_ids": list(prompt_ids), "n": n, "cache_salt": cache_salt, "seed": seed,
                           "extra_body": extra_body})  # fmt: skip
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("engine down")
        comps = [Completion([self.index] * max_tokens, [-0.5] * max_tokens, "length") for _ in range(n)]
        return comps, self.cached

    async def aclose(self):
        pass

    async def update_weights(self, path, version):
        self.version = version
        return {"path": path, "engine": self.index}

    async def weight_version(self):
        return getattr(self, "version", 0)

    async def pause(self, mode="keep", clear_cache=False):
        self.paused = (mode, clear_cache)

    async def resume(self):
        self.paused = None

    async def is_paused(self):
        return getattr(self, "paused", None) is not None

    async def reset_prefix_cache(self, reset_running_requests=False):
        return self.index != 1 or not self.fail

    async def health(self):
        return not self.fail


def test_routed_client_calls_the_hooks():
    engines = [_FakeEngine(0), _FakeEngine(1)]
    router = RequestRouter(RouterConfig(block_size=4), 2)
    client = RoutedClient(engines, router)  # type: ignore[arg-type]

    async def body():
        p1 = [3, 4, 5, 6, 7, 8]
        r1 = await client.generate_routed(p1, 2, 4, 1.0, cache_salt="s", seed=5, session_id="a",
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert r1.engine == 0 and r1.predicted_hit_blocks == 0
        assert engines[0].calls[0]["seed"] == 5 and engines[0].calls[0]["extra_body"] == {"ignore_eos": True}
        other = await client.generate([9, 9, 9], 1, 2, 0.0)  # another engine (ties: fewest routed)
        assert len(other[0]) == 1 and engines[1].calls
        # turn 2 of session a: previous prompt + output (4 x token 0) + 3 new -> (6+4-1)//4 = 2 cached blocks
        engines[0].cached = 8
        p2 = p1 + [0, 0, 0, 0] + [10, 11, 12]
        r2 = await client.generate_routed(p2, 1, 4, 1.0, cache_salt="s", session_id="a")
        assert r2.engine == 0 and r2.predicted_hit_blocks == 2 and r2.cached_tokens == 8
        engines[1].fail = True
        with pytest.raises(RuntimeError, match="engine down"):
            await client.generate([9, 9, 9, 9, 9], 1, 2, 0.0, session_id="b")
        await client.aclose()

    asyncio.run(body())
    s = router.stats()
    assert s["failed"] == 1 and s["finished"] == 3 and s["inflight_tokens"] == [0, 0] and s["inflight"] == 0
    assert s["observed_exact"] == 3 and s["routed"] == [2, 2]
    with pytest.raises(ValueError, match="num_engines=2 but 3 clients"):
        RoutedClient([_FakeEngine(0)] * 3, router)  # type: ignore[list-item]


@pytest.mark.parametrize("args, pattern", [
    (([], 1, 4, 1.0), r"prompt_ids=\[\] is empty"),
    (([3], 0, 4, 1.0), r"n=0 must be >= 1"),
    (([3], 1, 0, 1.0), r"max_tokens=0 must be >= 1"),
    (([3], 1, 4, -0.5), r"temperature=-0.5 must be >= 0"),
])  # fmt: skip
def test_routed_client_checks_the_arguments_before_routing(args, pattern):
    """``RoutedClient.generate`` applies ``check_generate_args`` (the contract's checks) before it routes: no
    engine is called and the router records nothing."""
    engines = [_FakeEngine(0), _FakeEngine(1)]
    router = RequestRouter(RouterConfig(block_size=4), 2)
    client = RoutedClient(engines, router)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"RoutedClient\.generate: {pattern}"):
        asyncio.run(client.generate(*args))
    assert not engines[0].calls and not engines[1].calls
    assert router.stats()["routed"] == [0, 0] and router.stats()["inflight"] == 0


def test_generate_rejects_an_unknown_option_before_routing():
    """The options are keyword-only ``GenerateOptions`` fields: a misspelt one (``cache_sal``) raises TypeError
    naming it, instead of being dropped (the request would otherwise run unsalted)."""
    engines = [_FakeEngine(0), _FakeEngine(1)]
    client = RoutedClient(engines, RequestRouter(RouterConfig(block_size=4), 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"RoutedClient\.generate: unexpected keyword arguments \['cache_sal'\]"):
        asyncio.run(client.generate([3, 4], 1, 4, 1.0, cache_sal="s"))  # type: ignore[call-arg]
    with pytest.raises(TypeError):  # keyword-only: a positional salt is not taken for session_id
        asyncio.run(client.generate([3, 4], 1, 4, 1.0, "s"))  # type: ignore[misc]
    assert not engines[0].calls and not engines[1].calls


# ---------------------------------------------------------------------------- 2 real vLLM servers
@pytest.fixture(scope="module")
def two_servers(tiny_moe_dirs, tmp_path_factory, shared_vllm_server):
    """The session's shared server (``v1``, core 0) and one more on core 1 (same weights and block size; the KV
    size does not matter here), so the module starts one server instead of two."""
    pytest.importorskip("vllm")
    from moe_rl.inference import VllmServer, VllmServerConfig

    cores = sorted(os.sched_getaffinity(0))
    pin = [cores[1]] if len(cores) >= 2 else None
    second = VllmServer(VllmServerConfig(cpu_affinity=pin, max_model_len=256, kv_cache_memory_bytes=32 * 2**20,
                                         startup_timeout_s=300), tiny_moe_dirs["v1"],
                        tmp_path_factory.mktemp("router_servers") / "s1.log")  # fmt: skip
    second.start()
    try:
        first = shared_vllm_server.get()  # starts (or checks) the shared one while the second loads
        second.wait_ready()
        yield [first, second]
    finally:
        second.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_two_turn_session_hits_on_real_servers(two_servers):
    """Turn 1 (70 tokens + 12 sampled), turn 2 = turn 1 + output + 20 new tokens (102): the router keeps the
    session on turn 1's engine and predicts (82-1)//32 = 2 hit blocks; the server reports 64 cached tokens. The
    same turn-2 prompt under another cache_salt hits nothing, predicted and observed."""
    from moe_rl.inference import VllmClient

    prompt1 = [1] + [3 + (7 * i) % 13 for i in range(69)]
    new_user = [3 + (5 * i) % 13 for i in range(20)]

    async def body():
        clients = [VllmClient(s.base_url, track_token_versions=False) for s in two_servers]
        router = RequestRouter(RouterConfig(block_size=32), 2)
        async with RoutedClient(clients, router) as rc:
            t1 = await rc.generate_routed(prompt1, 1, 12, 1.0, cache_salt="salt-a", seed=1, session_id="s",
                                          extra_body={"ignore_eos": True})  # fmt: skip
            prompt2 = prompt1 + t1.completions[0].token_ids + new_user
            t2 = await rc.generate_routed(prompt2, 1, 4, 1.0, cache_salt="salt-a", seed=2, session_id="s")
            other = await rc.generate_routed(prompt2, 1, 4, 1.0, cache_salt="salt-b", seed=2)
        return t1, t2, other, router.stats()

    t1, t2, other, stats = asyncio.run(body())
    assert t1.cached_tokens == 0 and t1.predicted_hit_blocks == 0
    assert t2.engine == t1.engine
    assert t2.predicted_hit_blocks == 2
    assert t2.cached_tokens == 64 > 0
    assert other.predicted_hit_blocks == 0 and other.cached_tokens == 0
    assert stats["observed_exact"] == 3 and stats["sticky_hits"] == 1


def test_routed_client_fans_engine_calls_out():
    from moe_rl.inference.protocol import InferenceClient

    engines = [_FakeEngine(0), _FakeEngine(1)]
    router = RequestRouter(RouterConfig(block_size=4, sticky_sessions=False), 2)
    client = RoutedClient(engines, router)  # type: ignore[arg-type]
    assert isinstance(client, InferenceClient)
    seq = list(range(1, 14))
    _finish(router, 0, "w0", seq)
    _finish(router, 1, "w1", seq)

    async def body():
        report = await client.update_weights("/w/step_3", 3)
        assert report == {
            "version": 3,
            "engines": [{"path": "/w/step_3", "engine": 0}, {"path": "/w/step_3", "engine": 1}],
        }
        assert await client.weight_version() == 3
        engines[1].version = 2
        with pytest.raises(RuntimeError, match=r"different versions \[3, 2\]"):
            await client.weight_version()
        await client.pause()
        assert await client.is_paused() and engines[1].paused == ("keep", False)
        await client.resume()
        assert not await client.is_paused()
        engines[1].fail = True  # engine 1 cannot reset: its cache model is kept, and the failure raises
        with pytest.raises(PrefixCacheResetError, match=r"engines \[1\] of \d+ did not reset"):
            await client.reset_prefix_cache()
        assert not await client.health()
        assert router.stats()["cached_blocks"] == [0, 3]
        engines[1].fail = False
        assert await client.reset_prefix_cache() and await client.health()
        assert router.stats()["cached_blocks"] == [0, 0]
        # An engine that raises: the engines that did reset are still forgotten, then the error propagates.
        _finish(router, 0, "w0", seq)
        _finish(router, 1, "w1", seq)

        async def boom(reset_running_requests=False):
            raise ConnectionError("engine 1 unreachable")

        engines[1].reset_prefix_cache = boom
        with pytest.raises(ConnectionError, match="unreachable"):
            await client.reset_prefix_cache()
        assert router.stats()["cached_blocks"] == [0, 3]

    asyncio.run(body())


def test_vllm_client_sends_the_session_as_x_session_id():
    """The ``session_id`` option reaches the wire as ``X-Session-ID`` (what vllm-router's ``consistent_hash`` and
    sticky policies key on) and is not put in the body; without it no such header is sent."""
    import httpx

    from moe_rl.inference import VllmClient

    seen: list[tuple[str | None, dict]] = []

    def handler(request):
        seen.append((request.headers.get("x-session-id"), json.loads(request.content)))
        choice = {"index": 0, "token_ids": [7, 8], "finish_reason": "length",
                  "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -0.25]}}
        return httpx.Response(200, json={"choices": [choice], "usage": {}})

    async def main():
        client = VllmClient("http://router:30000", track_token_versions=False)
        client._http._transport = httpx.MockTransport(handler)
        try:
            (a,), _ = await client.generate([1, 2, 3], 1, 2, 1.0, session_id="rollout-7", cache_salt="s")
            (b,), _ = await client.generate([1, 2, 3], 1, 2, 1.0)
        finally:
            await client.aclose()
        return a, b

    a, b = asyncio.run(main())
    assert a.token_ids == b.token_ids == [7, 8]
    assert [h for h, _ in seen] == ["rollout-7", None]
    assert all("session_id" not in body for _, body in seen) and seen[0][1]["cache_salt"] == "s"
