"""Rollout groups and the asynchronous rollout buffer that bounds their staleness.

Definitions (prime-rl PRs #1901/#1902/#2960, AReaL's staleness-bounded admission):

- A rollout *starts* under policy version ``v_start``: the version the engine serves when its request is
  sent (its ``cache_salt`` derives from it).
- Batch ``n`` is trained by the trainer at version ``n`` (the trainer has taken ``n`` optimizer steps).
- ``staleness = n - v_start``: the number of distinct policies that may have produced its tokens, minus
  one. Time a finished rollout spends waiting in the queue counts, because ``n`` is the version at
  *consumption*, not at completion.
- A rollout is usable for batch ``n`` only if ``staleness <= max_off_policy_steps``. With
  ``max_off_policy_steps = 0`` the loop is synchronous: batch ``n`` only holds rollouts started under
  version ``n``.
- Each generated token has its own version (the engine's version when it was sampled; requests in flight
  continue across weight updates). A sample's ``version_segments = [(version, first_token_index), ...]``
  give them, in canonical form (``moe_rl.rl.token_versions``: the first starts at token 0, indices and
  versions strictly increase, no version below ``v_start``; checked by ``put``); without segments every
  token has ``v_start``. Under ``"mask"`` a token version above the consuming version raises at ``take``.

Policies when a rollout exceeds the bound (``policy``):

- ``"drop"``: in-flight rollouts that can no longer be trained in time are cancelled by the caller
  (``expire_inflight`` names them), stale queued ones are discarded. Counted as ``dropped``.
- ``"withhold"``: nothing is cancelled; stale rollouts finish and are never trained. Counted as
  ``withheld`` (prime-rl #2960: cancelling races KV-transfer cleanup in P/D engines).
- ``"mask"``: nothing is cancelled; at consumption only tokens with
  ``consume_version - token_version <= max_off_policy_steps`` are trained (``Sample.train_mask``). A sample
  with no trainable token is counted as ``withheld`` (reason ``"fully_masked"``); masked tokens and
  partially masked samples are counted (``masked_tokens``, ``masked_samples``).

Group rule when members are lost (``partial_groups``): ``"survivors"`` trains the remaining members with a
baseline over the survivors (``moe_rl.rl.advantage.group_advantages`` on their rewards; prime-rl's
``TrainSink``), ``"drop_group"`` removes the whole group (reason ``"partial_group"``; needed when the
reward is a function of the whole group).

Retries: a group that leaves without any trained sample because of staleness has its prompt re-queued
*ahead of new prompts* (``next_retry``), so long rollouts are not starved (tinker-cookbook #822) -- at most
``max_retries`` times, after which the prompt is counted as abandoned. A group the caller fails with
``requeue=True`` (the orchestrator: reason ``"engine_died"``, its engine died mid-rollout) is re-queued the same
way. Groups started with ``prompt=None`` are never re-queued.

Admission (``admission_capacity``): a group started now under engine version ``v`` lands, in FIFO order,
in batch ``next_batch + pending // groups_per_step``, which must be ``<= v + max_ahead`` (``max_ahead <=
max_off_policy_steps``, default equal); so inference runs at most ``max_ahead`` versions ahead. ``admission``
chooses what is pending (queued + in flight, or queued only). Batch ``n`` is formed only once the engine
serves version ``>= n - 1`` (``may_take``). The orchestrator and the simulator (``moe_rl.rl.simulator``)
both use these through ``AsyncRolloutBuffer.start_capacity`` and ``may_take``; ``docs/async_rl.md``
discusses the choices.

Lifecycle of every started sample (counted, never silently lost)::

    started -> inflight -> queued -> in_batch -> trained
                  |           |
                  +-----------+--> dropped  (reason: "stale_inflight" | "stale_queued" | "error" | "partial_group" | ...)
                  +-----------+--> withheld (reason: "stale_inflight" | "stale_queued" | "fully_masked" | "partial_group")

so that at any time ``started == inflight + queued + in_batch + trained + dropped + withheld``.

Counters are in *samples*. A group is started as ``num_samples`` episodes, one expected sample each. An agentic
episode whose model calls form several trajectories by token prefix yields one sample per branch
(``Sample.episode`` names the episode; :func:`moe_rl.rl.trajectory.interleave_calls`), a number known only once it
has finished: ``put`` adds each episode's samples beyond its first to ``started`` (and to ``branches``) as they
leave the in-flight state, so the invariant holds exactly at every step. An episode that yields no sample (failed,
or nothing sampled) is one dropped sample (``"error"``). The group rule and the advantage baseline count episodes,
not samples (``moe_rl.rl.advantage.episode_advantages``).
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from moe_rl.rl.token_versions import check_segments, token_versions
from moe_rl.rl.token_versions import version_runs as _version_runs

__all__ = [
    "Sample",
    "RolloutGroup",
    "AsyncRolloutBuffer",
    "BufferCounters",
    "OffPolicyPolicy",
    "Admission",
    "PartialGroups",
    "admission_capacity",
    "may_take",
    "TAKE_AHEAD",
    "staleness",
    "token_versions",
    "token_train_mask",
]

OffPolicyPolicy = Literal["drop", "withhold", "mask"]
Admission = Literal["inflight", "queued"]
PartialGroups = Literal["survivors", "drop_group"]


@dataclass
class Sample:
    """One generated completion.

    Attributes:
        prompt_ids: prompt token ids (at least one; an empty prompt raises ``ValueError``).
        completion_ids: sampled token ids (ends with ``<eos>`` unless truncated).
        completion_logprobs: the engine's log-probability of each sampled token (same length).
        reward: scalar reward.
        finish_reason: the engine's finish reason ("stop", "length").
        train_mask: set by ``AsyncRolloutBuffer.take`` under the ``"mask"`` policy: one bool per completion
            token, True where the token is trained; ``None`` = every token is trained.
        version_segments: ``[(policy version, first token index), ...]``: the version that sampled each
            completion token, from the engine, in canonical form (``moe_rl.rl.token_versions``; checked by
            ``AsyncRolloutBuffer.put``, which also rejects versions below the group's ``version_start``);
            ``None`` = unknown, every token is taken to have the group's ``version_start``.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    reward: float = 0.0
    finish_reason: str = ""
    version_segments: list[tuple[int, int]] | None = None
    train_mask: list[bool] | None = None
    routed_experts: Any = None
    """``moe_rl.replay.RoutedExperts`` ``[prompt + completion tokens, MoE layers, top_k]`` from the engine (router
    replay, R3), or None (not recorded / incomplete: the trainer routes the sample itself)."""
    completion_mask: list[bool] | None = None
    """Multi-turn samples: one bool per completion token, True where the model sampled it, False for tokens the
    environment inserted between turns (never trained, never counted as masked; their logprob is a 0.0
    placeholder); None = every completion token was sampled (single turn)."""
    temperature: float | None = None
    """The temperature the engine sampled this sample with (the trainer divides its logits by it); None = the
    run's configured temperature."""
    sft: bool = False
    """A supervised sample (e.g. a demonstration): its completion tokens (where ``completion_mask`` allows) are
    trained with cross-entropy beside the RL samples, under one loss normalization; ``completion_logprobs`` are
    ignored (pass 0.0 per token), and it takes no part in its group's advantage baseline."""
    sampling_mask: Any = None
    """``moe_rl.rl.sampling_mask.SamplingMask`` of ``[len(completion_ids)]`` positions: the engine's top-k / top-p
    kept set of each completion token (sampling-mask replay; the trainer renormalises its log-probs over it), or
    None (the whole vocabulary)."""
    episode: int | None = None
    """Index (``0 .. num_samples - 1`` of ``AsyncRolloutBuffer.start``) of the episode of its group that produced this
    sample. Samples of a group with the same index are branches of one episode (trajectories of its model calls by
    token prefix): they carry the episode's reward, the episode counts once in the group baseline
    (``moe_rl.rl.advantage.episode_advantages``), and ``put`` counts the extra samples as started. None = the
    sample is an episode of its own (single-trajectory rollouts)."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(
                "Sample: prompt_ids is empty; a completion is predicted from its prompt, which needs at least one "
                "token (e.g. the tokenizer's BOS)"
            )
        if len(self.completion_ids) != len(self.completion_logprobs):
            raise ValueError(
                f"completion_ids has {len(self.completion_ids)} tokens but completion_logprobs has "
                f"{len(self.completion_logprobs)}; the engine must return one logprob per sampled token"
            )
        if self.sampling_mask is not None and len(self.sampling_mask) != len(self.completion_ids):
            raise ValueError(
                f"sampling_mask has {len(self.sampling_mask)} positions but completion_ids has "
                f"{len(self.completion_ids)} tokens; the engine records one kept set per sampled token (or None)"
            )
        if self.episode is not None:
            if isinstance(self.episode, bool) or not isinstance(self.episode, numbers.Integral):
                raise TypeError(f"Sample.episode={self.episode!r} is a {type(self.episode).__name__}; pass None or an "
                                "int (the index of the episode in its group that produced the sample)")
            if self.episode < 0:
                raise ValueError(f"Sample.episode={self.episode} must be >= 0 (the index of the episode in its group "
                                 "that produced the sample), or None")
        if self.completion_mask is not None and len(self.completion_mask) != len(self.completion_ids):
            raise ValueError(
                f"completion_mask has {len(self.completion_mask)} entries but completion_ids has "
                f"{len(self.completion_ids)} tokens; pass one bool per completion token (or None)"
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


# ---------------------------------------------------------------------------------------------- pure rules
def staleness(version_start: int, consume_version: int) -> int:
    """``consume_version - version_start`` (prime-rl PR #1901): distinct policies that may have produced a rollout, minus 1.

    Raises:
        ValueError: the result is negative (a rollout started under a version newer than the one consuming it).
            Versions only go up, so this means the version bookkeeping went backwards (e.g. a trainer that failed
            over or resumed restarted its counter); a negative staleness would pass every ``<= bound`` check and
            admit exactly the stalest data, so it is refused instead.
    """
    if consume_version < version_start:
        raise ValueError(
            f"negative staleness: consume_version={consume_version} < version_start={version_start}; policy "
            "versions must never decrease (after a failover or resume, continue from the latest published version)"
        )
    return consume_version - version_start


def admission_capacity(
    *,
    engine_version: int,
    next_batch: int,
    max_off_policy_steps: int,
    groups_per_step: int,
    pending_groups: int,
    inflight_groups: int,
    max_inflight: int,
    last_batch: int | None = None,
) -> int:
    """Groups that may be started now and still be trained within the staleness bound (may be <= 0).

    A group started now under ``engine_version`` lands, in FIFO order, in batch
    ``next_batch + pending_groups // groups_per_step``; it must satisfy
    ``batch - engine_version <= max_off_policy_steps`` (AReaL's admission rule, arXiv:2505.24298 §5), and
    no batch after ``last_batch`` (the run's last) is ever needed.

    Args:
        engine_version: version the engine serves now.
        next_batch: earliest batch not yet handed to the trainer.
        max_off_policy_steps: the staleness bound (>= 0).
        groups_per_step: groups per trainer batch (>= 1).
        pending_groups: groups that will land in a batch: queued plus in flight (not withheld).
        inflight_groups: groups occupying the engine (including withheld ones still running).
        max_inflight: cap on ``inflight_groups``.
        last_batch: index of the last batch of the run (None = unbounded).

    Returns:
        ``min(budget, max_inflight - inflight_groups)`` where ``budget`` is the number of batch slots left
        up to batch ``min(engine_version + max_off_policy_steps, last_batch)``.
    """
    last = engine_version + max_off_policy_steps
    if last_batch is not None:
        last = min(last, last_batch)
    budget = (last - next_batch + 1) * groups_per_step - pending_groups
    return min(budget, max_inflight - inflight_groups)


TAKE_AHEAD = 1
"""Batches the batcher may form ahead of the engine's version: batch ``n`` is taken only once the engine
serves version ``>= n - TAKE_AHEAD`` (``may_take``)."""


def may_take(batch: int, engine_version: int, take_ahead: int = TAKE_AHEAD) -> bool:
    """Whether batch ``batch`` may be formed now: ``batch <= engine_version + take_ahead``.

    Forming batches eagerly would let the batcher run up to ``max_off_policy_steps`` batches ahead of the
    trainer out of the fastest rollouts, and every slower rollout would expire after about one trainer step
    instead of ``max_off_policy_steps`` steps (short rollouts crowd out long ones). With ``take_ahead = 1``
    the next batch is formed while the trainer trains the current one, so the hand-off stays hidden; for
    ``max_off_policy_steps <= 1`` admission already implies this rule.
    """
    return batch <= engine_version + take_ahead


def token_train_mask(versions: Sequence[int], consume_version: int, max_off_policy_steps: int) -> list[bool]:
    """True for tokens with ``consume_version - version <= max_off_policy_steps`` (the ``"mask"`` policy)."""
    return [consume_version - v <= max_off_policy_steps for v in versions]


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, or TypeError (not an integer; bool rejected) / ValueError (below ``minimum``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int (got {type(value).__name__}); pass a whole number")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def _check_versions(group: RolloutGroup) -> int:
    """Validate every sample's ``version_segments`` against ``group.version_start``; return the group's newest
    token version (``version_start`` when no sample has segments).

    Raises:
        ValueError: segments are not canonical (``moe_rl.rl.token_versions.check_segments``: start at token 0,
            strictly increasing indices and versions, last index < completion length), or a version is below
            ``version_start`` (a token cannot be sampled by a policy older than the one its request started
            under).
    """
    newest = group.version_start
    for i, s in enumerate(group.samples):
        if not s.version_segments:
            continue
        try:
            check_segments(s.version_segments, len(s.completion_ids))
        except ValueError as e:
            raise ValueError(f"group {group.group_id}, sample {i}: {e}") from None
        if s.version_segments[0][0] < group.version_start:
            raise ValueError(
                f"group {group.group_id}, sample {i}: version_segments {list(s.version_segments)!r} start at version "
                f"{s.version_segments[0][0]} < version_start={group.version_start}; a token cannot be sampled by a "
                "policy older than the one its request started under"
            )
        newest = max(newest, s.version_segments[-1][0])
    return newest


def _episode_keys(samples: Sequence[Sample]) -> list[Any]:
    """One key per sample: its episode (``Sample.episode``), or a key of its own when that is None."""
    return [("sample", i) if s.episode is None else ("episode", s.episode) for i, s in enumerate(samples)]


def _num_episodes(group: RolloutGroup, started: int) -> int:
    """Distinct episodes of ``group``'s samples, checked against the ``started`` episodes.

    Raises:
        ValueError: more episodes than started, or an episode index ``>= started``.
    """
    bad = [s.episode for s in group.samples if s.episode is not None and s.episode >= started]
    if bad:
        raise ValueError(
            f"group {group.group_id}: a sample has episode={bad[0]} but only {started} episodes were started "
            f"(indices 0 .. {started - 1}); Sample.episode is the episode's index in its group"
        )
    n = len(set(_episode_keys(group.samples)))
    if n > started:
        raise ValueError(
            f"group {group.group_id} has {group.size} samples but only {started} started, and they form {n} "
            f"episodes > {started}; branches of one episode must share its Sample.episode index"
        )
    return n


# ---------------------------------------------------------------------------------------------- counters
@dataclass
class BufferCounters:
    """Sample-level lifecycle counters (invariant in the module docstring) and group-level retry counters.

    Attributes:
        started, inflight, queued, in_batch, trained, dropped, withheld: samples.
        dropped_by_reason, withheld_by_reason: samples per reason.
        masked_tokens: completion tokens of trained samples excluded by the ``"mask"`` policy.
        masked_samples: trained samples with at least one masked token.
        retried: groups whose prompt was re-queued after a staleness loss (or a loss the caller re-queues, e.g. an
            engine's death: ``fail(..., requeue=True)``).
        abandoned: groups whose prompt was given up after ``max_retries`` re-queues.
        branches: samples beyond the first of their episode (branch samples, ``Sample.episode``), added to
            ``started`` by ``put``: ``started`` = samples started by ``start`` + ``branches``.
    """

    started: int = 0
    inflight: int = 0
    queued: int = 0
    in_batch: int = 0
    trained: int = 0
    dropped: int = 0
    withheld: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    withheld_by_reason: dict[str, int] = field(default_factory=dict)
    masked_tokens: int = 0
    masked_samples: int = 0
    retried: int = 0
    abandoned: int = 0
    branches: int = 0

    def check(self) -> None:
        """Raise RuntimeError unless the accounting is consistent: every counter (per-reason ones included) is
        ``>= 0``, ``started == inflight + queued + in_batch + trained + dropped + withheld``, ``branches <= started``,
        and the per-reason counts sum to ``dropped`` / ``withheld``."""
        scalars = {k: getattr(self, k) for k in ("started", "inflight", "queued", "in_batch", "trained", "dropped",
                                                 "withheld", "masked_tokens", "masked_samples", "retried",
                                                 "abandoned", "branches")}
        scalars |= {f"dropped_by_reason[{k!r}]": v for k, v in self.dropped_by_reason.items()}
        scalars |= {f"withheld_by_reason[{k!r}]": v for k, v in self.withheld_by_reason.items()}
        negative = {k: v for k, v in scalars.items() if v < 0}
        if negative:
            raise RuntimeError(f"rollout accounting broken: negative counters {negative} ({self})")
        total = self.inflight + self.queued + self.in_batch + self.trained + self.dropped + self.withheld
        if self.branches > self.started:
            raise RuntimeError(f"rollout accounting broken: branches={self.branches} > started={self.started} ({self})")
        if total != self.started:
            raise RuntimeError(
                f"rollout accounting broken: started={self.started} but inflight+queued+in_batch+trained+"
                f"dropped+withheld={total} ({self})"
            )
        for name, by_reason in (("dropped", self.dropped_by_reason), ("withheld", self.withheld_by_reason)):
            if sum(by_reason.values()) != getattr(self, name):
                raise RuntimeError(
                    f"rollout accounting broken: {name}={getattr(self, name)} but {name}_by_reason sums to "
                    f"{sum(by_reason.values())} ({self})"
                )


@dataclass
class _InflightGroup:
    version_start: int
    num_samples: int
    prompt: Any
    retries: int
    withheld: bool = False


# ---------------------------------------------------------------------------------------------- buffer
class AsyncRolloutBuffer:
    """Tracks every rollout group from start to training and bounds its staleness.

    Usage (the orchestrator and ``moe_rl.rl.simulator`` follow it)::

        n = buf.start_capacity(engine_version, next_batch, groups_per_step, max_inflight)   # admission
        prompt, retries = buf.next_retry() or (new_prompt(), 0)
        buf.start(gid, engine_version, group_size, prompt=prompt, retries=retries)
        ... buf.put(finished_group) | buf.fail(gid, reason) ...
        groups = buf.take(groups_per_step, consume_version=n)        # None until enough usable groups
        for gid in buf.expire_inflight(next_batch=n + 1): cancel(gid); buf.fail(gid, "stale_inflight")
        buf.mark_trained(sum(g.size for g in groups))

    Args:
        max_off_policy_steps: largest staleness (or, under ``"mask"``, token age) trained (>= 0).
        policy: ``"drop"`` | ``"withhold"`` | ``"mask"`` (module docstring).
        partial_groups: ``"survivors"`` | ``"drop_group"`` (module docstring).
        max_retries: re-queues allowed per prompt after staleness losses (>= 0; 0 = never re-queue).
        max_ahead: versions inference may run ahead in the admission rule (``0 <= max_ahead <=
            max_off_policy_steps``; None = ``max_off_policy_steps``, AReaL's choice). A smaller value leaves
            long rollouts ``max_off_policy_steps - max_ahead`` steps of slack before they go stale (prime-rl
            gates dispatch at 1 step ahead and drops at ``max_off_policy_steps``).
        admission: which groups count as pending in the admission rule: ``"inflight"`` (queued + in flight,
            AReaL: a rollout started now lands within ``max_ahead`` versions if rollouts finish in FIFO order;
            long rollouts in flight hold budget, so a long tail starves the trainer) or ``"queued"`` (only
            finished, queued groups; ``max_inflight`` alone bounds the engine, as prime-rl's dispatcher does:
            keeps the engine full under a long tail, at the price of rollouts that finish too late).

    Raises:
        TypeError: an integer argument is not an int (bool and float rejected).
        ValueError: an argument is out of range or not one of the allowed values.
    """

    def __init__(self, max_off_policy_steps: int, policy: OffPolicyPolicy = "drop",
                 partial_groups: PartialGroups = "survivors", max_retries: int = 3,
                 max_ahead: int | None = None, admission: Admission = "inflight") -> None:
        max_off_policy_steps = _check_int("max_off_policy_steps", max_off_policy_steps, 0)  # 0 = synchronous
        if policy not in get_args(OffPolicyPolicy):
            raise ValueError(f"policy={policy!r} must be one of {get_args(OffPolicyPolicy)}")
        if partial_groups not in get_args(PartialGroups):
            raise ValueError(f"partial_groups={partial_groups!r} must be one of {get_args(PartialGroups)}")
        max_retries = _check_int("max_retries", max_retries, 0)
        if max_ahead is None:
            max_ahead = max_off_policy_steps
        if isinstance(max_ahead, bool) or not isinstance(max_ahead, numbers.Integral):
            raise TypeError(f"max_ahead={max_ahead!r} must be an int or None (got {type(max_ahead).__name__})")
        if not 0 <= max_ahead <= max_off_policy_steps:
            raise ValueError(f"max_ahead={max_ahead} must be in [0, max_off_policy_steps={max_off_policy_steps}]: "
                             f"inference running further ahead than the bound only produces stale rollouts")
        self.max_ahead = max_ahead
        if admission not in get_args(Admission):
            raise ValueError(f"admission={admission!r} must be one of {get_args(Admission)}")
        self.admission = admission
        self.max_off_policy_steps = max_off_policy_steps
        self.policy = policy
        self.partial_groups = partial_groups
        self.max_retries = max_retries
        self._inflight: dict[int, _InflightGroup] = {}
        self._queue: collections.deque[RolloutGroup] = collections.deque()
        self._retry: collections.deque[tuple[Any, int]] = collections.deque()
        self._retries_of: dict[int, int] = {}  # group id -> retries already spent on its prompt (queued groups)
        self._prompt_of: dict[int, Any] = {}
        self._max_version_of: dict[int, int] = {}  # group id -> newest token version (queued groups)
        self.counters = BufferCounters()
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self._last_consume_version: int | None = None  # versions consumed by take() never decrease
        self.on_finish: Callable[[RolloutGroup], None] | None = None
        """Called with every finished group passed to ``put`` (e.g. to log rollout timings)."""

    # -- staleness rules -------------------------------------------------------------------------
    @staticmethod
    def staleness(version_start: int, consume_version: int) -> int:
        """``consume_version - version_start`` (prime-rl PR #1901)."""
        return staleness(version_start, consume_version)

    def usable(self, version_start: int, consume_version: int) -> bool:
        """Whether a rollout started at ``version_start`` may be trained whole at ``consume_version``."""
        return staleness(version_start, consume_version) <= self.max_off_policy_steps

    def may_start(self, engine_version: int, next_batch: int) -> bool:
        """Whether a rollout started now (under ``engine_version``) could still be trained in batch
        ``next_batch``, the earliest batch not yet handed to the trainer."""
        return self.usable(engine_version, next_batch)

    def start_capacity(self, engine_version: int, next_batch: int, groups_per_step: int, max_inflight: int,
                       last_batch: int | None = None) -> int:
        """``admission_capacity`` with ``max_ahead`` as the bound, this buffer's queued groups plus (``admission
        = "inflight"``) its in-flight ones as pending (withheld ones use engine slots but land in no batch)."""
        landing = sum(not g.withheld for g in self._inflight.values()) if self.admission == "inflight" else 0
        return admission_capacity(
            engine_version=engine_version, next_batch=next_batch, max_off_policy_steps=self.max_ahead,
            groups_per_step=groups_per_step, pending_groups=len(self._queue) + landing,
            inflight_groups=len(self._inflight), max_inflight=max_inflight, last_batch=last_batch,
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def next_retry(self) -> tuple[Any, int] | None:
        """Pop the oldest re-queued prompt as ``(prompt, retries_so_far)``; None if there is none."""
        return self._retry.popleft() if self._retry else None

    def start(self, group_id: int, version_start: int, num_samples: int, *, prompt: Any = None,
              retries: int = 0) -> None:
        """A group of ``num_samples`` requests was sent under ``version_start``.

        Raises:
            TypeError: ``version_start``, ``num_samples`` or ``retries`` is not an int.
            ValueError: ``group_id`` is already in flight, ``version_start < 0``, ``num_samples < 1`` or
                ``retries < 0``.
        """
        if group_id in self._inflight:
            raise ValueError(f"group_id={group_id} is already in flight; group ids must be unique")
        version_start = _check_int("version_start", version_start, 0)
        num_samples = _check_int("num_samples", num_samples, 1)
        retries = _check_int("retries", retries, 0)
        self._inflight[group_id] = _InflightGroup(version_start, num_samples, prompt, retries)
        self.counters.started += num_samples
        self.counters.inflight += num_samples

    def fail(self, group_id: int, reason: str, requeue: bool | None = None) -> None:
        """An in-flight group was cancelled or failed; all its samples are counted as dropped with
        ``reason``. Its prompt is re-queued (``next_retry``, at most ``max_retries`` times) when ``requeue`` is
        True, or, with ``requeue=None``, for a staleness cancellation (``reason`` starting with ``"stale"``).

        Raises:
            ValueError: ``group_id`` is not in flight.
        """
        rec = self._pop_inflight(group_id)
        self.counters.inflight -= rec.num_samples
        self._count(self.counters.dropped_by_reason, rec.num_samples, reason, dropped=True)
        if requeue or (requeue is None and reason.startswith("stale")):
            self._requeue(rec.prompt, rec.retries)

    def put(self, group: RolloutGroup, expected_samples: int | None = None) -> None:
        """A group finished: its samples leave the in-flight state.

        The group's episodes are its samples grouped by ``Sample.episode`` (a sample with None is an episode of its
        own). Branch samples (an episode's samples beyond its first) are added to ``started`` and ``branches`` here,
        when their number becomes known. Episodes that did not come back (fewer episodes than were started) are
        dropped, one sample each (``"error"``); with ``partial_groups="drop_group"`` the rest of such a group goes
        too. A group withheld while in flight is counted as withheld (every sample, branches included).

        Args:
            group: the finished group.
            expected_samples: the number of episodes (samples) ``start`` recorded for the group, checked when given
                (branch samples are not included: they are counted from ``group`` itself).

        Raises:
            ValueError: the group is not in flight, its ``version_start`` differs from the one recorded by
                ``start`` (the staleness bound would be checked against the wrong version), it has more episodes
                than were started or an episode index outside ``0 .. started - 1``, ``expected_samples`` disagrees
                with the started count, or a sample's ``version_segments`` are invalid (``_check_versions``).
        """
        rec = self._inflight.get(group.group_id)
        if rec is None:
            raise ValueError(f"group {group.group_id} is not in flight (never started, or already finished/failed)")
        if group.version_start != rec.version_start:
            raise ValueError(
                f"group {group.group_id}: version_start={group.version_start} but start() recorded "
                f"version_start={rec.version_start}; the group must carry the version it was started under "
                "(staleness is measured from it)"
            )
        if expected_samples is not None and expected_samples != rec.num_samples:
            raise ValueError(f"group {group.group_id}: expected_samples={expected_samples} but {rec.num_samples} "
                             f"samples were started")
        episodes = _num_episodes(group, rec.num_samples)
        max_version = _check_versions(group)
        del self._inflight[group.group_id]
        if self.on_finish is not None:
            self.on_finish(group)
        c = self.counters
        branches = group.size - episodes
        c.started += branches
        c.branches += branches
        c.inflight -= rec.num_samples
        missing = rec.num_samples - episodes
        if missing:
            self._count(c.dropped_by_reason, missing, "error", dropped=True)
        if rec.withheld:
            self._count(c.withheld_by_reason, group.size, "stale_inflight", dropped=False)
            self._requeue(rec.prompt, rec.retries)
            return
        if group.size == 0:
            return
        if missing and self.partial_groups == "drop_group":
            self._count(c.dropped_by_reason, group.size, "partial_group", dropped=True)
            return
        c.queued += group.size
        self._max_version_of[group.group_id] = max_version
        self._retries_of[group.group_id] = rec.retries
        self._prompt_of[group.group_id] = rec.prompt
        self._queue.append(group)

    def expire_inflight(self, next_batch: int) -> list[int]:
        """Apply the policy to in-flight groups that can no longer be trained whole in batch ``next_batch``
        or later. ``"drop"``: return their ids; the caller must cancel them and call
        ``fail(gid, "stale_inflight")``. ``"withhold"``: mark them withheld (counted when they finish);
        returns []. ``"mask"``: nothing (their later tokens may still be trained); returns []."""
        stale = [gid for gid, g in self._inflight.items()
                 if not g.withheld and not self.usable(g.version_start, next_batch)]
        if self.policy == "drop":
            return stale
        if self.policy == "withhold":
            for gid in stale:
                self._inflight[gid].withheld = True
        return []

    def drop_stale(self, consume_version: int) -> int:
        """Remove queued groups that can no longer be trained at ``consume_version`` or later; return the
        number of samples removed (dropped under ``"drop"``, withheld otherwise).

        Raises:
            ValueError: under ``"mask"``, a queued group has a token sampled by a version newer than
                ``consume_version`` (nothing is removed then): the trainer at ``consume_version`` cannot have
                produced that policy, so the version bookkeeping is broken and the token's age is undefined.
        """
        if self.policy == "mask":
            newer = [(g.group_id, self._max_version_of[g.group_id]) for g in self._queue
                     if self._max_version_of.get(g.group_id, -1) > consume_version]
            if newer:
                raise ValueError(
                    f"consume_version={consume_version} but queued group {newer[0][0]} has a token of version "
                    f"{newer[0][1]} (newer than the consuming trainer version; {len(newer)} such group(s)); a batch "
                    "must be consumed at a version >= every token's version -- check the version bookkeeping"
                )
        kept: collections.deque[RolloutGroup] = collections.deque()
        removed = 0
        for g in self._queue:
            if self.policy == "mask":
                n, lost_episodes = self._apply_mask_rule(g, consume_version, commit=False)
                if n == 0:
                    removed += self._leave(g, "fully_masked")
                    continue
                # the group is partial when an episode lost every sample (a fully masked branch of an episode
                # with a surviving branch leaves the episode's reward in the baseline)
                if lost_episodes and self.partial_groups == "drop_group":
                    removed += self._leave(g, "partial_group")
                    continue
                kept.append(g)
            elif self.usable(g.version_start, consume_version):
                kept.append(g)
            else:
                removed += self._leave(g, "stale_queued")
        self._queue = kept
        return removed

    def take(self, num_groups: int, consume_version: int) -> list[RolloutGroup] | None:
        """Hand ``num_groups`` groups (oldest first) to batch ``consume_version``, or ``None`` if fewer usable
        groups are queued. Stale queued groups are removed first (``drop_stale``). Under ``"mask"`` each
        taken sample gets its ``train_mask``, and samples with no trainable token are removed from their
        group (withheld, ``"fully_masked"``), so a group's ``samples`` are its survivors.

        Raises:
            TypeError: ``num_groups`` or ``consume_version`` is not an int.
            ValueError: ``num_groups < 1``, ``consume_version < 0``, ``consume_version`` below the version of an
                earlier ``take`` (an observed version decrease: after a trainer failover or resume the version must
                continue, never restart), a queued group started under a version newer than ``consume_version``
                (negative staleness), or (``"mask"``) a token version is newer than ``consume_version``
                (``drop_stale``).
        """
        num_groups = _check_int("num_groups", num_groups, 1)
        consume_version = _check_int("consume_version", consume_version, 0)
        last = self._last_consume_version
        if last is not None and consume_version < last:
            raise ValueError(
                f"consume_version={consume_version} is below the version of an earlier batch ({last}): policy "
                "versions must never decrease (after a trainer failover or resume, continue from the latest "
                "published version instead of restarting the counter)"
            )
        self._last_consume_version = consume_version
        self.drop_stale(consume_version)
        if len(self._queue) < num_groups:
            return None
        groups = [self._queue.popleft() for _ in range(num_groups)]
        c = self.counters
        for g in groups:
            self._max_version_of.pop(g.group_id, None)
            self._retries_of.pop(g.group_id, None)
            self._prompt_of.pop(g.group_id, None)
            if self.policy == "mask":
                self._apply_mask_rule(g, consume_version, commit=True)
            c.queued -= g.size
            c.in_batch += g.size
            self.staleness_hist[staleness(g.version_start, consume_version)] += g.size
        return groups

    def mark_trained(self, num_samples: int) -> None:
        """The trainer finished a step on a batch holding ``num_samples`` samples.

        Raises:
            TypeError: ``num_samples`` is not an int.
            ValueError: ``num_samples < 0``, or more samples than are in batches.
        """
        num_samples = _check_int("num_samples", num_samples, 0)
        if num_samples > self.counters.in_batch:
            raise ValueError(f"num_samples={num_samples} exceeds the {self.counters.in_batch} samples in batches")
        self.counters.in_batch -= num_samples
        self.counters.trained += num_samples

    @property
    def num_queued_groups(self) -> int:
        return len(self._queue)

    @property
    def num_inflight_groups(self) -> int:
        return len(self._inflight)

    @property
    def num_retry_prompts(self) -> int:
        return len(self._retry)

    def inflight_version_start(self, group_id: int) -> int:
        return self._inflight[group_id].version_start

    # -- internals ------------------------------------------------------------------------------
    def _pop_inflight(self, group_id: int) -> _InflightGroup:
        rec = self._inflight.pop(group_id, None)
        if rec is None:
            raise ValueError(f"group {group_id} is not in flight (never started, or already finished/failed)")
        return rec

    def _apply_mask_rule(self, g: RolloutGroup, consume_version: int, commit: bool) -> tuple[int, int]:
        """``(samples, lost episodes)``: the number of samples of ``g`` with at least one trainable token at
        ``consume_version``, and the number of episodes none of whose samples has one; with ``commit`` set the kept
        samples' ``train_mask``, remove the others (withheld) and count masked tokens."""
        keep: list[Sample] = []
        keys = _episode_keys(g.samples)
        kept_keys = set()
        masked_tokens = masked_samples = 0
        for s, key in zip(g.samples, keys, strict=True):
            runs = _version_runs(len(s.completion_ids), g.version_start, s.version_segments)
            ok = [consume_version - v <= self.max_off_policy_steps for v, _, _ in runs]
            model = s.completion_mask  # env tokens of multi-turn samples are neither trained nor masked
            if model is None:
                n = len(s.completion_ids)
                n_ok = sum(b - a for (_, a, b), k in zip(runs, ok, strict=True) if k)
            else:
                n = sum(model)
                n_ok = sum(sum(model[a:b]) for (_, a, b), k in zip(runs, ok, strict=True) if k)
            if n_ok:
                keep.append(s)
                kept_keys.add(key)
                if commit:
                    mask: list[bool] = []
                    for (_, a, b), k in zip(runs, ok, strict=True):
                        mask += [k] * (b - a)
                    s.train_mask = None if n_ok == n else mask
                    masked_tokens += n - n_ok
                    masked_samples += n_ok < n
        if commit:
            gone = g.size - len(keep)
            if gone:
                self.counters.queued -= gone
                self._count(self.counters.withheld_by_reason, gone, "fully_masked", dropped=False)
            g.samples = keep
            self.counters.masked_tokens += masked_tokens
            self.counters.masked_samples += masked_samples
        return len(keep), len(set(keys) - kept_keys)

    def _leave(self, g: RolloutGroup, reason: str) -> int:
        """A queued group leaves untrained: count it (dropped under "drop", else withheld), re-queue its prompt."""
        self.counters.queued -= g.size
        self._max_version_of.pop(g.group_id, None)
        if self.policy == "drop":
            self._count(self.counters.dropped_by_reason, g.size, reason, dropped=True)
        else:
            self._count(self.counters.withheld_by_reason, g.size, reason, dropped=False)
        self._requeue(self._prompt_of.pop(g.group_id, None), self._retries_of.pop(g.group_id, 0))
        return g.size

    def _requeue(self, prompt: Any, retries: int) -> None:
        if prompt is None:  # started without a prompt (caller does not re-queue): nothing to retry
            return
        if retries < self.max_retries:
            self._retry.append((prompt, retries + 1))
            self.counters.retried += 1
        else:
            self.counters.abandoned += 1

    def _count(self, by_reason: dict[str, int], n: int, reason: str, dropped: bool) -> None:
        if n <= 0:
            return
        if dropped:
            self.counters.dropped += n
        else:
            self.counters.withheld += n
        by_reason[reason] = by_reason.get(reason, 0) + n
