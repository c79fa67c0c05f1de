"""The authenticated control plane of the vLLM servers moe_rl starts: a per-run shared secret, the ASGI middleware
that demands it, and the engine-side confinement of weight paths.

Why: vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; with ``VLLM_SERVER_DEV_MODE=1`` (needed for ``/collective_rpc`` weight reloads and
``/reset_prefix_cache``) the control routes ``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache``
answer anyone who can reach the port.

- **Token** (:func:`ensure_token`, :func:`run_token`): a ``secrets.token_urlsafe(32)`` string, one per run. The
  single-node run writes it to ``<run_dir>/control_token`` (mode 0600) and exports it to its own children as the
  environment variable ``MOE_RL_CONTROL_TOKEN``; a Slurm job sets that variable itself. It is never printed, never
  written to ``config.json``, summaries or logs, and never put on a command line (``ps`` shows argv).
- **Middleware** (:class:`ControlTokenMiddleware`): loaded by the server through vLLM's
  ``--middleware moe_rl.inference.control_plane.ControlTokenMiddleware`` (vLLM adds a class with
  ``app.add_middleware(cls)``, no arguments, so the token reaches it through the server's environment). Every
  HTTP/WebSocket request except ``GET /health`` (and ``/metrics`` when ``MOE_RL_CONTROL_OPEN_METRICS=1``) must carry
  ``Authorization: Bearer <token>`` or ``X-MoE-RL-Control-Token: <token>``; the comparison is constant-time
  (``hmac.compare_digest`` of SHA-256 digests). Refusals answer 401 and are counted; each writes one line to the
  server's stderr with the method, path and running count (never the token). The server also gets
  ``VLLM_API_KEY=<token>`` so vLLM's own check on the OpenAI routes accepts the same header.
- **Worker methods** (:data:`RPC_METHODS`): with the right token, ``POST /collective_rpc`` still runs only the worker
  methods moe_rl's own clients call; the middleware reads the JSON body (vLLM's shape: ``{"method", "args",
  "kwargs", "timeout"}``), answers 403 with a JSON reason for any other ``method`` (vLLM's own ``reload_weights``,
  ``save_sharded_state``, a malformed body), counts it with the 401s and passes the accepted body on re-encoded, so
  vLLM parses exactly what was checked.
- **Weight paths** (:func:`confine_weights_path`): a path that arrives over the network names a version folder
  under the run's weights root (``MOE_RL_WEIGHTS_ROOT`` in the engine's environment, set at start); ``..``
  components, absolute paths outside the root and symlinks that lead out of it are refused, for the folder and
  (:func:`confine_weight_files`) for every file in it the engine may open.

This module imports only the standard library: the vLLM API-server process imports it (``import moe_rl`` and
``import moe_rl.inference`` are lazy and cheap).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

__all__ = [
    "TOKEN_ENV",
    "TOKEN_HEADER",
    "TOKEN_FILE",
    "WEIGHTS_ROOT_ENV",
    "OPEN_METRICS_ENV",
    "ControlTokenMiddleware",
    "new_token",
    "ensure_token",
    "run_token",
    "auth_headers",
    "token_from_env",
    "confine_weights_path",
    "confine_weight_files",
    "RPC_METHODS",
    "RPC_PATH",
    "MAX_RPC_BODY_BYTES",
    "TOKEN_MIN_CHARS",
    "TOKEN_MIN_DISTINCT",
    "TOKEN_CHARSET",
]

TOKEN_ENV = "MOE_RL_CONTROL_TOKEN"
"""Environment variable holding the run's control token (servers read it; clients send it)."""

TOKEN_HEADER = "X-MoE-RL-Control-Token"
"""Dedicated header accepted besides ``Authorization: Bearer <token>``."""

TOKEN_FILE = "control_token"
"""File name of the token in the run directory (mode 0600)."""

WEIGHTS_ROOT_ENV = "MOE_RL_WEIGHTS_ROOT"
"""Environment variable naming the folder every weight path given to the engine must lie in."""

OPEN_METRICS_ENV = "MOE_RL_CONTROL_OPEN_METRICS"
"""``1``: ``/metrics`` answers without the token (for a Prometheus scraper that cannot send it)."""

_MIN_TOKEN_CHARS = 16

TOKEN_MIN_CHARS = 32
"""The Slurm job refuses a token shorter than this (:func:`new_token` makes 43 characters)."""

