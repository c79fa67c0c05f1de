"""``VllmServer`` + ``VllmClient`` against one real vLLM OpenAI server (CPU build) serving the tiny MoE.

The config and command-line tests at the top need no vLLM. The server tests share one server (the session's
``shared_vllm_server`` of ``tests/inference/conftest.py``, fresh: base weights, version 0; pinned to core 0 when
there are 2+ cores, as a recipe would run it beside a trainer) and run in file order; the last one stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from _vllm_http import MAX_TOKENS, PROMPTS, greedy_over_http, run_with_client

from moe_rl.config import ConfigError, load_config
from moe_rl.inference import VllmClient, VllmRequestError, VllmServer, VllmServerConfig

SALT_PROMPT = [1] + [3 + (5 * i) % 13 for i in range(99)]  # 100 tokens: 3 full 32-token blocks


# ---------------------------------------------------------------------------- no vLLM needed
def test_config_rejects_block_size_not_multiple_of_32():
    with pytest.raises(ConfigError, match=r"block_size = 48: .*multiple of 32"):
        load_config(VllmServerConfig, ["--block-size", "48"])
    with pytest.raises(ConfigError, match=r"cpu_affinity"):
        load_config(VllmServerConfig, ["--cpu-affinity", "[0, 0]"])
    with pytest.raises(ConfigError, match=r"extra_forbidden|Extra inputs"):
        load_config(VllmServerConfig, ["--gpu-memory-utilization", "0.5"])


def test_command_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    cfg = VllmServerConfig(
        cpu_affinity=[0], kv_cache_memory_bytes=2**26, extra_args=["--max-num-batched-tokens", "512"]
    )
    server = VllmServer(cfg, tmp_path, tmp_path / "log")
    argv = server.command(8123)
    assert argv[:4] == ["taskset", "-c", "0", argv[3]] and argv[4:6] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    joined = " ".join(argv)
    for piece in [
        "--port 8123",
        "--kv-cache-memory-bytes 67108864",
        "--block-size 32",
        "--worker-extension-cls moe_rl.weights.engine.WeightSyncExtension",
        "--enable-prompt-tokens-details",
        "--logprobs-mode processed_logprobs",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--max-num-batched-tokens 512",
    ]:
        assert piece in joined
    env = server.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    # one pinned core: the model runs in EngineCore (no worker process), which the CPU build allows only with
    # VLLM_ENABLE_V1_MULTIPROCESSING=0
    assert cfg.effective_executor == "uni" and "--distributed-executor-backend uni" in joined
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for kwargs, executor, flag_env in [
        (dict(cpu_affinity=None), None, "0"),  # vLLM's own choice: nothing passed, the environment left as it is
        (dict(cpu_affinity=[0, 1]), None, "0"),
        (dict(cpu_affinity=[0], executor="mp"), "mp", "1"),
        (dict(cpu_affinity=None, executor="uni"), "uni", "0"),
    ]:
        other = VllmServer(VllmServerConfig(**kwargs), tmp_path, tmp_path / "log")
        assert other.cfg.effective_executor == executor, kwargs
        argv_other = other.command(8123)
        if executor is None:
            assert "--distributed-executor-backend" not in argv_other
        else:
            i = argv_other.index("--distributed-executor-backend")
            assert argv_other[i + 1] == executor
        assert other.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == flag_env, kwargs
    with pytest.raises(ValueError, match=r"sets \['--distributed-executor-backend'\].*executor field"):
        VllmServerConfig(extra_args=["--distributed-executor-backend", "mp"])
    # "auto" leaves a parallel engine to vLLM even on one pinned core (the launcher may pin it after validation)
    tp_one_core = VllmServerConfig(cpu_affinity=[0], extra_args=["-tp", "2"])
    assert tp_one_core.effective_executor is None and tp_one_core.model_copy(update={"cpu_affinity": [1]}
                                                                             ).effective_executor is None
    assert "--distributed-executor-backend" not in VllmServer(tp_one_core, tmp_path, tmp_path / "log").command(1)
    # every spelling vLLM's parser accepts: dashes or underscores, abbreviated, inline value, short alias
    for spelling in (["--pipeline-parallel-size=2"], ["--tensor_parallel_size", "2"], ["--tensor_parallel_size=2"],
                     ["--tensor-parallel", "2"], ["-tp", "2"], ["-tp=2"], ["-pp", "4"]):
        with pytest.raises(ValueError, match=r"-parallel-size \d but executor='uni' runs the model in one process"):
            VllmServerConfig(executor="uni", extra_args=spelling)
    assert VllmServerConfig(executor="uni", extra_args=["--tensor-parallel-size", "1"]).effective_executor == "uni"
    assert VllmServerConfig(cpu_affinity=[0], executor="mp", extra_args=["-tp", "2"]).effective_executor == "mp"
    overridden = VllmServer(
        VllmServerConfig(extra_args=["--logprobs-mode=raw_logprobs", "--no-enable-prefix-caching"]),
        tmp_path,
        tmp_path / "log",
    ).command(8123)
    assert "processed_logprobs" not in overridden and "--enable-prefix-caching" not in overridden
    assert overridden[-2:] == ["--logprobs-mode=raw_logprobs", "--no-enable-prefix-caching"]
    with pytest.raises(ValueError, match=r"extra_args=.*sets \['--port'\]"):
        VllmServerConfig(extra_args=["--port", "9"])
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        server.start()
    with pytest.raises(RuntimeError, match="call start"):
        _ = server.base_url
    server.stop()  # never started: a no-op


# ---------------------------------------------------------------------------- start-up failures
@pytest.mark.vllm
@pytest.mark.slow
def test_wait_ready_reports_log_on_timeout_and_on_exit(tmp_path):
    pytest.importorskip("vllm")
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no_such_architecture"}')
    cores = [0] if len(os.sched_getaffinity(0)) >= 2 else None

    slow = VllmServer(VllmServerConfig(cpu_affinity=cores, startup_timeout_s=0.5), bad, tmp_path / "t.log")
    slow.start()
    pids = slow.group_pids()
    with pytest.raises(RuntimeError, match=r"not ready after startup_timeout_s=0.5 s \(stopped it\).*t\.log"):
        slow.wait_ready()
    assert slow.poll() is not None and slow.group_pids() == [] and pids

    broken = VllmServer(VllmServerConfig(cpu_affinity=cores), bad, tmp_path / "exit.log")
    broken.start()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 before it was ready; log .*exit\.log.*"
                       r"no_such_architecture"):  # fmt: skip
        broken.wait_ready()
    broken.stop()


# ---------------------------------------------------------------------------- one real server
@pytest.fixture(scope="module")
def references(tiny_moe_dirs, vllm_engine, greedy):
    """Greedy outputs of ``PROMPTS`` from fresh in-process engines, computed before the server starts (one
    vLLM at a time on this machine)."""
    pytest.importorskip("vllm")
    refs = {}
    for name in ("v1", "v2"):
        with vllm_engine(tiny_moe_dirs[name]) as llm:
            refs[name] = greedy(llm, PROMPTS, MAX_TOKENS)
    assert refs["v1"] != refs["v2"]
    return refs


@pytest.fixture(scope="module")
def server(references, shared_vllm_server):
    """The shared server, serving ``v1`` at version 0 (the references are computed first: their in-process engines
    run before a server starts when none is running yet)."""
    return shared_vllm_server.get()


@pytest.mark.vllm
@pytest.mark.slow
def test_health_and_sampling(server, references):
    async def body(client: VllmClient):
        assert await client.health()
        t0 = time.perf_counter()
        comps, cached = await client.generate(PROMPTS[0], n=4, max_tokens=16, temperature=1.0, seed=7)
        first_s = time.perf_counter() - t0
        again, _ = await client.generate(PROMPTS[0], n=4, max_tokens=16, temperature=1.0, seed=7)
        greedy = await greedy_over_http(client, salt="v1")
        return comps, cached, first_s, again, greedy

    comps, cached, first_s, again, greedy = run_with_client(body, server)
    print(f"first sampling request (pays vLLM's one-off logprobs setup): {first_s:.2f} s")
    assert len(comps) == 4 and cached == 0
    for c in comps:
        assert c.finish_reason in ("length", "stop")
        assert len(c.token_ids) == len(c.logprobs) >= 1
        assert len(c.token_ids) == 16 or (c.finish_reason == "stop" and c.token_ids[-1] == 2)
        assert all(lp <= 0.0 for lp in c.logprobs)
    assert len({tuple(c.token_ids) for c in comps}) > 1, "n=4 samples with one seed should differ"
    assert again == comps, "same seed, same samples"
    assert greedy == references["v1"], "server output differs from a fresh in-process engine"


@pytest.mark.vllm
@pytest.mark.slow
def test_cache_salt_and_reset(server):
    """100-token prompt, 32-token blocks: the same salt hits 96 tokens, a new salt 0; a reset empties the cache."""

    async def cached(client: VllmClient, salt: str) -> int:
        _, n_cached = await client.generate(SALT_PROMPT, n=1, max_tokens=2, temperature=0.0, cache_salt=salt)
        return n_cached

    async def body(client: VllmClient):
        hits = [await cached(client, salt) for salt in ("s1", "s1", "s2")]
        reset = await client.reset_prefix_cache()
        return hits, reset, await cached(client, "s1")

    hits, reset, after_reset = run_with_client(body, server)
    assert hits == [0, 96, 0]
    assert reset is True and after_reset == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_failed_update_reports_server_message(server):
    async def body(client: VllmClient):
        before = await client.weight_version()
        with pytest.raises(
            VllmRequestError, match=r"HTTP 500: .*path='/nonexistent/ckpt' is not a directory"
        ):
            await client.update_weights("/nonexistent/ckpt", 99)
        assert await client.health(), "a failed reload must leave the server healthy"
        assert await client.weight_version() == before

    run_with_client(body, server)


async def _wait_running(server: VllmServer, n: int, timeout_s: float = 10.0) -> float:
    """Poll ``/metrics`` until the scheduler runs ``n`` requests; returns the gauge's last value."""
    import httpx

    value = 0.0
    deadline = time.monotonic() + timeout_s
    from moe_rl.inference.control_plane import auth_headers

    async with httpx.AsyncClient(base_url=server.base_url, headers=auth_headers()) as http:
        while time.monotonic() < deadline:
            text = (await http.get("/metrics")).text
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("vllm:num_requests_running")]  # fmt: skip
            value = sum(values)
            if value >= n:
                return value
            await asyncio.sleep(0.02)
    raise AssertionError(f"only {value} requests running after {timeout_s} s; expected {n}")


