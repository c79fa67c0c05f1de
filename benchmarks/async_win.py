"""The async win, measured: real ``moe-rl rl`` runs of the agentic recipe (vLLM CPU engine + torchrun trainer +
calculator tool environment with a heavy tail) at several ``max_off_policy_steps``, each over the same wall budget,
beside the pipeline simulator's prediction from the inputs each run measured.

For every seed, the first setting's run trains the recipe's SFT warm-up (cached in ``<run>/sft``); its ``sft/`` is
copied into every other setting's run directory of that seed before it starts, so all settings of a seed start RL
from the same warm-up checkpoint (``moe-rl rl`` reuses a cache whose key matches: the key covers the model, the
environment, the SFT settings and the seed, not the orchestrator). Each run gets ``--max-steps 100000`` and
``--trainer.checkpoint-every 0`` (no checkpoint writes inside the budget) and is stopped with SIGTERM (the launcher
stops its processes and writes ``summary.json``) ``--budget-s`` seconds after its RL pipeline started (the first
line of ``engine_events.jsonl``, written when the orchestrator starts; engine and trainer start-up and the SFT
warm-up are outside the budget).

Measured per run, over the window from the first trainer step that ended at least ``--warmup-s`` seconds into
the RL pipeline (pipeline fill and the first weight updates excluded) to the last step that ended within the
budget (``metrics.jsonl``; ``time_s`` counts from the orchestrator's start):

- trained samples/hour = ``rollouts_trained`` gained over the window's steps / the window's seconds * 3600;
- trainer idle fraction = sum of ``trainer_idle_s`` / sum of (``trainer_idle_s`` + ``trainer_busy_s``) over the
  window's steps (the time the trainer waited for its batch / its time), and the same idle over the window's wall;
- the simulator inputs (``moe_rl.rl.simulator.fit_from_run``): the durations of the groups started inside the
  window no later than its end minus the longest logged group (so that a long group still running at the stop
  cannot be missing; synchronous runs: no such cut, as no group of theirs runs past a step; ``rollouts.jsonl``; all logged groups when that leaves fewer than one batch's), trainer step times (``trainer/step_*.json``: compute + publish), weight-reload and watcher times
  (``engine_events.jsonl``), and, for the record, the engine concurrency (groups in flight, time-weighted).

Predicted per run: ``simulate_pipeline`` with that run's orchestrator settings and its measured distributions
(empirical resampling), ``--sim-steps`` steps, ``--sim-seeds`` seeds averaged; its steady-state rate is trained
samples over steps ``1..`` / their seconds (the fill before step 0 excluded, like the measured window). Also
predicted: every setting from the synchronous run's inputs of the same seed (what one would forecast before
running async), and the GPU-like scenario of ``benchmarks/test_bench_async.py`` (its inputs are printed).

Run (a quiet machine; every run needs both cores)::

    .venv/bin/python benchmarks/async_win.py --budget-s 90 --plot docs/img/async_win_cpu2core.png

``--analyze-only`` re-reads the run directories of an earlier invocation (same ``--work-dir``) without running.
Writes ``benchmarks/results/async_win_cpu2core_<date>.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _bench_common import REPO, cpu_provenance, load_average, tree_dirty

from moe_rl.entrypoints.rl import RUN_MARKER
from moe_rl.rl.simulator import PipelineSimConfig, empirical_group_lengths, fit_from_run, simulate_pipeline

RECIPE = "recipes/agentic_cpu/rl.toml"
GOAL_SPEEDUP, GOAL_IDLE, GOAL_SIM_REL = 3.0, 0.10, 0.20


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}={text!r} must be comma-separated integers, e.g. 0,1,4,8") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"{name}={text!r} must list at least one integer >= 0")
    return vals


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by linear interpolation between order statistics."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------------- running
def run_cmd(recipe: str, run_dir: Path, seed: int, k: int, extra: list[str]) -> list[str]:
    """The ``moe-rl rl`` command of one setting (stopped by the budget, not by ``--max-steps``); ``extra``: more
    ``--section.field value`` flags for every run."""
    exe = Path(sys.executable).with_name("moe-rl")
    return [str(exe), "rl", "@", recipe, "--output-dir", str(run_dir), "--seed", str(seed), "--max-steps", "100000",
            "--orchestrator.max-off-policy-steps", str(k), "--trainer.checkpoint-every", "0", *extra, "--overwrite"]


def run_one(cmd: list[str], run_dir: Path, budget_s: float, start_timeout_s: float) -> dict:
    """Start ``cmd``, wait for its RL pipeline to start, let it run ``budget_s`` seconds, stop it with SIGTERM.

    Returns:
        ``{"exit_code", "launch_to_rl_s" (SFT + start-up), "stopped_by", "load_average"}``, the load average
        sampled every second of the budget (1-minute values: mean, max).

    Raises:
        RuntimeError: the run exited before its pipeline started or ran past the budget (its log tail).
    """
    log_path = run_dir.with_name(run_dir.name + ".log")  # beside it: moe-rl refuses a run dir holding other files
    log = log_path.open("w")
    t_launch, launched_at = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    events = run_dir / "engine_events.jsonl"
    t_rl = None
    loads: list[float] = []
    stopped_by = "exit"
    try:
        while proc.poll() is None:
            now = time.monotonic()
            # this run's first engine event (an earlier run's file stays until --overwrite deletes it)
            if t_rl is None and events.exists() and events.stat().st_mtime >= launched_at and events.stat().st_size:
                t_rl = now
            if t_rl is None and now - t_launch > start_timeout_s:
                stopped_by = "start_timeout"
                break
            if t_rl is not None:
                loads.append(load_average()[0])
                if now - t_rl >= budget_s:
                    stopped_by = "budget"
                    break
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher stops its own children and writes summary.json
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=120)
        log.close()
    if t_rl is None or stopped_by != "budget":
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)}: stopped by {stopped_by} (exit {proc.returncode}) before its budget "
                           f"of {budget_s} s ran out; launcher log tail:\n{tail}")
    return {"exit_code": proc.returncode, "launch_to_rl_s": round(t_rl - t_launch, 1), "stopped_by": stopped_by,
            "load_average_1min": {"mean": round(statistics.fmean(loads), 2), "max": max(loads)} if loads else None}


# ---------------------------------------------------------------------------------------------- analysis
def measure(run_dir: Path, budget_s: float, warmup_s: float) -> dict:
    """Trained samples/hour, trainer idle and the window's other figures of one finished (stopped) run.

    Raises:
        ValueError: fewer than two trainer steps ended in ``[warmup_s, budget_s]`` (no window to measure):
            raise ``--budget-s`` or lower ``--warmup-s``.
    """
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    inside = [m for m in metrics if warmup_s <= m["time_s"] <= budget_s]
    if len(inside) < 2:
        raise ValueError(f"{run_dir}: {len(inside)} trainer steps ended between warmup_s={warmup_s} and "
                         f"budget_s={budget_s} (steps ended at {[round(m['time_s'], 1) for m in metrics]}); the "
                         "window needs two: raise --budget-s or lower --warmup-s")
    a, steps = inside[0], inside[1:]
    b = steps[-1]
    window_s = b["time_s"] - a["time_s"]
    idle = sum(m["trainer_idle_s"] for m in steps)
    busy = sum(m["trainer_busy_s"] for m in steps)
    started = b["rollouts_started"] - a["rollouts_started"]
    stale = {}
    for m in steps:
        for s, n in m["staleness_counts"].items():
            stale[s] = stale.get(s, 0) + n
    return {
        "window_s": [round(a["time_s"], 2), round(b["time_s"], 2)], "steps_in_window": len(steps),
        "steps_total": len(metrics), "first_step_end_s": round(metrics[0]["time_s"], 2),
        "trained_samples": b["rollouts_trained"] - a["rollouts_trained"],
        "trained_samples_per_hour": (b["rollouts_trained"] - a["rollouts_trained"]) / window_s * 3600.0,
        "trainer_idle_frac": idle / max(1e-12, idle + busy),
        "trainer_idle_frac_of_wall": idle / window_s,
        "dropped_frac": (b["rollouts_dropped"] - a["rollouts_dropped"]) / max(1, started),
        "staleness_counts": dict(sorted(stale.items(), key=lambda kv: int(kv[0]))),
        "reward_mean": statistics.fmean(m["reward_mean"] for m in steps),
    }


def concurrency(rollouts: list[dict], group_size: int) -> dict:
    """Groups (and sequences = groups x ``group_size``) in flight on the engine, time-weighted over the span from
    the first start to the last finish of the logged groups; with the maximum."""
    edges = sorted([(r["t_start"], 1) for r in rollouts] + [(r["t_end"], -1) for r in rollouts])
    area = level = peak = 0
    for (t, d), (t_next, _) in zip(edges, edges[1:], strict=False):
        level += d
        peak = max(peak, level)
        area += level * (t_next - t)
    span = edges[-1][0] - edges[0][0] if edges else 0.0
    mean = area / span if span > 0 else 0.0
    return {"groups_mean": mean, "groups_max": peak, "sequences_mean": mean * group_size}


def inputs_summary(fit: dict, run_dir: Path) -> dict:
    """The simulator inputs of one run, summarized (the distributions themselves are in the run directory)."""
    d = fit["group_durations_s"]
    episodes = [e for r in _read_jsonl(run_dir / "rollouts.jsonl") for e in r.get("episode_s", [])]
    out = {"groups_in_window": len(d), "groups_logged": len(_read_jsonl(run_dir / "rollouts.jsonl")), "group_duration_s": {q: _quantile(d, p) for q, p in
                                                  (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))},
           "train_step_s_median": statistics.median(fit["train_step_s"]) if fit["train_step_s"] else None,
           "train_steps": len(fit["train_step_s"]),
           "weight_update_s_median": statistics.median(fit["weight_update_s"]) if fit["weight_update_s"] else 0.0,
           "watcher_busy_s_median": statistics.median(fit["watcher_busy_s"]) if fit["watcher_busy_s"] else 0.0,
           "cross_version_overtakes": fit["measured"]["cross_version_overtakes"],
           "engine_concurrency": concurrency(_read_jsonl(run_dir / "rollouts.jsonl"), fit["config"]["group_size"])}
    out["group_duration_p99_over_p50"] = out["group_duration_s"]["p99"] / max(1e-12, out["group_duration_s"]["p50"])
    if episodes:
        out["episode_s"] = {"p50": _quantile(episodes, 0.5), "p99": _quantile(episodes, 0.99), "n": len(episodes)}
    return out


def simulate_fit(fit: dict, k: int | None, steps: int, seeds: list[int]) -> dict:
    """Simulate the pipeline from a run's fitted inputs (``fit_from_run``), at ``max_off_policy_steps = k``
    (None = the run's own), ``steps`` trainer steps per seed, averaged over ``seeds``.

    The steady-state rate is trained samples of steps ``1..`` / (trainer idle + busy over steps ``1..``): the
    time from the end of step 0 to the end of the last step, as in the measured window.

    Raises:
        ValueError: the run logged no trainer step after step 0 or no finished group (nothing to resample).
    """
    if not fit["train_step_s"] or not fit["group_durations_s"]:
        raise ValueError(f"the run has {len(fit['train_step_s'])} trainer step times after step 0 and "
                         f"{len(fit['group_durations_s'])} group durations; the simulator needs at least one of each")
    train_s, reload_s = fit["train_step_s"], fit["weight_update_s"] or [0.0]
    probe_s = fit["watcher_busy_s"] or [0.0]
    in_order = fit["measured"]["cross_version_overtakes"] <= 0.1 * len(fit["group_durations_s"])  # as compare_with_run
    config = {**fit["config"], "max_steps": steps}
    if k is not None:
        config["max_off_policy_steps"] = k
    rates, idles, drops = [], [], []
    for seed in seeds:
        r = simulate_pipeline(
            PipelineSimConfig(**config, seed=seed, tokens_per_s=1.0, in_order_versions=in_order),
            empirical_group_lengths(fit["group_durations_s"], tokens_per_s=1.0),
            train_step_time=lambda g: train_s[g.randrange(len(train_s))],
            weight_update_time=lambda g: reload_s[g.randrange(len(reload_s))],
            watcher_busy_time=lambda g: probe_s[g.randrange(len(probe_s))])
        per_step = r.trained_samples / r.steps
        rates.append(per_step * (r.steps - 1) / max(1e-12, r.trainer_idle_s + r.trainer_busy_s) * 3600.0)
        idles.append(r.trainer_idle_frac)
        drops.append(r.dropped_frac)
    return {"max_off_policy_steps": config["max_off_policy_steps"], "in_order_versions": in_order,
            "trained_samples_per_hour": statistics.fmean(rates), "trainer_idle_frac": statistics.fmean(idles),
            "dropped_frac": statistics.fmean(drops), "per_seed_samples_per_hour": rates}


def gpu_like(settings: list[int]) -> dict:
    """The GPU-like scenario of ``benchmarks/test_bench_async.py`` (inputs stated there, repeated in the output):
    speedup and idle per ``max_off_policy_steps`` (admission ``inflight``, the recipe's default)."""
    import test_bench_async as tba

    return {"inputs": {**tba.BASE, "length_lognormal_median_tokens": tba.MEDIAN, "length_lognormal_sigma": tba.SIGMA,
                       "seeds": tba.SEEDS, "admission": "inflight", "source": "benchmarks/test_bench_async.py"},
            "rows": [tba._mean("inflight", k) for k in settings]}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(1e-12, abs(b))


def analyze(work: Path, settings: list[int], seeds: list[int], budget_s: float, warmup_s: float, sim_steps: int,
            sim_seeds: list[int], runs_info: dict) -> dict:
    rows = []
    for seed in seeds:
        sync_fit = None
        for k in settings:
            run_dir = work / f"seed{seed}_off{k}"
            fit = fit_from_run(run_dir)
            meas = measure(run_dir, budget_s, warmup_s)
            # inputs from the measured window only (the start-up and pipeline fill excluded, as from the rates),
            # from groups started early enough to have finished by the window's end whatever their length up to
            # the longest logged (a group still running when the run stopped is not logged: no bias to short ones);
            # synchronous: no cut, every group started in the window belongs to a batch trained in it
            logged = _read_jsonl(run_dir / "rollouts.jsonl")
            cut = meas["window_s"][1] - (0.0 if k == 0 else max(r["t_end"] - r["t_start"] for r in logged))
            window = [r["t_end"] - r["t_start"] for r in logged if meas["window_s"][0] <= r["t_start"] <= cut]
            durations_from = "all logged groups"
            if len(window) >= fit["config"]["batch_size"] // fit["config"]["group_size"]:
                fit["group_durations_s"], durations_from = window, f"groups started in [{meas['window_s'][0]}, {cut:.2f}] s"
            if k == 0:
                sync_fit = fit
            sft_json = run_dir / "sft" / "sft.json"
            sft = {key: v for key, v in json.loads(sft_json.read_text()).items()
                   if key in ("key", "steps", "seconds", "pass_rate", "reached")} if sft_json.exists() else None
            sim = simulate_fit(fit, None, sim_steps, sim_seeds)
            row = {"seed": seed, "max_off_policy_steps": k, "run_dir": str(run_dir),
                   **runs_info.get(run_dir.name, {}), "measured": meas, "sft_warmup": sft,
                   "inputs": {**inputs_summary(fit, run_dir), "durations_from": durations_from},
                   "simulated": sim,
                   "rel_err": {"trained_samples_per_hour": rel(sim["trained_samples_per_hour"],
                                                               meas["trained_samples_per_hour"]),
                               "trainer_idle_frac": rel(sim["trainer_idle_frac"], meas["trainer_idle_frac"])},
                   "abs_err_trainer_idle_frac": abs(sim["trainer_idle_frac"] - meas["trainer_idle_frac"])}
            if sync_fit is not None and k != 0:
                row["simulated_from_sync_inputs"] = simulate_fit(sync_fit, k, sim_steps, sim_seeds)
            rows.append(row)
    summary = []
    for k in settings:
        rk = [r for r in rows if r["max_off_policy_steps"] == k]
        m_rate = statistics.fmean(r["measured"]["trained_samples_per_hour"] for r in rk)
        s_rate = statistics.fmean(r["simulated"]["trained_samples_per_hour"] for r in rk)
        summary.append({"max_off_policy_steps": k, "seeds": [r["seed"] for r in rk],
                        "measured_samples_per_hour": m_rate, "simulated_samples_per_hour": s_rate,
                        "measured_idle_frac": statistics.fmean(r["measured"]["trainer_idle_frac"] for r in rk),
                        "simulated_idle_frac": statistics.fmean(r["simulated"]["trainer_idle_frac"] for r in rk)})
    base = next((s for s in summary if s["max_off_policy_steps"] == 0), None)
    for s in summary:
        if base is not None:
            s["measured_speedup_vs_sync"] = s["measured_samples_per_hour"] / base["measured_samples_per_hour"]
            s["simulated_speedup_vs_sync"] = s["simulated_samples_per_hour"] / base["simulated_samples_per_hour"]
    top = max(settings)
    at_top = next(s for s in summary if s["max_off_policy_steps"] == top)
    goal = {"setting": top, "speedup_ge_3x": at_top.get("measured_speedup_vs_sync", float("nan")) >= GOAL_SPEEDUP,
            "idle_lt_10pct": at_top["measured_idle_frac"] < GOAL_IDLE,
            "sim_within_20pct_every_point": all(r["rel_err"]["trained_samples_per_hour"] <= GOAL_SIM_REL
                                                and r["rel_err"]["trainer_idle_frac"] <= GOAL_SIM_REL for r in rows)}
    return {"rows": rows, "summary": summary, "goal": goal, "gpu_like": gpu_like(settings)}


# ---------------------------------------------------------------------------------------------- reporting
def markdown(res: dict) -> str:
    p = res["provenance"]
    out = [f"Agentic recipe (`{RECIPE}`), {p['cpu']} ({p['cpus_usable']} usable CPUs), budget {p['budget_s']:.0f} s per "
           f"run, window from the first step ending after {p['warmup_s']:.0f} s to the budget; commit "
           f"`{p['commit'][:12]}` (tree dirty: {p['tree_dirty']}).", "",
           "| seed | max_off_policy_steps | steps | samples/h measured | simulated | err | idle measured | "
           "simulated | dropped | group s p50 / p99 | train step s | groups in flight | load avg |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        m, s, i = r["measured"], r["simulated"], r["inputs"]
        la = r.get("load_average_1min") or {}
        out.append(f"| {r['seed']} | {r['max_off_policy_steps']} | {m['steps_in_window']} | "
                   f"{m['trained_samples_per_hour']:.0f} | {s['trained_samples_per_hour']:.0f} | "
                   f"{r['rel_err']['trained_samples_per_hour']:.0%} | {m['trainer_idle_frac']:.1%} | "
                   f"{s['trainer_idle_frac']:.1%} | {m['dropped_frac']:.0%} | {i['group_duration_s']['p50']:.1f} / "
                   f"{i['group_duration_s']['p99']:.1f} | {i['train_step_s_median']:.2f} | "
                   f"{i['engine_concurrency']['groups_mean']:.1f} | {la.get('mean', float('nan')):.1f} |")
    out += ["", "| max_off_policy_steps | samples/h measured (mean) | speedup | simulated | speedup | idle measured | "
            "simulated |", "|---|---|---|---|---|---|---|"]
    for s in res["summary"]:
        out.append(f"| {s['max_off_policy_steps']} | {s['measured_samples_per_hour']:.0f} | "
                   f"{s.get('measured_speedup_vs_sync', float('nan')):.2f}x | {s['simulated_samples_per_hour']:.0f} | "
                   f"{s.get('simulated_speedup_vs_sync', float('nan')):.2f}x | {s['measured_idle_frac']:.1%} | "
                   f"{s['simulated_idle_frac']:.1%} |")
    fs = [r for r in res["rows"] if "simulated_from_sync_inputs" in r]
    if fs:
        sync_rate = {r["seed"]: r["simulated"]["trained_samples_per_hour"] for r in res["rows"]
                     if r["max_off_policy_steps"] == 0}
        out += ["", "Forecast from each seed's synchronous run alone (its group durations replayed unchanged, i.e. an "
                "engine that does not slow down with more groups in flight): " + ", ".join(
                    f"seed {r['seed']} max_off_policy_steps={r['max_off_policy_steps']}: "
                    f"{r['simulated_from_sync_inputs']['trained_samples_per_hour'] / sync_rate[r['seed']]:.2f}x, idle "
                    f"{r['simulated_from_sync_inputs']['trainer_idle_frac']:.1%}" for r in fs) + "."]
    g = res["goal"]
    out += ["", f"Goal at max_off_policy_steps={g['setting']}: >= 3x samples/hour: {g['speedup_ge_3x']}; trainer idle "
            f"< 10%: {g['idle_lt_10pct']}; simulator within 20% of every measured point: "
            f"{g['sim_within_20pct_every_point']}."]
    gl = res["gpu_like"]
    inp = gl["inputs"]
    out += ["", f"Simulator on GPU-like inputs ({inp['source']}): lognormal completion lengths (median "
            f"{inp['length_lognormal_median_tokens']} tokens, sigma {inp['length_lognormal_sigma']}), "
            f"{inp['inference_slots']} engine slots at {inp['tokens_per_s']} tokens/s, {inp['train_step_s']} s "
            f"trainer steps of {inp['batch_size']} samples, {inp['weight_update_s']} s weight update: " +
            ", ".join(f"max_off_policy_steps={r['max_off_policy_steps']}: {r['speedup_vs_sync']:.2f}x, idle "
                      f"{r['trainer_idle_frac']:.1%}" for r in gl["rows"]) + "."]
    return "\n".join(out) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s["max_off_policy_steps"] for s in res["summary"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in res["rows"]:
        k = r["max_off_policy_steps"]
        ax1.plot(k, r["measured"]["trained_samples_per_hour"], "o", color="C0", alpha=0.5)
        ax2.plot(k, 100 * r["measured"]["trainer_idle_frac"], "o", color="C0", alpha=0.5)
    ax1.plot(settings, [s["measured_samples_per_hour"] for s in res["summary"]], "-", color="C0", label="measured")
    ax1.plot(settings, [s["simulated_samples_per_hour"] for s in res["summary"]], "--", marker="x", color="C1",
             label="simulated (run's inputs)")
    ax2.plot(settings, [100 * s["measured_idle_frac"] for s in res["summary"]], "-", color="C0", label="measured")
    ax2.plot(settings, [100 * s["simulated_idle_frac"] for s in res["summary"]], "--", marker="x", color="C1",
             label="simulated")
    ax2.axhline(100 * GOAL_IDLE, color="grey", ls=":", lw=0.8)
    ax1.set(xlabel="max_off_policy_steps", ylabel="trained samples / hour", xscale="symlog", ylim=(0, None))
    ax2.set(xlabel="max_off_policy_steps", ylabel="trainer idle (%)", xscale="symlog", ylim=(0, 100))
    for ax in (ax1, ax2):
        ax.set_xticks(settings, [str(k) for k in settings])
    ax1.legend(fontsize=8)
    p = res["provenance"]
    fig.suptitle(f"agentic_cpu recipe, vLLM CPU + torchrun, {p['budget_s']:.0f} s per run, seeds {p['seeds']}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budget-s", type=float, default=70.0, help="RL wall seconds per run (default 70)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of each run excluded from the window (default: 20%% of --budget-s)")
    p.add_argument("--settings", default="0,1,4,8", help="max_off_policy_steps values (0 = synchronous)")
    p.add_argument("--seeds", default="0,1", help="run seeds (each its own SFT warm-up)")
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/async_win"), help="run directories go here")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/async_win_cpu2core_<date>.json; the .md beside it)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG")
    p.add_argument("--sim-steps", type=int, default=200, help="simulated trainer steps per seed (default 200)")
    p.add_argument("--sim-seeds", type=int, default=5)
    p.add_argument("--start-timeout-s", type=float, default=1800.0,
                   help="longest SFT warm-up + start-up before a run is given up (default 1800)")
    p.add_argument("--analyze-only", action="store_true", help="re-read the run directories in --work-dir")
    p.add_argument("moe_rl_flags", nargs="*", metavar="-- FLAG VALUE",
                   help="after --: more moe-rl rl flags for every run, e.g. -- --sft.eval-every 10")
    args = p.parse_args(argv)
    extra = args.moe_rl_flags
    if any(f.startswith("--orchestrator.max") or f in ("--seed", "--output-dir", "--max-steps") for f in extra):
        p.error(f"moe-rl flags {extra} set what this script sets per run (seed, output dir, max steps, "
                "max_off_policy_steps); give them through --seeds / --settings / --work-dir instead")
    try:
        settings, seeds = _ints(args.settings, "--settings"), _ints(args.seeds, "--seeds")
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if 0 not in settings:
        p.error(f"--settings={args.settings!r} must include 0: the synchronous run is the baseline of every speedup")
    if not args.budget_s > 0:
        p.error(f"--budget-s={args.budget_s} must be > 0 seconds")
    warmup_s = 0.2 * args.budget_s if args.warmup_s is None else args.warmup_s
    if not 0 <= warmup_s < args.budget_s:
        p.error(f"--warmup-s={warmup_s} must be >= 0 and < --budget-s={args.budget_s}")
    settings = [0] + sorted(k for k in set(settings) if k != 0)
    work = args.work_dir.resolve()
    info_path = work / "runs_info.json"
    runs_info: dict = json.loads(info_path.read_text()) if args.analyze_only and info_path.exists() else {}
    t_all = time.monotonic()
    if not args.analyze_only:
        work.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            sft_src = None
            for k in settings:
                run_dir = work / f"seed{seed}_off{k}"
                # an earlier run in run_dir is deleted by moe-rl's --overwrite, which keeps its sft/ cache (reused
                # when its key matches: a rerun of this script trains no warm-up again)
                if sft_src is not None:  # the same warm-up checkpoint for every setting of this seed
                    if (run_dir / "sft").exists():
                        shutil.rmtree(run_dir / "sft")
                    shutil.copytree(sft_src, run_dir / "sft")
                    (run_dir / RUN_MARKER).write_text((sft_src.parent / RUN_MARKER).read_text())
                cmd = run_cmd(args.recipe, run_dir, seed, k, extra)
                print(f"[async_win] seed {seed} max_off_policy_steps {k}: {' '.join(cmd)}", flush=True)
                t0 = time.monotonic()
                info = run_one(cmd, run_dir, args.budget_s, args.start_timeout_s)
                info.update(command=" ".join(cmd), total_s=round(time.monotonic() - t0, 1))
                runs_info[run_dir.name] = info
                info_path.write_text(json.dumps(runs_info, indent=1))
                print(f"[async_win]   done in {info['total_s']} s (SFT + start-up {info['launch_to_rl_s']} s, load "
                      f"average {info['load_average_1min']})", flush=True)
                if sft_src is None:
                    sft_src = run_dir / "sft"
    res = analyze(work, settings, seeds, args.budget_s, warmup_s, args.sim_steps, list(range(args.sim_seeds)),
                  runs_info)
    date = datetime.date.today().isoformat()
    res["provenance"] = cpu_provenance(
        tree_dirty=tree_dirty("moe_rl", "benchmarks/async_win.py", "benchmarks/_bench_common.py", args.recipe),
        command=" ".join([Path(sys.argv[0]).name if argv is None else "async_win.py", *(sys.argv[1:] if argv is None
                                                                                         else argv)]),
        recipe=args.recipe, moe_rl_flags=extra, budget_s=args.budget_s, warmup_s=warmup_s, settings=settings, seeds=seeds,
        sim_steps=args.sim_steps, sim_seeds=args.sim_seeds, work_dir=str(work),
        wall_s_all_runs=None if args.analyze_only else round(time.monotonic() - t_all, 1),
        torch_threads_env=os.environ.get("OMP_NUM_THREADS"))
    out = args.out or REPO / "benchmarks" / "results" / f"async_win_cpu2core_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    if args.plot:
        plot(res, args.plot)
    print(md)
    print(f"[async_win] wrote {out} and {out.with_suffix('.md')}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
