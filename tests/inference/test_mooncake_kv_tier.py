"""The Mooncake KV tier (``moe_rl.inference.mooncake.kv_connector``) in a real vLLM CPU engine and a real master.

The engine runs in this process (``vllm_engine``: scheduler and worker here, so the connector's counters are read
with ``kv_tier_stats()``). "A second engine" is the same engine after ``reset_prefix_cache()``: its paged cache no
longer holds the prompt, so whatever it does not recompute comes from the store. Pinned down:

- a prompt computed under salt ``a`` is stored (2 full blocks of a 70-token prompt, block size 32); after the reset,
  the same prompt under ``a`` loads both blocks from the store, and its greedy tokens and log-probs are bit-equal to
  the same engine serving the prompt from its own prefix cache (the same arithmetic on the same KV bytes), tokens
  equal to the first full recompute; under salt ``b`` the lookup misses and the prompt is recomputed;
- with the stored blocks replaced by halved copies, the output changes (the loaded KV is really used);
- with the master stopped, requests succeed (recompute) and the failure counters rise; after a master restart on
  the same ports (empty store) requests still succeed.

Mooncake missing skips the module (``MOE_RL_REQUIRE_MOONCAKE=1`` fails it instead).
"""

from __future__ import annotations

import socket

import pytest

from moe_rl.inference.mooncake.keys import StoreKey, kv_block_key, kv_chain_hashes

BLOCK = 32
N = 8


# ---------------------------------------------------------------------- keys (no engine, no master)
_BASE = dict(model="tiny-moe", cache_salt="moe_rl-v3-float32", weight_version=3, kv_dtype="float32", block_size=32,
             layout="abc123", rank=0, world=2, chain_hash="00ff")


@pytest.mark.parametrize(
    ("field", "other"),
    [("model", "other-moe"), ("cache_salt", "moe_rl-v4-float32"), ("cache_salt", None), ("weight_version", 4),
     ("weight_version", None), ("kv_dtype", "bfloat16"), ("block_size", 16), ("layout", "def456"), ("rank", 1),
     ("world", 4), ("chain_hash", "00fe")],
)
def test_kv_key_changes_with_every_field(field, other):
    base = kv_block_key(**_BASE).to_str()
    changed = kv_block_key(**{**_BASE, field: other}).to_str()
    assert changed != base
    assert StoreKey.parse(base) == kv_block_key(**_BASE) and StoreKey.parse(base).kind == "kv"


def test_kv_key_hides_salt_text_and_validates():
    key = kv_block_key(**{**_BASE, "cache_salt": "a salt | with separators"}).to_str()
    assert "separators" not in key and len(key.split("|")) == 9
    with pytest.raises(ValueError, match="weight_version=-1"):
        kv_block_key(**{**_BASE, "weight_version": -1})
    with pytest.raises(ValueError, match="block_size=0"):
        kv_block_key(**{**_BASE, "block_size": 0})
    with pytest.raises(ValueError, match="rank=2, world=2"):
        kv_block_key(**{**_BASE, "rank": 2})


def test_chain_hash_covers_the_whole_prefix():
    a = list(range(96))
    b = list(a)
    b[5] = 999  # differs in block 0 only
    ha, hb = kv_chain_hashes(a, 32, 3), kv_chain_hashes(b, 32, 3)
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # block 0's change reaches every later digest
    c = a[:64] + [7] * 32
    assert kv_chain_hashes(c, 32, 3)[:2] == ha[:2] and kv_chain_hashes(c, 32, 3)[2] != ha[2]
    assert kv_chain_hashes(a, 32, 2) == ha[:2]
    with pytest.raises(ValueError, match="exceeds"):
        kv_chain_hashes(a, 32, 4)
    with pytest.raises(ValueError, match="block_size=0 must be an int >= 1"):
        kv_chain_hashes(a, 0, 1)
    for bad in ([1.5, 2], ["a", "b"], [2**70, 1]):
        with pytest.raises(ValueError, match=r"token_ids\[0:2\] = .* must be ints"):
            kv_chain_hashes(bad, 2, 1)


