"""``ProxiedClient``: generation through a prefill/decode (P/D) proxy, engine-wide calls to every engine replica.

In a disaggregated deployment (``inference.mode = "disaggregated"``) a request must go through the P/D proxy
(``vllm-router --vllm-pd-disaggregation``): it sends the prompt to a prefill replica, then the decode replica pulls
the KV (NIXL) and samples. The orchestrator's other calls are engine-wide and go to every replica directly (the proxy does
not forward them): ``update_weights`` (prefill and decode must serve the same weights: the decode replica samples
from KV the prefill replica computed), ``weight_version``, ``pause`` / ``resume`` / ``is_paused``,
``reset_prefix_cache`` and ``health``.

Per-token policy versions are not tracked: ``moe_rl.inference.token_versions.VersionTracker`` needs the reload
reports of the engine that served a request, keyed by a request id known before the request starts, and
vllm-router 0.1.17 in P/D mode replaces the client's id with its own (``___prefill_addr_<P>___decode_addr_<D>_<uuid>``,
on both stages; the client sees it only in the response's ``id``). Every completion carries
``version_segments=None``, so the orchestrator ages all its tokens from the rollout's start version (prime-rl's
rule); ``completions_without_versions`` counts them. Engine-side routing capture (router replay) is not available
either (``return_routed_experts`` is False): the decode engine never forwards the prompt positions whose KV it
received, so its record lacks them (the prefill engine's record under the router's id covers the prompt).

In P/D mode the router authenticates to the engines with ``OPENAI_API_KEY`` from its own environment (it drops the
client's ``Authorization`` header): start it with ``OPENAI_API_KEY`` set to the run's control token. Tested on the
CPU build with vLLM's ``NixlConnector`` (``nixl`` package installed) and its shared-storage ``ExampleConnector``
(``tests/inference/test_pd_nixl_vllm.py``, ``test_pd_disagg_vllm.py``).

The methods follow ``moe_rl.inference.InferenceClient`` (``protocol.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Unpack

from moe_rl.inference.client import Completion, EngineFanOut, VllmClient
from moe_rl.inference.protocol import GenerateOptions

__all__ = ["ProxiedClient", "EngineCallError"]


class EngineCallError(RuntimeError):
    """An engine-wide call failed on some replicas; ``failures`` maps each failed replica's name to its exception
    (the calls on the other replicas completed)."""

    def __init__(self, method: str, failures: dict[str, BaseException], total: int):
        detail = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failures.items())
        super().__init__(f"ProxiedClient.{method} failed on {len(failures)} of {total} engine replicas ({detail}); "
                         "the calls on the other replicas completed")
        self.method = method
        self.failures = failures


class ProxiedClient(EngineFanOut):
    """``generate`` through ``proxy_url``; engine-wide calls fanned out to ``engine_urls``.

    Args:
        proxy_url: the P/D proxy's base URL (``http://host:port``; it serves ``/v1/completions``).
        engine_urls: ``[(name, url)]``, one per engine replica API server (e.g. ``("prefill.0", "http://h:8000")``);
            names appear in error messages and reports.
        model: the engines' ``served_model_name``.
        timeout_s: per-request timeout in seconds (generation and weight loads).
        control_token: the run's control token, sent to the proxy and every replica (``VllmClient``); None:
            ``MOE_RL_CONTROL_TOKEN``.

    Raises:
        ValueError: no engine URLs, or two replicas with the same name or URL.
    """

    return_routed_experts = False
    """Routing capture needs the serving engine; never available behind the proxy."""

    def __init__(self, proxy_url: str, engine_urls: Sequence[tuple[str, str]], model: str = "policy",
                 timeout_s: float = 600.0, control_token: str | None = None):
        engine_urls = list(engine_urls)
        if not engine_urls:
            raise ValueError("ProxiedClient: engine_urls is empty; pass one (name, url) per engine replica")
        names = [n for n, _ in engine_urls]
        urls = [u.rstrip("/") for _, u in engine_urls]
        if len(set(names)) != len(names) or len(set(urls)) != len(urls):
            raise ValueError(f"ProxiedClient: engine_urls={engine_urls} repeats a name or a URL; give each replica once")
        self.proxy = VllmClient(proxy_url, model=model, timeout_s=timeout_s, track_token_versions=False,
                                control_token=control_token)
        self.engines = {n: VllmClient(u, model=model, timeout_s=timeout_s, track_token_versions=False,
                                      control_token=control_token)
                        for n, u in zip(names, urls, strict=True)}
        self.completions_without_versions = 0
        """Completions returned with ``version_segments=None`` (all of them: versions are not tracked here)."""

    async def __aenter__(self) -> ProxiedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the proxy's and every engine's connection pool."""
        for c in (self.proxy, *self.engines.values()):
            await c.aclose()

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       **options: Unpack[GenerateOptions]) -> tuple[list[Completion], int]:
        """See ``InferenceClient.generate``; sent through the proxy (errors as ``VllmClient.generate``), and every
        completion's ``version_segments`` is None."""
        completions, cached = await self.proxy.generate(prompt_ids, n, max_tokens, temperature, **options)
        for c in completions:
            c.version_segments = None
        self.completions_without_versions += len(completions)
        return completions, cached

    def _engine_clients(self) -> list[VllmClient]:
        return list(self.engines.values())

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``method`` on every engine replica concurrently; ``{name: result}`` once all finished.

        Raises:
            EngineCallError: one or more replicas failed (every failure named; the others completed).
        """
        names = list(self.engines)
        results = await asyncio.gather(*(getattr(self.engines[n], method)(*args, **kwargs) for n in names),
                                       return_exceptions=True)
        failures = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)}
        if failures:
            raise EngineCallError(method, failures, len(names)) from next(iter(failures.values()))
        return dict(zip(names, results, strict=True))

    async def weight_version(self) -> int:
        """The weight version every replica serves.

        Raises:
            RuntimeError: the replicas disagree (a partial update); the message lists each one's version.
        """
        versions = {n: int(v) for n, v in (await self._all("weight_version")).items()}
        if len(set(versions.values())) != 1:
            raise RuntimeError(f"ProxiedClient.weight_version: engine replicas serve different versions {versions}")
        return next(iter(versions.values()))

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Pause every replica (``VllmClient.pause``)."""
        await self._all("pause", mode=mode, clear_cache=clear_cache)

    async def is_paused(self) -> bool:
        """True when any replica is paused."""
        return any((await self._all("is_paused")).values())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Reset every replica's prefix cache; returns True once all reset.

        Raises:
            EngineCallError: a replica raised (e.g. ``PrefixCacheResetError``: its reset did not complete).
            PrefixCacheResetError: a replica answered something other than True (a reset that did not complete is
                an error, never a False return).
        """
        from moe_rl.inference.protocol import PrefixCacheResetError

        results = await self._all("reset_prefix_cache", reset_running_requests=reset_running_requests)
        failed = sorted(n for n, ok in results.items() if ok is not True)
        if failed:
            raise PrefixCacheResetError(
                f"ProxiedClient.reset_prefix_cache: replicas {failed} did not reset their prefix cache "
                f"(reset_running_requests={reset_running_requests}); their KV from older weights may be served"
            )
        return True

    async def health(self) -> bool:
        """True when the proxy and every replica answer ``/health`` with 200 (never raises)."""
        checks = await asyncio.gather(self.proxy.health(), *(c.health() for c in self.engines.values()))
        return all(checks)
