"""Deterministic discrete-event simulation of the async RL pipeline (inference engine, rollout buffer,
batcher, trainer, weight updates), driving the real ``AsyncRolloutBuffer`` and its admission rule.

What is simulated (time in seconds, no wall clock, one seeded ``random.Random``, a ``heapq`` event loop):

- **Producer** (as ``Orchestrator._producer``): after every event, start
  ``buffer.start_capacity(engine_version, next_batch, groups_per_step, max_inflight, last_batch)`` groups of
  ``group_size`` sequences; prompts re-queued by the buffer (``next_retry``) go first.
- **Engine**: ``inference_slots`` concurrent sequences (None = unlimited); a sequence waits FIFO for a slot,
  then takes ``request_latency_s + length / tokens_per_s`` seconds. A group finishes when its last member
  does (one request with ``n = group_size``, as in the orchestrator). A weight update switches the version
  of the tokens generated from then on (``Sample.version_segments``); requests in flight continue.
- **Batcher** (as ``Orchestrator._batcher``): takes batch ``next_batch`` as soon as ``may_take(next_batch,
  engine_version)`` holds and ``buffer.take(groups_per_step, consume_version=next_batch)`` succeeds, then applies
  ``buffer.expire_inflight`` (cancelling stale groups under ``"drop"``).
- **Trainer**: trains batch ``n`` (``train_step_s``, starting ``batch_handoff_s`` after the batch is
  taken), then publishes version ``n + 1``.
- **Weight watcher** (as ``Orchestrator._weight_watcher``): one update at a time; the engine serves the
  newest published version ``weight_update_s`` after the update starts, then the watcher is busy for
  ``watcher_busy_s`` (the salt probe) before it looks again, skipping versions published meanwhile.

``max_off_policy_steps = 0`` with ``admission = "inflight"`` is the synchronous baseline: the admission rule
then starts exactly one batch per policy version, and the trainer waits for the slowest rollout of each batch.
With ``in_order_versions`` a finished group is delivered only after every group started under an older
version (a FIFO engine with near-equal lengths, as measured on the CPU engine).

Metrics: ``trainer_idle_frac`` = time the trainer waits for a batch / (wait + train), both summed over
steps ``1..`` (the pipeline fill before batch 0 is excluded, as the real trainer's start-up is);
``trained_samples_per_hour`` = trained samples / simulated time at the end of the last step.

CLI: ``python -m moe_rl.rl.simulator --from-run RUN_DIR --out FILE.json`` fits the inputs from a finished
``moe-rl rl`` run (rollout durations, trainer step times, weight-reload times) and compares simulated and
measured trainer idle fraction and staleness histogram (``docs/async_rl.md``).
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import numbers
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.rl.buffer import AsyncRolloutBuffer, RolloutGroup, Sample, may_take
from moe_rl.rl.token_versions import normalize_segments

__all__ = [
    "PipelineSimConfig",
    "PipelineSimResult",
    "simulate_pipeline",
    "lognormal_lengths",
    "empirical_group_lengths",
    "fit_from_run",
    "compare_with_run",
]

LengthSampler = Callable[[random.Random, int], Sequence[float]]
"""``(rng, group_size) -> group_size`` completion lengths in tokens (> 0)."""
TimeSampler = Callable[[random.Random], float]
"""``rng -> seconds`` (>= 0)."""


class PipelineSimConfig(BaseConfig):
    """Inputs of ``simulate_pipeline`` besides the length and time distributions."""

    batch_size: int = Field(256, ge=1)
    """Samples per trainer step (a multiple of ``group_size``)."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt."""
    max_inflight: int = Field(64, ge=1)
    """Groups in flight at most (the orchestrator's ``max_inflight``)."""
    max_off_policy_steps: int = Field(1, ge=0)
    """Staleness bound; 0 = synchronous."""
    policy: Literal["drop", "withhold", "mask"] = "drop"
    partial_groups: Literal["survivors", "drop_group"] = "survivors"
    max_retries: int = Field(3, ge=0)
    max_ahead: int | None = Field(None, ge=0)
    """Versions inference may run ahead (admission); None = ``max_off_policy_steps``."""
    admission: Literal["inflight", "queued"] = "inflight"
    """Pending groups of the admission rule (``AsyncRolloutBuffer``)."""
    inference_slots: int | None = Field(None, ge=1)
    """Concurrent sequences the engine decodes (None = unlimited)."""
    tokens_per_s: float = Field(1.0, gt=0.0)
    """Decode speed of one sequence (tokens/s)."""
    request_latency_s: float = Field(0.0, ge=0.0)
    """Fixed time per sequence before its first token (prefill, network)."""
    train_step_s: float = Field(1.0, ge=0.0)
    """Trainer time per step (used when no ``train_step_time`` sampler is given)."""
    weight_update_s: float = Field(0.0, ge=0.0)
    """Delay from the start of a weight update to the engine serving the new version (reload)."""
    watcher_busy_s: float = Field(0.0, ge=0.0)
    """Time the weight watcher stays busy after an update (the orchestrator's salt probe) before it picks up
    the newest published version; versions published meanwhile are skipped, as the orchestrator does."""
    batch_handoff_s: float = Field(0.0, ge=0.0)
    """Delay from the batcher taking a batch to the trainer being able to start it."""
    in_order_versions: bool = False
    """Deliver a finished group only after every group started under an older version (a FIFO engine whose
    completions have near-equal lengths, like the debug_cpu run: it logged no finish that overtook an
    older-version group). False = each group finishes when its own sequences do."""
    max_steps: int = Field(100, ge=1)
    """Trainer steps simulated."""
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> PipelineSimConfig:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of group_size={self.group_size}")
        if self.max_ahead is not None and self.max_ahead > self.max_off_policy_steps:
            raise ValueError(
                f"max_ahead={self.max_ahead} must be <= max_off_policy_steps={self.max_off_policy_steps}: inference "
                "running further ahead than the bound only produces stale rollouts (or leave max_ahead=None)"
            )
        return self


