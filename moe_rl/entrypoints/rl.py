"""``moe-rl rl``: the whole async RL loop on one machine.

Processes (all started and stopped by this launcher, tracked by PID)::

    launcher (this process)      : config validation, SFT warm-up (cached), orchestrator (asyncio)
    vLLM OpenAI server           : python -m vllm.entrypoints.openai.api_server, worker extension for reloads
    trainer                      : torchrun --nproc-per-node N -m moe_rl.runtime.trainer.rl_trainer (FSDP2, gloo)
    Mooncake master + metadata   : only with trainer.weight_transport = "mooncake" (loopback; the launcher lends
                                   the store its memory; moe_rl.weights.mooncake.RunStore)

The trainer is started right after the engine processes are launched, so its start-up (torch, FSDP2, loading version
0) overlaps theirs; the orchestrator starts once every engine answers ``/health``, and the trainer's wait for its
first batch (step 0's ``idle_s``) includes what is left of the engines' start-up.

``trainer.weight_transport`` (``filesystem``, ``broadcast``, ``p2p`` or ``mooncake``; ``moe_rl.weights``) picks how the
trainer ranks ship each version to the engine; every version is announced in ``weights/announce/step_<v>.json``.

Files under ``--output-dir`` (``DIR``): ``config.json`` (resolved), ``sft/`` (cached warm-up),
``weights/step_<v>/`` (published versions: sharded folders; the final one always), ``weights/announce/``,
``batches/``, ``trainer/step_<n>.json``, ``logs/``, ``metrics.jsonl`` (per step also the weight update's trainer
blocking seconds, bytes, engine pause and load seconds), ``engine_events.jsonl``, ``summary.json``, ``curves.png``;
with the Mooncake weight transport also ``logs/mooncake/``; with ``metrics.tensorboard`` / ``metrics.wandb`` also
``tensorboard/`` / ``wandb/`` (``moe_rl.runtime.sinks``). A directory that holds an earlier run is refused unless
``existing="overwrite"`` (``moe-rl rl --overwrite``) or ``existing="resume"`` (``moe-rl rl --resume``: continue from
the newest complete checkpoint in ``checkpoints/``, written every ``trainer.checkpoint_every`` steps and after the
last one; ``moe_rl.runtime.checkpoint``); every run that starts writes ``summary.json`` (with its ``exit``: status,
cause, code) and ``curves.png``, failed and interrupted runs too.

``inference.num_engines`` vLLM servers run (logs ``logs/vllm.log``, ``logs/vllm_<i>.log``; ``pids.json`` lists them
in ``vllm_servers``); requests are routed over the live ones (``moe_rl.runtime.engine_pool``). When an engine dies,
its in-flight rollouts are dropped (reason ``engine_died``) and their prompts re-queued, the router stops choosing
it, and it is restarted (``inference.max_engine_restarts``, ``inference.engine_restart_backoff_s``) and rejoins
once it serves the current weight version; deaths and restarts are in ``metrics.jsonl`` and ``summary.json``
(``engines``). If a trainer rank dies, or an engine dies with no restart left, every process the launcher started
is stopped (by PID / process group) and the launcher exits non-zero naming the process, its exit code and its log.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from moe_rl.envs.tokenizer import CharTokenizer
from moe_rl.procs import OrphanReaper, stop_group, tail
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.run_dir import RunPaths

__all__ = ["run_rl", "RunFailed", "RunDirInUse", "build_env", "earlier_run_files", "install_task_dump", "prepare_run_dir",
           "prepare_resume", "write_summary", "compact_versions"]


class RunFailed(RuntimeError):
    """A process of the run died or the orchestrator failed; the message names the cause."""


# ---------------------------------------------------------------------------------------------- helpers
def _log(msg: str) -> None:
    print(f"[moe-rl] {msg}", file=sys.stderr, flush=True)


RUN_MARKER = ".moe_rl_run"
# what a run leaves behind; any of these marks the directory as holding an earlier (finished or failed) run. The SFT
# cache (sft/), the tokenizer and config.json are not run results: a directory with only those is reused silently.
_RUN_FILES = ("metrics.jsonl", "engine_events.jsonl", "rollouts.jsonl", "summary.json", "curves.png", "pids.json",
              "resume_discarded.jsonl")
_RUN_DIRS = ("weights", "batches", "trainer", "tensorboard", "wandb", "checkpoints")


class RunDirInUse(RunFailed):
    """``--output-dir`` holds an earlier run (or foreign files) and neither ``--overwrite`` nor ``--resume`` was
    given; nothing was deleted. The CLI exits 2."""


def earlier_run_files(paths: RunPaths) -> list[Path]:
    """The files and folders of an earlier run in ``paths.root`` (empty when there is none)."""
    return [p for p in (*(paths.root / f for f in _RUN_FILES), *(paths.root / d for d in _RUN_DIRS)) if p.exists()]


def prepare_run_dir(paths: RunPaths, existing: str = "refuse") -> list[Path]:
    """Make ``paths.root`` ready for a new run.

    Args:
        paths: the run directory.
        existing: what to do with an earlier run found there: ``"refuse"`` (default: raise, delete nothing) or
            ``"overwrite"`` (delete that run's files, listed in the return value; ``sft/`` is kept as a cache).

    Returns:
        The paths deleted (``"overwrite"`` only).

    Raises:
        RunDirInUse: the directory holds files but was not created by ``moe-rl rl`` (no ``.moe_rl_run`` marker;
            refused even with ``"overwrite"``), or it holds an earlier run and ``existing="refuse"``; nothing is
            deleted. The message names the directory and the two options.
        ValueError: ``existing`` is not ``"refuse"`` or ``"overwrite"``.
    """
    if existing not in ("refuse", "overwrite"):
        raise ValueError(f"prepare_run_dir: existing={existing!r} must be 'refuse' or 'overwrite'")
    root = paths.root
    if root.exists() and any(root.iterdir()) and not (root / RUN_MARKER).exists():
        raise RunDirInUse(
            f"--output-dir {root} is not empty and was not created by moe-rl rl; refusing to overwrite it. "
            "Choose a new or empty directory."
        )
    old = earlier_run_files(paths) if root.exists() else []
    if old and existing == "refuse":
        summary = root / "summary.json"
        how = ""
        if summary.exists():
            try:
                ex = json.loads(summary.read_text()).get("exit", {})
                how = f" ({ex.get('status', 'finished')}{': ' + ex['cause'] if ex.get('cause') else ''})"
            except (ValueError, AttributeError):
                how = ""
        raise RunDirInUse(
            f"--output-dir {root} already holds a run{how}: {', '.join(p.name for p in old)}. Nothing was deleted. "
            "Give --resume to continue it from its newest checkpoint, --overwrite to delete that run's files and "
            "start again (the cached SFT warm-up in sft/ is kept), or choose another --output-dir."
        )
    root.mkdir(parents=True, exist_ok=True)
    (root / RUN_MARKER).write_text("moe-rl rl run directory\n")
    if old and paths.logs.exists():  # --overwrite: the earlier run's logs go too
        old.append(paths.logs)
    for p in old:
        _log(f"--overwrite: deleting {p}")
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    paths.logs.mkdir(parents=True, exist_ok=True)
    return old


def prepare_resume(paths: RunPaths, cfg: RLConfig):
    """Make ``paths.root`` ready to continue its run from the newest complete checkpoint
    (:func:`moe_rl.runtime.checkpoint.prepare_resume`: config check, the interrupted segment's later work set aside).

    Returns:
        The :class:`moe_rl.runtime.checkpoint.Resume`.

    Raises:
        RunDirInUse: the directory holds no ``moe-rl rl`` run, no complete checkpoint, or the config differs from the
            checkpoint's in a field that must match (each difference named); nothing is changed.
    """
    from moe_rl.runtime.checkpoint import ResumeRefused
    from moe_rl.runtime.checkpoint import prepare_resume as _prepare

    if not (paths.root / RUN_MARKER).exists():
        raise RunDirInUse(f"--resume: {paths.root} holds no moe-rl rl run (no {RUN_MARKER} marker); start a new run "
                          "there without --resume")
    try:
        resume = _prepare(paths, cfg)
    except ResumeRefused as exc:
        raise RunDirInUse(str(exc)) from exc
    paths.logs.mkdir(parents=True, exist_ok=True)
    _log(f"--resume: continuing from {resume.path} (step {resume.step}); "
         f"{len(resume.discarded_steps)} later step(s) of the interrupted segment are trained again, "
         f"{resume.dropped_at_resume} unfinished rollout samples counted as dropped ('resume')"
         + (f"; the earlier logs are in {resume.logs_kept}" if resume.logs_kept else ""))
    return resume


def prepare_initial_weights(cfg: RLConfig, paths: RunPaths) -> dict:
    """Build the tokenizer and the version-0 policy (random init + cached SFT warm-up) and publish it as
    ``weights/step_0`` (HF checkpoint + tokenizer files).

    Returns:
        The SFT stats (``cached`` True when reused).
    """
    import torch

    from moe_rl.envs.addition import AdditionTask
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe import load_hf_state_dict, save_hf_checkpoint, to_hf_state_dict
    from moe_rl.models.hf_io import keeps_fp32
    from moe_rl.runtime.trainer.sft import run_sft, sft_cache_key
    from moe_rl.weights.filesystem import WeightPublisher

    tok = CharTokenizer(cfg.alphabet)
    # the built-in tasks warm up on single-turn addition (a chained task's turn 1), an env on its demonstrations
    task = AdditionTask(cfg.task, tok) if cfg.env is None else build_env(cfg, tok)
    sft_dir = paths.root / "sft"
    env_key = [] if cfg.env is None else [{"env": cfg.env, "env_args": cfg.env_args}]  # built-in task: keys unchanged
    key = sft_cache_key(cfg.model, cfg.task, cfg.sft, cfg.alphabet, cfg.seed, *env_key)
    stats_path = sft_dir / "sft.json"
    torch.manual_seed(cfg.seed)
    model = GlmMoeForCausalLM(cfg.model)
    stats: dict = {"enabled": cfg.sft.enabled}
    if cfg.sft.enabled:
        cached = stats_path.exists() and json.loads(stats_path.read_text()).get("key") == key
        if cached:
            model.load_state_dict(load_hf_state_dict(sft_dir))
            stats = {**json.loads(stats_path.read_text()), "cached": True}
            _log(f"SFT warm-up: reusing cache {sft_dir} (greedy pass {stats['pass_rate']:.3f})")
        else:
            _log("SFT warm-up: training until the held-out greedy pass rate reaches "
                 f"{cfg.sft.pass_trigger}")
            torch.set_num_threads(cfg.sft.torch_threads)
            stats = run_sft(model, task, cfg.sft, seed=cfg.seed, log=_log)
            if not stats["reached"]:
                _log(f"warning: SFT stopped at max_steps={cfg.sft.max_steps} with pass rate "
                     f"{stats['pass_rate']:.3f} < trigger {cfg.sft.pass_trigger}")
            if sft_dir.exists():
                shutil.rmtree(sft_dir)
            sft_dir.mkdir(parents=True)
            save_hf_checkpoint(model, cfg.model, sft_dir, dtype=torch.float32)
            stats_path.write_text(json.dumps({"key": key, **stats}, indent=2))
            stats = {**stats, "cached": False}
            _log(f"SFT warm-up: {stats['steps']} steps in {stats['seconds']:.1f}s, greedy pass {stats['pass_rate']:.3f}")
    tok_dir = paths.root / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    tok.save_pretrained(tok_dir)
    publisher = WeightPublisher(paths.weights, cfg.model.to_hf_config_dict(torch_dtype=cfg.inference.dtype),
                                extra_files=sorted(tok_dir.iterdir()))
    dtype = getattr(torch, cfg.inference.dtype)
    # the router bias correction stays fp32 (moe_rl.models.hf_io.keeps_fp32), as in every later version
    hf = {k: v.to(torch.float32 if keeps_fp32(k) else dtype)
          for k, v in to_hf_state_dict(model.state_dict(), cfg.model).items()}
    publisher.publish(hf, version=0)
    return stats


def build_env(cfg: RLConfig, tok: CharTokenizer):
    """The run's environment: ``env`` (``"module:factory"``, called as ``factory(tok, **env_args)``) or the built-in
    ``task``; checked against the engine's context (``inference.max_model_len``, which must also hold the engine
    probe's 72 tokens).

    Raises:
        RunFailed: the factory cannot be loaded (the message names the part that failed), or the environment's
            ``max_sequence_len()`` exceeds ``inference.max_model_len``.
    """
    from moe_rl.envs import make_task
    from moe_rl.envs.loader import EnvLoadError, load_env

    if cfg.env is None:
        return make_task(cfg.task, tok)
    try:
        env = load_env(cfg.env, tok, cfg.env_args)
    except EnvLoadError as exc:
        raise RunFailed(str(exc)) from exc
    longest = env.max_sequence_len()
    if longest is not None and longest > cfg.inference.max_model_len:
        raise RunFailed(f"env={cfg.env!r}: its conversations reach {longest} tokens (max_sequence_len) but "
                        f"inference.max_model_len={cfg.inference.max_model_len}; raise inference.max_model_len (and "
                        "model.max_position_embeddings) or lower the environment's token budget")
    return env


def _start_store(cfg: RLConfig, paths: RunPaths):
    """Start the run's Mooncake store (``trainer.weight_transport = "mooncake"``): a loopback master (logs in
    ``logs/mooncake/``) and the launcher's client lending ``trainer.mooncake.segment_bytes`` to it.

    Raises:
        RunFailed: Mooncake is not installed here or the master did not start (the message says why).
    """
    from moe_rl.weights.mooncake import RunStore

    store = RunStore(cfg.trainer.mooncake, paths.logs / "mooncake")
    try:
        store.start()
    except (ImportError, RuntimeError, OSError) as exc:
        raise RunFailed(f"trainer.weight_transport='mooncake': the run's Mooncake store did not start: {exc}") from exc
    _log(f"Mooncake store: master {store.master.rpc_address} (pid {store.master.master_pid}), "
         f"{cfg.trainer.mooncake.segment_bytes >> 20} MiB lent by the launcher (logs {paths.logs / 'mooncake'})")
    return store


def _affinities(cfg: RLConfig) -> tuple[list[int] | None, list[int] | None]:
    """Split cores between vLLM and the trainer (measured best on 2 cores: server on core 0, trainer on
    core 1). Several engines get every core, split among them by ``moe_rl.runtime.engine_pool.engine_cores``."""
    cores = sorted(os.sched_getaffinity(0))
    ncpu = len(cores)
    server = cfg.inference.cpu_affinity
    trainer = cfg.trainer.cpu_affinity
    if ncpu >= 2:  # several engines: spread over every core (moe_rl.runtime.engine_pool.engine_cores)
        server = server if server is not None else ([cores[0]] if cfg.inference.num_engines == 1 else cores)
        trainer = trainer if trainer is not None else [cores[-1]]
    return server, trainer


class _Proc:
    """A child process started in its own session so it and its children can be stopped by PGID."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path, affinity: list[int] | None):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
        preexec = (lambda: os.sched_setaffinity(0, affinity)) if affinity else None
        self.popen = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=preexec)
        self.pid = self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def stop(self, timeout: float = 10.0) -> None:
        stop_group(self.popen, timeout)
        self._log.close()