# ---------------------------------------------------------------------- real engine + master
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tier(start_mooncake_master, vllm_engine, tiny_moe_dirs, tmp_path_factory):
    """``{"llm", "master", "restart", "connector"}``: an in-process engine with the KV tier on a loopback master."""
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig

    ports = {"rpc_port": _free_port(), "metadata_port": _free_port(), "metrics_port": _free_port()}
    state = {"master": start_mooncake_master(**ports)}
    m = state["master"]
    kv = KVTransferConfig(
        kv_connector="MooncakeKVTier", kv_connector_module_path="moe_rl.inference.mooncake.kv_connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"master_address": m.rpc_address, "metadata_url": m.metadata_url,
                                   "model": "tiny-moe", "weight_version": 0, "global_segment_bytes": 32 << 20,
                                   "local_buffer_bytes": 16 << 20, "unreachable_cooldown_s": 2.0},
    )

    def restart():
        state["master"].stop()
        state["master"] = start_mooncake_master(**ports)

    try:
        with vllm_engine(tiny_moe_dirs["v1"], kv_transfer_config=kv, disable_log_stats=False) as llm:
            core = llm.llm_engine.engine_core.engine_core
            state.update(llm=llm, restart=restart, connector=core.scheduler.connector)
            yield state
    finally:
        state["master"].stop()


def _prompt(length: int, k: int) -> list[int]:
    return [1] + [3 + (5 * i + k) % 11 for i in range(length - 1)]


