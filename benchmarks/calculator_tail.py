"""The rollout-duration tail of the calculator environment (``moe_rl.envs.calculator``), measured.

Plays groups of episodes through the environment runner (``moe_rl.envs.runner.run_group``) with the real tool
sandbox (one Python process per tool call) against a scripted engine: the expert policy (it calls the tool on
every step, then answers) with a fixed latency per model call (``--call-latency-s``, standing in for the
engine). Each episode's wall time is then ``turns * latency + its tool calls``; the step count per problem is
heavy-tailed (``P(steps >= m) = m ** -tail_alpha``, capped at ``max_ops``), and so are the durations.

Reports quantiles of episode wall time and model turns, and ``p99 / p50`` of each, in a JSON file with
provenance (commit, dirty tree, CPU count, load average at start and end)::

    python benchmarks/calculator_tail.py --groups 100 --out benchmarks/results/calculator_tail_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from _bench_common import commit, tree_dirty


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile by the nearest-rank rule (``xs`` sorted ascending, non-empty)."""
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))]


class ExpertEngine:
    """The expert policy behind an engine interface: reads the environment's last segment ``=<value>|<step>`` from
    the prompt and calls the tool on it (or answers when the step is ``.``), after ``latency`` seconds."""

    def __init__(self, tok, latency: float) -> None:
        self.tok = tok
        self.latency = latency
        self.calls = 0

    async def generate(self, prompt_ids, n, max_tokens, temperature, cache_salt=None, seed=None,
                       stop_token_ids=None):
        self.calls += 1
        await asyncio.sleep(self.latency)
        text = self.tok.decode(list(prompt_ids), stop_at_eos=False)
        value, step = text[text.rfind("=") + 1:].split("|")
        out = self.tok.encode(value, bos=False) + [self.tok.eos_id] if step == "." else self.tok.encode(
            f"[{value}{step[:-1]}]", bos=False)
        return [SimpleNamespace(token_ids=out, logprobs=[0.0] * len(out), finish_reason="stop") for _ in range(n)], 0


async def measure(args) -> dict:
    from moe_rl.envs import CharTokenizer, run_group
    from moe_rl.envs.calculator import make_env

    tok = CharTokenizer()
    env = make_env(tok, max_ops=args.max_ops, tail_alpha=args.tail_alpha, max_concurrent_tools=args.tools,
                   tool_wall_s=30.0)
    engine = ExpertEngine(tok, args.call_latency_s)
    rng = random.Random(args.seed)
    problems = [env.sample(rng) for _ in range(args.groups)]
    sem = asyncio.Semaphore(args.concurrency)

    async def group(i, p):
        async with sem:
            return await run_group(env, p, args.group_size, engine, seed=args.seed * 100_003 + i)

    t0 = time.monotonic()
    groups = await asyncio.gather(*(group(i, p) for i, p in enumerate(problems)))
    wall = time.monotonic() - t0
    eps = [e for g in groups for e in g]
    failed = [e.error for e in eps if e.error is not None]
    ok = [e for e in eps if e.error is None]
    walls = sorted(e.wall_s for e in ok)
    turns = sorted(float(e.result.metrics["turns"]) for e in ok)
    tool_s = [e.result.metrics["tool_s"] / max(1, e.result.metrics["tool_calls"]) for e in ok]
    stops: dict[str, int] = {}
    for e in ok:
        stops[e.result.stop_reason] = stops.get(e.result.stop_reason, 0) + 1

    def summary(xs: list[float]) -> dict:
        qs = {f"p{int(q * 100)}": quantile(xs, q) for q in (0.5, 0.9, 0.99)}
        return {**qs, "max": xs[-1], "mean": statistics.fmean(xs), "p99_over_p50": qs["p99"] / qs["p50"]}

    return {
        "episodes": len(eps), "failed_episodes": len(failed), "failures": failed[:5], "stop_reasons": stops,
        "reward_mean": statistics.fmean(e.result.reward for e in ok),
        "episode_wall_s": summary(walls), "turns": summary(turns),
        "tool_call_s_mean": statistics.fmean(tool_s), "engine_calls": engine.calls, "run_wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight at once")
    p.add_argument("--tools", type=int, default=4, help="tool processes at once (max_concurrent_tools)")
    p.add_argument("--call-latency-s", type=float, default=0.02, help="seconds per model call")
    p.add_argument("--max-ops", type=int, default=24)
    p.add_argument("--tail-alpha", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    load0 = os.getloadavg()
    res = asyncio.run(measure(args))
    out = {
        "benchmark": "calculator_tail",
        "provenance": {"commit": commit(), "dirty": tree_dirty("moe_rl/envs", "benchmarks/calculator_tail.py"),
                       "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
                       "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "result": res,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if res["failed_episodes"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
