"""The orchestrator process of a cluster run (``moe-rl cluster``; ``moe_rl.launch.plan`` starts it on trainer node 0)::

    python -m moe_rl.entrypoints.cluster_orchestrator --config RUN_DIR/configs/cluster.json --run-dir RUN_DIR \\
        --inference-url http://<router>:<port> --engine-url ROLE=URL [--engine-url ROLE=URL ...]

It runs :class:`moe_rl.runtime.orchestrator.Orchestrator` against the run's engines and talks to the trainer
(``moe_rl.entrypoints.cluster_trainer``) through the files of the one-machine job (``RunPaths``): it writes
``batches/step_<n>.safetensors``; the trainer publishes version ``n+1`` through ``weights.kind`` (a sharded folder
``weights/step_<n+1>/``, the broadcast groups, or pieces the engines pull: ``p2p``), announces it in
``weights/announce/step_<n+1>.json`` and reports
``trainer/step_<n>.json``; the orchestrator's watcher makes every engine load each announced version. At the end it writes ``summary.json``, ``metrics.jsonl`` (per step),
``engine_events.jsonl``, ``rollouts.jsonl`` and ``curves.png`` like ``moe-rl rl``.

Engines (``--engine-url``, one per replica API server; ``ROLE`` is ``engine``, ``prefill`` or ``decode``):

- ``inference.mode = "colocated"``: generation is routed over the ``engine`` replicas by
  :class:`moe_rl.inference.RoutedClient` (prefix-cache-aware ``RequestRouter``); per-token policy versions are
  tracked by each replica's ``VllmClient``.
- ``inference.mode = "disaggregated"``: generation goes through the P/D proxy (``--inference-url``); weight
  updates, pause/resume, version probes and prefix-cache resets go to every prefill and decode replica
  (:class:`moe_rl.inference.ProxiedClient`). Per-token versions cannot be tracked behind the proxy: every token is
  aged from its rollout's start version (prime-rl's rule), counted in ``summary.json`` (``token_versions``).
  ``orchestrator.off_policy_policy = "mask"`` and ``trainer.router_replay = true`` need per-token versions /
  engine-side routing capture and are rejected at startup.

Version 0 is ``model.inference_checkpoint``, which the engines start on: nothing is read from ``weights/step_0``.
At startup the run directory must hold no weight version >= 1, batch, trainer report or metrics of an earlier run,
and every replica must serve version 0 (a replica that already loaded a later version would make the
orchestrator's version bookkeeping wrong).

Exit status: 0 on success; 2 for bad arguments or config; 1 when the run failed (the message names the cause).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from moe_rl.entrypoints.rl import _log, install_task_dump, write_summary
from moe_rl.runtime.checks import UsageError, check_supported
from moe_rl.runtime.run_dir import RunPaths

__all__ = ["main", "parse_engine_url", "load_cluster_config", "check_engine_roles",
           "build_tokenizer", "build_task", "build_client", "check_fresh_run_dir", "run_cluster_orchestrator"]

ROLES = ("engine", "prefill", "decode")


# ------------------------------------------------------------------------------------------------ arguments
def parse_engine_url(text: str) -> tuple[str, str]:
    """``"ROLE=URL"`` -> ``(role, url)`` (``ROLE`` in ``engine``/``prefill``/``decode``, ``URL`` ``http(s)://...``).

    Raises:
        argparse.ArgumentTypeError: no ``=``, an unknown role, or a URL that is not ``http://`` / ``https://``.
    """
    role, sep, url = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--engine-url {text!r} must be ROLE=URL, e.g. engine=http://node3:8000")
    if role not in ROLES:
        raise argparse.ArgumentTypeError(f"--engine-url {text!r}: role {role!r} must be one of {list(ROLES)}")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise argparse.ArgumentTypeError(f"--engine-url {text!r}: URL {url!r} must start with http:// or https://")
    return role, url.rstrip("/")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_rl.entrypoints.cluster_orchestrator",
                                description="Orchestrator of a moe-rl cluster run (started by the sbatch script).")
    p.add_argument("--config", required=True, type=Path, help="the resolved ClusterConfig (configs/cluster.json)")
    p.add_argument("--run-dir", required=True, type=Path, help="the run directory shared with the trainer")
    p.add_argument("--inference-url", required=True, help="the router / P/D proxy, http://host:port")
    p.add_argument("--engine-url", action="append", default=[], type=parse_engine_url, metavar="ROLE=URL",
                   help="one per engine replica API server (ROLE: engine, prefill or decode); repeat")
    return p


# ------------------------------------------------------------------------------------------------ checks
def load_cluster_config(path: Path):
    """Read and validate a ``ClusterConfig`` JSON file.

    Raises:
        UsageError: the file is missing, not JSON, or fails validation (one line per bad field).
    """
    from pydantic import ValidationError

    from moe_rl.config import format_validation_error
    from moe_rl.launch.config import ClusterConfig

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--config {str(path)!r} cannot be read: {exc}") from exc
    try:
        return ClusterConfig.model_validate_json(text)
    except ValidationError as exc:
        raise UsageError(f"--config {str(path)!r} is not a valid ClusterConfig:\n{format_validation_error(exc)}") from exc


def check_engine_roles(cfg, engine_urls: list[tuple[str, str]]) -> None:
    """Check ``--engine-url`` against ``inference``: colocated takes only ``engine`` replicas, disaggregated only
    ``prefill`` and ``decode``; one URL per replica of each group, no URL twice.

    Raises:
        UsageError: the roles or counts disagree with the config (the message lists what was given and expected).
    """
    given: dict[str, int] = {}
    for role, _ in engine_urls:
        given[role] = given.get(role, 0) + 1
    expected = {role: grp.replicas for role, grp in cfg.inference.groups()}
    if given != expected:
        raise UsageError(
            f"--engine-url gives {given or 'no engines'} but inference.mode={cfg.inference.mode!r} has replicas "
            f"{expected}; pass one --engine-url ROLE=URL per replica API server")
    urls = [u for _, u in engine_urls]
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise UsageError(f"--engine-url repeats {dup}; each replica API server once")


# ------------------------------------------------------------------------------------------------ parts
def build_tokenizer(cfg):
    """The task tokenizer: ``task.tokenizer = "char"`` -> ``CharTokenizer(task.alphabet)``; ``"checkpoint"`` ->
    ``HfTokenizer(model.inference_checkpoint)`` (the tokenizer the engines serve).

    Raises:
        ImportError: ``transformers`` missing for ``"checkpoint"``.
        ValueError: the checkpoint's tokenizer cannot be loaded or has no EOS token.
    """
    from moe_rl.envs import CharTokenizer, HfTokenizer

    if cfg.task.tokenizer == "char":
        return CharTokenizer(cfg.task.alphabet)
    return HfTokenizer(cfg.model.inference_checkpoint, trust_remote_code=cfg.inference.trust_remote_code)


def build_task(cfg, tok) -> Any:
    """The environment: ``task.env = "module:factory"`` (or its older spelling ``task.factory``), built as
    ``factory(tok, **task.env_args)`` by :func:`moe_rl.envs.load_env`; else the built-in task of the ``task.env``
    table (``moe_rl.envs.make_task``).

    Raises:
        UsageError: the factory cannot be loaded or built, or returned no environment (the message names the
            option and the part that failed).
    """
    from moe_rl.envs import make_task
    from moe_rl.envs.loader import EnvLoadError, load_env

    spec = cfg.task.env_spec
    if spec is None:
        return make_task(cfg.task.env, tok)
    option, name = spec
    try:
        return load_env(name, tok, cfg.task.env_args, option=option, args_option="task.env_args")
    except EnvLoadError as exc:
        raise UsageError(str(exc)) from exc


def build_client(cfg, inference_url: str, engine_urls: list[tuple[str, str]]):
    """The orchestrator's engine client.

    Colocated: a ``RoutedClient`` over one ``VllmClient`` per ``engine`` URL (``RequestRouter`` with the default
    score policy; ``return_routed_experts = trainer.router_replay``). Disaggregated: a ``ProxiedClient``
    (generation through ``inference_url``, engine-wide calls to every replica, named ``<role>.<i>``).
    """
    from moe_rl.inference import ProxiedClient, RequestRouter, RoutedClient, RouterConfig, VllmClient

    model, timeout = cfg.inference.served_model_name, cfg.orchestrator.request_timeout_s
    if cfg.inference.mode == "disaggregated":
        counters: dict[str, int] = {}
        named = []
        for role, url in engine_urls:
            named.append((f"{role}.{counters.get(role, 0)}", url))
            counters[role] = counters.get(role, 0) + 1
        return ProxiedClient(inference_url, named, model=model, timeout_s=timeout)
    clients = [VllmClient(url, model=model, timeout_s=timeout, return_routed_experts=cfg.trainer.router_replay)
               for _, url in engine_urls]
    return RoutedClient(clients, RequestRouter(RouterConfig(), num_engines=len(clients)))


def check_fresh_run_dir(paths: RunPaths) -> None:
    """The version-0 assumptions of the orchestrator: no weight version >= 1, batch, trainer step report or
    metrics of an earlier run in ``paths`` (the trainer starts first, but writes nothing before batch 0 exists;
    ``weights/step_0`` is tolerated: version 0 is the engines' start checkpoint and is never read here).

    Raises:
        UsageError: leftovers found (the message lists them; use a fresh run directory).
    """
    from moe_rl.weights.filesystem import latest_published

    found = []
    latest = latest_published(paths.weights)
    if latest is not None and latest >= 1:
        found.append(f"weights/step_{latest}")
    announce = paths.weights / "announce"
    found += [str(p.relative_to(paths.root)) for p in sorted(announce.glob("*.json"))[:3]] if announce.is_dir() else []
    for d, pattern in ((paths.batches, "step_*"), (paths.trainer, "step_*.json")):
        found += [str(p.relative_to(paths.root)) for p in sorted(d.glob(pattern))[:3]] if d.is_dir() else []
    found += [p.name for p in (paths.metrics, paths.engine_events, paths.root / "summary.json") if p.exists()]
    if found:
        raise UsageError(f"--run-dir {paths.root} holds files of an earlier run ({found}); the orchestrator starts "
                         "at version 0 and would mix them in. Use a fresh run directory")


def token_version_report(client) -> dict:
    """How per-token policy versions were known: tracked by each engine client (colocated: completions left
    unknown counted), or not tracked behind a P/D proxy (every completion counted)."""
    if hasattr(client, "completions_without_versions"):
        return {"tracked": False, "completions_without_versions": client.completions_without_versions,
                "rule": "every token aged from its rollout's start version (behind the P/D proxy)"}
    engines = getattr(client, "clients", [client])
    return {"tracked": True, "completions_unknown": sum(c.versions.unknown for c in engines),
            "tracking_errors": [c.token_versions_error for c in engines if c.token_versions_error]}


# ------------------------------------------------------------------------------------------------ run
async def _orchestrate(cfg, paths: RunPaths, task: Any, client) -> dict:
    from moe_rl.runtime.orchestrator import Orchestrator

    install_task_dump(paths.logs / "orchestrator_tasks.txt")

    def on_step(rec: dict) -> None:
        _log(f"step {rec['step']}: reward {rec['reward_mean']:.3f} mismatch_kl {rec['mismatch_kl']:.2e} "
             f"staleness_max {rec['staleness_max']} engine_version {rec['engine_version']}")

    async with client:
        if not await client.health():
            raise RuntimeError("an engine replica (or the proxy) does not answer /health; see its log")
        served = await client.weight_version()
        if served != 0:
            raise RuntimeError(f"the engines serve weight version {served}, not 0: they must be fresh servers of "
                               "model.inference_checkpoint (restart them with the run)")
        orch = Orchestrator(cfg.orchestrator, task, client, paths, cfg.max_steps, seed=cfg.seed, run_id=cfg.name,
                            weight_dtype=cfg.weights.dtype, on_step=on_step, weight_transport=cfg.weights.kind)
        summary = await orch.run()
        summary["token_versions"] = token_version_report(client)
    return summary


def run_cluster_orchestrator(cfg, run_dir: Path, inference_url: str, engine_urls: list[tuple[str, str]]) -> dict:
    """Check ``cfg`` and the arguments, run the orchestrator to ``cfg.max_steps`` and write the run's report.

    Returns:
        The summary (also ``run_dir/summary.json``).

    Raises:
        UsageError: unsupported settings, engine URLs that disagree with the config, or a used run directory.
        Exception: the orchestrator failed (engine errors, trainer stall past ``orchestrator.stall_timeout_s``).
    """
    check_supported(cfg)
    check_engine_roles(cfg, engine_urls)
    paths = RunPaths(Path(run_dir).resolve())
    paths.root.mkdir(parents=True, exist_ok=True)
    check_fresh_run_dir(paths)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.weights.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(cfg)
    task = build_task(cfg, tok)
    client = build_client(cfg, inference_url, engine_urls)
    t0 = time.monotonic()
    _log(f"orchestrator: {cfg.inference.mode} inference, {len(engine_urls)} engine replicas, {cfg.max_steps} steps, "
         f"run dir {paths.root}")
    summary = asyncio.run(_orchestrate(cfg, paths, task, client))
    return write_summary(paths, summary, {
        "total_wall_s": time.monotonic() - t0,
        "cluster": {"name": cfg.name, "mode": cfg.inference.mode, "inference_url": inference_url,
                    "engines": [f"{r}={u}" for r, u in engine_urls], "weights": cfg.weights.kind},
    })


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status (0 ok, 2 bad arguments / config, 1 run failed)."""
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed the message
        return int(exc.code or 0)
    try:
        cfg = load_cluster_config(args.config)
        summary = run_cluster_orchestrator(cfg, args.run_dir, args.inference_url.rstrip("/"), args.engine_url)
    except UsageError as exc:
        print(f"cluster_orchestrator: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001 - every failure is reported by cause and exits non-zero
        print(f"cluster_orchestrator: run failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    _log(f"done: {summary['steps']} steps, summary {Path(args.run_dir) / 'summary.json'}: "
         + json.dumps({k: summary[k] for k in ("rollouts_started", "rollouts_trained", "rollouts_dropped",
                                               "rollouts_withheld", "engine_errors")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
