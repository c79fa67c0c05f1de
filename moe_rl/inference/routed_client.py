"""``RoutedClient``: one ``generate`` over several vLLM engines, each request placed by a ``RequestRouter``.

It takes ``VllmClient.generate``'s arguments (the ``session_id`` option, the rollout / trajectory id of a
multi-turn rollout, keeps its turns on one engine), so an orchestrator written against one ``VllmClient`` can drive N engines. Around each request it calls
``router.route`` + ``router.on_start`` (with no ``await`` in between, so concurrent requests see each other's
load) and ``router.on_finish`` with the ``prompt + output`` of every completion and the engine's reported
``cached_tokens`` (also on failure or cancellation, marked failed).

It also fans the engine-wide calls of ``moe_rl.inference.InferenceClient`` (``update_weights``,
``weight_version``, ``pause``/``resume``/``is_paused``, ``reset_prefix_cache``, ``health``) out to every engine,
so it satisfies that protocol and the orchestrator can use it in place of one ``VllmClient``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from moe_rl.inference.client import Completion, EngineFanOut, VllmClient
from moe_rl.inference.protocol import GenerateOptions, check_generate_args
from moe_rl.inference.router import RequestRouter

__all__ = ["RoutedClient", "RoutedResult"]


@dataclass
class RoutedResult:
    """One routed request.

    Attributes:
        completions: as ``VllmClient.generate`` returns them, ``n`` of them.
        cached_tokens: prompt tokens the engine served from its prefix cache.
        engine: index of the engine that served it.
        predicted_hit_blocks: the router's prediction of ``cached_tokens // block_size`` on that engine.
        latency_s: wall time of the HTTP request, seconds.
    """

    completions: list[Completion]
    cached_tokens: int
    engine: int
    predicted_hit_blocks: int
    latency_s: float


class RoutedClient(EngineFanOut):
    """Routes ``generate`` calls over ``clients`` (one ``VllmClient`` per engine) with ``router``.

    Args:
        clients: one client per engine; index i is the router's engine i.
        router: a ``RequestRouter`` with ``num_engines == len(clients)``.

    Raises:
        ValueError: no clients, or the router was built for another number of engines.
    """

    def __init__(self, clients: Sequence[VllmClient], router: RequestRouter):
        if not clients:
            raise ValueError("RoutedClient: clients is empty; pass one VllmClient per engine")
        if router.num_engines != len(clients):
            raise ValueError(
                f"RoutedClient: router.num_engines={router.num_engines} but {len(clients)} clients were given; "
                "build the router with num_engines=len(clients)"
            )
        self.clients = list(clients)
        self.router = router
        self._ids = itertools.count()

    @property
    def return_routed_experts(self) -> bool:
        """True when every engine's client records routed experts (R3)."""
        return all(c.return_routed_experts for c in self.clients)

    @property
    def routed_experts_counts(self) -> dict[str, int]:
        """The clients' ``routed_experts_counts`` summed over the engines."""
        total: dict[str, int] = {}
        for c in self.clients:
            for k, v in c.routed_experts_counts.items():
                total[k] = total.get(k, 0) + v
        return total

    async def __aenter__(self) -> RoutedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every client's connection pool."""
        for c in self.clients:
            await c.aclose()

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       **options: Unpack[GenerateOptions]) -> tuple[list[Completion], int]:
        """See ``InferenceClient.generate``; runs on the engine the router picks. The ``session_id`` option groups
        the turns of one multi-turn rollout (sticky sessions). Errors: those of ``generate_routed``."""
        r = await self.generate_routed(prompt_ids, n, max_tokens, temperature, **options)
        return r.completions, r.cached_tokens

    async def generate_routed(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                              **options: Unpack[GenerateOptions]) -> RoutedResult:
        """Like ``generate`` but also returns the engine, the router's predicted hit and the latency.

        Raises:
            ValueError, TypeError: as ``check_generate_args`` (checked before routing), or as
                ``VllmClient.generate``.
            VllmRequestError: the engine rejected the request (the router records it as failed).
        """
        check_generate_args("RoutedClient.generate", prompt_ids, n, max_tokens, temperature, options)
        cache_salt, session_id = options.get("cache_salt"), options.get("session_id")
        decision = self.router.route(prompt_ids, cache_salt, session_id)
        request_id = f"routed-{next(self._ids)}"
        engine = decision.engine
        self.router.on_start(engine, request_id, len(prompt_ids) + n * max_tokens, decision=decision)
        t0 = time.perf_counter()
        try:
            # the session is spent here, on the choice of engine: the engine itself is not asked to route
            forward = {k: v for k, v in options.items() if k != "session_id"}
            completions, cached = await self.clients[engine].generate(prompt_ids, n, max_tokens, temperature, **forward)
        except BaseException:
            self.router.on_finish(engine, request_id, failed=True)
            raise
        latency = time.perf_counter() - t0
        prompt = list(prompt_ids)
        self.router.on_finish(
            engine, request_id, [prompt + c.token_ids for c in completions], cached_tokens=cached
        )
        return RoutedResult(completions, cached, engine, decision.predicted_hit_blocks[engine], latency)

    def end_session(self, session_id: str) -> bool:
        """Forget a finished rollout's pin (``RequestRouter.end_session``)."""
        return self.router.end_session(session_id)

    # ------------------------------------------------------------------ engine-wide calls (every engine)
    async def _gather(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every engine concurrently; every call's result or exception, once all have finished."""
        return list(await asyncio.gather(*(getattr(c, method)(*args, **kwargs) for c in self.clients),
                                         return_exceptions=True))  # fmt: skip

    def _raise_failed(self, method: str, results: list[Any], done: str) -> None:
        """Raise the first engine's exception in ``results``, with a note naming every failed engine and ``done``
        (what happened on the others)."""
        failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            first = results[failed[0]]
            first.add_note(f"RoutedClient.{method}: failed on engines {failed} of {len(self.clients)}; {done}")
            raise first

    def _engine_clients(self) -> list[VllmClient]:
        return self.clients

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every engine concurrently; returns once every call has finished, then raises the first
        engine's error (with a note naming every failed engine) if any failed."""
        results = await self._gather(method, *args, **kwargs)
        self._raise_failed(method, results, "the other engines' calls completed")
        return results

    async def weight_version(self) -> int:
        """The weight version every engine serves.

        Raises:
            RuntimeError: the engines disagree (a partial update); the message lists each engine's version.
        """
        versions = [int(v) for v in await self._all("weight_version")]
        if len(set(versions)) != 1:
            raise RuntimeError(f"RoutedClient.weight_version: engines serve different versions {versions}")
        return versions[0]

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Pause every engine (``VllmClient.pause``)."""
        await self._all("pause", mode=mode, clear_cache=clear_cache)
        if clear_cache:
            self.router.reset_engine_cache()

    async def is_paused(self) -> bool:
        """True when any engine is paused."""
        return any(await self._all("is_paused"))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Reset every engine's prefix cache; the router forgets the cache model of each engine that reset.

        Returns:
            True once every engine reset (a reset that did not complete raises; it is never a False return).

        Raises:
            Exception: the first engine error, after the cache model of every engine that did reset was cleared (a
                note lists the failed engines).
            PrefixCacheResetError: an engine answered something other than True (its cache model is kept).
        """
        from moe_rl.inference.protocol import PrefixCacheResetError

        results = await self._gather("reset_prefix_cache", reset_running_requests=reset_running_requests)
        for engine, ok in enumerate(results):
            if ok is True:
                self.router.reset_engine_cache(engine)
        self._raise_failed("reset_prefix_cache", results, "the router forgot the cache model of the engines that reset")
        failed = [i for i, ok in enumerate(results) if ok is not True]
        if failed:
            raise PrefixCacheResetError(
                f"RoutedClient.reset_prefix_cache: engines {failed} of {len(self.clients)} did not reset their prefix "
                f"cache (reset_running_requests={reset_running_requests}); the router kept their cache model"
            )
        return True

    async def health(self) -> bool:
        """True when every engine is healthy (never raises)."""
        return all(await self._all("health"))
