"""Several vLLM engines for ``moe-rl rl`` that survive an engine's death (``inference.num_engines``,
``inference.max_engine_restarts``, ``inference.engine_restart_backoff_s``).

:class:`EngineSupervisor` starts the run's engines (one :class:`moe_rl.inference.VllmServer` each), watches their
processes and restarts a dead one; :class:`EnginePool` is the orchestrator's engine client over them
(``moe_rl.runtime.orchestrator.EngineClient``)::

    generate        -> RoutedClient over the engines; RequestRouter chooses among the *live* ones only
                       (waits while none is live, e.g. the only engine is restarting)
    load_sharded /  -> every live engine, under the pool's load lock; the last successful call is the run's
    update_weights     *current version* (a restarted engine replays it before it serves)
    weight_version  -> every live engine must report the same version

When an engine dies (its API process exits; seen by the supervisor's poll, or at once by a request that failed
on it with a transport error while its process is gone):

1. it is marked dead: the router stops choosing it; requests in flight on it fail with :class:`EngineDied`, and
   the orchestrator drops their rollout groups (``rollouts_dropped_by_reason["engine_died"]``) and re-queues
   their prompts (``moe_rl.rl.buffer.AsyncRolloutBuffer.fail(requeue=True)``); a weight load that loses an
   engine is not a failed load (the engine will replay it);
2. if the run has restarts left (``inference.max_engine_restarts``, counted over all engines) the supervisor
   waits ``engine_restart_backoff_s * 2**(earlier restarts of this engine)`` (at most 60 s), stops what is left
   of the engine's process group, starts a new server from ``weights/step_0`` (log
   ``logs/vllm_<i>.restart<k>.log``) and waits until it answers ``/health``;
3. it loads the current version with the call the run used (the filesystem transport's version folder), then,
   holding the load lock (no load can move the version meanwhile), asks the engine for the version it serves
   (``weight_version``, the engine's version probe); only if that equals the current version is it marked live
   and routed to. A newer version published during the load is loaded first. A restart that fails (the server
   does not start, the load fails at the current version, the probe disagrees) costs a restart and is tried again;
4. with no restart left, or with a weight transport a restarted engine cannot rejoin (``broadcast``, ``p2p``,
   ``mooncake``: collective groups and store clients are per process), the run fails with
   :class:`EngineRestartLimit`, whose message names the engine, its pid, exit code, log and the limit.

Deaths, restarts, failed restarts and every rejoin (version loaded, version served, the time it turned live and
the first request it got afterwards) are reported by :meth:`EnginePool.report` (``summary.json["engines"]``; as
they happen in ``logs/engine_faults.jsonl``) and
counted per step by :meth:`EnginePool.fault_counters` (``metrics.jsonl``). A trainer rank's death is not an
engine's: it still stops the run (``moe_rl.entrypoints.rl``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EngineDied", "EngineRestartLimit", "EnginePool", "EngineSupervisor", "engine_cores", "engine_log_path"]

_MAX_BACKOFF_S = 60.0
_DEATH_GRACE_S = 5.0
"""How long a request that failed with a transport error waits for its engine's process to be seen gone."""


class EngineDied(RuntimeError):
    """A request (or load) failed because its engine died; ``engine`` is its index, ``exit_code`` the API
    process's exit code."""

    def __init__(self, engine: int, exit_code: int | None, cause: str):
        super().__init__(f"vLLM engine {engine} died (exit code {exit_code}) while the request ran: {cause}")
        self.engine = engine
        self.exit_code = exit_code


class EngineRestartLimit(RuntimeError):
    """An engine died and the run cannot restart it (no restart left, or a transport without rejoin)."""


def engine_log_path(logs: Path, index: int, restart: int = 0) -> Path:
    """``logs/vllm.log`` (engine 0), ``logs/vllm_<i>.log``, and ``logs/vllm_<i>.restart<k>.log`` for the ``k``-th
    restart of engine ``i``."""
    if restart:
        return logs / f"vllm_{index}.restart{restart}.log"
    return logs / ("vllm.log" if index == 0 else f"vllm_{index}.log")


