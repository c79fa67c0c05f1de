"""The control plane without vLLM: the token middleware as a bare ASGI app, the run token file, and the confinement of
weight paths under the weights root (``moe_rl.inference.control_plane``)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.inference import control_plane as cp

TOKEN = "t" * 20 + "-secret-" + "u" * 15


async def _inner(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"served " + scope["path"].encode()})


def _call(app, path: str, headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, bytes]:
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


@pytest.mark.parametrize("path", ["/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/v1/completions",
                                  "/is_paused", "/metrics", "/"])
def test_missing_or_wrong_token_is_refused_and_counted(path, capsys):
    app = cp.ControlTokenMiddleware(_inner, token=TOKEN)
    assert _call(app, path)[0] == 401
    assert _call(app, path, {"Authorization": "Bearer " + TOKEN[:-1] + "x"})[0] == 401
    assert _call(app, path, {"Authorization": "Basic " + TOKEN})[0] == 401
    assert _call(app, path, {cp.TOKEN_HEADER: "wrong-token-wrong-token"})[0] == 401
    assert app.refused == 4
    err = capsys.readouterr().err
    assert f"refused POST {path}" in err and "#4" in err
    assert TOKEN not in err and TOKEN[:-1] not in err  # the log never carries the token (right or nearly right)


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer " + TOKEN}, {"authorization": "bearer " + TOKEN},
                                     {cp.TOKEN_HEADER: TOKEN}])
def test_right_token_is_served(headers):
    app = cp.ControlTokenMiddleware(_inner, token=TOKEN)
    for path in ("/collective_rpc", "/pause", "/reset_prefix_cache", "/v1/completions"):
        assert _call(app, path, headers) == (200, b"served " + path.encode())
    assert app.refused == 0


def test_health_is_open_metrics_only_when_configured(monkeypatch):
    app = cp.ControlTokenMiddleware(_inner, token=TOKEN)
    assert _call(app, "/health", method="GET")[0] == 200
    assert _call(app, "/metrics", method="GET")[0] == 401
    assert _call(app, "/health/../collective_rpc")[0] == 401  # exact paths only
    monkeypatch.setenv(cp.OPEN_METRICS_ENV, "1")
    app = cp.ControlTokenMiddleware(_inner, token=TOKEN)
    assert _call(app, "/metrics", method="GET")[0] == 200


def test_lifespan_passes_through():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    app = cp.ControlTokenMiddleware(inner, token=TOKEN)
    asyncio.run(app({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_comparison_is_constant_time(monkeypatch):
    """Every presented token is compared with ``hmac.compare_digest`` (on SHA-256 digests: equal lengths)."""
    calls = []
    real = cp.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(cp.hmac, "compare_digest", spy)
    app = cp.ControlTokenMiddleware(_inner, token=TOKEN)
    assert _call(app, "/pause", {"Authorization": "Bearer short"})[0] == 401
    assert _call(app, "/pause", {"Authorization": "Bearer " + TOKEN})[0] == 200
    assert calls == [(32, 32), (32, 32)]


def test_token_from_environment_and_refusal_without(monkeypatch):
    monkeypatch.setenv(cp.TOKEN_ENV, TOKEN)
    app = cp.ControlTokenMiddleware(_inner)
    assert _call(app, "/pause", cp.auth_headers())[0] == 200
    monkeypatch.delenv(cp.TOKEN_ENV)
    with pytest.raises(RuntimeError, match="MOE_RL_CONTROL_TOKEN is not set"):
        cp.ControlTokenMiddleware(_inner)
    monkeypatch.setenv(cp.TOKEN_ENV, "short")
    with pytest.raises(ValueError, match="at least 16") as info:
        cp.ControlTokenMiddleware(_inner)
    assert "short" not in str(info.value).replace("shorter", "")


def test_run_token_file_is_0600_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(cp.TOKEN_ENV, raising=False)
    token = cp.run_token(tmp_path)
    path = tmp_path / cp.TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == token == os.environ[cp.TOKEN_ENV]
    assert len(token) >= 40
    monkeypatch.delenv(cp.TOKEN_ENV)
    assert cp.run_token(tmp_path) == token  # the file is reused
    monkeypatch.delenv(cp.TOKEN_ENV)
    rotated = cp.run_token(tmp_path, rotate=True)  # a new run: a new token replaces the file
    assert rotated != token and path.read_text().strip() == rotated
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.delenv(cp.TOKEN_ENV)
    path.unlink()  # rotation by hand: delete the file
    assert cp.run_token(tmp_path) not in (token, rotated)
    monkeypatch.setenv(cp.TOKEN_ENV, TOKEN)  # a Slurm job's variable wins and is written to the file
    assert cp.run_token(tmp_path) == TOKEN and path.read_text().strip() == TOKEN
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    monkeypatch.delenv(cp.TOKEN_ENV)
    with pytest.raises(PermissionError, match="chmod 600"):
        cp.run_token(tmp_path)


def test_middleware_module_is_light():
    """The vLLM API server imports the middleware: no torch, no vllm, no heavy part of moe_rl."""
    code = ("import sys; import moe_rl.inference.control_plane; "
            "bad = [m for m in ('torch', 'vllm', 'numpy', 'httpx', 'pydantic', 'moe_rl.inference.client') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- weight paths
@pytest.fixture
def root(tmp_path):
    r = tmp_path / "run" / "weights"
    (r / "step_1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    return r


def test_paths_inside_the_root_resolve(root):
    real = os.path.realpath(root)
    assert cp.confine_weights_path("step_1", root=root) == os.path.join(real, "step_1")
    assert cp.confine_weights_path(str(root / "step_1"), root=root) == os.path.join(real, "step_1")
    assert cp.confine_weights_path("announce/p2p_3.json", root=root) == os.path.join(real, "announce", "p2p_3.json")
    (root / "latest").symlink_to(root / "step_1")  # a symlink that stays inside is fine
    assert cp.confine_weights_path("latest", root=root) == os.path.join(real, "step_1")


@pytest.mark.parametrize("bad", ["../elsewhere", "step_1/../../elsewhere", "/etc", "{tmp}/elsewhere", "", "a\x00b",
                                 "{root}/../elsewhere"])
def test_paths_outside_the_root_are_refused(root, tmp_path, bad):
    bad = bad.format(tmp=tmp_path, root=root)
    with pytest.raises(ValueError, match="weights root|'\\.\\.'"):
        cp.confine_weights_path(bad, "reload_and_repack: path", root=root)


def test_symlink_out_is_refused(root, tmp_path):
    (root / "step_2").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="outside the engine's weights root"):
        cp.confine_weights_path("step_2", root=root)


def test_non_string_is_refused(root):
    with pytest.raises(ValueError, match="non-empty string"):
        cp.confine_weights_path(["step_1"], root=root)


def test_root_from_environment_and_unconfined_without(root, tmp_path, monkeypatch):
    monkeypatch.delenv(cp.WEIGHTS_ROOT_ENV, raising=False)
    assert cp.confine_weights_path(str(tmp_path / "elsewhere")) == str(tmp_path / "elsewhere")
    monkeypatch.setenv(cp.WEIGHTS_ROOT_ENV, str(root))
    with pytest.raises(ValueError, match="MOE_RL_WEIGHTS_ROOT"):
        cp.confine_weights_path(str(tmp_path / "elsewhere"))


# ---------------------------------------------------------------------------------------------- VllmServer launch
def test_server_command_loads_the_middleware_and_keeps_the_token_out_of_argv(tmp_path, monkeypatch):
    from moe_rl.config import ConfigError, load_config
    from moe_rl.inference import VllmServer, VllmServerConfig

    monkeypatch.setenv(cp.TOKEN_ENV, TOKEN)
    server = VllmServer(VllmServerConfig(weights_root=str(tmp_path / "w")), tmp_path, tmp_path / "log")
    argv = server.command(8123)
    assert argv[argv.index("--middleware") + 1] == "moe_rl.inference.control_plane.ControlTokenMiddleware"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert TOKEN not in " ".join(argv) and "--api-key" not in argv
    env = server.environment()
    assert env[cp.TOKEN_ENV] == env["VLLM_API_KEY"] == TOKEN
    assert env[cp.WEIGHTS_ROOT_ENV] == str((tmp_path / "w").resolve())
    monkeypatch.setenv(cp.WEIGHTS_ROOT_ENV, "/somewhere")
    assert cp.WEIGHTS_ROOT_ENV not in VllmServer(VllmServerConfig(), tmp_path, tmp_path / "l").environment()
    monkeypatch.delenv(cp.TOKEN_ENV)
    made = VllmServer(VllmServerConfig(), tmp_path, tmp_path / "l").environment()[cp.TOKEN_ENV]
    assert len(made) >= 40 and os.environ[cp.TOKEN_ENV] == made  # the process's clients get it too
    for flag in ("--api-key", "--middleware"):
        with pytest.raises(ConfigError, match="VllmServer sets itself"):
            load_config(VllmServerConfig, ["--extra-args", f'["{flag}", "x"]'])


def test_client_sends_the_token(monkeypatch):
    import httpx

    from moe_rl.inference import VllmClient

    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"results": [3]})

    async def main(client):
        client._http._transport = httpx.MockTransport(handler)
        try:
            return await client.weight_version()
        finally:
            await client.aclose()

    monkeypatch.setenv(cp.TOKEN_ENV, TOKEN)
    assert asyncio.run(main(VllmClient("http://engine:8000"))) == 3
    assert asyncio.run(main(VllmClient("http://engine:8000", control_token="explicit-token-123456"))) == 3
    assert seen == [f"Bearer {TOKEN}", "Bearer explicit-token-123456"]


@pytest.mark.parametrize("extra", [["--hos", "0.0.0.0"], ["--api_key", "x"], ["--middlewar", "m.M"], ["--host=0.0.0.0"],
                                   ["--api-ke=x"]])
def test_extra_args_cannot_set_the_owned_flags_in_any_spelling(extra):
    """vLLM's parser takes abbreviations and underscores: each spelling of an owned flag is refused, single-node and
    cluster alike."""
    from moe_rl.inference.vllm_server import VllmServerConfig
    from moe_rl.launch.engines import EngineGroup

    with pytest.raises(ValueError, match="extra_args"):
        VllmServerConfig(extra_args=extra)
    assert any("extra_args sets" in p for p in EngineGroup(extra_args=extra).problems("inference.decode", "decode", 8, 256))


def test_a_refused_path_is_logged_escaped_on_one_line(capsys):
    import asyncio

    from moe_rl.inference.control_plane import ControlTokenMiddleware

    async def app(scope, receive, send):  # never reached
        raise AssertionError

    mw = ControlTokenMiddleware(app, token="t" * 32)
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request"}

    scope = {"type": "http", "method": "GET", "path": "/x\n(APIServer pid=1) INFO fake\x1b[31m", "headers": []}
    asyncio.run(mw(scope, receive, send))
    err = capsys.readouterr().err
    assert sent[0]["status"] == 401
    assert err.count("\n") == 1 and "\x1b" not in err and "\\n(APIServer" in err


def test_the_client_never_sends_the_token_through_a_proxy_from_the_environment(monkeypatch):
    import httpx

    from moe_rl.inference.client import VllmClient

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")

    def proxied(http: httpx.AsyncClient) -> bool:  # httpx mounts a proxy transport per scheme it proxies
        return any(t is not None for t in http._mounts.values())

    default = httpx.AsyncClient()
    c = VllmClient("http://node17.cluster:8000", control_token="t" * 32)
    try:
        assert proxied(default)  # the environment does configure a proxy: the check below can fail
        assert not proxied(c._http)
    finally:
        asyncio.run(c.aclose())
        asyncio.run(default.aclose())


def test_a_world_readable_token_file_is_rewritten_0600_when_the_variable_holds_the_token(tmp_path, monkeypatch):
    token = cp.new_token()
    f = tmp_path / cp.TOKEN_FILE
    f.write_text(token + "\n")
    f.chmod(0o644)
    monkeypatch.setenv(cp.TOKEN_ENV, token)
    assert cp.run_token(tmp_path) == token
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.read_text().strip() == token
