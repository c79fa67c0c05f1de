"""Rollout groups and the asynchronous rollout buffer that bounds their staleness.

Definitions (``shared/cases`` B18; prime-rl #1901/#1902/#2960):

- A rollout *starts* under policy version ``v_start``: the version the engine serves when its request is
  sent (its ``cache_salt`` derives from it).
- Batch ``n`` is trained by the trainer at version ``n`` (the trainer has taken ``n`` optimizer steps).
- ``staleness = n - v_start``: the number of distinct policies that may have produced its tokens, minus
  one. Time a finished rollout spends waiting in the queue counts, because ``n`` is the version at
  *consumption*, not at completion.
- A rollout is usable for batch ``n`` only if ``staleness <= max_off_policy_steps``. With
  ``max_off_policy_steps = 0`` the loop is synchronous: batch ``n`` only holds rollouts started under
  version ``n``.

Lifecycle of every started sample (counted, never silently lost)::

    started -> inflight -> queued -> in_batch -> trained
                  |           |
                  +-----------+--> dropped (reason: "stale_inflight" | "stale_queued" | "error")

so that at any time ``started == inflight + queued + in_batch + trained + dropped``.

This first buffer implements the ``drop`` policy (cancel in-flight rollouts that can no longer be
consumed in time, discard stale queued ones) with whole-group granularity.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sample", "RolloutGroup", "AsyncRolloutBuffer", "BufferCounters"]


@dataclass
class Sample:
    """One generated completion.

    Attributes:
        prompt_ids: prompt token ids.
        completion_ids: sampled token ids (ends with ``<eos>`` unless truncated).
        completion_logprobs: the engine's log-probability of each sampled token (same length).
        reward: scalar reward.
        finish_reason: the engine's finish reason ("stop", "length").
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    reward: float = 0.0
    finish_reason: str = ""

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.completion_logprobs):
            raise ValueError(
                f"completion_ids has {len(self.completion_ids)} tokens but completion_logprobs has "
                f"{len(self.completion_logprobs)}; the engine must return one logprob per sampled token"
            )


@dataclass
class RolloutGroup:
    """``n`` samples of one prompt, started together under one policy version and one ``cache_salt``.

    Attributes:
        group_id: unique id within the run.
        version_start: policy version served when the group's request was sent.
        version_end: policy version served when the last sample finished (>= version_start).
        cache_salt: the salt every request of this group carried.
        samples: the completions.
        problem: the task's problem object (for logging).
        t_start, t_end: monotonic seconds.
    """

    group_id: int
    version_start: int
    cache_salt: str
    samples: list[Sample] = field(default_factory=list)
    version_end: int = -1
    problem: Any = None
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def size(self) -> int:
        return len(self.samples)


@dataclass
class BufferCounters:
    """Sample-level counters (see the module docstring for the invariant)."""

    started: int = 0
    inflight: int = 0
    queued: int = 0
    in_batch: int = 0
    trained: int = 0
    dropped: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)

    def check(self) -> None:
        total = self.inflight + self.queued + self.in_batch + self.trained + self.dropped
        if total != self.started:
            raise RuntimeError(
                f"rollout accounting broken: started={self.started} but inflight+queued+in_batch+trained+"
                f"dropped={total} ({self})"
            )


class AsyncRolloutBuffer:
    """FIFO of finished rollout groups with a staleness bound.

    Args:
        max_off_policy_steps: largest staleness a trained rollout may have (>= 0).

    Raises:
        ValueError: ``max_off_policy_steps`` is negative.
    """

    def __init__(self, max_off_policy_steps: int) -> None:
        if max_off_policy_steps < 0:
            raise ValueError(
                f"max_off_policy_steps={max_off_policy_steps} must be >= 0 (0 = synchronous on-policy training)"
            )
        self.max_off_policy_steps = max_off_policy_steps
        self._queue: collections.deque[RolloutGroup] = collections.deque()
        self.counters = BufferCounters()
        self.staleness_hist: collections.Counter[int] = collections.Counter()

    # -- staleness rules -------------------------------------------------------------------------
    @staticmethod
    def staleness(version_start: int, consume_version: int) -> int:
        """``consume_version - version_start`` (B18)."""
        return consume_version - version_start

    def usable(self, version_start: int, consume_version: int) -> bool:
        """Whether a rollout started at ``version_start`` may be trained at ``consume_version``."""
        return self.staleness(version_start, consume_version) <= self.max_off_policy_steps

    def may_start(self, engine_version: int, next_batch: int) -> bool:
        """Admission gate: a rollout started now (under ``engine_version``) could still be trained in
        batch ``next_batch``, the earliest batch not yet handed to the trainer."""
        return self.usable(engine_version, next_batch)

    # -- lifecycle ------------------------------------------------------------------------------
    def on_started(self, num_samples: int) -> None:
        self.counters.started += num_samples
        self.counters.inflight += num_samples

    def on_dropped_inflight(self, num_samples: int, reason: str) -> None:
        """An in-flight group was cancelled or failed; its samples are counted as dropped."""
        self.counters.inflight -= num_samples
        self._count_drop(num_samples, reason)

    def put(self, group: RolloutGroup, expected_samples: int) -> None:
        """A group finished: move its samples from in flight to queued.

        Args:
            group: the finished group.
            expected_samples: samples that were counted as started for it. Fewer finished samples count
                the rest as dropped ("error").
        """
        if group.size > expected_samples:
            raise ValueError(f"group {group.group_id} has {group.size} samples but only {expected_samples} started")
        self.counters.inflight -= expected_samples
        self.counters.queued += group.size
        if group.size < expected_samples:
            self._count_drop(expected_samples - group.size, "error")
        self._queue.append(group)

    def drop_stale(self, consume_version: int) -> int:
        """Discard queued groups that are too stale for ``consume_version``; return samples dropped."""
        kept: collections.deque[RolloutGroup] = collections.deque()
        dropped = 0
        for g in self._queue:
            if self.usable(g.version_start, consume_version):
                kept.append(g)
            else:
                dropped += g.size
        self._queue = kept
        if dropped:
            self.counters.queued -= dropped
            self._count_drop(dropped, "stale_queued")
        return dropped

    def take(self, num_groups: int, consume_version: int) -> list[RolloutGroup] | None:
        """Hand ``num_groups`` groups (oldest first) to batch ``consume_version``, or ``None`` if fewer
        usable groups are queued. Stale queued groups are dropped first."""
        self.drop_stale(consume_version)
        if len(self._queue) < num_groups:
            return None
        groups = [self._queue.popleft() for _ in range(num_groups)]
        n = sum(g.size for g in groups)
        self.counters.queued -= n
        self.counters.in_batch += n
        for g in groups:
            self.staleness_hist[self.staleness(g.version_start, consume_version)] += g.size
        return groups

    def mark_trained(self, num_samples: int) -> None:
        """The trainer finished a step on a batch holding ``num_samples`` samples."""
        self.counters.in_batch -= num_samples
        self.counters.trained += num_samples

    @property
    def num_queued_groups(self) -> int:
        return len(self._queue)

    def _count_drop(self, n: int, reason: str) -> None:
        self.counters.dropped += n
        self.counters.dropped_by_reason[reason] = self.counters.dropped_by_reason.get(reason, 0) + n
