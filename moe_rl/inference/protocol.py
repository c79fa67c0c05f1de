"""``InferenceClient``: what the orchestrator needs from one inference engine, as a runtime-checkable Protocol.

``moe_rl.inference.VllmClient`` implements it for vLLM (GPU or CPU build); a test double or another engine
(SGLang, a remote pool) only has to provide these coroutines. ``moe_rl.runtime.orchestrator.EngineClient`` is the
subset the current orchestrator loop calls (generate, update_weights, weight_version).

Contract of each method (``VllmClient``'s docstrings give the vLLM details):

- ``generate(prompt_ids, n, max_tokens, temperature, cache_salt=None, seed=None, stop_token_ids=None,
  extra_body=None) -> (completions, cached_prompt_tokens)``: token ids in, ``n`` completions out, each with
  ``token_ids [num_generated]``, ``logprobs [num_generated]`` (sampler logprobs), ``finish_reason``,
  ``version_segments`` (``[(policy version, first token index), ...]`` or None = unknown) and
  ``routed_experts`` (``moe_rl.replay.RoutedExperts`` or None when the engine does not record routing).
  ``cache_salt`` namespaces the prefix cache (one salt per weight version).
- ``update_weights(path, version) -> report``: load an HF checkpoint folder in place; requests in flight are not
  aborted. Afterwards ``weight_version() == version``.
- ``weight_version() -> int``: the version of the weights being served (0 before the first update).
- ``pause(mode="keep", clear_cache=False)`` / ``resume()`` / ``is_paused()``: freeze scheduling (in-flight
  requests kept with ``"keep"``), e.g. around a multi-step weight push.
- ``reset_prefix_cache(reset_running_requests=False) -> bool``: drop the prefix cache; returns True once every
  cached block is gone and raises :class:`PrefixCacheResetError` when the reset does not complete (e.g. running
  requests hold blocks and ``reset_running_requests`` is False). A reset that did not happen is never reported
  as a return value or a warning only: stale KV computed under old weights would be served silently.
- ``health() -> bool``: never raises; False when unreachable.

``isinstance(obj, InferenceClient)`` checks that every method exists (not their signatures; Python's
``runtime_checkable`` semantics).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["InferenceClient", "PrefixCacheResetError"]


class PrefixCacheResetError(RuntimeError):
    """A prefix-cache reset that did not complete: the engine still holds KV computed under older weights.

    Raised by every ``reset_prefix_cache`` implementation instead of returning False or logging a warning. With
    ``reset_running_requests=True`` vLLM preempts the running requests (they keep their generated tokens and
    recompute their KV under the current weights), so the reset completes even while requests run.
    """


@runtime_checkable
class InferenceClient(Protocol):
    """One inference engine as the orchestrator sees it (see the module docstring for the contract)."""

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
    ) -> tuple[list[Any], int]: ...

    async def update_weights(self, path: str, version: int) -> dict[str, Any]: ...

    async def weight_version(self) -> int: ...

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...

    async def health(self) -> bool: ...