@dataclass
class PipelineSimResult:
    """Outputs of ``simulate_pipeline``.

    Attributes:
        time_s: simulated seconds until the last trainer step ended.
        steps: trainer steps completed.
        trained_samples: samples trained.
        trained_samples_per_hour: ``trained_samples / time_s * 3600``.
        trainer_idle_s, trainer_busy_s: waiting for batches / training, steps ``1..`` (fill excluded).
        trainer_idle_frac: ``idle / (idle + busy)``.
        staleness_hist: ``{staleness: samples}`` of trained samples (``consume - version_start``).
        started: samples started; dropped_frac / withheld_frac: their fraction of ``started``.
        masked_token_frac: masked tokens / completion tokens of trained samples (``"mask"`` policy).
        counters: the buffer's ``BufferCounters`` as a dict at the end.
        step_idle_s: per-step wait for the batch (step 0 included).
    """

    time_s: float
    steps: int
    trained_samples: int
    trained_samples_per_hour: float
    trainer_idle_s: float
    trainer_busy_s: float
    trainer_idle_frac: float
    staleness_hist: dict[int, int]
    started: int
    dropped_frac: float
    withheld_frac: float
    masked_token_frac: float
    counters: dict
    step_idle_s: list[float] = field(default_factory=list)

    def staleness_fractions(self) -> dict[int, float]:
        total = sum(self.staleness_hist.values())
        return {k: v / total for k, v in sorted(self.staleness_hist.items())} if total else {}