def _metric(llm, name: str) -> float:
    """A counter of the engine's Prometheus metrics (summed over labels)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.mark.vllm
@pytest.mark.slow
def test_prefix_is_reused_under_the_same_salt_only(tier, greedy):
    from moe_rl.inference.mooncake.kv_connector import kv_tier_stats

    llm = tier["llm"]
    prompt = _prompt(70, 0)
    s0 = kv_tier_stats()
    ref = greedy(llm, [prompt], N, cache_salt="a")  # computes the prompt, stores its 2 full blocks
    s1 = kv_tier_stats()
    assert s1["saved_blocks"] - s0["saved_blocks"] == 70 // BLOCK
    assert s1["lookup_hit_blocks"] == s0["lookup_hit_blocks"]
    local = greedy(llm, [prompt], N, cache_salt="a")  # served from the engine's own prefix cache
    assert kv_tier_stats()["lookup_hit_blocks"] == s1["lookup_hit_blocks"]
    llm.reset_prefix_cache()
    s2 = kv_tier_stats()
    hits0 = _metric(llm, "vllm:external_prefix_cache_hits")
    loaded = greedy(llm, [prompt], N, cache_salt="a")
    d = _delta(s2, kv_tier_stats())
    assert d.get("lookup_hit_blocks") == (70 - 1) // BLOCK and d.get("loaded_blocks") == (70 - 1) // BLOCK, d
    assert "load_failures" not in d and "lookup_failures" not in d
    # the same 64 KV rows (bit-identical bytes) and the same 6-token forward as the local prefix-cache hit
    assert loaded == local
    assert loaded[0] == ref[0]  # tokens equal the full recompute
    assert _metric(llm, "vllm:external_prefix_cache_hits") - hits0 == (70 - 1) // BLOCK * BLOCK  # vLLM's own count of loaded tokens
    llm.reset_prefix_cache()
    s3 = kv_tier_stats()
    other = greedy(llm, [prompt], N, cache_salt="b")
    d = _delta(s3, kv_tier_stats())
    assert "lookup_hit_blocks" not in d and "loaded_blocks" not in d, d
    assert d.get("saved_blocks") == 70 // BLOCK  # stored again under salt b
    assert other[0] == ref[0]


@pytest.mark.vllm
@pytest.mark.slow
def test_loaded_kv_is_used(tier, greedy):
    """Replace the stored blocks of a prompt by halved copies: the next load changes the output."""
    import numpy as np

    from moe_rl.inference.mooncake.kv_connector import _client, kv_tier_stats

    llm, conn = tier["llm"], tier["connector"]
    prompt = _prompt(70, 1)
    ref = greedy(llm, [prompt], N, cache_salt="c")
    client = _client(conn._store_config)
    keys = conn._keys(kv_chain_hashes(prompt, BLOCK, 2), "c", 0)
    for key in keys:
        data = np.frombuffer(client.get(key), dtype=np.float32) * np.float32(0.5)
        assert client.remove(key, force=True)
        client.put(key, data)
    llm.reset_prefix_cache()
    before = kv_tier_stats()["loaded_blocks"]
    got = greedy(llm, [prompt], N, cache_salt="c")
    assert kv_tier_stats()["loaded_blocks"] - before == 2
    assert got != ref  # a recomputed prefix would have given ref exactly (test_prefix_is_reused...)


@pytest.mark.vllm
@pytest.mark.slow
def test_separate_server_loads_the_prefix_over_the_store(tier, greedy, tiny_moe_dirs, tmp_path):
    """Engine B is a vLLM API server in its own process: it finds the in-process engine's blocks (held in that
    engine's Mooncake segment, fetched over the transfer engine) under the same salt, and misses under another."""
    import asyncio
    import re

    import httpx

    from moe_rl.inference import VllmClient, VllmServer, VllmServerConfig
    from moe_rl.inference.control_plane import auth_headers

    llm, m = tier["llm"], tier["master"]
    prompt = _prompt(70, 3)
    ref = greedy(llm, [prompt], N, cache_salt="e")  # engine A computes and stores the prompt
    kv = {"kv_connector": "MooncakeKVTier", "kv_connector_module_path": "moe_rl.inference.mooncake.kv_connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"master_address": m.rpc_address, "metadata_url": m.metadata_url,
                                        "model": "tiny-moe", "weight_version": 0, "global_segment_bytes": 16 << 20,
                                        "local_buffer_bytes": 16 << 20}}
    cfg = VllmServerConfig(max_model_len=256, startup_timeout_s=300, kv_cache_memory_bytes=64 * 2**20, block_size=BLOCK,
                           kv_transfer_config=kv)
    srv = VllmServer(cfg, tiny_moe_dirs["v1"], tmp_path / "engine_b.log")

    def metric(name: str) -> float:
        text = httpx.get(f"{srv.base_url}/metrics", headers=auth_headers(), timeout=30, trust_env=False).text
        return sum(float(x) for x in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    async def run() -> None:
        client = VllmClient(srv.base_url, track_token_versions=False)
        try:
            (same,), cached = await client.generate(prompt, 1, N, 0.0, cache_salt="e", extra_body={"ignore_eos": True})
            assert cached == (70 - 1) // BLOCK * BLOCK and same.token_ids == ref[0][0]
            assert metric("vllm:external_prefix_cache_hits_total") == cached
            assert metric("vllm:moe_rl_kv_tier_loaded_blocks_total") == (70 - 1) // BLOCK
            (other,), cached = await client.generate(prompt, 1, N, 0.0, cache_salt="f", extra_body={"ignore_eos": True})
            assert cached == 0 and other.token_ids == ref[0][0]
            assert metric("vllm:external_prefix_cache_hits_total") == (70 - 1) // BLOCK * BLOCK
        finally:
            await client.aclose()

    try:
        srv.start()
        srv.wait_ready()
        asyncio.run(run())
    finally:
        srv.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_master_down_degrades_to_recompute(tier, greedy):
    from moe_rl.inference.mooncake.kv_connector import kv_tier_stats

    llm = tier["llm"]
    prompt = _prompt(70, 2)
    ref = greedy(llm, [prompt], N, cache_salt="d")
    tier["master"].stop()
    llm.reset_prefix_cache()
    s0 = kv_tier_stats()
    m0 = _metric(llm, "vllm:moe_rl_kv_tier_lookup_failures")
    down = greedy(llm, [prompt], N, cache_salt="d")
    d = _delta(s0, kv_tier_stats())
    assert d.get("lookup_failures") == 1 and d.get("save_failures") == 1, d
    assert _metric(llm, "vllm:moe_rl_kv_tier_lookup_failures") - m0 == 1  # the engine's own metrics count it too
    assert "loaded_blocks" not in d
    assert down[0] == ref[0]
    tier["restart"]()  # a new, empty master on the same ports
    llm.reset_prefix_cache()
    again = greedy(llm, [prompt], N, cache_salt="d")
    assert again[0] == ref[0]