def engine_cores(cores: list[int] | None, index: int, num_engines: int) -> list[int] | None:
    """The cores engine ``index`` of ``num_engines`` is pinned to: ``cores`` split round-robin (``cores[index::N]``),
    or one core each, shared in turn, when there are fewer cores than engines. Engines must not share a core when
    they can avoid it: each vLLM CPU engine's processes poll busily, and a second engine on the same core got
    almost no CPU time (its first request waited 40 s on the 2-core machine). None: no pinning."""
    if cores is None:
        return None
    if len(cores) >= num_engines:
        return list(cores[index::num_engines])
    return [cores[index % len(cores)]]


@dataclass
class _Slot:
    index: int
    server: Any
    client: Any = None
    state: str = "starting"
    """``starting`` (first start), ``live``, ``dead``, ``restarting`` (new server, rejoining)."""
    generation: int = 0
    """Restarts of this engine so far (a request remembers the generation it was sent to)."""
    t_live: float | None = None
    requests: int = 0
    """Requests sent to the current generation."""
    first_request_t: float | None = None
    """Pool time of the first request sent to the current generation (after it turned live)."""
    retired_routed: collections.Counter = field(default_factory=collections.Counter)


class _EngineHandle:
    """What ``RoutedClient`` sees as engine ``i``: forwards to the slot's current client and turns a failure caused
    by the engine's death into :class:`EngineDied`."""

    def __init__(self, pool: EnginePool, index: int):
        self._pool = pool
        self._index = index

    @property
    def _slot(self) -> _Slot:
        return self._pool.slots[self._index]

    @property
    def return_routed_experts(self) -> bool:
        return bool(self._slot.client.return_routed_experts)

    @property
    def routed_experts_counts(self) -> dict[str, int]:
        counts = collections.Counter(self._slot.retired_routed)
        counts.update(self._slot.client.routed_experts_counts)
        return dict(counts)

    async def aclose(self) -> None:
        await self._slot.client.aclose()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        slot, pool = self._slot, self._pool
        if slot.state != "live":  # the router never chooses it; a guard, counted
            pool.counts["requests_refused_not_live"] += 1
            raise EngineDied(slot.index, slot.server.poll(), f"engine {slot.index} is {slot.state}, not live")
        generation = slot.generation
        slot.requests += 1
        if slot.first_request_t is None:
            slot.first_request_t = pool.now()
        try:
            return await slot.client.generate(*args, **kwargs)
        except Exception as exc:
            if await pool.confirm_death(slot.index, generation, exc):
                raise EngineDied(slot.index, slot.server.poll(), f"{type(exc).__name__}: {exc}") from exc
            raise


