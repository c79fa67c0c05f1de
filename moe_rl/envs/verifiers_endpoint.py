"""The environment-side endpoint of :mod:`moe_rl.envs.verifiers_env`: a loopback HTTP server that speaks vLLM's
token-in/token-out ``POST /inference/v1/generate`` wire format and hands every request to a Python coroutine. It is
the format adapter between a client that renders chat prompts to token ids itself (the ``renderers`` package, used
by ``verifiers`` training clients) and moe_rl's engine path (the episode's ``ctx.generate``); it never talks to an
engine itself.

The client posts ``{"model", "token_ids": [P], "sampling_params": {...}, "cache_salt"?}``; the endpoint parses it
into a :class:`GenerateRequest` and awaits ``handler(request)``, which returns a :class:`GenerateResult` (sampled
ids ``[k]``, the engine's log-probs ``[k]``, the finish reason). The reply is what that client accepts::

    {"request_id": ..., "prompt_token_ids": [P],
     "choices": [{"index": 0, "token_ids": [k], "finish_reason": "stop",
                  "logprobs": {"content": [{"token": "token_id:<id>", "logprob": <float>}, ...]}}],
     "usage": {"prompt_tokens": P, "completion_tokens": k, "total_tokens": P + k}}

Every log-prob entry names its token as ``"token_id:<id>"`` (the client checks it against ``token_ids``); vLLM 0.32's
own reply names tokens by text, which is why the adapter exists. ``GET /v1/models`` lists the served model with its
``max_model_len`` (the client's pre-flight length check). Routed experts are not put on the wire: the handler
records them on moe_rl's side (:mod:`moe_rl.envs.runner`), where per-token versions and router replay are kept.

Handler errors: ``ValueError``/``TypeError`` -> HTTP 400, anything else -> 500, each with ``{"error": {"message"}}``
(vLLM's error shape), so the client raises and its episode fails. A body that is not this format -> 400 naming the
field; a body over 64 MiB -> 413; an unknown path -> 404; a method other than POST on the generate path -> 405.

Serving: :class:`GenerateApp` is a plain ASGI 3 application (usable in process through ``httpx.ASGITransport``);
:class:`GenerateEndpoint` serves it on a loopback socket with ``uvicorn`` (the ``envs`` extra) inside the running
event loop, because verifiers builds its own HTTP client from a base URL and takes no injected transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GenerateApp", "GenerateEndpoint", "GenerateRequest", "GenerateResult", "parse_generate_body",
           "render_generate_reply"]

MAX_BODY_BYTES = 64 << 20
"""The largest request body accepted (bytes); a prompt of millions of token ids still fits."""

_GENERATE_PATHS = ("/inference/v1/generate", "/v1/inference/v1/generate")
_MODELS_PATHS = ("/v1/models", "/models")


@dataclass(frozen=True)
class GenerateRequest:
    """One ``/inference/v1/generate`` request.

    Attributes:
        model: the ``model`` field.
        prompt_ids: the prompt token ids (>= 1).
        max_tokens: tokens to sample (>= 1), or None when the client set none.
        temperature: the sampling temperature, or None.
        seed: the client's sampling seed, or None.
        stop_token_ids: ids that end the completion (the renderer's stop tokens).
        cache_salt: the top-level ``cache_salt``, or None.
        sampling_params: every ``sampling_params`` entry as sent (the fields above included).
        headers: the request headers, names lower-cased (e.g. ``x-session-id``).
    """

    model: str
    prompt_ids: list[int]
    max_tokens: int | None
    temperature: float | None
    seed: int | None
    stop_token_ids: list[int]
    cache_salt: str | None
    sampling_params: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateResult:
    """What the handler returns for one request.

    Attributes:
        token_ids: the sampled ids ``[k]`` (a stop token included when it ended the completion).
        logprobs: the engine's log-prob of each sampled token ``[k]`` (finite floats, natural log).
        finish_reason: ``"stop"``, ``"length"`` or the engine's.
        request_id: the id reported back (default: a fresh one).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    request_id: str = ""


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
        raise ValueError(f"{name} must be a list of token ids (ints >= 0), got {str(v)[:80]}")
    return list(v)


def parse_generate_body(body: Any, headers: Mapping[str, str] | None = None) -> GenerateRequest:
    """Parse a ``/inference/v1/generate`` JSON body.

    Args:
        body: the decoded JSON object.
        headers: the request headers (stored lower-cased).

    Returns:
        The :class:`GenerateRequest`.

    Raises:
        ValueError: not an object, no/empty ``token_ids``, ``sampling_params`` not an object, or a field of the
            wrong type (the message names it). Multimodal requests (``features``, ``content_parts``) are refused:
            the adapter carries token ids only.
    """
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in ("features", "content_parts"):
        if key in body:
            raise ValueError(f"{key!r} (multimodal input) is not supported: send text prompts as token_ids only")
    prompt = _int_list(body.get("token_ids"), "token_ids")
    if not prompt:
        raise ValueError("token_ids is empty; a prompt holds at least one token")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise ValueError(f"sampling_params must be an object, got {type(sp).__name__}")
    mt = sp.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise ValueError(f"sampling_params.max_tokens={mt!r} must be an int >= 1")
    temp = sp.get("temperature")
    if temp is not None and (isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp)):
        raise ValueError(f"sampling_params.temperature={temp!r} must be a finite number")
    seed = sp.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling_params.seed={seed!r} must be an int")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt={salt!r} must be a string")
    return GenerateRequest(model=str(body.get("model", "")), prompt_ids=prompt, max_tokens=mt,
                           temperature=None if temp is None else float(temp), seed=seed,
                           stop_token_ids=_int_list(sp.get("stop_token_ids") or [], "sampling_params.stop_token_ids"),
                           cache_salt=salt, sampling_params=dict(sp),
                           headers={k.lower(): v for k, v in (headers or {}).items()})