@pytest.mark.vllm
@pytest.mark.slow
def test_update_weights_with_requests_in_flight(server, references, tiny_moe_dirs):
    """8 long generations are running when the reload RPC lands; none is aborted, and afterwards the server
    matches a fresh v2 engine exactly."""
    n_inflight, long_tokens = 8, 160

    async def body(client: VllmClient):
        assert await client.weight_version() == 0
        tasks = [
            asyncio.create_task(client.generate(
                PROMPTS[i % len(PROMPTS)], n=1, max_tokens=long_tokens, temperature=1.0, seed=i,
                extra_body={"ignore_eos": True}))
            for i in range(n_inflight)
        ]  # fmt: skip
        await _wait_running(server, n_inflight)
        timings = await client.update_weights(str(tiny_moe_dirs["v2"]), 2)
        pending_at_update = sum(not t.done() for t in tasks)
        inflight = await asyncio.gather(*tasks)
        version = await client.weight_version()
        t0 = time.perf_counter()
        after = await greedy_over_http(client, salt="v2")
        return timings, pending_at_update, inflight, version, after, time.perf_counter() - t0

    timings, pending_at_update, inflight, version, after, greedy_s = run_with_client(body, server)
    print(
        f"update_weights timings: {timings}; {pending_at_update}/{n_inflight} requests still running when it "
        f"returned; greedy batch after update {greedy_s:.3f} s"
    )
    assert pending_at_update > 0, "the reload should land while requests are still generating"
    for comps, _ in inflight:
        assert comps[0].finish_reason == "length"  # not "abort"
        assert len(comps[0].token_ids) == len(comps[0].logprobs) == long_tokens
    assert timings["version"] == version == 2
    assert timings["moe_layers_repacked"] == timings["moe_layers_total"] == 1
    assert timings["reload_s"] <= timings["rpc_s"]
    assert after == references["v2"], "after the update the server differs from a fresh v2 engine"


