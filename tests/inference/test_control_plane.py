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


RPC_BODY = b'{"method": "weight_version", "args": []}'


def _call(app, path: str, headers: dict[str, str] | None = None, method: str = "POST",
          body: bytes | list[bytes] | None = None) -> tuple[int, bytes]:
    """Run one request through the ASGI ``app``; ``body`` is one message or a list of ``more_body`` chunks (default:
    :data:`RPC_BODY` for ``/collective_rpc``, else empty). Returns ``(status, response body)``."""
    if body is None:
        body = RPC_BODY if path == "/collective_rpc" else b""
    chunks = [body] if isinstance(body, bytes) else body
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

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


# ---------------------------------------------------------------------------------------------- /collective_rpc methods
def _rpc(app, chunks: list[bytes], headers: dict[str, str] | None = None):
    """POST /collective_rpc with the body in ``chunks`` (ASGI ``more_body`` messages); returns (status, reply, what
    the wrapped app received)."""
    import json

    headers = {"Authorization": "Bearer " + TOKEN, "content-length": str(sum(map(len, chunks))), **(headers or {})}
    status, body = _call(app, "/collective_rpc", headers, body=chunks)
    return status, json.loads(body)


async def _read_body(receive) -> bytes:
    """The whole request body of an ASGI app's ``receive``, over its ``more_body`` messages (as Starlette reads it)."""
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body", False):
            return body


async def _send_json(send, obj) -> None:
    """Answer 200 with ``obj`` as a JSON body."""
    import json

    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


async def _echo(scope, receive, send):
    """An app that reads its whole body (as Starlette does) and answers it back, with the content-length it saw."""
    import json

    body = await _read_body(receive)
    after = await receive()  # the next message is the client's disconnect (the replay sends the body once)
    length = dict(scope["headers"]).get(b"content-length", b"").decode()
    await _send_json(send, {"body": json.loads(body), "length": length, "after": after["type"]})


@pytest.mark.parametrize("body", [
    b'{"method": "reload_weights", "kwargs": {"weights_path": "/etc"}}',  # vLLM's own worker method
    b'{"method": "save_sharded_state", "args": ["/tmp/x"]}',
    b'{"method": "__class__"}',
    b'{"args": ["step_1", 3]}',  # no method
    b'{"method": ["reload_and_repack"]}',  # not a string
    b'["reload_and_repack"]',  # not an object
    b'not json',
    b'\xff\xfe{"method": "weight_version"}',  # not UTF-8
    b'{"method": "weight_version", "method": "reload_weights"}',  # duplicate key: vLLM's parser takes the last
    b"[" * 100_000,  # nested past the parser's recursion limit
])
def test_collective_rpc_refuses_other_worker_methods_with_403(body, capsys):
    app = cp.ControlTokenMiddleware(_echo, token=TOKEN)
    status, reply = _rpc(app, [body])
    assert status == 403 and reply["error"].startswith("Forbidden: ")
    assert app.refused == 1
    err = capsys.readouterr().err
    assert "refused POST /collective_rpc" in err and "(403; refusal #1)" in err and TOKEN not in err