TOKEN_MIN_DISTINCT = 8
"""The Slurm job refuses a token with fewer distinct characters (a floor against ``aaaa...``-style mistakes; no
check on a given string measures its entropy: make tokens with :func:`new_token`)."""

TOKEN_CHARSET = "A-Za-z0-9._~+/=-"
"""Characters the Slurm job accepts in a token (a bracket expression body): RFC 6750's ``b64token`` grammar, the
characters a Bearer token may hold, which covers ``secrets.token_urlsafe``, hex and base64 output."""

RPC_PATH = "/collective_rpc"

RPC_METHODS: frozenset[str] = frozenset({
    # moe_rl.inference.vllm_worker_ext.EngineExtension
    "reload_and_repack", "weight_version", "start_token_versions", "enable_routed_experts_capture",
    "pop_routed_experts", "enable_sampling_mask_capture", "pop_sampling_masks",
    # moe_rl.weights.engine.WeightSyncExtension
    "load_sharded", "init_weight_broadcast", "init_sharded_broadcast", "update_weights_from_broadcast",
    "close_weight_broadcast", "init_p2p", "update_weights_from_p2p", "update_weights_from_mooncake",
})
"""The worker methods ``POST /collective_rpc`` may name: exactly those ``VllmClient`` calls (checked by
``tests/inference/test_control_plane.py``). Anything else, vLLM's own worker methods included, is refused with 403."""

MAX_RPC_BODY_BYTES = 1 << 20
"""Largest ``/collective_rpc`` body the middleware reads (1 MiB; moe_rl's RPC bodies are a few hundred bytes: paths,
versions, endpoint lists, a store config); a larger one is refused with 403 before it is buffered whole."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def new_token() -> str:
    """A fresh control token: ``secrets.token_urlsafe(32)`` (43 URL-safe characters, 256 random bits)."""
    return secrets.token_urlsafe(32)


def _check_token(token: Any, source: str) -> str:
    if not isinstance(token, str) or len(token) < _MIN_TOKEN_CHARS or not token.isascii() or any(
        c.isspace() for c in token
    ):
        # never quote the value: it is a secret
        raise ValueError(
            f"control token from {source} is not usable: it must be an ASCII string of at least {_MIN_TOKEN_CHARS} "
            "characters without whitespace; generate one with `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return token


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The token in ``MOE_RL_CONTROL_TOKEN`` (of ``environ``, default ``os.environ``), or None when unset or empty.

    Raises:
        ValueError: the variable is set but too short or contains whitespace (the message does not quote it).
    """
    value = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    return _check_token(value, f"${TOKEN_ENV}") if value else None


def ensure_token() -> str:
    """This process's control token: ``MOE_RL_CONTROL_TOKEN`` when set, else a fresh one that is then set in
    ``os.environ`` (so every server this process starts and every client it makes share it)."""
    token = token_from_env()
    if token is None:
        token = new_token()
        os.environ[TOKEN_ENV] = token
    return token


def run_token(run_dir: str | os.PathLike, rotate: bool = False) -> str:
    """The run's token, kept in ``<run_dir>/control_token`` (mode 0600) and exported as ``MOE_RL_CONTROL_TOKEN``.

    Order: ``MOE_RL_CONTROL_TOKEN`` when set (a Slurm job's; it is also written to the file), else the file when it
    exists and ``rotate`` is False, else a fresh token (``rotate=True``: a new run replaces an earlier run's file). The file is created with ``O_EXCL`` and mode 0600, so it is never readable by others,
    not even for a moment.

    Raises:
        ValueError: the variable or the file holds an unusable token (the message names the source, not the value).
        PermissionError: the file exists with permissions beyond 0600 (fix: ``chmod 600`` it, or delete it).
    """
    path = Path(run_dir) / TOKEN_FILE
    token = token_from_env()
    if token is None and path.exists() and not rotate:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise PermissionError(
                f"run_token: {path} has mode {oct(mode)}; a control token must be readable by its owner only: run "
                f"`chmod 600 {path}` (and rotate it if others may have read it: delete the file)"
            )
        token = _check_token(path.read_text().strip(), str(path))
    if token is None:
        token = new_token()
    if not path.exists() or path.stat().st_mode & 0o077 or path.read_text().strip() != token:  # rewritten 0600
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    os.environ[TOKEN_ENV] = token
    return token