async def _rescore(client: VllmClient, seqs: list[tuple[list[int], list[int]]], salt: str) -> list[list[float]]:
    """Logprob of every completion token given its prefix (``prompt_logprobs``), under the current weights."""
    out = []
    for i, (prompt, completion) in enumerate(seqs):
        body = {"model": client.model, "prompt": prompt + completion, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, "cache_salt": f"{salt}-{i}"}
        plp = (await client._post("/v1/completions", json=body))["choices"][0]["prompt_logprobs"]
        out.append([plp[len(prompt) + j][str(tok)]["logprob"] for j, tok in enumerate(completion)])
    return out


def _served_vs_rescored_bounds(model_dir, seqs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Per sequence: the bound on ``|served - rescored|`` of one completion token's log-prob under checkpoint
    ``model_dir``: the engine's decode (served) and prefill (rescored) passes are two fp32 chains of the same model
    (other batch shapes, attention kernels and so summation orders), each within ``logprob_error`` of the exact
    log-prob (``tests/_tolerance.py``: the chain's normwise relative error times ``2 max|z| + log V``), so twice
    that. ``max|z|`` comes from this library's fp32 forward of the whole sequence (same weights)."""
    import torch
    from _tolerance import decoder_chain, logprob_error

    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm4_moe.state_dict import load_hf_state_dict

    cfg = GlmMoeConfig.from_hf_config_dict(json.loads((Path(model_dir) / "config.json").read_text()))
    model = GlmMoeForCausalLM(cfg).float().eval()
    model.load_state_dict(load_hf_state_dict(model_dir, cfg), strict=True)
    out = []
    with torch.no_grad():
        for prompt, completion in seqs:
            ids = torch.tensor([prompt + completion])
            k, depth = decoder_chain(cfg, ids.numel())
            out.append(2 * logprob_error(model(ids), k=k, depth=depth))
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_token_version_segments_match_recomputation(server, tiny_moe_dirs):
    """Per-token policy versions (``Completion.version_segments``) are exact with reloads landing mid-request.

    Versions b+1 = ``v1``, b+2 = ``v2``, b+3 = ``v1`` (KV-neutral changes of each other, so recomputing a
    whole sequence under one checkpoint reproduces the served logprob of every token sampled with it). Long
    n=2 requests run across two reloads, short ones start between them, one is sent while a reload is in
    flight. Afterwards every completion is rescored under ``v1`` and ``v2`` and each token is labelled by the
    checkpoint whose logprob equals the served one; the segments must give exactly these labels.
    """

    async def body(client: VllmClient):
        b = await client.weight_version()
        await client.update_weights(str(tiny_moe_dirs["v1"]), b + 1)  # known starting weights
        ckpt = {b + 1: "v1", b + 2: "v2", b + 3: "v1"}
        ie = {"ignore_eos": True}
        long = [asyncio.create_task(client.generate(PROMPTS[i], n=2, max_tokens=90, temperature=1.0, seed=i,
                                                    extra_body=ie)) for i in range(3)]  # fmt: skip
        await _wait_running(server, 6, timeout_s=30.0)
        await client.update_weights(str(tiny_moe_dirs["v2"]), b + 2)
        short = [asyncio.create_task(client.generate(PROMPTS[i], n=2, max_tokens=3, temperature=1.0, seed=10 + i,
                                                     extra_body=ie)) for i in range(2)]  # fmt: skip
        await asyncio.sleep(0.1)
        update = asyncio.create_task(client.update_weights(str(tiny_moe_dirs["v1"]), b + 3))
        racer = asyncio.create_task(client.generate(PROMPTS[2], n=1, max_tokens=5, temperature=1.0, seed=20,
                                                    extra_body=ie))  # sent while the reload is in flight
        await update
        done = await asyncio.gather(*long, *short, racer)
        assert client.versions.unknown == 0 and client.token_versions_error is None
        prompts = PROMPTS[:3] + PROMPTS[:2] + [PROMPTS[2]]
        comps = [(p, c) for p, (cs, _) in zip(prompts, done, strict=True) for c in cs]
        seqs = [(p, c.token_ids) for p, c in comps]
        await client.update_weights(str(tiny_moe_dirs["v2"]), b + 4)
        under_v2 = await _rescore(client, seqs, "rescore-v2")
        await client.update_weights(str(tiny_moe_dirs["v1"]), b + 5)
        under_v1 = await _rescore(client, seqs, "rescore-v1")
        return b, ckpt, comps, under_v1, under_v2

    from moe_rl.rl.token_versions import token_versions_from_segments

    b, ckpt, comps, under_v1, under_v2 = run_with_client(body, server)
    seqs = [(p, c.token_ids) for p, c in comps]
    # per sequence and checkpoint: the fp32 rounding bound of served vs rescored (helper's docstring; ~6e-3 here,
    # observed differences 0 to ~1e-6); a token served under the other checkpoint is off by ~0.1 to 1
    tols = {"v1": _served_vs_rescored_bounds(tiny_moe_dirs["v1"], seqs),
            "v2": _served_vs_rescored_bounds(tiny_moe_dirs["v2"], seqs)}
    total = distinguishable = 0
    for k, (_, c) in enumerate(comps):
        print(f"completion {k}: {len(c.token_ids)} tokens, segments {c.version_segments}")
        assert c.version_segments is not None, k
        expected = [ckpt[v] for v in token_versions_from_segments(c.version_segments, len(c.token_ids))]
        for j, served in enumerate(c.logprobs):
            rescored = {"v1": under_v1[k][j], "v2": under_v2[k][j]}
            other = "v2" if expected[j] == "v1" else "v1"
            # the served logprob is the one of the checkpoint the segments name...
            tol = max(tols["v1"][k], tols["v2"][k])
            assert abs(served - rescored[expected[j]]) <= tol, (k, j, c.version_segments, served, rescored, tol)
            # ...and (almost always) not the other's, beyond both bounds (the label is unique): a few tokens are
            # near-certain under both checkpoints
            distinguishable += abs(served - rescored[other]) > 2 * tol
            total += 1
    assert distinguishable >= 0.9 * total, (distinguishable, total)
    # both reloads landed while the long generations ran: three versions each, switching mid-sequence
    long_segments = [c.version_segments for _, c in comps[:6]]
    assert all([v for v, _ in s] == [b + 1, b + 2, b + 3] and s[1][1] > 0 for s in long_segments), long_segments


@pytest.mark.vllm
@pytest.mark.slow
def test_stop_leaves_no_process(server):
    pids = server.group_pids()
    # API server + EngineCore (+ a worker process unless the model runs in EngineCore)
    expected = 2 if server.cfg.effective_executor == "uni" else 3
    assert server.pid in pids and len(pids) >= expected, f"expected {expected} processes, got {pids}"
    assert "VLLM::EngineCor" in _process_names(pids)
    t0 = time.perf_counter()
    server.stop()
    print(f"stop took {time.perf_counter() - t0:.2f} s")
    assert server.poll() is not None
    assert server.group_pids() == []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"pid {pid} of the server is still alive (state {state})"
    server.stop()  # idempotent


@pytest.mark.vllm
@pytest.mark.slow
def test_both_executors_serve_the_same_greedy_tokens(references, tiny_moe_dirs, tmp_path):
    """The other executor than the shared server's (which runs the model in EngineCore when pinned to one core)
    serves the same greedy tokens as a fresh in-process engine, with its own process layout."""
    cores = [0] if len(os.sched_getaffinity(0)) >= 2 else None
    shared = VllmServerConfig(cpu_affinity=cores).effective_executor
    executor = "mp" if shared == "uni" else "uni"
    cfg = VllmServerConfig(cpu_affinity=cores, max_model_len=256, startup_timeout_s=240, executor=executor)
    with VllmServer(cfg, tiny_moe_dirs["v1"], tmp_path / "other.log") as other:
        names = _process_names(other.group_pids())
        assert names.count("VLLM::EngineCor") == 1, names  # /proc/<pid>/comm keeps 15 characters
        assert names.count("VLLM::Worker") == (0 if executor == "uni" else 1), (executor, names)
        greedy = run_with_client(lambda client: greedy_over_http(client, salt="v1"), other)  # (tokens, logprobs)
    assert greedy == references["v1"], f"executor={executor!r} serves other tokens than a fresh in-process engine"


def _process_names(pids: list[int]) -> list[str]:
    """``/proc/<pid>/comm`` of each live pid (vLLM names its processes ``VLLM::EngineCore``, ``VLLM::Worker``...,
    cut to 15 characters there)."""
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except FileNotFoundError:
            continue
    return names