def render_generate_reply(request: GenerateRequest, result: GenerateResult) -> dict[str, Any]:
    """The JSON reply for ``result`` (module docstring).

    Raises:
        ValueError: ``token_ids`` and ``logprobs`` differ in length, or a log-prob is not finite.
    """
    ids = [int(t) for t in result.token_ids]
    lps = [float(x) for x in result.logprobs]
    if len(ids) != len(lps):
        raise ValueError(f"GenerateResult: {len(ids)} token ids but {len(lps)} log-probs; give one per token")
    if not all(math.isfinite(x) for x in lps):
        raise ValueError("GenerateResult.logprobs holds a non-finite value; the engine must return sampler log-probs")
    n_prompt = len(request.prompt_ids)
    return {
        "request_id": result.request_id or f"gen-{uuid.uuid4().hex}",
        "prompt_token_ids": list(request.prompt_ids),
        "choices": [{
            "index": 0,
            "token_ids": ids,
            "finish_reason": result.finish_reason,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": x} for t, x in zip(ids, lps, strict=True)]},
        }],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)},
    }


Handler = Callable[[GenerateRequest], Awaitable[GenerateResult]]


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


class GenerateApp:
    """The endpoint as an ASGI 3 application (module docstring): ``POST /inference/v1/generate`` and
    ``GET /v1/models``; any other ASGI scope than ``http`` is refused with ``TypeError``.

    Args:
        handler: ``async handler(request) -> GenerateResult``.
        model: the model name listed by ``GET /v1/models``.
        max_model_len: the context limit (tokens) listed there (None: not listed, the client skips its length
            check).

    Attributes:
        requests: generate requests that reached the handler (well-formed bodies).

    Raises:
        TypeError: ``handler`` is not callable.
    """

    def __init__(self, handler: Handler, *, model: str, max_model_len: int | None = None) -> None:
        if not callable(handler):
            raise TypeError(f"handler is a {type(handler).__name__}; pass an async function(request) -> GenerateResult")
        self.handler = handler
        self.model = model
        self.max_model_len = max_model_len
        self.requests = 0

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            raise TypeError(f"GenerateApp serves HTTP only, got an ASGI {scope['type']!r} scope")
        raw, too_large = bytearray(), False
        while True:  # read the whole body (or stop counting past the limit)
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away: nobody to answer
            if not too_large:
                raw += message.get("body", b"")
                too_large = len(raw) > MAX_BODY_BYTES
            if not message.get("more_body", False):
                break
        if too_large:
            status, payload = 413, _error(f"the request body is over {MAX_BODY_BYTES} bytes")
        else:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            status, payload = await self._route(scope["method"], scope["path"], headers, bytes(raw))
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        path = path.rstrip("/")
        if path in _MODELS_PATHS:
            card: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": "moe_rl"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return 200, {"object": "list", "data": [card]}
        if path not in _GENERATE_PATHS:
            return 404, _error(f"no route {path!r}; this endpoint serves POST /inference/v1/generate and "
                               "GET /v1/models")
        if method != "POST":
            return 405, _error(f"{method} {path}: use POST")
        try:
            request = parse_generate_body(json.loads(raw or b"null"), headers)
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            return 400, _error(f"bad /inference/v1/generate request: {exc}")
        self.requests += 1
        try:
            return 200, render_generate_reply(request, await self.handler(request))
        except (ValueError, TypeError) as exc:
            return 400, _error(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported to the client, which fails its episode
            return 500, _error(f"{type(exc).__name__}: {exc}")


def _import_uvicorn() -> Any:
    try:
        import uvicorn
    except ImportError as exc:
        raise ImportError("GenerateEndpoint serves with `uvicorn`: pip install 'moe_rl[envs]'") from exc
    return uvicorn


class GenerateEndpoint:
    """:class:`GenerateApp` served on a loopback port by ``uvicorn``, in the running event loop (module docstring).

    Args:
        handler: ``async handler(request) -> GenerateResult``.
        model: the model name listed by ``GET /v1/models``.
        max_model_len: the context limit (tokens) listed there, or None.
        host: the address to bind (loopback by default).
        shutdown_timeout_s: seconds :meth:`close` lets requests in flight finish before cancelling them (> 0).

    Use ``await start()`` (binds a free port; :attr:`base_url` is then ``http://host:port/v1``) and
    ``await close()``, or ``async with``. The server installs no signal handlers and leaves logging configuration
    alone (only uvicorn's own loggers are set to WARNING; no access log). Idle keep-alive connections are kept for
    300 s, longer than ``httpx`` clients keep theirs (5 s), so the client always closes an idle connection first
    and never sends on one the server is closing.

    Raises:
        TypeError: ``handler`` is not callable.
        ValueError: ``shutdown_timeout_s`` is not a positive number.
    """

    def __init__(self, handler: Handler, *, model: str, max_model_len: int | None = None, host: str = "127.0.0.1",
                 shutdown_timeout_s: float = 5.0) -> None:
        if isinstance(shutdown_timeout_s, bool) or not isinstance(shutdown_timeout_s, (int, float)) or not (
                shutdown_timeout_s > 0):
            raise ValueError(f"shutdown_timeout_s={shutdown_timeout_s!r} must be a number > 0 (seconds)")
        self.app = GenerateApp(handler, model=model, max_model_len=max_model_len)
        self.host = host
        self.port = 0
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self._server: Any = None
        self._task: asyncio.Task | None = None

    @property
    def requests(self) -> int:
        """Generate requests that reached the handler."""
        return self.app.requests

    @property
    def base_url(self) -> str:
        """``http://<host>:<port>/v1`` (the OpenAI-style base URL clients take)."""
        if self._task is None:
            raise RuntimeError("GenerateEndpoint is not started; await start() first")
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> GenerateEndpoint:
        """Bind a free port on ``host`` and serve until :meth:`close` (a second call does nothing).

        Raises:
            ImportError: ``uvicorn`` is not installed.
            OSError: the address cannot be bound.
        """
        if self._task is not None:
            return self
        uvicorn = _import_uvicorn()

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # the run owns SIGINT/SIGTERM, not this server
                yield

        # ceil: uvicorn's graceful-shutdown timeout is whole seconds
        config = uvicorn.Config(self.app, interface="asgi3", http="h11", ws="none", lifespan="off",
                                log_config=None, log_level="warning", access_log=False, proxy_headers=False,
                                server_header=False, timeout_keep_alive=300,
                                timeout_graceful_shutdown=math.ceil(self.shutdown_timeout_s))
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))  # bound here, so a bind error is an OSError and not uvicorn's sys.exit
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name="moe_rl-generate-endpoint")
        while not server.started:
            if task.done():
                sock.close()
                task.result()  # raises the startup error
                raise RuntimeError("the generate endpoint stopped during startup")
            await asyncio.sleep(0.005)
        self.port = sock.getsockname()[1]
        self._server, self._task = server, task
        return self

    async def close(self) -> None:
        """Stop accepting connections, let requests in flight finish (at most ``shutdown_timeout_s``), stop."""
        server, task, self._server, self._task = self._server, self._task, None, None
        if task is None:
            return
        server.should_exit = True
        await task

    async def __aenter__(self) -> GenerateEndpoint:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