def _start_trainer(cfg: RLConfig, paths: RunPaths, affinity: list[int] | None) -> _Proc:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg.trainer.torch_threads))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={cfg.trainer.nproc_per_node}", "-m", "moe_rl.runtime.trainer.rl_trainer",
            "--run-dir", str(paths.root)]
    return _Proc("trainer (torchrun)", argv, env, paths.logs / "trainer.log", affinity)


async def _watch(procs: list[tuple[str, object, Path]], interval: float = 0.2, engines=None) -> None:
    """Return only by raising ``RunFailed`` when one of ``(name, process, log_path)`` exits, or when ``engines``
    (an ``EngineSupervisor``, run here) cannot restart a dead engine."""
    from moe_rl.runtime.engine_pool import EngineRestartLimit

    supervise = asyncio.create_task(engines.run(), name="engine_supervisor") if engines is not None else None
    try:
        await _watch_procs(procs, interval, supervise)
    except EngineRestartLimit as exc:
        raise RunFailed(str(exc)) from exc
    finally:
        if supervise is not None and not supervise.done():
            supervise.cancel()
            await asyncio.gather(supervise, return_exceptions=True)


async def _watch_procs(procs: list[tuple[str, object, Path]], interval: float, supervise) -> None:
    while True:
        if supervise is not None and supervise.done():
            supervise.result()  # raises EngineRestartLimit (it never ends otherwise)
        for name, p, log in procs:
            code = p.poll()
            if code is not None:
                raise RunFailed(
                    f"{name} (pid {p.pid}) exited with code {code} before the run finished; "
                    f"log: {log}\n--- last lines of the log ---\n{tail(log, 15)}"
                )
        await asyncio.sleep(interval)