class EnginePool:
    """The orchestrator's engine client over the supervisor's engines (module docstring).

    Args:
        slots: the engines (filled by :class:`EngineSupervisor`).
        router_cfg: a ``moe_rl.inference.RouterConfig`` (None: the default score policy, ``block_size`` as given).
        block_size: the engines' KV block size (the router's prefix-cache model).
        events_path: a JSONL file each event is also appended to as it happens (None: none).
    """

    def __init__(self, slots: list[_Slot], router_cfg: Any = None, block_size: int = 32,
                 events_path: Path | None = None):
        from moe_rl.inference import RequestRouter, RoutedClient, RouterConfig

        self.slots = slots
        cfg = router_cfg if router_cfg is not None else RouterConfig(block_size=block_size)
        self.router = RequestRouter(cfg, num_engines=len(slots))
        self.routed = RoutedClient([_EngineHandle(self, i) for i in range(len(slots))], self.router)
        self.version = 0
        """The run's current weight version: the last one every live engine loaded (or that no live engine could
        take, deferred to the rejoining engines)."""
        self._current: tuple[str, tuple] | None = None
        self._lock = asyncio.Lock()
        self._live = asyncio.Event()
        self._t0 = time.monotonic()
        self.counts: collections.Counter = collections.Counter()
        self.events: list[dict] = []
        self.events_path = events_path
        self.on_death: Callable[[int], None] | None = None
        for s in slots:
            self.router.set_available(s.index, False)

    # ------------------------------------------------------------------ state
    def now(self) -> float:
        """Seconds since the pool was made (the clock of ``report()``'s times)."""
        return time.monotonic() - self._t0

    def live(self) -> list[int]:
        """Indices of the live engines."""
        return [s.index for s in self.slots if s.state == "live"]

    def set_live(self, index: int) -> None:
        """Engine ``index`` serves the current version: route to it."""
        s = self.slots[index]
        s.state, s.t_live, s.requests, s.first_request_t = "live", self.now(), 0, None
        self.router.set_available(index, True)
        self._live.set()

    def mark_dead(self, index: int, exit_code: int | None, how: str) -> bool:
        """Take engine ``index`` out of routing (idempotent). Returns True if this call marked it."""
        s = self.slots[index]
        if s.state != "live":
            return False
        s.state = "dead"
        self.router.set_available(index, False)
        if not self.live():
            self._live.clear()
        self.counts["deaths"] += 1
        self.record("died", engine=index, pid=s.server.pid, exit_code=exit_code, detected_by=how,
                    generation=s.generation, requests=s.requests)
        if self.on_death is not None:
            self.on_death(index)
        return True

    async def confirm_death(self, index: int, generation: int, exc: BaseException) -> bool:
        """Whether ``exc`` (a failed call to generation ``generation`` of engine ``index``) came from the engine's
        death: the engine was already marked dead or replaced, or the failure is a transport error and the API
        process is seen gone within a few seconds (then it is marked dead here)."""
        import httpx

        s = self.slots[index]
        if s.generation != generation or s.state != "live":
            return True
        if not isinstance(exc, httpx.TransportError):
            return False
        deadline = time.monotonic() + _DEATH_GRACE_S
        while (code := s.server.poll()) is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        self.mark_dead(index, code, "request")
        return True

    def record(self, event: str, **fields: Any) -> None:
        """Keep an event (``report()["events"]``; also a line of ``events_path``)."""
        rec = {"event": event, "t": round(self.now(), 3), **fields}
        self.events.append(rec)
        if self.events_path is not None:
            import json

            with open(self.events_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       **options: Any) -> tuple[list[Any], int]:
        """``InferenceClient.generate`` on a live engine the router picks; waits while no engine is live.

        Raises:
            EngineDied: the engine died while the request ran.
            Exception: as ``RoutedClient.generate``.
        """
        while not self.live():
            self._live.clear()
            await self._live.wait()
        return await self.routed.generate(prompt_ids, n, max_tokens, temperature, **options)

    @property
    def return_routed_experts(self) -> bool:
        return self.routed.return_routed_experts

    @property
    def routed_experts_counts(self) -> dict[str, int]:
        return self.routed.routed_experts_counts

    # ------------------------------------------------------------------ weights
    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        """``VllmClient.update_weights`` on every live engine (see :meth:`_load`)."""
        return await self._load("update_weights", (str(path), int(version)), int(version))

    async def load_sharded(self, path: str, version: int) -> dict[str, Any]:
        """``VllmClient.load_sharded`` on every live engine (see :meth:`_load`)."""
        return await self._load("load_sharded", (str(path), int(version)), int(version))

    async def _load(self, method: str, args: tuple, version: int) -> dict[str, Any]:
        """Run a weight load on every live engine, concurrently, holding the load lock.

        Returns:
            The engine's report with one engine; else the slowest engine's report plus ``engines`` (every report).
            With no live engine: ``{"version", "deferred", "reload_s": 0.0}`` (the rejoining engines load it).

        Raises:
            Exception: an engine that is still alive failed the load (the first such error; the version is not
                current, the orchestrator counts and retries it).
        """
        async with self._lock:
            live = self.live()
            gens = {i: self.slots[i].generation for i in live}
            results = await asyncio.gather(*(getattr(self.slots[i].client, method)(*args) for i in live),
                                           return_exceptions=True)
            reports, errors = [], []
            for i, r in zip(live, results, strict=True):
                if isinstance(r, BaseException):
                    if not await self.confirm_death(i, gens[i], r):
                        errors.append((i, r))
                else:
                    reports.append(dict(r))
            if errors:
                i, first = errors[0]
                first.add_note(f"EnginePool.{method}(version {version}): failed on engines {[e for e, _ in errors]}")
                raise first
            self.version, self._current = version, (method, args)
        if not reports:
            self.counts["loads_deferred"] += 1
            return {"version": version, "reload_s": 0.0,
                    "deferred": "no live engine: the restarting engines load this version before they serve"}
        if len(reports) == 1 and len(self.slots) == 1:
            return reports[0]
        slowest = max(reports, key=lambda r: float(r.get("reload_s", 0.0)) + float(r.get("read_s", 0.0)))
        return {**slowest, "engines": reports}

    async def rejoin(self, index: int) -> dict[str, Any]:
        """Bring restarted engine ``index`` to the current version, check its version probe, then mark it live
        (module docstring, step 3).

        Returns:
            The rejoin event (``version``, ``served_version``, ``loads``, ``load_s``).

        Raises:
            RuntimeError: the load failed at the current version, or the engine serves another version.
        """
        s = self.slots[index]
        loads, t0 = 0, time.monotonic()
        while True:
            target, call = self.version, self._current
            if call is not None:
                loads += 1
                try:
                    await getattr(s.client, call[0])(*call[1])
                except Exception as exc:
                    if self.version != target:  # superseded meanwhile (its folder may be gone): load the new one
                        continue
                    raise RuntimeError(f"engine {index} could not load the current weights version {target} "
                                       f"({call[0]}): {type(exc).__name__}: {exc}") from exc
            async with self._lock:
                if self.version != target:
                    continue
                served = await s.client.weight_version()
                if served != target:
                    raise RuntimeError(f"engine {index} serves weights version {served} after loading version "
                                       f"{target} (its version probe disagrees)")
                self.set_live(index)
                event = {"engine": index, "version": target, "served_version": served, "current_version": self.version,
                         "loads": loads, "load_s": round(time.monotonic() - t0, 3), "pid": s.server.pid,
                         "generation": s.generation, "t_live": round(s.t_live, 3)}
                self.record("rejoined", **event)
                return event

    async def weight_version(self) -> int:
        """The version every live engine serves (waits for a live engine).

        Raises:
            RuntimeError: the live engines disagree (a partial update).
        """
        while True:
            while not self.live():
                await self._live.wait()
            async with self._lock:
                live = self.live()
                gens = {i: self.slots[i].generation for i in live}
                results = await asyncio.gather(*(self.slots[i].client.weight_version() for i in live),
                                               return_exceptions=True)
                versions = {}
                for i, r in zip(live, results, strict=True):
                    if isinstance(r, BaseException):
                        if not await self.confirm_death(i, gens[i], r):
                            raise r
                    else:
                        versions[i] = int(r)
            if versions:
                if len(set(versions.values())) != 1:
                    raise RuntimeError(f"EnginePool.weight_version: live engines serve different versions {versions}")
                return next(iter(versions.values()))

    # ------------------------------------------------------------------ other transports (one engine only)
    def _only(self, method: str) -> Any:
        if len(self.slots) != 1:
            raise RuntimeError(f"EnginePool.{method}: only the filesystem weight transport drives several engines "
                               f"(inference.num_engines={len(self.slots)})")
        return getattr(self.slots[0].client, method)

    async def update_weights_from_mooncake(self, *args: Any, **kwargs: Any) -> Any:
        return await self._only("update_weights_from_mooncake")(*args, **kwargs)

    async def init_sharded_broadcast(self, *args: Any, **kwargs: Any) -> Any:
        return await self._only("init_sharded_broadcast")(*args, **kwargs)

    async def update_weights_from_broadcast(self, *args: Any, **kwargs: Any) -> Any:
        return await self._only("update_weights_from_broadcast")(*args, **kwargs)

    async def init_p2p(self, *args: Any, **kwargs: Any) -> Any:
        return await self._only("init_p2p")(*args, **kwargs)

    async def update_weights_from_p2p(self, *args: Any, **kwargs: Any) -> Any:
        return await self._only("update_weights_from_p2p")(*args, **kwargs)

    async def health(self) -> bool:
        """True when at least one engine is live and every live one answers ``/health``."""
        live = self.live()
        return bool(live) and all(await asyncio.gather(*(self.slots[i].client.health() for i in live)))

    async def aclose(self) -> None:
        for s in self.slots:
            if s.client is not None:
                await s.client.aclose()

    # ------------------------------------------------------------------ reporting
    def fault_counters(self) -> dict[str, int]:
        """Per-step metrics (cumulative): ``engines_live``, ``engine_deaths``, ``engine_restarts``,
        ``engine_restart_failures``."""
        return {"engines_live": len(self.live()), "engine_deaths": self.counts["deaths"],
                "engine_restarts": self.counts["restarts"], "engine_restart_failures": self.counts["restart_failures"]}

    def report(self) -> dict[str, Any]:
        """``summary.json["engines"]``: counters, per-engine state (pid, restarts, requests since it turned live,
        when it turned live and got its first request, on the ``events`` clock) and every event."""
        stats = self.router.stats()
        return {
            "num_engines": len(self.slots),
            "current_version": self.version,
            **self.fault_counters(),
            "loads_deferred": self.counts["loads_deferred"],
            "requests_refused_not_live": self.counts["requests_refused_not_live"],
            "requests_routed": stats["routed"],
            "requests_failed": stats["failed"],
            "engines": [{"engine": s.index, "state": s.state, "pid": s.server.pid, "restarts": s.generation,
                         "t_live": None if s.t_live is None else round(s.t_live, 3),
                         "requests_since_live": s.requests,
                         "first_request_t": None if s.first_request_t is None else round(s.first_request_t, 3)}
                        for s in self.slots],
            "events": list(self.events),
        }


