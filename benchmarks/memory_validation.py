"""Measured vs planned per-rank peak memory of a scaled-down GLM-5 training step (regenerates the table of
``docs/memory.md``).

Runs ``tests/distributed/_memory_dsa_worker.py`` on 4 gloo ranks (``ParallelDims(dp_shard=4 / cp, cp=cp)``) for
every scenario of :data:`GRID`: the real forward + backward + AdamW step through ``parallelize_model`` under
:class:`moe_rl.distributed.meter.LiveBytesMeter`, and compares each rank's peak with
:func:`moe_rl.distributed.memory.plan_memory` of the same inputs (:class:`moe_rl.distributed.memory.PlanInputs`).
Writes ``benchmarks/results/memory_validation_<date>.json`` (provenance: commit, torch, CPU, threads) and prints the
markdown table.

Usage: ``python benchmarks/memory_validation.py [--quick] [--out PATH]`` (about 1 minute per scenario on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench_common import commit, tree_dirty

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "distributed" / "_memory_dsa_worker.py"
WORLD = 4
LOSS_CHUNK = 128

GRID = (
    [dict(cp=cp, seq_len=s, dtype="float32", ac="full", attn_kernel="dense")
     for cp in (1, 2, 4) for s in (128, 256, 512, 1024)]
    + [dict(cp=cp, seq_len=s, dtype="bfloat16", ac="full", attn_kernel="chunked")
       for cp, s in ((1, 1024), (2, 512), (2, 1024), (4, 1024))]
)
QUICK = [dict(cp=1, seq_len=512, dtype="float32", ac="full", attn_kernel="dense"),
         dict(cp=2, seq_len=1024, dtype="bfloat16", ac="full", attn_kernel="chunked")]


def scenario_name(sc: dict) -> str:
    return f"cp{sc['cp']}_s{sc['seq_len']}_{sc['dtype']}_{sc['ac']}_{sc['attn_kernel']}"


def run_ranks(scenarios: list[dict], world: int, tmp: Path, timeout_s: float = 3600) -> dict[int, dict]:
    """Launch the worker on ``world`` gloo ranks; returns ``{rank: {name: peak bytes | traceback}}``."""
    (tmp / "scenarios.json").write_text(json.dumps(
        [dict(sc, name=scenario_name(sc), loss_chunk_tokens=LOSS_CHUNK) for sc in scenarios]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(tmp / "init"), str(tmp)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    out = {}
    for r in range(world):
        f = tmp / f"rank{r}.json"
        out[r] = json.loads(f.read_text()) if f.exists() else {"_log": logs[r][-3000:]}
    return out


def planned(sc: dict, world: int = WORLD):
    """The plan of one scenario, from the same inputs the worker runs."""
    sys.path.insert(0, str(WORKER.parent))
    from _memory_dsa_worker import ATTN_BACKEND, VALIDATION_CONFIG

    from moe_rl.distributed.memory import PlanInputs
    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig.tiny_debug(**VALIDATION_CONFIG, attn_backend=ATTN_BACKEND[sc["attn_kernel"]])
    return PlanInputs(cfg, ParallelDims(dp_shard=world // sc["cp"], cp=sc["cp"]), sc["seq_len"], 1, sc["dtype"],
                      sc["ac"], False, LOSS_CHUNK, sc["attn_kernel"]).plan()


def table(rows: list[dict]) -> str:
    lines = ["| cp | seq | dtype | DSA kernel | measured peak (MiB, max over ranks) | planned (MiB) | planned / measured "
             "| planned peak phase |", "|---:|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['cp']} | {r['seq_len']} | {r['dtype']} | {r['attn_kernel']} | {r['measured_max'] / 2**20:.2f} "
                     f"| {r['planned'] / 2**20:.2f} | {r['ratio']:.3f} | {r['phase']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two scenarios only")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    scenarios = QUICK if a.quick else GRID
    with tempfile.TemporaryDirectory() as d:
        res = run_ranks(scenarios, WORLD, Path(d))
    rows = []
    for sc in scenarios:
        name = scenario_name(sc)
        peaks = [res[r].get(name) for r in range(WORLD)]
        if not all(isinstance(p, int) for p in peaks):
            print(f"{name} failed: {peaks}", file=sys.stderr)
            return 1
        plan = planned(sc)
        rows.append(dict(sc, name=name, measured=peaks, measured_max=max(peaks), planned=plan.peak_bytes,
                         ratio=plan.peak_bytes / max(peaks), phase=plan.peak_phase, components=plan.components))
    doc = {
        "what": "per-rank peak live bytes (LiveBytesMeter) of 2 training steps of a scaled-down GLM-5 through "
                "parallelize_model on gloo ranks vs moe_rl.distributed.memory.plan_memory",
        "provenance": {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "commit": commit(), "dirty_tree": tree_dirty(), "torch": torch.__version__,
                       "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "threads_per_rank": 1, "world": WORLD,
                       "command": "python benchmarks/memory_validation.py" + (" --quick" if a.quick else "")},
        "rows": rows,
    }
    out = a.out or REPO / "benchmarks" / "results" / f"memory_validation_{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
