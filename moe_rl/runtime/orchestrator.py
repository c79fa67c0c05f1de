"""The asyncio orchestrator: keeps rollouts in flight against an inference engine, scores them, packs
staleness-bounded batches for the trainer, and pushes each new policy version to the engine.

Data flow per run (see ``docs/architecture.md``)::

    producer --requests(cache_salt = f(v_start))--> engine --tokens, logprobs--> rewards -> buffer
    batcher  <-- buffer.take(groups, consume_version=n) --> batches/step_<n>.safetensors --> trainer
    watcher  <-- weights/announce/step_<v>.json (trainer rank 0; moe_rl.weights.announce) --> the engine loads v
             from the transport named there (sharded folder, broadcast groups, Mooncake store), no drain
    metrics  <-- trainer/step_<n>.json --> metrics.jsonl (one line per trainer step)

The weight update is the only synchronisation point: the trainer trains batch ``n`` while the engine
generates rollouts for later batches under the newest version it has; nothing waits for the slowest
rollout (a batch takes the first finished groups).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.envs.loader import as_environment
from moe_rl.envs.protocol import Environment
from moe_rl.rl.batch import build_batch, write_batch
from moe_rl.rl.buffer import AsyncRolloutBuffer, RolloutGroup, Sample, may_take
from moe_rl.rl.salt import cache_salt_for, check_run_id
from moe_rl.runtime.engine_pool import EngineDied
from moe_rl.runtime.run_dir import RunPaths

__all__ = ["OrchestratorConfig", "Orchestrator", "EngineClient"]


class OrchestratorConfig(BaseConfig):
    """Rollout scheduling and staleness control."""

    batch_size: int = Field(128, ge=1)
    """Episodes per trainer step (``batch_size // group_size`` groups); a multiple of ``group_size``. An agentic
    episode that forms several trajectories by token prefix trains each as a sample (row) of its own, so a batch
    may hold more rows."""
    group_size: int = Field(8, ge=1, le=256)
    """Samples per prompt; advantages use the group mean as baseline."""
    max_inflight: int = Field(32, ge=1)
    """Groups (engine requests with ``n = group_size``) kept in flight."""
    max_off_policy_steps: int = Field(1, ge=0)
    """Largest staleness trained: ``trainer version at consumption - policy version at rollout start``.
    0 = synchronous on-policy. What happens to rollouts that exceed it is ``off_policy_policy``."""
    off_policy_policy: Literal["drop", "withhold", "mask"] = "drop"
    """``drop``: cancel stale in-flight groups, discard stale queued ones; ``withhold``: let them finish, never
    train them; ``mask``: train only the tokens whose own policy version is within ``max_off_policy_steps``
    of the consuming trainer version (``moe_rl.rl.buffer``). Every lost sample is counted by reason."""
    partial_groups: Literal["survivors", "drop_group"] = "survivors"
    """A group that lost members (engine error, fully masked samples) trains its survivors with a baseline over
    the survivors (``survivors``) or is removed whole (``drop_group``)."""
    max_retries: int = Field(3, ge=0)
    """Re-queues (ahead of new prompts) of a prompt whose group was lost to staleness; then it is abandoned."""
    max_ahead: int | None = Field(None, ge=0)
    """Versions inference may run ahead of the trainer in the admission rule (<= ``max_off_policy_steps``;
    None = ``max_off_policy_steps``). Smaller values leave long rollouts slack before they go stale."""
    admission: Literal["inflight", "queued"] = "inflight"
    """Groups the admission rule counts as pending: queued + in flight (``inflight``, AReaL) or only queued
    (``queued``, prime-rl: ``max_inflight`` alone bounds the engine; better under a long-tail length
    distribution, see ``docs/async_rl.md``)."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature (the trainer divides its logits by the same value)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the engine samples from the smallest set of most likely tokens whose probability reaches
    ``top_p`` (sent as the request's ``top_p``; 1.0 = off). Below 1 the engine's log-probs are renormalised over
    that set, which the trainer reproduces only with ``trainer.sampling_mask_replay`` (otherwise ``mismatch_kl``
    grows by the dropped mass)."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the ``top_k`` most likely tokens (sent as the request's ``top_k``; -1 = off, 0 is not allowed).
    Same caveat as ``top_p``."""
    engine_probe: bool = True
    """After each weight update, send two probe requests with the new salt and record the served version,
    the probe's greedy tokens/logprobs and vLLM's cached-token counts (a live check that the weights
    changed and that salting isolates versions)."""
    request_timeout_s: float = Field(600.0, gt=0.0)
    """Timeout of one engine request."""
    episode_timeout_s: float | None = Field(None, gt=0.0)
    """Wall-clock limit of one episode (all its model calls and tools); a cancelled episode is not trained and
    is counted (``episodes_stop_timeout``). None: no limit."""
    max_consecutive_errors: int = Field(20, ge=1)
    """Abort the run after this many engine errors in a row (each failed group is counted as dropped)."""
    stall_timeout_s: float = Field(600.0, gt=0.0)
    """Fail the run (with a dump of every asyncio task's stack) if no trainer step completes for this long."""
    keep_weight_versions: int = Field(2, ge=1)
    """Published weight directories kept on disk behind the served one (older ones are deleted)."""

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.top_k == 0:
            raise ValueError("top_k=0 is not a kept-set size; set -1 (off) or a count >= 1")
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of group_size={self.group_size} "
                f"(a batch holds whole groups); e.g. set batch_size={self.group_size * max(1, self.batch_size // self.group_size)}"
            )
        if self.max_ahead is not None and self.max_ahead > self.max_off_policy_steps:
            raise ValueError(f"max_ahead={self.max_ahead} must be <= max_off_policy_steps={self.max_off_policy_steps} "
                             f"(inference running further ahead only produces stale rollouts); lower it or set None")
        return self


class EngineClient(Protocol):
    """What the orchestrator needs from an inference engine (``moe_rl.inference.VllmClient``).

    ``generate`` returns ``(completions, cached_prompt_tokens)``; each completion has ``token_ids``,
    ``logprobs``, ``finish_reason`` and optionally ``version_segments`` (``[(policy version, first token
    index), ...]``, the weights that sampled each token across in-flight weight updates; None or absent =
    unknown, every token is then taken to have the group's start version). Requests of an environment that sets
    stop tokens pass ``stop_token_ids=[...]`` too (``moe_rl.envs.runner.run_group``).
    """

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       cache_salt: str | None, seed: int | None) -> tuple[list[Any], int]: ...

    async def update_weights(self, path: str, version: int) -> dict: ...

    async def weight_version(self) -> int: ...

    # per transport (only the one the run uses is called): sharded folder, broadcast groups, p2p pulls
    async def load_sharded(self, path: str, version: int) -> dict: ...

    async def init_sharded_broadcast(self, endpoints: list, rank_offset: int, world_size: int, backend: str,
                                     timeout_s: float) -> Any: ...

    async def update_weights_from_broadcast(self, version: int) -> dict: ...

    async def init_p2p(self, endpoints: list, rank_offset: int, world_size: int, timeout_s: float) -> Any: ...

    async def update_weights_from_p2p(self, index: str, version: int) -> dict: ...


@dataclass
class _Inflight:
    task: asyncio.Task
    version_start: int
    num_samples: int
    cancel_reason: str = "cancelled"


@dataclass
class _BatchInfo:
    step: int
    num_samples: int
    reward_mean: float
    staleness_max: int
    staleness_mean: float
    mixed_version_groups: int
    policy_version: int
    staleness_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class _State:
    engine_version: int = 0
    next_batch: int = 0
    completion_tokens: int = 0
    consecutive_errors: int = 0
    errors: int = 0
    batches: dict[int, _BatchInfo] = field(default_factory=dict)
    reload_s: list[float] = field(default_factory=list)
    error_messages: dict[str, int] = field(default_factory=dict)
    weights_loaded: dict[int, str] = field(default_factory=dict)
    """Version -> transport it was loaded from (``mooncake``/``filesystem``)."""
    weights_skipped: list[int] = field(default_factory=list)
    """Versions never tried because a newer one was already published (the watcher jumps to the newest)."""
    weights_failed: dict[int, str] = field(default_factory=dict)
    """Versions whose load failed (e.g. lost with a dead store, no folder copy), superseded by a newer one."""
    weights_recovered: list[int] = field(default_factory=list)
    """Versions whose store load failed and that were then loaded from the trainer's folder copy (republished)."""
    weight_load_fallbacks: int = 0
    """Store-announced versions the engine loaded from the folder because the store could not deliver them."""
    weight_load_retries: int = 0
    """Loads tried again after a failure (a folder load that failed, a store version republished to the folder)."""
    last_update: dict = field(default_factory=dict)
    """The engine's latest weight update: ``version``, ``source``, ``engine_pause_s``, ``load_s``, ``bytes``."""
    trainer_weight_transport: dict = field(default_factory=dict)
    """The trainer's publisher counters from its latest step report."""
    recorded_version: int = 0
    """Newest version whose engine event (probe included) is written."""
    turns: collections.Counter = field(default_factory=collections.Counter)
    """Multi-turn rollouts (cumulative): ``samples`` (trajectory samples built), ``branches`` (samples beyond the
    first of their episode: a re-rendered history or a rollback), ``turns``, ``env_tokens``; with router replay
    ``routed_experts_stitched`` (complete whole-sequence records), ``routed_experts_missing_turn`` (a turn had no
    engine record), ``routed_experts_incomplete`` (rows still missing after stitching) and
    ``routed_experts_conflict_rows`` (rows two turns recorded differently; the earlier turn's kept)."""
    episodes: collections.Counter = field(default_factory=collections.Counter)
    sampling_masks: collections.Counter = field(default_factory=collections.Counter)
    """Samples built (cumulative) with an engine kept-set record (``with``) and without one (``without``: not
    recorded, incomplete, or a multi-call episode, whose records are not merged across turns)."""
    """Episodes (cumulative): ``episodes``, ``stop_<reason>``, ``errors_<kind>`` (engine / env / timeout) and the
    environments' own metrics summed as ``env_<name>``."""


class Orchestrator:
    """Run the async RL data plane until the trainer has finished ``max_steps`` steps.

    Args:
        cfg: the orchestrator config.
        task: the environment (:class:`moe_rl.envs.Environment`; an object with the older task interface is
            adapted by :func:`moe_rl.envs.as_environment`). Each group plays ``group_size`` episodes
            (:func:`moe_rl.envs.runner.run_group`); each episode's model calls become samples by token prefix
            (:func:`moe_rl.rl.trajectory.interleave_calls`): one per trajectory (branch), the whole conversation of
            that branch, env tokens masked out of the loss.
        client: the engine client.
        paths: run directories (weights, batches, trainer reports).
        max_steps: trainer steps of the run.
        seed: seed of the prompt sampler and of per-request sampling seeds.
        max_model_len: the engine's context limit, given to the episodes (None: unknown).
        run_id: mixed into ``cache_salt`` so runs sharing an engine never share KV (refused at once if it cannot make a
            valid salt: :func:`moe_rl.rl.salt.check_run_id`).
        weight_dtype: the engine's dtype (mixed into ``cache_salt``).
        on_step: called with each metrics record (e.g. to advance a progress bar).
        store: with ``trainer.weight_transport = "mooncake"``, the run's store
            (``moe_rl.weights.mooncake.StoreSource``): announced store versions are loaded from it (folder
            fallback), and the run ends only once the engine serves the final version.
        weight_transport: the trainer's ``trainer.weight_transport`` (default: ``"mooncake"`` with a store, else
            ``"filesystem"``). Every transport announces its versions (``moe_rl.weights.announce``); with
            ``"broadcast"`` the watcher first makes the engine join the trainer's groups, then receives every
            version in order, and the run ends once the engine serves the final version; with ``"p2p"`` it first
            makes the engine join the trainer ranks' p2p groups, then pulls the newest announced version.
    """

    def __init__(
        self,
        cfg: OrchestratorConfig,
        task: Environment | Any,
        client: EngineClient,
        paths: RunPaths,
        max_steps: int,
        seed: int = 0,
        run_id: str = "",
        weight_dtype: str = "float32",
        on_step: Callable[[dict], None] | None = None,
        store: Any = None,
        weight_transport: Literal["filesystem", "broadcast", "mooncake", "p2p"] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.task = as_environment(task)
        self.max_model_len = max_model_len
        self.client = client
        self.paths = paths
        self.max_steps = max_steps
        self.rng = random.Random(seed)
        self.run_id = check_run_id(run_id)  # a run id that cannot make a valid cache_salt fails here, not mid-run
        self.weight_dtype = weight_dtype
        self.on_step = on_step
        self.store = store
        self.weight_transport = weight_transport or ("mooncake" if store is not None else "filesystem")
        if self.weight_transport == "mooncake" and store is None:
            raise ValueError("Orchestrator: weight_transport='mooncake' needs store= (the run's StoreSource)")
        self.buffer = AsyncRolloutBuffer(cfg.max_off_policy_steps, policy=cfg.off_policy_policy,
                                         partial_groups=cfg.partial_groups, max_retries=cfg.max_retries,
                                         max_ahead=cfg.max_ahead, admission=cfg.admission)
        self.buffer.on_finish = self._log_rollout
        self._rollout_log: list[dict] = []
        self._episode_s: dict[int, list[float]] = {}  # group id -> its episodes' wall times (rollouts.jsonl)
        self.state = _State()
        self._inflight: dict[int, _Inflight] = {}
        self._producer_wake = asyncio.Event()
        self._batcher_wake = asyncio.Event()
        self._next_group_id = 0
        self._last_error = ""
        self._t0 = time.monotonic()
        self.records: list[dict] = []
        self.start_step = 0
        """First trainer step of this run: 0, or the checkpoint's step of a resumed run
        (``moe_rl.runtime.checkpoint.restore_orchestrator``)."""

    # ------------------------------------------------------------------ public
    async def run(self) -> dict:
        """Run to completion and return the summary dict (also the totals of ``summary.json``).

        Raises:
            RuntimeError: engine requests keep failing, or a background task failed.
        """
        for d in (self.paths.batches, self.paths.trainer):
            d.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        await self._record_engine_event(self.state.engine_version, 0.0, {})
        metrics = asyncio.create_task(self._collect_metrics(), name="metrics")
        tasks = [
            asyncio.create_task(self._producer(), name="producer"),
            asyncio.create_task(self._batcher(), name="batcher"),
            asyncio.create_task(self._weight_watcher(), name="weight_watcher"),
        ]
        try:
            pending = {metrics, *tasks}
            while metrics in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # re-raises a failed task's exception (the batcher ends normally)
            if self.weight_transport != "filesystem":
                await self._await_final_version(pending)
        finally:
            for t in [metrics, *tasks]:
                t.cancel()
            victims = self._cancel_inflight("exit")
            stuck = await _settle([metrics, *tasks, *victims], timeout=30.0)
            if stuck:
                raise RuntimeError(f"orchestrator tasks did not stop within 30 s after cancellation:\n{stuck}")
        return self.summary()

    def summary(self) -> dict:
        c = self.buffer.counters
        wall = time.monotonic() - self._t0
        return {
            "steps": self.start_step + len(self.records),
            "policy_version": self.start_step + len(self.records),
            "engine_version": self.state.engine_version,
            "rollouts_started": c.started,
            "rollouts_trained": c.trained,
            "rollouts_dropped": c.dropped,
            "rollouts_dropped_by_reason": dict(c.dropped_by_reason),
            "rollouts_withheld": c.withheld,
            "rollouts_withheld_by_reason": dict(c.withheld_by_reason),
            "masked_tokens": c.masked_tokens,
            "masked_samples": c.masked_samples,
            "groups_retried": c.retried,
            "groups_abandoned": c.abandoned,
            "rollouts_inflight_at_exit": c.inflight + c.queued + c.in_batch,
            "engine_errors": self.state.errors,
            "engine_error_messages": dict(self.state.error_messages),
            "staleness_histogram": {str(k): v for k, v in sorted(self.buffer.staleness_hist.items())},
            "completion_tokens": self.state.completion_tokens,
            "wall_s": wall,
            "weight_reload_s_mean": sum(self.state.reload_s) / max(1, len(self.state.reload_s)),
            "weight_transport": self.weight_transport_summary(),
            **({"multiturn": dict(self.state.turns)} if self._multiturn() else {}),
            "episodes": dict(self.state.episodes),
        }

    def _multiturn(self) -> bool:
        """Multi-turn counters are reported: a multi-turn task, or an episode made more than one call."""
        return getattr(self.task, "num_turns", 1) > 1 or self.state.turns["samples"] > 0

    def weight_transport_summary(self) -> dict:
        """Where every published version went: loaded (by source), skipped because a newer one was published,
        failed then superseded, or not loaded when the run ended; plus the fallback counters of both sides."""
        st = self.state
        published = self.start_step + len(self.records)  # versions 1..steps (the trainer publishes one per step)
        accounted = set(st.weights_loaded) | set(st.weights_skipped) | set(st.weights_failed)
        by_source: dict[str, int] = {}
        for src in st.weights_loaded.values():
            by_source[src] = by_source.get(src, 0) + 1
        return {
            "mode": self.weight_transport,
            "versions_published": published,
            "versions_loaded_by_source": by_source,
            "versions_loaded": {str(v): src for v, src in sorted(st.weights_loaded.items())},
            "versions_skipped_newer": sorted(st.weights_skipped),
            "versions_failed": {str(v): err for v, err in sorted(st.weights_failed.items())},
            "versions_republished": sorted(st.weights_recovered),
            "versions_not_loaded_at_exit": [v for v in range(1, published + 1) if v not in accounted],
            "engine_load_fallbacks": st.weight_load_fallbacks,
            "engine_load_retries": st.weight_load_retries,
            "trainer_publish_fallbacks": st.trainer_weight_transport.get("publish_fallbacks", 0),
            "trainer_publish": st.trainer_weight_transport,
        }

    # ------------------------------------------------------------------ rollouts
    def _start_capacity(self) -> int:
        """Groups that may still be started now and be trained within the staleness bound
        (``moe_rl.rl.buffer.admission_capacity``, the rule the simulator uses too)."""
        return self.buffer.start_capacity(self.state.engine_version, self.state.next_batch,
                                          self.cfg.batch_size // self.cfg.group_size, self.cfg.max_inflight,
                                          last_batch=self.max_steps - 1)

    async def _producer(self) -> None:
        while True:
            for _ in range(max(0, self._start_capacity())):
                self._start_group()
            self._producer_wake.clear()
            await self._producer_wake.wait()

    def _notify(self) -> None:
        self._producer_wake.set()
        self._batcher_wake.set()

    def _start_group(self) -> None:
        gid = self._next_group_id
        self._next_group_id += 1
        version = self.state.engine_version
        retry = self.buffer.next_retry()  # prompts lost to staleness go first
        problem, retries = retry if retry is not None else (self.task.sample(self.rng), 0)
        seed = self.rng.randrange(2**31)
        n = self.cfg.group_size
        self.buffer.start(gid, version, n, prompt=problem, retries=retries)
        task = asyncio.create_task(self._rollout(gid, problem, version, seed), name=f"group-{gid}")
        self._inflight[gid] = _Inflight(task, version, n)
        task.add_done_callback(lambda t, gid=gid: self._on_group_done(gid))

    def _on_group_done(self, gid: int) -> None:
        """Count a cancelled group as dropped. Runs for every finished group task, including tasks cancelled
        before they started running; groups that completed or failed were already removed by ``_rollout``."""
        info = self._inflight.pop(gid, None)
        if info is not None:
            self.buffer.fail(gid, info.cancel_reason)
            self._notify()

    async def _rollout(self, gid: int, problem: Any, version: int, seed: int) -> None:
        """One group: ``group_size`` episodes of the environment (:func:`moe_rl.envs.runner.run_group`) with one
        ``cache_salt`` on every request, that of the version the engine serves when the group's first request is
        sent (later turns reuse the history's KV, prime-rl PR #1650), and the group's seed; identical first requests
        go out as one request with ``n = group_size``.

        Each finished episode becomes one sample per trajectory branch (:meth:`_episode_samples`), each with the
        episode's reward and ``Sample.episode`` = its index in the group (the baseline counts episodes); an episode
        that raised or timed out trains nothing (its sample counts as dropped, reason ``"error"``, by ``put``; branch
        samples join ``rollouts_started`` there). A group whose shared first request failed is one engine error (the
        group is failed, reason ``"error"``)."""
        from moe_rl.envs.runner import run_group

        sent_salts: list[str] = []

        def salt_at_first_request() -> str:  # the served version's salt when the group's first request goes out
            sent_salts.append(cache_salt_for(self.state.engine_version, weight_dtype=self.weight_dtype,
                                             run_id=self.run_id))
            return sent_salts[-1]

        n = self.cfg.group_size
        t_start = time.monotonic()
        episodes = await run_group(
            self.task, problem, n, self.client, temperature=self.cfg.temperature, seed=seed,
            cache_salt=salt_at_first_request,
            version=lambda: self.state.engine_version, request_timeout_s=self.cfg.request_timeout_s,
            episode_timeout_s=self.cfg.episode_timeout_s, max_model_len=self.max_model_len)
        self._inflight.pop(gid, None)
        ep_stats = self.state.episodes
        for ep in episodes:
            ep_stats["episodes"] += 1
            if ep.error_kind is not None:
                ep_stats[f"errors_{ep.error_kind}"] += 1
            if ep.result is not None:
                ep_stats[f"stop_{ep.result.stop_reason}"] += 1
                for k, v in ep.result.metrics.items():
                    ep_stats[f"env_{k}"] += v
        if any(isinstance(ep.exception, EngineDied) for ep in episodes):
            # its engine died (moe_rl.runtime.engine_pool): not an engine error; the group is dropped, the prompt
            # re-queued, and the other engines (or the restarted one) play it again
            self.buffer.fail(gid, "engine_died", requeue=True)
            self._notify()
            return
        if all(ep.error_kind == "engine" and not ep.calls for ep in episodes):  # the first request failed
            self.buffer.fail(gid, "error")
            self._count_engine_error(episodes[0].exception or RuntimeError(episodes[0].error))
            self._notify()
            return
        if any(ep.calls for ep in episodes):
            self.state.consecutive_errors = 0
        samples = []
        for ep in episodes:
            if ep.error_kind == "engine":
                self._count_engine_error(ep.exception or RuntimeError(ep.error))
            if ep.error is not None or ep.result is None:
                continue
            samples.extend(self._episode_samples(ep))
        self._episode_s[gid] = [round(ep.wall_s, 6) for ep in episodes]
        salt = sent_salts[0] if sent_salts else cache_salt_for(version, weight_dtype=self.weight_dtype,
                                                               run_id=self.run_id)
        group = RolloutGroup(gid, version, salt, samples, version_end=self.state.engine_version,
                             problem=problem, t_start=t_start, t_end=time.monotonic())
        # n episodes were started; branch samples join `started` in put, episodes with no sample count as dropped
        self.buffer.put(group, expected_samples=n)
        self._notify()

    def _episode_samples(self, ep: Any) -> list[Sample]:
        """The trainable samples of a finished episode (``[]`` when no call sampled a token), one per trajectory
        branch, each with the episode's reward and ``episode=ep.index``.

        One call: its prompt and completion as the engine returned them. Several calls: the samples
        :func:`moe_rl.rl.trajectory.interleave_calls` builds by token prefix (``branch="train"``). A call whose
        prompt extends a sample's tokens grows it: env tokens get ``completion_mask`` False and a 0.0 logprob
        placeholder, and per-token behaviour logprobs and versions are concatenated over turns (a call whose engine
        reports no ``version_segments`` is taken to be sampled by the version served when it was sent, never older
        than the sample's previous token). A call whose prompt does not (a chat template that re-renders history,
        e.g. strips past ``<think>`` blocks; a new agent) starts a new sample whose prompt is the re-rendered
        history; a rollback to an earlier state of a sample starts a branch that copies that state's tokens, loss
        mask, log-probs, versions and routed rows, and trains them again (each branch a whole trajectory, as in
        prime-rl). With router replay (``client.return_routed_experts``) each sample's rows are merged with
        ``moe_rl.replay.stitch_records`` from its calls' records and the rows of the prefix it shares with an
        earlier sample: every token's row comes from the first record that holds it, so call ``k+1`` fills the
        row of call ``k``'s last sampled token (prime-rl PR #1807). A temperature other than
        ``orchestrator.temperature`` is carried per sample. Counted: ``turns["samples"]``, ``turns["branches"]``
        (samples beyond the episode's first), ``turns["turns"]``, ``turns["env_tokens"]`` and the routing status of
        each sample.
        """
        from moe_rl.rl.trajectory import interleave_calls

        reward = float(ep.result.reward)
        calls = ep.calls
        if len(calls) == 1:
            c = calls[0]
            if not c.completion_ids:
                return []
            self.state.completion_tokens += len(c.completion_ids)
            mask = getattr(c, "sampling_mask", None)
            self.state.sampling_masks["with" if mask is not None else "without"] += 1
            return [Sample(list(c.prompt_ids), list(c.completion_ids), list(c.logprobs), reward, c.finish_reason,
                           version_segments=c.version_segments, routed_experts=c.routed_experts,
                           temperature=None if c.temperature == self.cfg.temperature else c.temperature,
                           sampling_mask=mask, episode=ep.index)]
        built = interleave_calls(calls)
        if not built:
            return []
        st = self.state.turns
        st["samples"] += len(built)
        st["branches"] += len(built) - 1
        st["turns"] += len(calls)
        # tokens the engine sampled (a rollback branch trains its copied prefix again, but it was sampled once)
        self.state.completion_tokens += sum(len(c.completion_ids) for c in calls)
        self.state.sampling_masks["without"] += len(built)  # kept-set records are not merged across turns
        replay = getattr(self.client, "return_routed_experts", False)
        out = []
        for t in built:
            st["env_tokens"] += t.completion_mask.count(False)
            routed = self._count_routing(t) if replay else None
            out.append(Sample(t.prompt_ids, t.completion_ids, t.completion_logprobs, reward, t.finish_reason,
                              version_segments=t.version_segments, routed_experts=routed,
                              completion_mask=t.completion_mask,
                              temperature=None if t.temperature == self.cfg.temperature else t.temperature,
                              episode=ep.index))
        return out

    def _count_engine_error(self, exc: BaseException) -> None:
        self.state.errors += 1
        self.state.consecutive_errors += 1
        self._last_error = repr(exc)
        self.state.error_messages[repr(exc)[:200]] = self.state.error_messages.get(repr(exc)[:200], 0) + 1

    def _count_routing(self, t: Any) -> Any:
        """The stitched record of a trajectory sample (:class:`moe_rl.rl.trajectory.TrajectorySample`), or None
        (counted) when a turn has none or rows stay missing; rows two turns recorded differently are counted (the
        earlier turn's row is kept)."""
        st = self.state.turns
        st["routed_experts_conflict_rows"] += t.routing_conflict_rows
        if t.routing in ("not_recorded", "missing_call"):
            st["routed_experts_missing_turn"] += 1
        elif t.routing == "incomplete":
            st["routed_experts_incomplete"] += 1
        else:
            st["routed_experts_stitched"] += 1
        return t.routed_experts

    def _cancel_inflight(self, reason: str, group_ids: set[int] | None = None) -> list[asyncio.Task]:
        """Cancel the in-flight groups in ``group_ids`` (all if None); they are counted as dropped with
        ``reason`` when their task ends (``_on_group_done``). Returns the cancelled tasks."""
        victims = []
        for gid, info in self._inflight.items():
            if group_ids is None or gid in group_ids:
                info.cancel_reason = reason
                info.task.cancel()
                victims.append(info.task)
        return victims

    # ------------------------------------------------------------------ batches
    async def _batcher(self) -> None:
        groups_per_step = self.cfg.batch_size // self.cfg.group_size
        for step in range(self.start_step, self.max_steps):
            while True:
                if self.state.consecutive_errors >= self.cfg.max_consecutive_errors:
                    raise RuntimeError(
                        f"{self.state.consecutive_errors} engine requests failed in a row "
                        f"(last: {self._last_error})"
                    )
                # batch `step` is formed at most TAKE_AHEAD versions ahead of the engine (moe_rl.rl.buffer.may_take)
                groups = None
                if may_take(step, self.state.engine_version):
                    queued = self.buffer.num_queued_groups
                    groups = self.buffer.take(groups_per_step, consume_version=step)
                    if groups is None and self.buffer.num_queued_groups < queued:
                        # take() removed stale queued groups: their batch slots are free again. The producer
                        # computed its capacity with them counted as pending (it runs first on the same
                        # notification), so wake it, or a run whose last groups went stale waits forever
                        # (nothing in flight, trainer waiting for this batch; case: engine jumping versions)
                        self._producer_wake.set()
                if groups is not None:
                    break
                self._batcher_wake.clear()
                try:
                    await asyncio.wait_for(self._batcher_wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
            # the groups now belong to batch `step`: advance before any await so that the admission rule
            # never sees them as neither queued nor batched
            self.state.next_batch = step + 1
            # build_batch ANDs each sample's train_mask ("mask" policy) into the loss mask
            batch = build_batch(groups, step=step, pad_id=self.task.tok.pad_id)
            stale = [step - g.version_start for g in groups for _ in g.samples]
            # recorded before the file exists: the trainer may finish the step before this task resumes
            self.state.batches[step] = _BatchInfo(
                step=step,
                num_samples=batch.num_samples,
                reward_mean=_episode_reward_mean(groups),
                staleness_max=max(stale),
                staleness_mean=sum(stale) / len(stale),
                mixed_version_groups=sum(g.version_end != g.version_start for g in groups),
                policy_version=self.state.engine_version,
                staleness_counts={str(k): v for k, v in sorted(collections.Counter(stale).items())},
            )
            await asyncio.to_thread(write_batch, batch, self.paths.batches)
            # in-flight groups that can no longer be trained in time: cancelled under "drop", marked withheld
            # under "withhold", kept under "mask"
            stale = self.buffer.expire_inflight(self.state.next_batch)
            if stale:
                self._cancel_inflight("stale_inflight", set(stale))
            self._notify()

    # ------------------------------------------------------------------ weights
    async def _load_announced(self, version: int, ann: dict) -> dict:
        """Make the engine load ``version`` from the transport its announcement names; the engine's report."""
        src = ann["source"]
        if src == "broadcast":
            info = dict(await self.client.update_weights_from_broadcast(version))
        elif src == "p2p":
            from moe_rl.weights.p2p import index_path

            try:
                info = dict(await self.client.update_weights_from_p2p(str(index_path(self.paths.weights, version)),
                                                                      version))
            except Exception as exc:
                if not (ann.get("filesystem_copy") and ann.get("path")):
                    raise
                # the final version is also a sharded folder: the trainer may have exited before the pull
                info = dict(await self.client.load_sharded(ann["path"], version))
                info["p2p_error"] = f"{type(exc).__name__}: {exc}"[:500]
        elif src == "mooncake":
            from moe_rl.weights.mooncake import update_engine_weights

            info = await update_engine_weights(
                self.client, version, store_config=self.store.store_config, model=self.store.model,
                shard=ann.get("shards") or self.store.shard,
                fallback_root=self.paths.weights if ann.get("filesystem_copy") else None)
        else:
            from moe_rl.weights.filesystem import is_sharded, version_dir

            path = ann.get("path") or str(version_dir(self.paths.weights, version))
            if ann.get("layout") == "sharded" or (ann.get("layout") is None and is_sharded(path)):
                info = dict(await self.client.load_sharded(path, version))
            else:
                info = dict(await self.client.update_weights(path, version))
        info.setdefault("source", src)
        return info

    async def _connect_broadcast(self) -> None:
        """``weight_transport = "broadcast"`` / ``"p2p"``: wait for the trainer's group file, then make the engine's
        workers join one group per trainer rank (broadcast: the trainer ranks wait in ``ShardedBroadcastPublisher``
        meanwhile; p2p: each rank's server thread forms its group, the trainer does not wait)."""
        from moe_rl.weights.broadcast import read_group_file

        p2p = self.weight_transport == "p2p"
        if p2p:
            from moe_rl.weights.p2p import group_path

            path = group_path(self.paths.weights)
        else:
            path = None
        deadline = time.monotonic() + self.cfg.stall_timeout_s
        while (group := read_group_file(self.paths.weights, path)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"weight_transport={self.weight_transport!r}: the trainer wrote no group file under "
                                   f"{self.paths.weights / 'announce'} within stall_timeout_s={self.cfg.stall_timeout_s}s")
            await asyncio.sleep(0.01)
        if p2p:
            await self.client.init_p2p(group["endpoints"], 1, group["world_size"], group["timeout_s"])
        else:
            await self.client.init_sharded_broadcast(group["endpoints"], 1, group["world_size"], group["backend"],
                                                     group["timeout_s"])

    async def _weight_watcher(self) -> None:
        """Wait for ``weights/announce/step_<v>.json`` (:mod:`moe_rl.weights.announce`), load the version from the
        transport the announcement names (jumping to the newest announced version, except for broadcast where each
        version is received in order), and record the source, the engine's pause and load seconds in
        ``engine_events.jsonl``.

        A failed load is recorded in ``weights_failed``. A store version with no folder copy is then asked for again
        (``announce/request_<v>.json``): the trainer writes it to the folder and re-announces it, and it is loaded
        from there (``weights_recovered``, a load fallback) or superseded by a newer one; a folder load is retried
        (every retry counted in ``weight_load_retries``). A failed broadcast ends the run with its error (the
        groups are unusable after a failed collective). A store run ends only once the engine serves the final
        version, which the trainer always writes to the folder too."""
        from moe_rl.weights.announce import AnnouncementWatcher, write_republish_request

        root = self.paths.weights
        st = self.state
        if self.weight_transport in ("broadcast", "p2p"):
            await self._connect_broadcast()
        watcher = AnnouncementWatcher(root, jump=self.weight_transport != "broadcast")
        failed_from: dict[int, str] = {}  # failed version -> the source its last load attempt used
        while True:
            nxt = watcher.next_version(st.engine_version)
            if nxt is None:
                await asyncio.sleep(0.002)
                continue
            ann = watcher.read(nxt)
            if nxt in st.weights_failed:  # tried and lost: wait for the trainer's folder copy or a newer version
                # (a store version announced with a folder copy, the final one, is retried: nobody republishes it)
                if ann["source"] == "mooncake" and not ann.get("filesystem_copy"):
                    await asyncio.sleep(0.01)
                    continue
                del st.weights_failed[nxt]
                st.weight_load_retries += 1
                if failed_from[nxt] == "mooncake" and ann["source"] == "filesystem":  # republished by the trainer
                    st.weights_recovered.append(nxt)
                    st.weight_load_fallbacks += 1
            t = time.monotonic()
            try:
                info = await self._load_announced(nxt, ann)
            except Exception as exc:  # noqa: BLE001 - counted and reported; a newer version supersedes it
                st.weights_failed[nxt] = f"{type(exc).__name__}: {exc}"[:500]
                if ann["source"] == "broadcast":
                    raise RuntimeError(f"the engine could not receive weights version {nxt} over the broadcast "
                                       f"groups: {st.weights_failed[nxt]}") from exc
                if ann["source"] == "p2p" and "p2p groups are closed" in str(exc):  # P2PTransferError
                    raise RuntimeError(f"the engine could not pull weights version {nxt} from the trainer ranks (a "
                                       f"rank is gone or a transfer stopped): {st.weights_failed[nxt]}") from exc
                if ann["source"] in ("filesystem", "p2p"):  # retry, not in a hot loop (p2p: a CRC-32 mismatch)
                    if nxt in st.weights_recovered:
                        st.weights_recovered.remove(nxt)
                        st.weight_load_fallbacks -= 1
                        failed_from[nxt] = "mooncake"  # still a store version if it is loaded later
                    else:
                        failed_from.setdefault(nxt, ann["source"])
                    await asyncio.sleep(0.5)
                elif ann.get("filesystem_copy"):  # store and folder copy both failed: retry, not in a hot loop
                    failed_from[nxt] = "mooncake"
                    await asyncio.sleep(0.5)
                else:  # the trainer may wait for a batch that needs a newer engine version: ask for a folder copy
                    failed_from[nxt] = "mooncake"
                    write_republish_request(root, nxt, st.weights_failed[nxt])
                continue
            reload_s = time.monotonic() - t
            st.reload_s.append(reload_s)
            source = info.get("source", ann["source"])
            fallback_error = info.get("mooncake_error") or info.get("p2p_error")
            if fallback_error is not None:
                st.weight_load_fallbacks += 1
            failed_before = sorted(v for v in st.weights_failed if st.engine_version < v < nxt)
            skipped = self._mark_loaded(nxt, source)
            # the engine takes no model step while the load RPC runs: its wall time is the engine's pause;
            # load_s is the worker's own time (read/receive/fetch + in-place reload)
            load_s = float(info.get("reload_s", 0.0)) + float(
                info.get("read_s", info.get("recv_s", info.get("fetch_s", info.get("pull_s", 0.0)))))
            st.last_update = {"version": nxt, "source": source, "engine_pause_s": reload_s, "load_s": load_s,
                              "bytes": int(info.get("bytes", 0))}
            st.engine_version = nxt
            self._notify()
            await self._record_engine_event(nxt, reload_s, info, extra={
                "source": source, "announced_source": ann["source"], "fallback_error": fallback_error,
                "skipped_versions": skipped, "failed_versions": failed_before,
                "republished": nxt in st.weights_recovered, "engine_pause_s": reload_s, "load_s": load_s})
            self._cleanup_weights(nxt)

    def _mark_loaded(self, version: int, source: str) -> list[int]:
        """Book ``version`` as loaded from ``source``; the versions jumped over since the served one count as
        skipped (or stay failed, if their load was tried). Returns the skipped ones."""
        st = self.state
        skipped = [v for v in range(st.engine_version + 1, version) if v not in st.weights_failed]
        st.weights_skipped.extend(skipped)
        st.weights_loaded[version] = source
        return skipped

    async def _await_final_version(self, pending: set[asyncio.Task]) -> None:
        """Wait until the engine serves version ``max_steps`` (store mode: the store may lose versions, so the
        run only ends once the final policy is loaded).

        Raises:
            RuntimeError: not served within ``stall_timeout_s`` (the message lists the failed loads).
        """
        deadline = time.monotonic() + self.cfg.stall_timeout_s
        while self.state.recorded_version < self.max_steps:  # loaded, probed and logged
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the engine did not load the final weights version {self.max_steps} within stall_timeout_s="
                    f"{self.cfg.stall_timeout_s}s (serving {self.state.engine_version}; failed loads: "
                    f"{self.state.weights_failed})")
            if not pending:  # unreachable in practice: the watcher and the producer never end by themselves
                raise RuntimeError(f"every orchestrator task ended before the engine loaded version {self.max_steps}")
            done, _ = await asyncio.wait(pending, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # re-raises a failed task's exception
                pending.discard(t)

    async def _record_engine_event(self, version: int, reload_s: float, info: dict,
                                   extra: dict | None = None) -> None:
        event: dict[str, Any] = {"version": version, "reload_s": reload_s, "t": time.monotonic() - self._t0,
                                 "engine": info, **(extra or {})}
        if self.cfg.engine_probe:
            t_probe = time.monotonic()
            try:
                event.update(await self._probe(version))
            except EngineDied as exc:
                # the engine died under the probe: the version's event is written without it and the failure is
                # counted; the engine supervisor restarts the engine (or, with no restarts left, fails the run
                # naming it), so the probe never becomes the run's cause of failure
                msg = f"engine probe: {type(exc).__name__}: {exc}"
                self.state.error_messages[msg] = self.state.error_messages.get(msg, 0) + 1
                event["probe_skipped"] = str(exc)
            event["probe_s"] = time.monotonic() - t_probe  # the watcher is busy for this long (simulator input)
        with self.paths.engine_events.open("a") as f:
            f.write(json.dumps(event) + "\n")
        self.state.recorded_version = version

    async def _probe(self, version: int) -> dict:
        """Two greedy requests with the new salt on a fixed multi-block prompt: the first must miss the
        prefix cache (new salt), the second must hit it (same salt)."""
        salt = cache_salt_for(version, weight_dtype=self.weight_dtype, run_id=self.run_id)
        prompt = _probe_prompt(self.task)
        first, cached_first = await self.client.generate(prompt, n=1, max_tokens=2, temperature=0.0,
                                                         cache_salt=salt, seed=0)
        _, cached_second = await self.client.generate(prompt, n=1, max_tokens=2, temperature=0.0,
                                                      cache_salt=salt, seed=0)
        served = await self.client.weight_version()
        return {
            "served_version": served,
            "salt": salt,
            "probe_token_ids": list(first[0].token_ids),
            "probe_logprobs": list(first[0].logprobs),
            "probe_cached_tokens_new_salt": cached_first,
            "probe_cached_tokens_same_salt": cached_second,
            "probe_prompt_tokens": len(prompt),
        }

    def _cleanup_weights(self, served: int) -> None:
        from moe_rl.weights.filesystem import version_dir

        for v in range(1, served - self.cfg.keep_weight_versions):
            d = version_dir(self.paths.weights, v)
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ metrics
    def _log_rollout(self, group: RolloutGroup) -> None:
        """Buffer hook: remember each finished group's timing (written to ``rollouts.jsonl`` per trainer step;
        ``python -m moe_rl.rl.simulator --from-run`` fits its inputs from it)."""
        self._rollout_log.append(_rollout_record(self, group))

    def _flush_rollout_log(self) -> None:
        if self._rollout_log:
            with self.paths.rollouts.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in self._rollout_log)
            self._rollout_log.clear()

    async def _collect_metrics(self) -> None:
        # inference throughput over a trailing window of at least 10 s (a per-step delta is often 0: two
        # trainer steps can finish while no group completes)
        window: collections.deque[tuple[float, int]] = collections.deque([(self._t0, self.state.completion_tokens)])
        for step in range(self.start_step, self.max_steps):
            report_path = self.paths.trainer_step(step)
            waited = time.monotonic()
            while not report_path.exists():
                await asyncio.sleep(0.005)
                if time.monotonic() - waited > self.cfg.stall_timeout_s:
                    raise RuntimeError(
                        f"no trainer report for step {step} within stall_timeout_s={self.cfg.stall_timeout_s}s "
                        f"(engine version {self.state.engine_version}, next batch {self.state.next_batch}, "
                        f"{len(self._inflight)} groups in flight, counters {self.buffer.counters}); tasks:\n"
                        f"{describe_tasks()}"
                    )
            report = json.loads(report_path.read_text())
            if "weight_transport" in report:
                self.state.trainer_weight_transport = report["weight_transport"]
            info = self.state.batches[step]
            self.buffer.mark_trained(info.num_samples)
            self.buffer.counters.check()
            now = time.monotonic()
            c = self.buffer.counters
            busy = report["compute_s"] + report["publish_s"]
            record = {
                "step": step,
                "policy_version": step + 1,
                "engine_version": self.state.engine_version,
                "batch_policy_version": info.policy_version,
                "reward_mean": info.reward_mean,
                "mismatch_kl": report["mismatch_kl"],
                "loss": report["loss"],
                "masked_frac": report["masked_frac"],
                "grad_norm": report["grad_norm"],
                "lr": report["lr"],
                "rollouts_started": c.started,
                "rollouts_trained": c.trained,
                "rollouts_dropped": c.dropped,
                "rollouts_withheld": c.withheld,
                "masked_tokens": c.masked_tokens,
                "masked_samples": c.masked_samples,
                "groups_retried": c.retried,
                "groups_abandoned": c.abandoned,
                "rollouts_inflight": c.inflight + c.queued + c.in_batch,
                "staleness_max": info.staleness_max,
                "staleness_mean": info.staleness_mean,
                "mixed_version_groups": info.mixed_version_groups,
                "trainer_idle_frac": report["idle_s"] / max(1e-9, report["idle_s"] + busy),
                "trainer_idle_s": report["idle_s"],
                "trainer_busy_s": busy,
                "staleness_counts": info.staleness_counts,
                "inference_tokens_per_s": (self.state.completion_tokens - window[0][1]) / max(1e-9, now - window[0][0]),
                "trainer_tokens_per_s": report["tokens"] / max(1e-9, report["compute_s"]),
                "time_s": now - self._t0,
            }
            routed = getattr(self.client, "routed_experts_counts", None)
            if getattr(self.client, "return_routed_experts", False) and routed is not None:
                # router replay: completions with a full / incomplete / no engine routing record (cumulative)
                record.update({f"routed_experts_{k}": v for k, v in routed.items()})
            if self.state.sampling_masks["with"] or self.cfg.top_p < 1.0 or self.cfg.top_k > 0:
                # sampling-mask replay: samples built with / without the engine's kept sets (cumulative)
                record.update(sampling_mask_samples=self.state.sampling_masks["with"],
                              sampling_mask_absent=self.state.sampling_masks["without"])
            if self._multiturn():  # multi-turn rollouts (cumulative)
                record.update({f"multiturn_{k}": self.state.turns.get(k, 0) for k in (
                    "samples", "branches", "turns", "env_tokens", "routed_experts_stitched",
                    "routed_experts_missing_turn",
                    "routed_experts_incomplete", "routed_experts_conflict_rows")})
            # weight sync of this step's version (trainer side) and the engine's latest update (engine side)
            upd = report.get("weight_update", {})
            eng = self.state.last_update
            record.update(weight_transport=upd.get("source", self.weight_transport),
                          weight_trainer_blocking_s=upd.get("blocking_s", report["publish_s"]),
                          weight_bytes=upd.get("bytes"),
                          weight_engine_version=eng.get("version", 0),
                          weight_engine_pause_s=eng.get("engine_pause_s"),
                          weight_engine_load_s=eng.get("load_s"),
                          weight_load_retries=self.state.weight_load_retries)
            if self.store is not None:  # weight transport counters (cumulative)
                record.update({f"weights_loaded_{k}": v for k, v in
                               collections.Counter(self.state.weights_loaded.values()).items()})
                record.update(weight_publish_fallbacks=self.state.trainer_weight_transport.get("publish_fallbacks", 0),
                              weight_load_fallbacks=self.state.weight_load_fallbacks,
                              weight_load_failures=len(self.state.weights_failed))
            # episodes (cumulative): stop reasons, error kinds, the environments' metrics (env_<name>)
            record.update({f"episodes_{k}": v for k, v in sorted(self.state.episodes.items())})
            # the loss's own metrics (kind-dependent: masked/clipped fractions, ratio quantiles, token ages)
            record.update(report.get("loss_metrics", {}))
            faults = getattr(self.client, "fault_counters", None)  # several engines / restarts (engine_pool)
            if faults is not None:
                record.update(faults())
            window.append((now, self.state.completion_tokens))
            while len(window) > 2 and now - window[1][0] >= 10.0:
                window.popleft()
            self.records.append(record)
            with self.paths.metrics.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self._flush_rollout_log()
            if self.on_step:
                self.on_step(record)
            if self.state.consecutive_errors >= self.cfg.max_consecutive_errors:
                raise RuntimeError(f"engine requests keep failing (last: {self._last_error})")


def _rollout_record(orch: Orchestrator, group: RolloutGroup) -> dict:
    return {"group_id": group.group_id, "version_start": group.version_start, "version_end": group.version_end,
            "t_start": group.t_start - orch._t0, "t_end": group.t_end - orch._t0, "samples": group.size,
            "completion_tokens": [len(s.completion_ids) if s.completion_mask is None else sum(s.completion_mask)
                                  for s in group.samples],
            "episode_s": orch._episode_s.pop(group.group_id, [])}


def _episode_reward_mean(groups: list[RolloutGroup]) -> float:
    """Mean reward over the episodes of ``groups`` (each episode once, whatever its number of branch samples)."""
    rewards = {}
    for g in groups:
        for i, s in enumerate(g.samples):
            rewards[(g.group_id, ("episode", s.episode) if s.episode is not None else ("sample", i))] = s.reward
    return sum(rewards.values()) / max(1, len(rewards))


def describe_tasks() -> str:
    """One block per pending asyncio task of the running loop: its name and the frames it is suspended in."""
    out = []
    for t in asyncio.all_tasks():
        frames = t.get_stack(limit=8)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames)) or "(not started)"
        out.append(f"  {t.get_name()}: {where}")
    return "\n".join(sorted(out))


async def _settle(tasks: list[asyncio.Task], timeout: float) -> str:
    """Wait up to ``timeout`` for cancelled ``tasks`` to finish; describe the ones that did not ('' if none)."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, pending_set = await asyncio.wait(pending, timeout=timeout)
        pending = list(pending_set)
    await asyncio.sleep(0)  # let done-callbacks (drop accounting) run
    for t in tasks:  # mark failures as seen: the caller reports the run's cause (no "never retrieved" tracebacks)
        if t.done() and not t.cancelled():
            t.exception()
    return "\n".join(f"  {t.get_name()}" for t in pending)


def _probe_prompt(task: Any) -> list[int]:
    """A fixed 2-block-plus prompt (70 tokens) built from the task's alphabet."""
    text = ("1234567890+" * 7)[:69]
    return task.tok.encode(text, bos=True)
