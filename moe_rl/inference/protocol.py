"""``InferenceClient``: what the orchestrator needs from one inference engine, as a runtime-checkable Protocol.

``moe_rl.inference.VllmClient`` implements it for vLLM (GPU or CPU build); a test double or another engine
(SGLang, a remote pool) only has to provide these coroutines. ``moe_rl.runtime.orchestrator.EngineClient`` is the
subset the current orchestrator loop calls (generate, update_weights, weight_version).

Contract of each method (``VllmClient``'s docstrings give the vLLM details):

- ``generate(prompt_ids, n, max_tokens, temperature, **options) -> (completions, cached_prompt_tokens)``, the
  options keyword-only (:class:`GenerateOptions`: ``cache_salt``, ``seed``, ``stop_token_ids``, ``extra_body``,
  each None by default): token ids in, ``n`` completions out, each with
  ``token_ids [num_generated]``, ``logprobs [num_generated]`` (sampler logprobs), ``finish_reason``,
  ``version_segments`` (``[(policy version, first token index), ...]`` or None = unknown) and
  ``routed_experts`` (``moe_rl.replay.RoutedExperts`` or None when the engine does not record routing) and
  optionally ``sampling_mask`` (``moe_rl.rl.sampling_mask.SamplingMask``: each generated token's top-k / top-p kept
  set, or None when not recorded; an engine without it may omit the attribute).
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

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

__all__ = ["GenerateOptions", "InferenceClient", "PrefixCacheResetError", "check_generate_args",
           "init_sharded_broadcast_split"]


class PrefixCacheResetError(RuntimeError):
    """A prefix-cache reset that did not complete: the engine still holds KV computed under older weights.

    Raised by every ``reset_prefix_cache`` implementation instead of returning False or logging a warning. With
    ``reset_running_requests=True`` vLLM preempts the running requests (they keep their generated tokens and
    recompute their KV under the current weights), so the reset completes even while requests run.
    """


class GenerateOptions(TypedDict, total=False):
    """The keyword-only options of ``InferenceClient.generate``, one definition for every client (each absent or
    None: not sent).

    Attributes:
        cache_salt: prefix-cache namespace: only requests with an equal salt share cached KV. Use one per weight
            version so KV computed under old weights is never reused. None: the unsalted namespace.
        seed: per-request sampling seed (reproducible sampling); None: the engine's generator.
        stop_token_ids: extra ids that end a completion (EOS always does unless ``ignore_eos``).
        extra_body: more request fields, e.g. ``{"top_p": 0.9, "ignore_eos": True}``; they override the fields
            above.
        session_id: the rollout (trajectory) whose turn this is: the turns of one multi-turn rollout share it so
            a router keeps them on one engine (its prefix cache). ``VllmClient`` sends it as the ``X-Session-ID``
            header (what vllm-router's ``consistent_hash`` and sticky policies key on); ``RoutedClient`` routes by
            it (``RouterConfig.sticky_sessions``). None: no session.
    """

    cache_salt: str | None
    seed: int | None
    stop_token_ids: list[int] | None
    extra_body: dict[str, Any] | None
    session_id: str | None


def check_generate_args(where: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                        options: dict[str, Any] | None = None) -> None:
    """The argument checks of ``InferenceClient.generate``, shared by every implementation.

    Args:
        where: the caller, e.g. ``"generate"`` or ``"RoutedClient.generate"``; starts each message.
        prompt_ids: prompt token ids, ``[prompt_len]``; must not be empty.
        n: completions to sample; must be >= 1.
        max_tokens: most tokens per completion; must be >= 1.
        temperature: sampling temperature; must be >= 0 (0 = greedy).
        options: the call's keyword options; each key must be a :class:`GenerateOptions` field.

    Raises:
        TypeError: an option that is not a :class:`GenerateOptions` field (a misspelt keyword would otherwise be
            dropped silently).
        ValueError: the first rule broken, naming the argument, its value and the rule.
    """
    unknown = sorted(set(options or ()) - set(GenerateOptions.__annotations__))
    if unknown:
        raise TypeError(f"{where}: unexpected keyword arguments {unknown}; the options are "
                        f"{sorted(GenerateOptions.__annotations__)} (moe_rl.inference.GenerateOptions)")
    if not prompt_ids:
        raise ValueError(f"{where}: prompt_ids=[] is empty; pass at least one token id")
    if n < 1:
        raise ValueError(f"{where}: n={n} must be >= 1")
    if max_tokens < 1:
        raise ValueError(f"{where}: max_tokens={max_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"{where}: temperature={temperature} must be >= 0 (0 = greedy)")


async def init_sharded_broadcast_split(engines: Sequence[Any], endpoints: list[list[Any]], rank_offset: int,
                                       world_size: int, backend: str = "gloo", timeout_s: float = 120.0) -> list[Any]:
    """``init_sharded_broadcast`` on every engine concurrently, the worker ranks split evenly over the engines.

    Shared by the clients that drive several engines (``RoutedClient``, ``ProxiedClient``): the
    ``world_size - rank_offset`` worker ranks are split in engine order, so engine ``i``'s first worker is
    ``rank_offset + i * workers``.

    Args:
        engines: the engines' clients (each with ``VllmClient.init_sharded_broadcast``), in rank order.
        endpoints, world_size, backend, timeout_s: as ``VllmClient.init_sharded_broadcast``.
        rank_offset: the first worker rank (the trainer ranks come before it).

    Returns:
        Each engine's answer, in engine order.

    Raises:
        ValueError: the worker ranks do not split evenly over the engines (or fewer than one per engine).
        Exception: the first engine error, as soon as it happens (the other engines' calls go on; they are not
            cancelled).
    """
    engines = list(engines)
    workers, rest = divmod(int(world_size) - int(rank_offset), len(engines))
    if rest or workers < 1:
        raise ValueError(f"init_sharded_broadcast: world_size={world_size} - rank_offset={rank_offset} worker "
                         f"ranks do not split evenly over {len(engines)} engines; every engine needs the same "
                         "number of workers (weights.kind='broadcast')")
    return list(await asyncio.gather(*(
        e.init_sharded_broadcast(endpoints, int(rank_offset) + i * workers, world_size, backend, timeout_s)
        for i, e in enumerate(engines))))


@runtime_checkable
class InferenceClient(Protocol):
    """One inference engine as the orchestrator sees it (see the module docstring for the contract)."""

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       **options: Unpack[GenerateOptions]) -> tuple[list[Any], int]:
        """Sample ``n`` completions of one prompt; the contract every implementation follows.

        Args:
            prompt_ids: prompt token ids, ``[prompt_len]``.
            n: completions to sample (they share the prompt's KV).
            max_tokens: most tokens per completion.
            temperature: 0 for greedy.
            options: keyword-only ``cache_salt``, ``seed``, ``stop_token_ids``, ``extra_body``
                (:class:`GenerateOptions`).

        Returns:
            ``(completions, cached_tokens)``: completions in choice order (see the module docstring for their
            fields), and the prompt tokens served from the prefix cache (0 when the engine does not report it).

        Raises:
            ValueError, TypeError: an argument breaks :func:`check_generate_args` (checked before any request).
        """
        ...

    async def update_weights(self, path: str, version: int) -> dict[str, Any]: ...

    async def weight_version(self) -> int: ...

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...

    async def health(self) -> bool: ...
