"""Plumbing shared by the benchmarks: the commit and tree state for provenance, and CUDA-event timing.

Imported as ``from _bench_common import ...``: the scripts in this folder find it as ``sys.path[0]``, the pytest
benchmarks through ``benchmarks/conftest.py`` (which puts this folder on ``sys.path``), and the GPU scripts in
``gpu/`` put this folder on ``sys.path`` first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The commit measured: ``$MOE_RL_COMMIT`` when set (a copy without ``.git``), else ``git rev-parse HEAD`` in
    the repository, else ``"unknown"``."""
    env = os.environ.get("MOE_RL_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tree_dirty(*paths: str) -> bool:
    """True when ``git status --porcelain [paths]`` lists a change (or git cannot say): the measured code may
    differ from :func:`commit`."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", *paths], capture_output=True, text=True,
                                   check=True, cwd=REPO).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return True


def cuda_times_ms(torch, fn: Callable[[], object], iters: int,
                  before: Callable[[], object] | None = None) -> list[float]:
    """Run ``fn`` ``iters`` times, each between two CUDA events; the elapsed milliseconds of each run.

    ``before`` (e.g. ``dist.barrier``) runs ahead of each timed call, outside the timed span. The device is
    synchronized once first, so work queued earlier is not timed. ``torch`` is passed in so that importing this
    module does not import torch (the scripts' ``--dry-run`` works without it).
    """
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def dry_run_or_no_cuda(dry_run: bool, plan: Callable[[], dict], script: str, needs: str = "") -> int | None:
    """The start of a GPU script's ``main``: the exit status when it must not measure, else None.

    Returns:
        0 after printing ``plan()`` as JSON when ``dry_run``; 2 (with a line on stderr naming ``script`` and what
        it ``needs``) when torch sees no CUDA device; None when the script can go on measuring.
    """
    if dry_run:
        print(json.dumps(plan(), indent=1))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device (torch.cuda.is_available() is False){needs}; nothing measured",
              file=sys.stderr)
        return 2
    return None


def results_dir(out: Path | None) -> Path:
    """Where a GPU script writes its JSON: ``--out``, else ``$OUT``, else ``benchmarks/results``; created."""
    d = out or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages of ``/proc/loadavg`` (runnable + uninterruptible tasks);
    ``(nan, nan, nan)`` where that file cannot be read (not Linux)."""
    try:
        a, b, c = Path("/proc/loadavg").read_text().split()[:3]
        return float(a), float(b), float(c)
    except (OSError, ValueError):
        return float("nan"), float("nan"), float("nan")


def cpu_provenance(**extra: object) -> dict[str, object]:
    """Commit, CPU model, logical CPUs (all / usable by this process), load average now, machine, Python and UTC
    time (to the second), plus ``extra``: the provenance of a CPU benchmark."""
    import datetime
    import platform

    model = "unknown"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"commit": commit(), "cpu": model, "cpus": os.cpu_count(), "cpus_usable": usable,
            "load_average_1_5_15": load_average(), "machine": platform.platform(),
            "python": platform.python_version(), **extra,
            "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def gpu_provenance(torch, **extra: object) -> dict[str, object]:
    """Commit, GPU 0's name, torch and CUDA versions, machine and UTC time (to the second), plus ``extra``."""
    import datetime
    import platform

    return {"commit": commit(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "machine": platform.platform(), **extra,
            "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
