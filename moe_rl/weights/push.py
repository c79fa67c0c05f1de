"""Orchestrator side of a weight push to several engines, written against ``InferenceClient`` only.

``push_weights`` updates every engine to one version from a checkpoint folder, optionally inside a pause
(``mode="keep"``: requests in flight are frozen, not aborted, and continue under the new weights), optionally
resets the prefix caches, and then checks the engines' version skew. Engines that fail are reported, never
dropped silently: the others keep their update, and the skew check names the laggards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from moe_rl.inference.protocol import InferenceClient, PrefixCacheResetError
from moe_rl.inference.version_skew import VersionSkewMonitor

__all__ = ["push_weights"]


async def push_weights(
    engines: Mapping[str, InferenceClient],
    path: str,
    version: int,
    *,
    pause_mode: str | None = "keep",
    reset_prefix_cache: bool = False,
    monitor: VersionSkewMonitor | None = None,
) -> dict[str, Any]:
    """Update every engine to ``version`` (concurrently) and report per-engine results and the version skew.

    Steps per engine: ``pause(pause_mode)`` (skipped when None) -> ``update_weights(path, version)`` ->
    ``reset_prefix_cache(reset_running_requests=True)`` (when asked) -> ``resume()`` (always once pause was sent,
    even if pause itself or the update failed, so a failure never leaves an engine frozen; a failing resume is
    reported in ``errors`` with the first error and the words "may still be PAUSED"). Then
    ``monitor.check(engines, expected=version)``.

    Args:
        engines: name -> client.
        path: checkpoint folder as seen by the engines.
        version: policy version (>= 0).
        pause_mode: ``"keep"`` / ``"wait"`` / ``"abort"``, or None to update without pausing (vLLM applies an
            update between two steps anyway; the pause matters for multi-step pushes).
        reset_prefix_cache: drop every cached prefix after the update (not needed when salting per version), with
            running requests preempted (they keep their tokens and recompute their KV under the new weights). A
            reset that does not complete puts that engine in ``errors`` (``PrefixCacheResetError``).
        monitor: skew monitor (its counters accumulate across pushes); default ``VersionSkewMonitor()``.

    Returns:
        ``{"version", "push_s", "results": {name: update report}, "errors": {name: error text},
        "skew": SkewReport}``.

    Raises:
        ValueError: ``engines`` is empty, ``version < 0`` or a bad ``pause_mode``.
        VersionSkewError: from the monitor, when it is set to raise.
    """
    if not engines:
        raise ValueError("push_weights: engines={} is empty; pass name -> InferenceClient")
    if version < 0:
        raise ValueError(f"push_weights: version={version} must be >= 0")
    if pause_mode not in (None, "keep", "wait", "abort"):
        raise ValueError(f"push_weights: pause_mode={pause_mode!r} must be None, 'keep', 'wait' or 'abort'")
    monitor = monitor if monitor is not None else VersionSkewMonitor()

    async def one(engine: InferenceClient) -> dict[str, Any]:
        # resume is owed as soon as pause was *sent*: a pause that raised (client timeout, dropped connection,
        # cancellation) may still have paused the engine, and vLLM's resume of a running engine is a no-op.
        owes_resume = False
        try:
            if pause_mode is not None:
                owes_resume = True
                await engine.pause(mode=pause_mode, clear_cache=False)
            report = await engine.update_weights(path, version)
            if reset_prefix_cache:
                ok = await engine.reset_prefix_cache(reset_running_requests=True)
                if ok is not True:  # a reset that did not complete is this engine's error, never a report value
                    raise PrefixCacheResetError(
                        f"reset_prefix_cache(reset_running_requests=True) returned {ok!r} after the update to version "
                        f"{version}: the engine may serve KV computed under older weights"
                    )
                report["prefix_cache_reset"] = True
        except BaseException as exc:
            if owes_resume:
                try:
                    await engine.resume()
                except Exception as resume_exc:  # keep the first error; say the engine may still be paused
                    raise RuntimeError(
                        f"{type(exc).__name__}: {exc}; then resume() failed too ({type(resume_exc).__name__}: "
                        f"{resume_exc}): the engine may still be PAUSED; call resume() on it"
                    ) from exc
            raise
        if owes_resume:
            try:
                await engine.resume()
            except Exception as resume_exc:
                raise RuntimeError(
                    f"updated to version {version}, but resume() failed ({type(resume_exc).__name__}: {resume_exc}): "
                    "the engine may still be PAUSED; call resume() on it"
                ) from resume_exc
        return report

    t0 = time.perf_counter()
    names = list(engines)
    outcomes = await asyncio.gather(*[one(engines[n]) for n in names], return_exceptions=True)
    results = {n: o for n, o in zip(names, outcomes, strict=True) if not isinstance(o, BaseException)}
    errors = {n: f"{type(o).__name__}: {o}" for n, o in zip(names, outcomes, strict=True)
              if isinstance(o, BaseException)}  # fmt: skip
    push_s = time.perf_counter() - t0
    skew = await monitor.check(engines, expected=version)
    return {"version": version, "push_s": push_s, "results": results, "errors": errors, "skew": skew}
