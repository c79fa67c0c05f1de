"""Shared benchmark plumbing: provenance in the saved JSON and ratio-to-baseline reporting.

Run: ``.venv/bin/pytest benchmarks --benchmark-json benchmarks/results/<theme>_<hardware>_<date>.json``.
Each benchmark group holds one ``baseline`` entry (``extra_info["role"] == "baseline"``); the terminal
summary and the JSON get every entry's median time as a ratio to that baseline, measured in the same run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

# benchmarks/_bench_common.py (provenance, timing) is imported as `from _bench_common import ...`.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import commit  # noqa: E402


def _ratios(benchmarks: list[dict]) -> list[tuple[str, str, float]]:
    base: dict[str, float] = {}
    for b in benchmarks:
        if b["extra_info"].get("role") == "baseline":
            base[b["group"]] = b["stats"]["median"]
    out = []
    for b in benchmarks:
        if b["group"] in base:
            out.append((b["group"], b["name"], b["stats"]["median"] / base[b["group"]]))
    return out


def pytest_benchmark_update_json(config, benchmarks, output_json):
    import torch

    output_json["moe_rl_provenance"] = {
        "commit": commit(),
        "machine": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    ratios = _ratios(output_json["benchmarks"])
    for b in output_json["benchmarks"]:
        for group, name, r in ratios:
            if b["group"] == group and b["name"] == name:
                b["extra_info"]["ratio_to_baseline"] = r


def pytest_terminal_summary(terminalreporter):
    session = terminalreporter.config._benchmarksession if hasattr(terminalreporter.config, "_benchmarksession") else None
    if session is None or not session.benchmarks:
        return
    rows = [{"group": b.group, "name": b.name, "extra_info": b.extra_info, "stats": {"median": b.stats.median}}
            for b in session.benchmarks]
    terminalreporter.write_sep("-", "median time / baseline (same run)")
    for group, name, r in _ratios(rows):
        terminalreporter.write_line(f"{group:40s} {name:60s} {r:6.2f}x")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextlib.contextmanager
def _gloo_peers(script: Path, stop: Callable[[], object], world: int, init: Path, timeout_s: float) -> Iterator[None]:
    """This process as rank 0 of a ``world``-rank gloo group whose ranks 1..world-1 run ``script``.

    Each peer runs ``python script <rank> <world> <init>`` (one thread, the repository on ``PYTHONPATH``) and
    joins through the file ``init``. On a normal exit ``stop()`` (the peer protocol's stop command) runs first;
    then the group is destroyed and each peer is waited for (60 s, then killed).
    """
    import torch.distributed as dist

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(init)], env=env)
             for r in range(1, world)]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield
        stop()
    finally:
        dist.destroy_process_group()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def gloo_peers():
    """The ``_gloo_peers`` context manager, for the multi-process benchmarks' module fixtures."""
    return _gloo_peers
