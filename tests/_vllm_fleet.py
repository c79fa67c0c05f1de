"""Test scaffolding for real vLLM CPU servers behind the real ``vllm-router`` binary (the ``router`` extra): the
binary (skip, or fail under ``MOE_RL_REQUIRE_ROUTER=1`` / another named variable), free ports, Prometheus metric
sums, a fleet of servers with the router in front (started, health-checked, stopped), and an engine's routed-experts
record of one request.

Used by ``tests/inference/test_vllm_router_vllm.py`` and the P/D tests (``test_pd_disagg_vllm.py``,
``test_pd_nixl_vllm.py``).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_rl.inference.control_plane import auth_headers


def router_executable(require_env: str = "MOE_RL_REQUIRE_ROUTER", also_missing: Sequence[str] = ()) -> str:
    """The ``vllm-router`` binary; skips the test when it (or anything in ``also_missing``, descriptions of other
    missing parts) is absent, or fails it when ``$require_env`` is ``1``."""
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    missing = list(also_missing)
    if not Path(exe).exists():
        missing.append("vllm-router (pip install -e '.[router]')")
    if missing:
        what = " and ".join(missing)
        if os.environ.get(require_env) == "1":
            pytest.fail(f"{require_env}=1 but {what} is not installed")
        pytest.skip(f"{what} not installed")
    return exe


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    """A server's Prometheus metric ``name`` summed over its label sets (``GET /metrics`` with the control token)."""
    resp = httpx.get(f"{url}/metrics", headers=auth_headers(), timeout=30, trust_env=False)
    assert resp.status_code == 200, resp.text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", resp.text, re.M))


@contextlib.contextmanager
def fleet(model_dir: Path, logs: Path, configs: Sequence[tuple[str, object, dict[str, str]]],
          router_args: Callable[[list[str]], list[str]], router_env: dict[str, str] | None = None,
          exe: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """Start one ``VllmServer`` per ``(name, VllmServerConfig, extra environment)`` on ``model_dir`` (logs in
    ``logs/<name>.log``), then ``vllm-router --host 127.0.0.1 --port P <router_args(server urls)>``; yields
    ``(router_url, server_urls)`` once the router answers ``/health`` (120 s), and stops everything after."""
    from moe_rl.inference import VllmServer

    exe = exe or router_executable()
    servers: list[VllmServer] = []
    router = None
    try:
        for name, cfg, env in configs:
            srv = VllmServer(cfg, model_dir, logs / f"{name}.log")
            servers.append(srv)
            with pytest.MonkeyPatch.context() as mp:  # the server copies this process's environment at start()
                for k, v in env.items():
                    mp.setenv(k, v)
                srv.start()
        for srv in servers:
            srv.wait_ready()
        urls = [s.base_url for s in servers]
        port = free_port()
        argv = [exe, "--host", "127.0.0.1", "--port", str(port), *router_args(urls),
                "--prometheus-port", str(free_port())]
        env = dict(os.environ, **(router_env or {}))
        router = subprocess.Popen(argv, stdout=open(logs / "router.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                  env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert router.poll() is None, (logs / "router.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, ("vllm-router not healthy in 120 s: "
                                                 + (logs / "router.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url, urls
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
        for s in servers:
            s.stop()


async def routed_record(engine, request_id: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """``(entry, ids [length, M*K] int64, row_valid [length])`` of ``request_id``'s routed-experts record on
    ``engine`` (a ``VllmClient`` whose server captures routed experts); popped from the engine."""
    from moe_rl.inference.request_ids import completion_external_id
    from moe_rl.replay.indices import TokenIndices

    external = completion_external_id(request_id)
    (res,) = await engine.collective_rpc("pop_routed_experts", [[external]])
    entry = (res or {}).get("records", {}).get(external, {}).get("0")
    assert entry is not None, f"no routed-experts record for {request_id}"
    rec = TokenIndices.from_bytes(base64.b64decode(entry["data"]))
    return entry, rec.ids.reshape(rec.ids.shape[0], -1).astype(np.int64), np.asarray(rec.row_valid)


@contextlib.asynccontextmanager
async def capturing_clients(*urls: str) -> AsyncIterator[list]:
    """``VllmClient``s of ``urls`` (no per-token versions) with routed-experts capture switched on; closed on exit."""
    from moe_rl.inference import VllmClient

    clients = [VllmClient(u, track_token_versions=False) for u in urls]
    try:
        for c in clients:
            await c.collective_rpc("enable_routed_experts_capture")
        yield clients
    finally:
        for c in clients:
            await c.aclose()


async def reference_completion(engine, prompt: list[int], max_tokens: int, request_id: str
                               ) -> tuple[object, np.ndarray, np.ndarray]:
    """Greedy ``max_tokens`` tokens of ``prompt`` on ``engine`` alone (EOS ignored; ``request_id`` is also its
    ``cache_salt``, so no other request's prefix cache serves it): ``(completion, routed ids, row_valid)``
    (:func:`routed_record`)."""
    (ref,), _ = await engine.generate(prompt, 1, max_tokens, 0.0, cache_salt=request_id,
                                      extra_body={"request_id": request_id, "ignore_eos": True})
    _, ids, valid = await routed_record(engine, request_id)
    return ref, ids, valid
