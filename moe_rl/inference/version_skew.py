"""Engine weight-version skew: query every engine's ``weight_version()`` and report which ones lag.

With several engines, a weight push reaches them at different times (or fails on some): for a while the
engines serve different policy versions. That is allowed (rollouts carry per-token versions and are filtered
by ``max_off_policy_steps``), but a skew that persists means an engine stopped taking updates. The orchestrator
calls :meth:`VersionSkewMonitor.check` after each push (``moe_rl.weights.push.push_weights`` does).

Definitions, for the engines that answered:

- ``skew = max(versions) - min(versions)`` (0 when all agree);
- ``target = expected`` when given (the version just pushed), else ``max(versions)``;
- an engine *lags* when its version ``< target``; its lag is ``target - version``;
- with ``expected`` given, an engine is *ahead* when its version ``> expected`` (it serves weights the push did
  not produce, e.g. a failed push of an older version after a trainer restart); that is a violation too;
- an engine that does not answer is *unreachable* (its error is kept); it counts as a violation.

The check is ``ok`` when ``max lag <= max_skew``, no engine is ahead of ``expected`` and every engine
answered. Counters (``stats``) say how
often skew was seen, so nothing is lost between checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SkewReport", "VersionSkewError", "VersionSkewMonitor"]


class VersionSkewError(RuntimeError):
    """Engines lag more than the bound (or did not answer); ``report`` has the details."""

    def __init__(self, report: SkewReport):
        super().__init__(report.describe())
        self.report = report


@dataclass
class SkewReport:
    """One check.

    Attributes:
        versions: engine name -> served weight version (engines that answered).
        errors: engine name -> error text (engines that did not answer).
        target: the version engines should serve (``expected``, else the newest served).
        skew: ``max - min`` of ``versions`` (0 with fewer than 2 answers).
        lagging: engine name -> ``target - version``, for engines behind ``target``.
        max_skew: the bound checked.
        ok: ``max(lag) <= max_skew``, nothing ``ahead`` and no errors.
        ahead: engine name -> ``version - expected``, for engines serving a version newer than ``expected``.
    """

    versions: dict[str, int]
    errors: dict[str, str]
    target: int | None
    skew: int
    lagging: dict[str, int]
    max_skew: int
    ok: bool
    ahead: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: ok or the violation, naming the lagging / unreachable engines."""
        head = "ok" if self.ok else "VIOLATION"
        parts = [f"version skew {head}: skew={self.skew} (bound {self.max_skew}), target={self.target}"]
        if self.lagging:
            parts.append("lagging " + ", ".join(f"{k} by {v} (at {self.versions[k]})" for k, v in self.lagging.items()))
        if self.ahead:
            parts.append("ahead of the expected version " + ", ".join(
                f"{k} by {v} (at {self.versions[k]})" for k, v in self.ahead.items()))
        if self.errors:
            parts.append("unreachable " + ", ".join(f"{k}: {v}" for k, v in self.errors.items()))
        return "; ".join(parts)


@dataclass
class VersionSkewMonitor:
    """Checks engines' weight versions and counts skew events.

    Args:
        max_skew: largest allowed lag (versions) behind the target; 0 = every engine must serve it.
        raise_on_violation: :meth:`check` raises :class:`VersionSkewError` instead of returning a failed report.
        timeout_s: seconds to wait for each engine's ``weight_version()``.

    Attributes:
        stats: ``checks``, ``skew_events`` (checks that saw any lag or skew > 0), ``violations`` (not ok),
            ``unreachable`` (engine answers missing, summed), ``max_skew_seen``.
        last: the last report.
    """

    max_skew: int = 0
    raise_on_violation: bool = False
    timeout_s: float = 30.0
    stats: dict[str, int] = field(default_factory=lambda: {"checks": 0, "skew_events": 0, "violations": 0,
                                                           "unreachable": 0, "max_skew_seen": 0})  # fmt: skip
    last: SkewReport | None = None

    def __post_init__(self) -> None:
        if self.max_skew < 0:
            raise ValueError(f"VersionSkewMonitor: max_skew={self.max_skew} must be >= 0 versions")
        if not self.timeout_s > 0:
            raise ValueError(f"VersionSkewMonitor: timeout_s={self.timeout_s} must be > 0 seconds")

    async def check(self, engines: Mapping[str, Any], expected: int | None = None) -> SkewReport:
        """Query every engine's ``weight_version()`` concurrently and evaluate the skew.

        Args:
            engines: name -> ``InferenceClient`` (anything with ``async weight_version() -> int``).
            expected: the version the engines should serve (e.g. just pushed); None = the newest served.

        Returns:
            The :class:`SkewReport` (also kept in ``last``).

        Raises:
            ValueError: ``engines`` is empty.
            VersionSkewError: not ok and ``raise_on_violation``.
        """
        if not engines:
            raise ValueError("VersionSkewMonitor.check: engines={} is empty; pass name -> client")
        names = list(engines)
        answers = await asyncio.gather(
            *[asyncio.wait_for(engines[n].weight_version(), self.timeout_s) for n in names], return_exceptions=True
        )
        versions: dict[str, int] = {}
        errors: dict[str, str] = {}
        for name, a in zip(names, answers, strict=True):
            if isinstance(a, BaseException):
                errors[name] = f"{type(a).__name__}: {a}" if str(a) else type(a).__name__
            else:
                versions[name] = int(a)
        report = self.evaluate(versions, errors, expected)
        if self.raise_on_violation and not report.ok:
            raise VersionSkewError(report)
        return report

    def evaluate(self, versions: Mapping[str, int], errors: Mapping[str, str] | None = None,
                 expected: int | None = None) -> SkewReport:  # fmt: skip
        """The pure part of :meth:`check`: build the report from known versions and update the counters."""
        errors = dict(errors or {})
        vals = list(versions.values())
        target = expected if expected is not None else (max(vals) if vals else None)
        skew = max(vals) - min(vals) if vals else 0
        lagging = {k: target - v for k, v in versions.items() if target is not None and v < target}
        ahead = {k: v - expected for k, v in versions.items() if expected is not None and v > expected}
        ok = not errors and not ahead and max(lagging.values(), default=0) <= self.max_skew
        report = SkewReport(dict(versions), errors, target, skew, lagging, self.max_skew, ok, ahead)
        s = self.stats
        s["checks"] += 1
        s["skew_events"] += int(skew > 0 or bool(lagging) or bool(ahead))
        s["violations"] += int(not ok)
        s["unreachable"] += len(errors)
        s["max_skew_seen"] = max(s["max_skew_seen"], skew, max(lagging.values(), default=0))
        self.last = report
        return report