# ---------------------------------------------------------------------------------------------- samplers
def lognormal_lengths(median: float, sigma: float, max_len: float | None = None) -> LengthSampler:
    """i.i.d. lognormal completion lengths: ``median * exp(sigma * z)``, ``z ~ N(0, 1)`` (rounded up to a
    whole token, capped at ``max_len``). ``p99 / p50 = exp(2.326 * sigma)`` (>= 20 for sigma >= 1.288).

    Raises:
        ValueError: ``median <= 0`` or ``sigma < 0``.
    """
    if median <= 0 or sigma < 0:
        raise ValueError(f"lognormal_lengths needs median > 0 and sigma >= 0, got median={median}, sigma={sigma}")

    def sample(rng: random.Random, n: int) -> list[float]:
        out = []
        for _ in range(n):
            x = math.ceil(median * math.exp(sigma * rng.gauss(0.0, 1.0)))
            out.append(float(min(x, max_len) if max_len else x))
        return out

    return sample


def empirical_group_lengths(durations: Sequence[float], tokens_per_s: float) -> LengthSampler:
    """Resample whole-group durations (seconds, e.g. measured ``t_end - t_start`` of each group) and give
    every member that duration's length at ``tokens_per_s`` (a group finishes when its slowest member does,
    so a group's measured duration is its slowest member's).

    Raises:
        ValueError: ``durations`` is empty or has a negative value.
    """
    if not durations or min(durations) < 0:
        raise ValueError(f"durations must be a non-empty list of seconds >= 0, got {len(durations)} values")
    values = list(durations)

    def sample(rng: random.Random, n: int) -> list[float]:
        d = values[rng.randrange(len(values))]
        return [max(1e-9, d * tokens_per_s)] * n

    return sample


# ---------------------------------------------------------------------------------------------- simulation
def _checked_lengths(lengths: LengthSampler) -> LengthSampler:
    """``lengths`` raising ValueError unless it returns ``n`` finite lengths > 0 (tokens)."""

    def sample(rng: random.Random, n: int) -> list[float]:
        out = list(lengths(rng, n))
        if len(out) != n:
            raise ValueError(f"lengths sampler returned {len(out)} lengths for a group of group_size={n}; it must "
                             "return exactly one completion length per group member")
        bad = [x for x in out if not (isinstance(x, numbers.Real) and math.isfinite(x) and x > 0)]
        if bad:
            raise ValueError(f"lengths sampler returned {bad[0]!r} ({len(bad)} bad of {n}); every completion "
                             "length must be a finite number of tokens > 0")
        return [float(x) for x in out]

    return sample


def _checked_time(name: str, sampler: TimeSampler) -> TimeSampler:
    """``sampler`` raising ValueError unless it returns a finite number of seconds >= 0."""

    def sample(rng: random.Random) -> float:
        t = sampler(rng)
        if not (isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0):
            raise ValueError(f"{name} sampler returned {t!r}; it must return a finite number of seconds >= 0")
        return float(t)

    return sample


@dataclass
class _Seq:
    gid: int
    member: int
    length: float
    t_gen: float = -1.0  # when it got a slot (-1 = waiting)
    segments: list[tuple[int, int]] = field(default_factory=list)
    done: bool = False


@dataclass
class _Group:
    version_start: int
    t_start: float
    seqs: list[_Seq]
    remaining: int