async def _run_orchestrator(cfg: RLConfig, paths: RunPaths, engines, trainer: _Proc, progress, store=None,
                            holder: dict | None = None, sinks=None) -> dict:
    from moe_rl.runtime import checkpoint
    from moe_rl.runtime.orchestrator import Orchestrator

    task = build_env(cfg, CharTokenizer(cfg.alphabet))
    holder = {} if holder is None else holder

    def on_step(rec: dict) -> None:
        progress.step(rec)
        if sinks is not None:
            sinks.log(rec)
        if checkpoint.finalize_if_due(paths.root, holder["orchestrator"], rec, cfg) is not None:
            _log(f"checkpoint {rec['step'] + 1} complete ({paths.root / 'checkpoints'})")

    _quiet_after_failure(holder, paths.logs / "launcher_asyncio.log")
    install_task_dump(paths.logs / "launcher_tasks.txt")
    client = engines.attach()  # the engines' pool (moe_rl.runtime.engine_pool): routes over the live engines
    run_id = paths.root.name
    if holder.get("resume") is not None:
        # a resumed segment re-trains the steps after its checkpoint and republishes their version numbers with other
        # weights: a fresh salt namespace per segment keeps KV computed under the discarded versions from ever being
        # reused (an engine-side or Mooncake prefix cache keyed by cache_salt)
        run_id = f"{run_id}-{secrets.token_hex(4)}"
    try:
        orch = Orchestrator(cfg.orchestrator, task, client, paths, cfg.max_steps, seed=cfg.seed,
                            run_id=run_id, weight_dtype=cfg.inference.dtype, on_step=on_step,
                            store=None if store is None else store.source(cfg.inference.served_model_name),
                            weight_transport=cfg.trainer.weight_transport, max_model_len=cfg.inference.max_model_len)
        resume = holder.get("resume")
        if resume is not None:  # the fresh engine serves the checkpoint's version before any request
            await checkpoint.load_engine(client, paths.weights, resume)
            checkpoint.restore_orchestrator(orch, resume)
            _log(f"resumed at step {resume.step}: the engine serves version {resume.step}")
        holder["orchestrator"] = orch
        procs = [(trainer.name, trainer, trainer.log_path)]  # engines: restarted by the supervisor (in _watch)
        orch_task = asyncio.create_task(orch.run())
        watch_task = asyncio.create_task(_watch(procs, engines=engines))
        ticker = asyncio.create_task(progress.tick_until_first_step())
        try:
            done, _ = await asyncio.wait([orch_task, watch_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ticker.cancel()
        if orch_task in done:
            watch_task.cancel()
            exc = orch_task.exception()
            if exc is not None:
                holder["failed"] = True
                # a dead process usually surfaces first as a failed request: name the root cause
                await asyncio.sleep(1.0)
                try:
                    await asyncio.wait_for(_watch(procs), timeout=1.0)
                except TimeoutError:
                    pass
                raise RunFailed(f"orchestrator failed: {type(exc).__name__}: {exc}") from exc
            summary = orch_task.result()
        else:
            holder["failed"] = True
            orch_task.cancel()
            await asyncio.gather(orch_task, return_exceptions=True)
            watch_task.result()  # raises RunFailed
            raise AssertionError("unreachable")
    finally:
        await client.aclose()
    # the trainer finishes by itself once the last step is reported
    deadline = time.monotonic() + 60
    while trainer.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    code = trainer.poll()
    if code not in (0, None):
        raise RunFailed(f"{trainer.name} (pid {trainer.pid}) exited with code {code}; log: {trainer.log_path}")
    return summary


class _Progress:
    """The run's progress bar: a status line (elapsed seconds) until the first trainer step, which includes the
    trainer's start-up and the first step's warm-up; then one tick per step, its numbers set before the count moves
    (the bar never shows a step's count with the previous step's numbers); the rate, and so the remaining time, is
    measured from the first step on, so the warm-up does not inflate the estimate."""

    WARMUP = "rl: first step (trainer start-up, first batch, warm-up)"

    def __init__(self, total: int, **tqdm_kwargs) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=self.WARMUP, unit="step", dynamic_ncols=True, **tqdm_kwargs)
        self.steps = 0

    async def tick_until_first_step(self, every_s: float = 1.0) -> None:
        """Refresh the status line (its elapsed time) until the first step is done."""
        while self.steps == 0:
            self.bar.refresh()
            await asyncio.sleep(every_s)

    def step(self, rec: dict) -> None:
        """Show step ``rec['step']``: its reward, mismatch KL and staleness, and the count of finished steps."""
        self.steps += 1
        if self.steps == 1:  # restart the clock (the rate counts from the first step on), before any numbers show
            self.bar.set_description("rl", refresh=False)
            self.bar.reset()
        self.bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", kl=f"{rec['mismatch_kl']:.1e}",
                             stale=rec["staleness_max"], refresh=False)
        if self.steps == 1:
            self.bar.initial = self.bar.n = self.bar.last_print_n = 1
            self.bar.refresh()
        else:
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _quiet_after_failure(holder: dict, log_path: Path) -> None:
    """Route asyncio's "Task exception was never retrieved" reports to ``log_path`` once the run has failed (the
    launcher has already named the cause; a second traceback of a follow-on error would only bury it); before
    that, the loop's default handler prints them."""
    loop = asyncio.get_running_loop()

    def handler(loop, context: dict) -> None:
        if not holder.get("failed"):
            loop.default_exception_handler(context)
            return
        import traceback

        exc = context.get("exception")
        with open(log_path, "a") as f:
            f.write(f"{context.get('message', '')}: {context.get('task', context.get('future', ''))}\n")
            if exc is not None:
                f.write("".join(traceback.format_exception(exc)))

    loop.set_exception_handler(handler)