class EngineSupervisor:
    """Starts ``cfg.num_engines`` vLLM servers, keeps them in an :class:`EnginePool` and restarts dead ones.

    Args:
        cfg: the engines' ``VllmServerConfig`` (``num_engines``, ``max_engine_restarts``,
            ``engine_restart_backoff_s``; with ``port`` set, engine ``i`` uses ``port + i``).
        model_dir: the checkpoint every engine starts from (``weights/step_0``).
        logs: the run's log folder (:func:`engine_log_path`).
        make_client: ``base_url -> VllmClient`` (the run's client settings).
        restartable: False when the run's weight transport cannot bring a restarted engine to the current
            version (any death then fails the run).
        log: a function printing one progress line.
    """

    def __init__(self, cfg: Any, model_dir: Path, logs: Path, make_client: Callable[[str], Any],
                 restartable: bool = True, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.logs = Path(logs)
        self.make_client = make_client
        self.restartable = restartable
        self.log = log
        self.pool = EnginePool([_Slot(i, self._server(i, 0)) for i in range(cfg.num_engines)],
                               block_size=cfg.block_size, events_path=self.logs / "engine_faults.jsonl")
        self.pool.on_death = self._on_death
        self.on_restart: Callable[[], None] | None = None
        """Called after a restarted engine's server started (e.g. to rewrite the run's ``pids.json``)."""
        self._wake: asyncio.Event | None = None
        self._restarts: dict[int, asyncio.Task] = {}

    def _server(self, index: int, restart: int):
        from moe_rl.inference import VllmServer

        update: dict[str, Any] = {"cpu_affinity": engine_cores(self.cfg.cpu_affinity, index, self.cfg.num_engines)}
        if self.cfg.port:
            update["port"] = self.cfg.port + index
        cfg = self.cfg.model_copy(update=update)
        return VllmServer(cfg, self.model_dir, engine_log_path(self.logs, index, restart))

    @property
    def servers(self) -> list[Any]:
        """The current server of every engine."""
        return [s.server for s in self.pool.slots]

    def start(self, while_starting: Callable[[], object] | None = None,
              check: Callable[[], object] | None = None) -> float:
        """Start every engine and wait until all answer ``/health`` (blocking; before the event loop runs).

        Args:
            while_starting: called once every engine process is launched and before waiting for them (e.g. start
                the trainer, so that its start-up overlaps the engines').
            check: called about every 0.25 s while waiting (``VllmServer.wait_ready``), e.g. to fail at once when the
                trainer started beside the engines dies; what it raises stops every engine and propagates.

        Returns:
            Seconds until the last one was ready.

        Raises:
            RuntimeError: an engine did not start (``VllmServer.wait_ready``; every engine is stopped).
            Exception: whatever ``while_starting`` or ``check`` raises, once every engine is stopped.
        """
        t0 = time.monotonic()
        try:
            for s in self.pool.slots:
                s.server.start()
            if while_starting is not None:
                while_starting()
            for s in self.pool.slots:
                s.server.wait_ready(check=check) if check is not None else s.server.wait_ready()
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

    def attach(self) -> EnginePool:
        """Make each engine's client (inside the event loop) and mark every engine live; returns the pool."""
        for s in self.pool.slots:
            s.client = self.make_client(s.server.base_url)
            self.pool.set_live(s.index)
        self._wake = asyncio.Event()
        return self.pool

    def stop(self) -> None:
        """Stop every engine's process group (idempotent; blocking)."""
        for s in self.pool.slots:
            s.server.stop()

    def _on_death(self, index: int) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self, interval_s: float = 0.2) -> None:
        """Watch the engines until cancelled: mark dead the ones whose process exited and restart them.

        Raises:
            EngineRestartLimit: an engine died and the run has no restart left (or cannot restart it), or a restart
                failed with none left.
        """
        assert self._wake is not None, "call attach() first"
        try:
            while True:
                for s in self.pool.slots:
                    if s.state == "live" and (code := s.server.poll()) is not None:
                        self.pool.mark_dead(s.index, code, "process_exit")
                for s in self.pool.slots:
                    if s.state == "dead" and s.index not in self._restarts:
                        self._restarts[s.index] = asyncio.create_task(self._restart(s.index), name=f"restart-{s.index}")
                for i, t in list(self._restarts.items()):
                    if t.done():
                        del self._restarts[i]
                        t.result()  # re-raises EngineRestartLimit
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=interval_s)
                except TimeoutError:
                    pass
        finally:
            for t in self._restarts.values():
                t.cancel()
            if self._restarts:
                await asyncio.gather(*self._restarts.values(), return_exceptions=True)

    def _limit(self, s: _Slot, why: str) -> EngineRestartLimit:
        from moe_rl.procs import tail

        died = next((e for e in reversed(self.pool.events) if e["event"] == "died" and e["engine"] == s.index), {})
        log = s.server.log_path
        if not self.restartable:
            rule = ("the run's trainer.weight_transport cannot bring a restarted engine to the current weights (only "
                    "'filesystem' can)")
        else:
            rule = (f"the run survives at most inference.max_engine_restarts={self.cfg.max_engine_restarts} engine "
                    f"restarts and {self.pool.counts['restarts'] + self.pool.counts['restart_failures']} were used "
                    "(raise it to survive more)")
        return EngineRestartLimit(
            f"vLLM server {s.index} (pid {died.get('pid', s.server.pid)}) exited with code {died.get('exit_code')} "
            f"before the run finished{why}; {rule}; log: {log}\n--- last lines of the log ---\n{tail(log, 15)}")

    async def _restart(self, index: int) -> None:
        """Restart engine ``index`` until it rejoins, or raise :class:`EngineRestartLimit`."""
        s = self.pool.slots[index]
        why = ""
        while True:
            used = self.pool.counts["restarts"] + self.pool.counts["restart_failures"]
            if not self.restartable or used >= self.cfg.max_engine_restarts:
                raise self._limit(s, why)
            backoff = min(_MAX_BACKOFF_S, self.cfg.engine_restart_backoff_s * 2 ** s.generation)
            await asyncio.sleep(backoff)
            s.state = "restarting"
            await asyncio.to_thread(s.server.stop)  # what is left of the old process group (EngineCore, worker)
            s.generation += 1
            if s.client is not None:  # kept (closed) until a new one replaces it: its counters stay readable
                await s.client.aclose()
            s.server = server = self._server(index, s.generation)
            self.log(f"restarting vLLM engine {index} (restart {s.generation}, after {backoff:.1f}s backoff; log "
                     f"{server.log_path})")
            t0 = time.monotonic()
            try:
                server.start()
                if self.on_restart is not None:
                    self.on_restart()
                ready_s = await asyncio.to_thread(server.wait_ready)
                old_client, s.client = s.client, self.make_client(server.base_url)
                if old_client is not None:
                    s.retired_routed.update(old_client.routed_experts_counts)
                self.pool.record("restarted", engine=index, pid=server.pid, generation=s.generation, ready_s=ready_s,
                                 backoff_s=backoff)
                event = await self.pool.rejoin(index)
            except asyncio.CancelledError:
                await asyncio.to_thread(server.stop)  # ends a wait_ready still running in its thread
                raise
            except Exception as exc:  # noqa: BLE001 - counted; tried again while restarts are left
                self.pool.counts["restart_failures"] += 1
                why = f"; restart {s.generation} failed: {type(exc).__name__}: {exc}"
                self.pool.record("restart_failed", engine=index, generation=s.generation,
                                 error=f"{type(exc).__name__}: {exc}"[:500])
                self.log(f"vLLM engine {index}: restart {s.generation} failed: {type(exc).__name__}: {exc}")
                await asyncio.to_thread(server.stop)
                s.state = "dead"
                continue
            self.pool.counts["restarts"] += 1
            self.log(f"vLLM engine {index} rejoined at weights version {event['version']} (served "
                     f"{event['served_version']}) {time.monotonic() - t0:.1f}s after its restart (pid {server.pid})")
            return