def simulate_pipeline(cfg: PipelineSimConfig, lengths: LengthSampler,
                      train_step_time: TimeSampler | None = None,
                      weight_update_time: TimeSampler | None = None,
                      watcher_busy_time: TimeSampler | None = None) -> PipelineSimResult:
    """Simulate ``cfg.max_steps`` trainer steps of the async pipeline (module docstring).

    Args:
        cfg: pipeline parameters.
        lengths: completion-length sampler of one group (tokens; duration = ``request_latency_s +
            length / tokens_per_s``).
        train_step_time: sampler of one trainer step's duration (default: constant ``cfg.train_step_s``).
        weight_update_time: sampler of the publish-to-serve delay (default: ``cfg.weight_update_s``).
        watcher_busy_time: sampler of the time the weight watcher stays busy after an update (default:
            ``cfg.watcher_busy_s``).

    Returns:
        ``PipelineSimResult``.

    Raises:
        ValueError: a sampler returns a bad value: ``lengths`` not exactly ``group_size`` finite lengths > 0,
            or a time sampler a value that is not a finite number of seconds >= 0.
        RuntimeError: the pipeline deadlocks (no event pending while steps remain) or the buffer's
            accounting breaks.
    """
    rng = random.Random(cfg.seed)
    gps = cfg.batch_size // cfg.group_size
    buf = AsyncRolloutBuffer(cfg.max_off_policy_steps, policy=cfg.policy, partial_groups=cfg.partial_groups,
                             max_retries=cfg.max_retries, max_ahead=cfg.max_ahead, admission=cfg.admission)
    lengths = _checked_lengths(lengths)
    step_time = _checked_time("train_step_time", train_step_time or (lambda _r: cfg.train_step_s))
    update_time = _checked_time("weight_update_time", weight_update_time or (lambda _r: cfg.weight_update_s))
    probe_time = _checked_time("watcher_busy_time", watcher_busy_time or (lambda _r: cfg.watcher_busy_s))

    events: list[tuple[float, int, str, tuple]] = []
    seq_no = 0

    def push(t: float, kind: str, payload: tuple = ()) -> None:
        nonlocal seq_no
        heapq.heappush(events, (t, seq_no, kind, payload))
        seq_no += 1

    now = 0.0
    engine_version = 0
    next_batch = 0          # next batch the batcher takes
    trained_steps = 0       # = trainer version
    trainer_busy = False
    trainer_free_at = 0.0
    watcher_busy = False  # one weight update at a time, then the newest published version
    ready: dict[int, tuple[list[RolloutGroup], float]] = {}  # batch -> (groups, time it can start)
    groups: dict[int, _Group] = {}
    waiting: collections.deque[_Seq] = collections.deque()
    active: set[tuple[int, int]] = set()
    slots_free = cfg.inference_slots if cfg.inference_slots is not None else math.inf
    next_gid = 0
    next_prompt = 0
    idle_s = busy_s = 0.0
    step_idle: list[float] = []
    trained_tokens = masked_tokens = 0
    wake_for = [-1]  # the step a "wake" event is pending for (batch handoff)
    undelivered: collections.Counter[int] = collections.Counter()  # start version -> groups not yet in the buffer
    held: set[int] = set()  # finished groups waiting for older-version groups (in_order_versions)

    def start_seq(s: _Seq) -> None:
        nonlocal slots_free
        slots_free -= 1
        s.t_gen = now + cfg.request_latency_s
        g = groups[s.gid]
        if engine_version != g.version_start:
            s.segments.append((engine_version, 0))
        active.add((s.gid, s.member))
        push(s.t_gen + s.length / cfg.tokens_per_s, "seq_done", (s.gid, s.member))

    def fill_slots() -> None:
        while waiting and slots_free > 0:
            s = waiting.popleft()
            if s.gid in groups and not s.done:
                start_seq(s)

    def produce() -> None:
        nonlocal next_gid, next_prompt
        cap = buf.start_capacity(engine_version, next_batch, gps, cfg.max_inflight, last_batch=cfg.max_steps - 1)
        for _ in range(max(0, cap)):
            retry = buf.next_retry()
            if retry is None:
                prompt, retries = next_prompt, 0
                next_prompt += 1
            else:
                prompt, retries = retry
            gid = next_gid
            next_gid += 1
            buf.start(gid, engine_version, cfg.group_size, prompt=prompt, retries=retries)
            seqs = [_Seq(gid, i, float(x)) for i, x in enumerate(lengths(rng, cfg.group_size))]
            groups[gid] = _Group(engine_version, now, seqs, len(seqs))
            undelivered[engine_version] += 1
            waiting.extend(seqs)
        fill_slots()

    def cancel(gid: int) -> None:
        nonlocal slots_free
        g = groups.pop(gid)
        undelivered[g.version_start] -= 1
        held.discard(gid)
        for s in g.seqs:
            if (gid, s.member) in active:
                active.discard((gid, s.member))
                slots_free += 1
        buf.fail(gid, "stale_inflight")
        deliver_held()

    def deliver(gid: int) -> None:
        g = groups.pop(gid)
        undelivered[g.version_start] -= 1
        samples = []
        for s in g.seqs:
            n = max(1, math.ceil(s.length))
            # s.segments are switch points after the start version: canonical form for the buffer
            segs = normalize_segments([(g.version_start, 0), *s.segments], n) if s.segments else None
            samples.append(Sample([0], [0] * n, [0.0] * n, version_segments=segs))
        buf.put(RolloutGroup(gid, g.version_start, "", samples, version_end=engine_version,
                             problem=None, t_start=g.t_start, t_end=now))

    def deliver_held() -> None:
        for gid in sorted(held, key=lambda x: groups[x].version_start):
            v0 = groups[gid].version_start
            if not any(n and v < v0 for v, n in undelivered.items()):
                held.discard(gid)
                deliver(gid)

    def batcher() -> None:
        nonlocal next_batch
        while next_batch < cfg.max_steps and may_take(next_batch, engine_version):
            got = buf.take(gps, consume_version=next_batch)
            if got is None:
                return
            ready[next_batch] = (got, now + cfg.batch_handoff_s)
            next_batch += 1
            for gid in buf.expire_inflight(next_batch):
                cancel(gid)
            fill_slots()

    def trainer() -> None:
        nonlocal trainer_busy, idle_s, busy_s
        if trainer_busy or trained_steps >= cfg.max_steps or trained_steps not in ready:
            return
        got, t_ok = ready[trained_steps]
        if t_ok > now:
            if wake_for[0] != trained_steps:
                wake_for[0] = trained_steps
                push(t_ok, "wake")
            return
        del ready[trained_steps]
        wait = now - trainer_free_at
        step_idle.append(wait)
        dt = step_time(rng)
        if trained_steps > 0:
            idle_s += wait
            busy_s += dt
        trainer_busy = True
        push(now + dt, "train_done", (sum(g.size for g in got), got))

    produce()
    while trained_steps < cfg.max_steps:
        if not events:
            raise RuntimeError(
                f"simulated pipeline deadlocked at t={now:.3f}s: step {trained_steps}/{cfg.max_steps}, engine "
                f"version {engine_version}, next batch {next_batch}, {buf.num_inflight_groups} groups in flight, "
                f"{buf.num_queued_groups} queued, counters {buf.counters}"
            )
        now, _, kind, payload = heapq.heappop(events)
        if kind == "seq_done":
            gid, member = payload
            if (gid, member) not in active:
                continue  # cancelled
            active.discard((gid, member))
            slots_free += 1
            g = groups[gid]
            g.seqs[member].done = True
            g.remaining -= 1
            if g.remaining == 0:
                if cfg.in_order_versions and any(n and v < g.version_start for v, n in undelivered.items()):
                    held.add(gid)
                else:
                    deliver(gid)
                    deliver_held()
            fill_slots()
        elif kind == "train_done":
            n_samples, got = payload
            buf.mark_trained(n_samples)
            for g in got:
                for s in g.samples:
                    trained_tokens += len(s.completion_ids)
                    if s.train_mask is not None:
                        masked_tokens += len(s.train_mask) - sum(s.train_mask)
            trained_steps += 1
            trainer_busy = False
            trainer_free_at = now
            if not watcher_busy:
                watcher_busy = True
                push(now + update_time(rng), "engine_update", (trained_steps,))
        elif kind == "watcher_free":
            watcher_busy = trained_steps > engine_version
            if watcher_busy:  # adopt the newest published version (skipping any in between)
                push(now + update_time(rng), "engine_update", (trained_steps,))
        elif kind == "engine_update":
            (version,) = payload
            push(now + probe_time(rng), "watcher_free")
            if version > engine_version:
                engine_version = version
                for gid, member in active:
                    s = groups[gid].seqs[member]
                    k = max(0, math.floor((now - s.t_gen) * cfg.tokens_per_s))
                    if k >= math.ceil(s.length):
                        continue
                    if s.segments and s.segments[-1][1] == k:
                        s.segments[-1] = (engine_version, k)
                    else:
                        s.segments.append((engine_version, k))
        batcher()
        produce()
        batcher()
        trainer()
        buf.counters.check()

    c = buf.counters
    started = max(1, c.started)
    return PipelineSimResult(
        time_s=now,
        steps=trained_steps,
        trained_samples=c.trained,
        trained_samples_per_hour=c.trained / max(now, 1e-12) * 3600.0,
        trainer_idle_s=idle_s,
        trainer_busy_s=busy_s,
        trainer_idle_frac=idle_s / max(1e-12, idle_s + busy_s),
        staleness_hist=dict(sorted(buf.staleness_hist.items())),
        started=c.started,
        dropped_frac=c.dropped / started,
        withheld_frac=c.withheld / started,
        masked_token_frac=masked_tokens / max(1, trained_tokens),
        counters=asdict(c),
        step_idle_s=step_idle,
    )