def run_rl(cfg: RLConfig, existing: str = "refuse") -> dict:
    """Run the whole async RL loop described by ``cfg`` and return the summary.

    Every run that got past the run-directory check writes ``summary.json`` (with ``exit``: ``status``
    ``finished`` / ``failed`` / ``interrupted``, ``cause``, ``code``) and ``curves.png``, whatever ended it.
    Should this process be killed outright (SIGKILL), a watcher (``moe_rl.procs.OrphanReaper``) stops the engines,
    the trainer and the store it started.

    Args:
        cfg: the run's config.
        existing: an earlier run in ``cfg.output_dir``: ``"refuse"`` or ``"overwrite"`` (:func:`prepare_run_dir`),
            or ``"resume"``: continue it from its newest complete checkpoint (:func:`prepare_resume`).

    Raises:
        RunDirInUse: the output directory holds an earlier run and ``existing="refuse"`` (nothing deleted), or
            ``existing="resume"`` and the run cannot be resumed (no complete checkpoint, a config that differs in a
            field that must match; the message names each difference).
        RunFailed: a process died or the orchestrator failed (every started process is stopped first).
        KeyboardInterrupt: Ctrl-C or SIGTERM (every started process is stopped first).
    """
    paths = RunPaths(Path(cfg.output_dir).resolve())
    resume = None
    try:
        if existing == "resume":
            resume = prepare_resume(paths, cfg)
        else:
            prepare_run_dir(paths, existing)
    except OSError as exc:
        raise RunFailed(f"cannot use --output-dir {paths.root}: {exc}") from exc
    (paths.root / "config.json").write_text(cfg.model_dump_json(indent=2))
    t0 = time.monotonic()
    holder: dict = {"resume": resume}
    extra: dict = {"sft": None}
    if resume is not None:
        extra["resume"] = resume.summary()
    status, cause, code = "failed", "", 1
    summary: dict | None = None

    def _on_sigterm(signum, frame):  # run the cleanup below instead of dying with the children orphaned
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with OrphanReaper():  # stops the run's processes should this one be killed outright (SIGKILL, OOM killer)
            summary = _run(cfg, paths, holder, extra)
        status, code = "finished", 0
    except KeyboardInterrupt as exc:
        status, cause, code = "interrupted", str(exc) or "SIGINT (Ctrl-C)", 130
        raise
    except RunFailed as exc:
        cause = str(exc).split("\n--- last lines")[0]
        raise
    except Exception as exc:  # noqa: BLE001 - every failure stops all processes and is reported by name
        cause = f"{type(exc).__name__}: {exc}"
        raise RunFailed(cause) from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
        if summary is None:  # failed or interrupted: the orchestrator's totals so far, when it had started
            orch = holder.get("orchestrator")
            summary = orch.summary() if orch is not None else {}
        extra.update(total_wall_s=time.monotonic() - t0, exit={"status": status, "cause": cause, "code": code})
        if "t_ready" in holder:
            extra["rl_wall_s"] = time.monotonic() - holder["t_ready"]
        try:
            write_summary(paths, summary, extra)
        except Exception as exc:  # noqa: BLE001 - never hide the run's own outcome behind a reporting error
            _log(f"could not write {paths.root / 'summary.json'} / curves.png: {type(exc).__name__}: {exc}")
    return summary