def auth_headers(token: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` for ``token`` (default: ``MOE_RL_CONTROL_TOKEN``); ``{}`` when no
    token is known."""
    token = token if token is not None else token_from_env()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class ControlTokenMiddleware:
    """Pure ASGI middleware: 401 for every request without the control token, except the open paths.

    Args:
        app: the wrapped ASGI app (vLLM passes it).
        token: the expected token; None reads ``MOE_RL_CONTROL_TOKEN`` from the environment.
        open_paths: paths served without the token; None: ``{"/health"}``, plus ``"/metrics"`` when
            ``MOE_RL_CONTROL_OPEN_METRICS=1``.

    Raises:
        RuntimeError: no token is given and ``MOE_RL_CONTROL_TOKEN`` is unset: a server loaded with this middleware
            refuses to start rather than run unguarded.
        ValueError: the token is unusable (too short, whitespace).

    ``refused`` counts the requests answered 401 or 403 (also written to stderr, one line each, without the token).
    ``POST /collective_rpc`` with the right token is answered 403 unless its JSON body's ``method`` is one of
    ``rpc_methods`` (default :data:`RPC_METHODS`).
    """

    def __init__(self, app: ASGIApp, token: str | None = None, open_paths: set[str] | None = None,
                 rpc_methods: frozenset[str] | None = None) -> None:
        self.app = app
        self.rpc_methods = RPC_METHODS if rpc_methods is None else frozenset(rpc_methods)
        if token is None:
            token = token_from_env()
            if token is None:
                raise RuntimeError(
                    f"ControlTokenMiddleware: ${TOKEN_ENV} is not set in the server's environment; start the server "
                    "through moe_rl (VllmServer sets it) or export the run's token"
                )
        self._digest = _digest(_check_token(token, "ControlTokenMiddleware(token=...)"))
        if open_paths is None:
            open_paths = {"/health"}
            if os.environ.get(OPEN_METRICS_ENV, "") == "1":
                open_paths.add("/metrics")
        self.open_paths = frozenset(open_paths)
        self.refused = 0

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the raw ASGI ``headers`` carry the token (Bearer or the dedicated header); constant-time."""
        presented: list[str] = []
        for name, value in headers:
            key = name.lower()
            text = value.decode("latin-1")
            if key == b"authorization":
                scheme, _, param = text.partition(" ")
                if scheme.lower() == "bearer":
                    presented.append(param.strip())
            elif key == TOKEN_HEADER.lower().encode():
                presented.append(text.strip())
        ok = False
        for candidate in presented:
            ok |= hmac.compare_digest(_digest(candidate), self._digest)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path in self.open_paths:
            await self.app(scope, receive, send)
            return
        if not self.authorized(list(scope.get("headers", []))):
            await self._refuse(scope, send, path, 401, "Unauthorized: missing or wrong moe_rl control token",
                               "without a valid control token")
            return
        if scope["type"] == "http" and path.rstrip("/") == RPC_PATH:
            body, reason = await self._rpc_body(receive)
            if reason is not None:
                await self._refuse(scope, send, path, 403, f"Forbidden: {reason}", f"({reason})")
                return
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            scope["headers"].append((b"content-length", str(len(body)).encode()))
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _rpc_body(self, receive: Receive) -> tuple[bytes, str | None]:
        """Read the whole ``/collective_rpc`` body; ``(canonical JSON body, None)`` when its ``method`` is allowed,
        else ``(b"", reason)`` (the reason quotes no argument: they may hold paths or addresses)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", "the client disconnected before the /collective_rpc body arrived"
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_RPC_BODY_BYTES:
                return b"", f"/collective_rpc body larger than {MAX_RPC_BODY_BYTES} bytes"
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            data = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return b"", "/collective_rpc body is not JSON"
        method = data.get("method") if isinstance(data, dict) else None
        if not isinstance(method, str) or method not in self.rpc_methods:
            shown = _printable(method)[:80] if isinstance(method, str) else type(method).__name__
            return b"", (f"/collective_rpc method {shown!r} is not one of moe_rl's worker methods "
                         f"({', '.join(sorted(self.rpc_methods))})")
        return json.dumps(data).encode(), None

    async def _refuse(self, scope: Scope, send: Send, path: str, status: int, error: str, why: str) -> None:
        self.refused += 1
        method = scope.get("method", "WS")
        print(f"moe_rl control plane: refused {_printable(method)} {_printable(path)} {why} ({status}; refusal "
              f"#{self.refused})", file=sys.stderr, flush=True)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that returns ``body`` as one ``http.request`` message, then defers to ``receive`` (which then
    reports the client's disconnect)."""
    sent = False

    async def replay() -> Mapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def confine_weights_path(path: Any, what: str = "path", root: str | os.PathLike | None = None) -> str:
    """Resolve a weight path received over the network under the weights root; refuse anything outside it.

    Args:
        path: a version folder or file: relative to the root (``"step_3"``) or absolute inside it.
        what: the argument's name, for messages (e.g. ``"reload_and_repack: path"``).
        root: the weights root; None reads ``MOE_RL_WEIGHTS_ROOT``. When neither is set the path is returned as
            given (an engine started without a root, e.g. by a test, is not confined).

    Returns:
        The resolved absolute path (symlinks followed) inside the root, or ``path`` unchanged without a root.

    Raises:
        ValueError: ``path`` is not a non-empty string, contains a ``..`` component or a NUL, or resolves (symlinks
            followed) outside the root. Nothing is read.
    """
    if root is None:
        root = os.environ.get(WEIGHTS_ROOT_ENV) or None
    if root is None:
        return path
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"{what}={path!r} must be a non-empty string naming a folder under the weights root {root}")
    if ".." in Path(path).parts:
        raise ValueError(
            f"{what}={path!r} contains '..'; name a version folder under the weights root {root} (e.g. 'step_3')"
        )
    root_real = os.path.realpath(root)
    candidate = path if os.path.isabs(path) else os.path.join(root_real, path)
    real = os.path.realpath(candidate)
    if real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"{what}={path!r} resolves to {real}, outside the engine's weights root {root_real} "
            f"(${WEIGHTS_ROOT_ENV}); the engine loads only from inside it: publish there, or start the engine "
            "with that root"
        )
    return real


def confine_weight_files(folder: Any, what: str = "path", root: str | os.PathLike | None = None) -> int:
    """Refuse a version folder under the weights root any of whose entries leads outside the root.

    :func:`confine_weights_path` checks the folder a request names; the engine then opens the files in it (vLLM's
    loader globs ``*.safetensors`` and reads the index, ``read_sharded`` opens the shards the index lists), and any of
    those may be a symlink to a file elsewhere. This walks ``folder`` (subfolders included, symlinked folders not
    entered) and resolves every entry, symlinks followed, before anything is read.

    Args:
        folder: the resolved version folder (:func:`confine_weights_path`'s result).
        what: the argument's name, for messages.
        root: the weights root; None reads ``MOE_RL_WEIGHTS_ROOT``. When neither is set nothing is checked (an
            engine started without a root is not confined) and 0 is returned.

    Returns:
        The number of entries checked.

    Raises:
        ValueError: an entry resolves outside the root (a symlink out, or a dangling link); the message names the
            entry and where it leads. Nothing is read.

    A check, then an open: whoever can replace a checked file between the two can already write into the root.
    """
    if root is None:
        root = os.environ.get(WEIGHTS_ROOT_ENV) or None
    if root is None:
        return 0
    root_real = os.path.realpath(root)
    prefix = root_real.rstrip(os.sep) + os.sep
    checked = 0
    for dirpath, dirnames, filenames in os.walk(folder):  # followlinks=False: a linked folder is checked, not entered
        for name in [*dirnames, *filenames]:
            entry = os.path.join(dirpath, name)
            real = os.path.realpath(entry)
            checked += 1
            if not real.startswith(prefix) or not os.path.exists(real):
                raise ValueError(
                    f"{what}: {entry} resolves to {real}, "
                    + ("which does not exist" if real.startswith(prefix) else f"outside the engine's weights root {root_real}")
                    + f" (${WEIGHTS_ROOT_ENV}); every file of a version folder must lie inside the root (no symlinks "
                    "out): copy the file in instead of linking it; nothing was loaded"
                )
    return checked


def _printable(text: str) -> str:
    """``text`` as is when every character is printable, else its ``repr`` (a request path from the network must not
    write control characters, e.g. a forged log line, into the engine's log)."""
    return text if text.isprintable() else repr(text)
