"""The control plane on a real vLLM CPU server started by moe_rl (``VllmServer``): the control and OpenAI routes refuse
requests without the run's token (401) and serve them with it; a weight reload from outside the weights root is
refused and the served version does not change, and so is a folder inside the root whose shards link out of it;
``/collective_rpc`` with the token still refuses vLLM's own worker methods (403); the token never reaches the command
line or the server's log."""

from __future__ import annotations

import asyncio
import os
import shutil

import httpx
import pytest

from moe_rl.inference import VllmClient, VllmRequestError, VllmServer, VllmServerConfig
from moe_rl.inference.control_plane import TOKEN_ENV, auth_headers

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_control_routes_need_the_token_and_reloads_stay_under_the_weights_root(tiny_moe_dirs, tmp_path):
    root = tmp_path / "run" / "weights"
    shutil.copytree(tiny_moe_dirs["v1"], root / "step_0")
    shutil.copytree(tiny_moe_dirs["v2"], root / "step_1")
    (root / "step_9").symlink_to(tiny_moe_dirs["v3"], target_is_directory=True)  # a symlink out of the root
    shutil.copytree(tiny_moe_dirs["v2"], root / "step_2")  # a folder inside the root whose shards link out of it
    shards = sorted((root / "step_2").glob("*.safetensors"))
    assert shards
    for f in shards:
        f.unlink()
        f.symlink_to(tiny_moe_dirs["v3"] / f.name)
    cores = [0] if len(os.sched_getaffinity(0)) >= 2 else None
    cfg = VllmServerConfig(cpu_affinity=cores, max_model_len=128, startup_timeout_s=240, weights_root=str(root))
    server = VllmServer(cfg, root / "step_0", tmp_path / "server.log")
    with server:
        token = os.environ[TOKEN_ENV]  # the process's token (VllmServer made it)
        assert token not in " ".join(server.command(server.port))
        completion = {"model": "policy", "prompt": [1, 4, 5, 13], "max_tokens": 2, "temperature": 0.0}
        requests = [
            ("POST", "/collective_rpc", {"json": {"method": "weight_version", "args": []}}),
            ("POST", "/pause", {"params": {"mode": "keep"}}),
            ("POST", "/resume", {}),
            ("POST", "/reset_prefix_cache", {}),
            ("POST", "/v1/completions", {"json": completion}),
        ]

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as anon, \
                    httpx.AsyncClient(base_url=server.base_url, timeout=60, headers=auth_headers()) as authed:
                assert (await anon.get("/health")).status_code == 200
                wrong = {"Authorization": "Bearer " + "x" * len(token)}
                for method, path, kw in requests:
                    assert (await anon.request(method, path, **kw)).status_code == 401, path
                    assert (await anon.request(method, path, headers=wrong, **kw)).status_code == 401, path
                for method, path, kw in requests:
                    resp = await authed.request(method, path, **kw)
                    assert resp.status_code == 200, (path, resp.text)
                # with the token: vLLM's own worker methods are still refused (403), moe_rl's pass with their body
                for body in ({"method": "reload_weights", "kwargs": {"weights_path": str(tiny_moe_dirs["v3"])}},
                             {"method": "save_sharded_state", "args": [str(tmp_path / "dump")]}):
                    resp = await authed.post("/collective_rpc", json=body)
                    assert resp.status_code == 403 and "not one of moe_rl's worker methods" in resp.json()["error"]
                resp = await authed.post("/collective_rpc", json={"method": "weight_version", "args": []})
                assert resp.status_code == 200 and resp.json() == {"results": ["0"]}, resp.text

            async with VllmClient(server.base_url, track_token_versions=False) as client:
                assert await client.weight_version() == 0
                for bad in (str(tiny_moe_dirs["v2"]), "../../elsewhere", str(root / "step_1" / ".." / ".."),
                            "step_9"):
                    with pytest.raises(VllmRequestError, match="weights root|'\\.\\.'"):
                        await client.update_weights(bad, 1)
                    assert await client.weight_version() == 0, bad
                with pytest.raises(VllmRequestError, match="resolves to .*outside the engine's weights root"):
                    await client.update_weights("step_2", 1)  # the folder is inside, its shards are not
                assert await client.weight_version() == 0
                report = await client.update_weights("step_1", 1)  # a version folder under the root
                assert report["version"] == 1 and await client.weight_version() == 1

        asyncio.run(probe())
    log = server.log_path.read_text()
    assert token not in log
    assert "refused POST /collective_rpc" in log and "refused POST /v1/completions" in log
    assert "(403; refusal" in log and "reload_weights" in log
    assert not (tmp_path / "dump").exists()