def _run(cfg: RLConfig, paths: RunPaths, holder: dict, extra: dict) -> dict:
    """The body of :func:`run_rl` after the run directory is ready (``holder`` and ``extra`` collect what a
    failure report needs)."""
    from moe_rl.inference import VllmClient
    from moe_rl.inference.control_plane import run_token
    from moe_rl.runtime.engine_pool import EngineSupervisor
    from moe_rl.runtime.sinks import MetricSinks

    sinks = MetricSinks(cfg.metrics, paths.root, json.loads(cfg.model_dump_json()))
    if sinks.enabled:
        _log(f"metric sinks: {', '.join(sinks.enabled)}")
    if holder.get("resume") is None:
        sft_stats = prepare_initial_weights(cfg, paths)
    else:  # resumed: version 0 (and the SFT warm-up it holds) is already published
        sft_json = paths.root / "sft" / "sft.json"
        sft_stats = {**json.loads(sft_json.read_text()), "cached": True} if sft_json.exists() else {"enabled": False}
    extra["sft"] = {k: v for k, v in sft_stats.items() if k != "history"}
    server_aff, trainer_aff = _affinities(cfg)
    # the trainer divides its logits by the sampling temperature, so the engine must report logprobs of the
    # distribution it sampled from (after temperature), not the raw ones
    server_cfg = cfg.inference.model_copy(update={"cpu_affinity": server_aff, "logprobs_mode": "processed_logprobs",
                                                  "weights_root": str(paths.weights)})
    # the run's control token: a fresh one per run (or MOE_RL_CONTROL_TOKEN when set) in <run_dir>/control_token
    # (0600), exported to this process's clients and children; never printed
    run_token(paths.root, rotate=True)
    procs: list = []

    def make_client(base_url: str) -> VllmClient:
        o = cfg.orchestrator
        sampling = {**({"top_p": o.top_p} if o.top_p < 1.0 else {}), **({"top_k": o.top_k} if o.top_k > 0 else {})}
        return VllmClient(base_url, model=cfg.inference.served_model_name,
                          return_routed_experts=cfg.trainer.router_replay,
                          return_sampling_masks=cfg.trainer.sampling_mask_replay, sampling_defaults=sampling or None)

    # inference.num_engines servers; a dead one is restarted (inference.max_engine_restarts) and rejoins at the
    # current version, which only the filesystem transport can bring it to (moe_rl.runtime.engine_pool)
    engines = EngineSupervisor(server_cfg, paths.weights / "step_0", paths.logs, make_client,
                               restartable=cfg.trainer.weight_transport == "filesystem", log=_log)
    pids: dict = {}

    def write_pids() -> None:
        servers = [s.pid for s in engines.servers]
        (paths.root / "pids.json").write_text(json.dumps({**pids, "vllm_server": servers[0], "vllm_servers": servers}))

    engines.on_restart = write_pids
    progress = None
    store = None
    try:
        if cfg.trainer.weight_transport == "mooncake":
            store = _start_store(cfg, paths)
            procs.append(store)
            cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"mooncake": store.resolved})})
            (paths.root / "config.json").write_text(cfg.model_dump_json(indent=2))  # the trainer reads the ports
        n = cfg.inference.num_engines
        _log(f"starting {n} vLLM server{'s' if n > 1 else ''} (log {paths.logs / 'vllm.log'}"
             f"{', vllm_<i>.log' if n > 1 else ''}) and the trainer (log {paths.logs / 'trainer.log'})")
        procs.append(engines)
        started: list[_Proc] = []

        def start_trainer() -> None:  # while the engines start: the two start-ups overlap
            started.append(_start_trainer(cfg, paths, trainer_aff))
            procs.append(started[0])  # stopped before the engines (reversed order) if anything fails

        def trainer_alive() -> None:  # a trainer that dies while the engines start fails the run at once
            code = started[0].poll() if started else None
            if code is not None:
                log = paths.logs / "trainer.log"
                raise RunFailed(f"trainer (torchrun) (pid {started[0].pid}) exited with code {code} while the vLLM "
                                f"engines started; log: {log}\n--- last lines of the log ---\n{tail(log, 15)}")

        startup_s = engines.start(while_starting=start_trainer, check=trainer_alive)
        holder["t_ready"] = time.monotonic()
        urls = ", ".join(s.base_url for s in engines.servers)
        _log(f"vLLM ready at {urls} after {startup_s:.1f}s")
        trainer = started[0]
        pids.update(launcher=os.getpid(), trainer=trainer.pid)
        if store is not None:
            pids["mooncake_master"] = store.master.master_pid
        write_pids()
        _log("waiting for the first trainer step (trainer start-up, first batch, warm-up); later steps are faster")
        progress = _Progress(cfg.max_steps - (holder["resume"].step if holder.get("resume") else 0))
        summary = asyncio.run(_run_orchestrator(cfg, paths, engines, trainer, progress, store, holder, sinks))
    finally:
        if progress is not None:
            progress.close()
        for p in reversed(procs):
            p.stop()
        sinks.close()
        extra["engines"] = engines.pool.report()  # deaths, restarts, rejoins (failed runs too)
    if store is not None:
        _log("weight transport: " + json.dumps({k: summary["weight_transport"][k] for k in (
            "versions_loaded_by_source", "versions_skipped_newer", "versions_failed", "engine_load_fallbacks",
            "trainer_publish_fallbacks")}))
    return summary