def test_collective_rpc_body_over_the_cap_is_refused_before_it_is_buffered(capsys):
    app = cp.ControlTokenMiddleware(_echo, token=TOKEN)
    chunk = b" " * (1 << 16)
    chunks = [b'{"method": "weight_version", "args": ["'] + [chunk] * (cp.MAX_RPC_BODY_BYTES // len(chunk) + 2)
    status, reply = _rpc(app, chunks)
    assert status == 403 and "larger than" in reply["error"] and app.refused == 1


def test_collective_rpc_without_the_token_is_still_401_not_403():
    app = cp.ControlTokenMiddleware(_echo, token=TOKEN)
    status, _ = _rpc(app, [b'{"method": "reload_weights"}'], {"Authorization": "Bearer wrong-token-wrong-token"})
    assert status == 401 and app.refused == 1


@pytest.mark.parametrize("method", sorted(cp.RPC_METHODS))
def test_allowed_methods_reach_the_server_with_their_body_replayed(method):
    """The middleware consumes the body to check it; the app must still read the same JSON (split over several ASGI
    messages here), with a matching content-length, and then see the disconnect."""
    import json

    app = cp.ControlTokenMiddleware(_echo, token=TOKEN)
    sent = {"method": method, "args": ["step_1", 3, {"k": [1, 2.5, None]}], "kwargs": {}, "timeout": 30.0}
    raw = json.dumps(sent).encode()
    status, reply = _rpc(app, [raw[:7], raw[7:20], raw[20:]])
    assert status == 200 and app.refused == 0
    assert reply["body"] == sent
    assert int(reply["length"]) == len(json.dumps(sent).encode()) and reply["after"] == "http.disconnect"


def test_every_worker_method_moe_rl_calls_over_http_is_allowed_and_nothing_else():
    """Static: every method name ``VllmClient`` (or any moe_rl module) passes to ``collective_rpc`` / ``_tracked_update``
    (or to ``VllmClient``'s ``_enable_capture`` / ``_pop_records``, which call ``collective_rpc`` with it) is in ``RPC_METHODS``, every allowed name is called somewhere, and each is a method of the worker extension the
    servers run."""
    import ast

    from moe_rl.weights.engine import WeightSyncExtension

    pkg = Path(cp.__file__).resolve().parents[1]
    called: dict[str, str] = {}
    for f in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("collective_rpc", "_tracked_update", "_enable_capture", "_pop_records")
                    and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                called[node.args[0].value] = f"{f.relative_to(pkg.parent)}:{node.lineno}"
    assert called, "no collective_rpc call found: the scan is broken"
    assert {m: w for m, w in called.items() if m not in cp.RPC_METHODS} == {}
    assert cp.RPC_METHODS - set(called) == set()  # no allowed method that nothing calls
    assert all(callable(getattr(WeightSyncExtension, m, None)) for m in cp.RPC_METHODS)


def test_the_clients_rpc_calls_pass_the_real_middleware(monkeypatch):
    """``VllmClient``'s public weight methods, over HTTP through ``ControlTokenMiddleware`` (httpx's ASGI transport):
    each request passes, and the app sees the method and args the client sent."""
    import json

    import httpx

    from moe_rl.inference import VllmClient

    seen: list[tuple[str, list]] = []

    async def engine(scope, receive, send):
        data = json.loads(await _read_body(receive))
        seen.append((data["method"], data["args"]))
        result = 3 if data["method"] == "weight_version" else {"version": 5, "rank": 1}
        await _send_json(send, {"results": [result]})

    mw = cp.ControlTokenMiddleware(engine, token=TOKEN)

    async def main():
        client = VllmClient("http://engine:8000", control_token=TOKEN)
        client._http._transport = httpx.ASGITransport(app=mw)
        try:
            await client.update_weights("step_5", 5)
            assert await client.weight_version() == 3
            await client.load_sharded("step_5", 5)
            await client.init_weight_broadcast("10.0.0.1", 29600, 1, 2)
            await client.init_sharded_broadcast([["10.0.0.1", 29600]], 1, 2)
            await client.update_weights_from_broadcast(5)
            await client.init_p2p([["10.0.0.1", 29700]], 1, 2)
            await client.update_weights_from_p2p("announce/p2p_5.json", 5)
            await client.update_weights_from_mooncake({"master_address": "10.0.0.1:50051"}, "m", 5)
            await client.close_weight_broadcast()
        finally:
            await client.aclose()

    asyncio.run(main())
    assert mw.refused == 0
    assert [m for m, _ in seen] == ["reload_and_repack", "weight_version", "load_sharded", "init_weight_broadcast",
                                    "init_sharded_broadcast", "update_weights_from_broadcast", "init_p2p",
                                    "update_weights_from_p2p", "update_weights_from_mooncake", "close_weight_broadcast"]
    assert seen[0][1] == ["step_5", 5]


# ---------------------------------------------------------------------------------------------- files of a version
def _version(root, name="step_3"):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 8)
    return d