# ---------------------------------------------------------------------------------------------- fit to a run
def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def fit_from_run(run_dir: str | Path) -> dict:
    """Measured inputs and outputs of a finished ``moe-rl rl`` run.

    Reads ``config.json`` (orchestrator settings), ``rollouts.jsonl`` (group durations),
    ``trainer/step_*.json`` (``compute_s + publish_s`` per step), ``engine_events.jsonl`` (weight reload
    seconds) and ``metrics.jsonl`` (per-step trainer idle and staleness counts).

    Returns:
        ``{"config": PipelineSimConfig kwargs, "group_durations_s": [...], "train_step_s": [...],
        "weight_update_s": [...], "measured": {"trainer_idle_frac", "staleness_hist", ...}}``.

    Raises:
        FileNotFoundError: a required file is missing (e.g. a run made before ``rollouts.jsonl`` existed).
    """
    run = Path(run_dir)
    for name in ("config.json", "rollouts.jsonl", "metrics.jsonl", "engine_events.jsonl"):
        if not (run / name).exists():
            raise FileNotFoundError(f"{run / name} is missing; --from-run needs a finished moe-rl rl run directory")
    cfg = json.loads((run / "config.json").read_text())
    orch = cfg["orchestrator"]
    rollouts = _read_jsonl(run / "rollouts.jsonl")
    metrics = _read_jsonl(run / "metrics.jsonl")
    steps = sorted(run.glob("trainer/step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    reports = [json.loads(p.read_text()) for p in steps]
    events = _read_jsonl(run / "engine_events.jsonl")
    durations = [r["t_end"] - r["t_start"] for r in rollouts]
    # finishes that overtook a group started under an older version (0 -> the engine delivers in version order)
    overtakes, latest_end = 0, {}
    for r in sorted(rollouts, key=lambda r: r["t_start"]):
        v = r.get("version_start", 0)
        older = [t for u, t in latest_end.items() if u < v]
        overtakes += bool(older) and r["t_end"] < max(older)
        latest_end[v] = max(latest_end.get(v, r["t_end"]), r["t_end"])
    train_s = [r["compute_s"] + r["publish_s"] for r in reports[1:]]
    reload_s = [e["reload_s"] for e in events if e["version"] > 0]
    # watcher busy time after each update (the salt probe): logged as probe_s, else recovered from the next
    # update's start when that started later than its publication (the watcher was still busy)
    published_at = {m["step"] + 1: m["time_s"] for m in metrics}  # the trainer report follows the publish
    if all("probe_s" in e for e in events[1:]):
        probe_s = [e["probe_s"] for e in events[1:]]
    else:
        probe_s = []
        for a, b in zip(events, events[1:], strict=False):
            start_b = b["t"] - b["reload_s"]
            if b["version"] in published_at and start_b - published_at[b["version"]] > 0.05:
                probe_s.append(max(0.0, start_b - a["t"]))
    idle = sum(m["trainer_idle_s"] for m in metrics[1:])
    busy = sum(m["trainer_busy_s"] for m in metrics[1:])
    hist: collections.Counter[int] = collections.Counter()
    for m in metrics:
        for k, v in m["staleness_counts"].items():
            hist[int(k)] += v
    return {
        "config": {
            "batch_size": orch["batch_size"], "group_size": orch["group_size"], "max_inflight": orch["max_inflight"],
            "max_off_policy_steps": orch["max_off_policy_steps"],
            "policy": orch.get("off_policy_policy", "drop"), "partial_groups": orch.get("partial_groups", "survivors"),
            "max_retries": orch.get("max_retries", 3), "max_steps": len(metrics),
            "max_ahead": orch.get("max_ahead"), "admission": orch.get("admission", "inflight"),
        },
        "group_durations_s": durations,
        "train_step_s": train_s,
        "weight_update_s": reload_s,
        "watcher_busy_s": probe_s,
        "measured": {
            "trainer_idle_frac": idle / max(1e-12, idle + busy),
            "staleness_hist": dict(sorted(hist.items())),
            "steps": len(metrics),
            "rollouts_dropped": metrics[-1]["rollouts_dropped"],
            "rollouts_started": metrics[-1]["rollouts_started"],
            "group_duration_s_median": statistics.median(durations),
            "cross_version_overtakes": overtakes,
            "train_step_s_median": statistics.median(train_s),
            "weight_update_s_median": statistics.median(reload_s) if reload_s else 0.0,
        },
    }


def _fractions(hist: dict[int, int]) -> dict[int, float]:
    total = sum(hist.values())
    return {k: v / total for k, v in sorted(hist.items())} if total else {}


def compare_with_run(run_dir: str | Path, seeds: Sequence[int] = (0, 1, 2, 3, 4), tolerance: float = 0.2,
                     in_order: bool | None = None) -> dict:
    """Simulate a run from its fitted inputs (empirical resampling of group durations, trainer step times and
    weight-reload times, with the run's orchestrator settings) and compare with what it measured.

    Args:
        run_dir: the run directory.
        seeds: simulator seeds (results are averaged).
        tolerance: the acceptance bound for both checks.
        in_order: ``PipelineSimConfig.in_order_versions``; None = True when at most 10 % of the measured groups
            finished before a group started under an older version.

    Returns:
        A JSON-able dict: inputs summary, measured and simulated (mean over ``seeds``) trainer idle
        fraction, staleness fractions and dropped fraction, and errors. ``within_tolerance``: the idle
        fraction's relative error and the staleness histograms' total-variation distance (the fraction of
        samples whose staleness bin would have to change) are both ``<= tolerance``. Relative errors of
        the bins holding >= 5 % of the measured samples are reported too.
    """
    fit = fit_from_run(run_dir)
    if in_order is None:
        in_order = fit["measured"]["cross_version_overtakes"] <= 0.1 * len(fit["group_durations_s"])
    train_s, reload_s = fit["train_step_s"], fit["weight_update_s"] or [0.0]
    probe_s = fit["watcher_busy_s"] or [0.0]
    sims = []
    for seed in seeds:
        cfg = PipelineSimConfig(**fit["config"], seed=seed, tokens_per_s=1.0,
                                in_order_versions=in_order)
        sims.append(simulate_pipeline(
            cfg, empirical_group_lengths(fit["group_durations_s"], tokens_per_s=1.0),
            train_step_time=lambda r: train_s[r.randrange(len(train_s))],
            weight_update_time=lambda r: reload_s[r.randrange(len(reload_s))],
            watcher_busy_time=lambda r: probe_s[r.randrange(len(probe_s))],
        ))
    sim_idle = statistics.fmean(s.trainer_idle_frac for s in sims)
    bins = sorted({k for s in sims for k in s.staleness_hist} | set(fit["measured"]["staleness_hist"]))
    sim_frac = {k: statistics.fmean(s.staleness_fractions().get(k, 0.0) for s in sims) for k in bins}
    meas_frac = {k: _fractions(fit["measured"]["staleness_hist"]).get(k, 0.0) for k in bins}
    idle_meas = fit["measured"]["trainer_idle_frac"]
    rel_idle = abs(sim_idle - idle_meas) / max(1e-12, idle_meas)
    bin_err = {k: abs(sim_frac[k] - meas_frac[k]) / meas_frac[k] for k in bins if meas_frac[k] >= 0.05}
    tv = 0.5 * sum(abs(sim_frac[k] - meas_frac[k]) for k in bins)
    return {
        "run_dir": str(run_dir),
        "config": fit["config"],
        "inputs": {
            "groups_measured": len(fit["group_durations_s"]),
            "group_duration_s_median": fit["measured"]["group_duration_s_median"],
            "group_duration_s_p90": statistics.quantiles(fit["group_durations_s"], n=10)[-1],
            "train_step_s_median": fit["measured"]["train_step_s_median"],
            "weight_update_s_median": fit["measured"]["weight_update_s_median"],
            "cross_version_overtakes": fit["measured"]["cross_version_overtakes"],
            "watcher_busy_s_median": statistics.median(probe_s),
            "watcher_busy_samples": len(fit["watcher_busy_s"]),
        },
        "seeds": list(seeds),
        "measured": {"trainer_idle_frac": idle_meas, "staleness_frac": {str(k): v for k, v in meas_frac.items()},
                     "dropped_frac": fit["measured"]["rollouts_dropped"] / max(1, fit["measured"]["rollouts_started"])},
        "simulated": {"trainer_idle_frac": sim_idle,
                      "trainer_idle_frac_per_seed": [s.trainer_idle_frac for s in sims],
                      "staleness_frac": {str(k): v for k, v in sim_frac.items()},
                      "dropped_frac": statistics.fmean(s.dropped_frac for s in sims)},
        "rel_err": {"trainer_idle_frac": rel_idle, "staleness_frac": {str(k): v for k, v in bin_err.items()},
                    "staleness_total_variation": tv},
        "tolerance": tolerance,
        "in_order_versions": in_order,
        "within_tolerance": rel_idle <= tolerance and tv <= tolerance,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_rl.rl.simulator",
                                description="Compare the pipeline simulator with a finished moe-rl rl run.")
    p.add_argument("--from-run", action="append", required=True, metavar="RUN_DIR",
                   help="a finished run directory (repeatable)")
    p.add_argument("--out", type=Path, help="write the comparison JSON here (with provenance)")
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args(argv)
    results = [compare_with_run(d, seeds=range(args.seeds)) for d in args.from_run]
    for r in results:
        print(f"{r['run_dir']}: max_off_policy_steps={r['config']['max_off_policy_steps']} trainer idle measured "
              f"{r['measured']['trainer_idle_frac']:.3f} simulated {r['simulated']['trainer_idle_frac']:.3f} "
              f"(rel err {r['rel_err']['trainer_idle_frac']:.1%}); staleness measured {_fmt(r['measured'])}"
              f" simulated {_fmt(r['simulated'])} (total variation "
              f"{r['rel_err']['staleness_total_variation']:.3f}); within {r['tolerance']:.0%}: {r['within_tolerance']}")
    if args.out:
        out = {"provenance": _provenance(), "comparisons": results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["within_tolerance"] for r in results) else 1


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:.3f}" for k, v in d["staleness_frac"].items()) + "}"


def _provenance() -> dict:
    import datetime
    import platform
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "moe_rl"], capture_output=True, text=True,
                                    check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", True
    return {"commit": commit, "moe_rl_tree_dirty": dirty, "machine": platform.platform(),
            "python": platform.python_version(), "date_utc": datetime.datetime.now(datetime.UTC).isoformat(),
            "command": "python -m moe_rl.rl.simulator " + " ".join(sys.argv[1:])}


if __name__ == "__main__":
    raise SystemExit(main())