def install_task_dump(out: Path) -> None:
    """Make ``kill -USR1 <pid>`` write the stack of every asyncio task of the running loop to ``out``
    (``moe_rl.runtime.orchestrator.describe_tasks``). Call from inside the loop."""
    from moe_rl.runtime.orchestrator import describe_tasks

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: out.write_text(describe_tasks() + "\n"))


def write_summary(paths: RunPaths, summary: dict, extra: dict | None = None) -> dict:
    """Finish a run's report: ``summary`` (``Orchestrator.run``'s totals; ``{}`` for a run that failed before the
    orchestrator started) updated with ``extra`` and the per-step aggregates of ``metrics.jsonl`` (reward of the
    first / last 5 steps, mismatch KL max / mean, largest staleness, mean trainer idle fraction; None without
    steps), written to ``summary.json``; the curves are plotted to ``curves.png`` (empty axes without steps).
    ``weight_transport.versions_loaded`` (one entry per version) is written compactly (:func:`compact_versions`).

    Returns:
        The updated ``summary`` (the same dict).
    """
    from moe_rl.runtime.plots import plot_curves

    text = paths.metrics.read_text() if paths.metrics.exists() else ""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    summary.update(extra or {})
    wt = summary.get("weight_transport")
    if isinstance(wt, dict) and isinstance(wt.get("versions_loaded"), dict) and "count" not in wt["versions_loaded"]:
        wt["versions_loaded"] = compact_versions(wt["versions_loaded"])
    summary.update({
        "reward_first5": _mean([r["reward_mean"] for r in records[:5]]),
        "reward_last5": _mean([r["reward_mean"] for r in records[-5:]]),
        "mismatch_kl_max": max((r["mismatch_kl"] for r in records), default=None),
        "mismatch_kl_mean": _mean([r["mismatch_kl"] for r in records]),
        "staleness_max": max((r["staleness_max"] for r in records), default=None),
        "trainer_idle_frac_mean": _mean([r["trainer_idle_frac"] for r in records]),
    })
    (paths.root / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves(records, paths.root / "curves.png")
    return summary


def compact_versions(loaded: dict) -> dict:
    """``{version: source}`` of the versions the engine loaded, compactly: ``{"count", "first", "last", "gaps",
    "ranges_by_source"}``. ``gaps`` lists the ``[from, to]`` ranges (inclusive) between ``first`` and ``last`` that
    were not loaded; ``ranges_by_source`` maps each source to the ``[from, to]`` runs of consecutive loaded versions
    it served (one run for a run whose every version came the same way)."""
    vs = sorted(int(v) for v in loaded)
    src = {int(v): s for v, s in loaded.items()}
    gaps = [[a + 1, b - 1] for a, b in zip(vs, vs[1:], strict=False) if b > a + 1]
    runs: dict[str, list[list[int]]] = {}
    for v in vs:
        mine = runs.setdefault(src[v], [])
        if mine and mine[-1][1] == v - 1:
            mine[-1][1] = v
        else:
            mine.append([v, v])
    return {"count": len(vs), "first": vs[0] if vs else None, "last": vs[-1] if vs else None, "gaps": gaps,
            "ranges_by_source": runs}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