def test_files_linked_in_from_outside_the_root_are_refused(root, tmp_path):
    d = _version(root)
    assert cp.confine_weight_files(str(d), root=root) == 2
    secret = tmp_path / "elsewhere" / "secret.safetensors"
    secret.write_bytes(b"y" * 8)
    (d / "model-00002-of-00002.safetensors").symlink_to(secret)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors resolves to .*outside the engine's weights "
                                         "root"):
        cp.confine_weight_files(str(d), "load_sharded: path", root=root)


def test_links_that_stay_inside_the_root_pass_and_dangling_or_linked_folders_do_not(root, tmp_path):
    d = _version(root)
    (d / "shared.safetensors").symlink_to(root / "step_1")  # inside the root: fine
    assert cp.confine_weight_files(str(d), root=root) == 3
    (d / "sub").mkdir()
    (d / "sub" / "index.json").symlink_to(tmp_path / "elsewhere" / "x.json")  # dangling, and outside
    with pytest.raises(ValueError, match="index.json"):
        cp.confine_weight_files(str(d), root=root)
    (d / "sub" / "index.json").unlink()
    (d / "sub" / "gone.json").symlink_to(root / "missing.json")  # dangling inside
    with pytest.raises(ValueError, match="does not exist"):
        cp.confine_weight_files(str(d), root=root)
    (d / "sub" / "gone.json").unlink()
    (d / "linked").symlink_to(tmp_path / "elsewhere")  # a folder linked out: refused, not entered
    with pytest.raises(ValueError, match="linked resolves"):
        cp.confine_weight_files(str(d), root=root)


class _Worker:
    """The part of a vLLM worker the weight-loading methods touch before loading: ``_apply_weights`` records."""

    def __init__(self):
        self.applied = []

    def _apply_weights(self, version, **source):
        self.applied.append((version, source))
        return {"version": version}


@pytest.mark.parametrize("method", ["reload_and_repack", "load_sharded"])
def test_engine_refuses_a_version_folder_with_a_file_linked_out(root, tmp_path, monkeypatch, method):
    """The engine side (``EngineExtension.reload_and_repack``, ``WeightSyncExtension.load_sharded``) with
    ``MOE_RL_WEIGHTS_ROOT`` set: a folder inside the root whose shard is a symlink out is refused before anything is
    read or loaded; the same folder with the file copied in loads."""
    import moe_rl.weights.filesystem as fs
    from moe_rl.weights.engine import WeightSyncExtension

    class Worker(_Worker, WeightSyncExtension):
        pass

    reads = []
    monkeypatch.setattr(fs, "read_sharded", lambda path, names=None: reads.append(path) or [])
    monkeypatch.setenv(cp.WEIGHTS_ROOT_ENV, str(root))
    d = _version(root)
    outside = tmp_path / "elsewhere" / "evil.safetensors"
    outside.write_bytes(b"z" * 8)
    (d / "model-2.safetensors").symlink_to(outside)
    w = Worker()
    with pytest.raises(ValueError, match="model-2.safetensors resolves to .*outside"):
        getattr(w, method)("step_3", 4)
    assert w.applied == [] and reads == []
    (d / "model-2.safetensors").unlink()
    (d / "model-2.safetensors").write_bytes(outside.read_bytes())
    getattr(w, method)("step_3", 4)
    assert [v for v, _ in w.applied] == [4]


def test_read_sharded_refuses_an_index_that_names_files_outside_the_folder(tmp_path):
    import json

    from moe_rl.weights import filesystem as fs

    d = tmp_path / "step_1"
    d.mkdir()
    (d / fs.MARKER).write_text("")
    index = {"format": fs.SHARD_FORMAT, "files": {"../../etc/passwd": 10},
             "tensors": {"w": {"pieces": [["../../etc/passwd", "w", -1]]}}}
    (d / fs.SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="plain names"):
        fs.read_sharded(d)
