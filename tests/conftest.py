"""Fixtures shared by every test package.

``launch_ranks`` runs a multi-rank worker script (one Python process per rank on a gloo group, initialised through a
file in the test's temporary folder) and returns each rank's JSON report. Workers follow one protocol::

    python WORKER RANK WORLD INIT_FILE OUT_DIR   ->   OUT_DIR/rank<RANK>.json  {scenario: "ok" | traceback, ...}

``check_scenario`` turns one scenario's per-rank results into an assertion that shows every failing rank's traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _launch(worker: Path, world: int, tmp: Path, timeout_s: float = 600) -> dict[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(world), str(tmp / "init"), str(tmp)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for r, p in enumerate(procs):
        path = tmp / f"rank{r}.json"
        if p.returncode != 0 or not path.exists():
            pytest.fail(f"{worker.name} rank {r}/{world} exited with {p.returncode}:\n" + "\n".join(logs))
        results[r] = json.loads(path.read_text())
    return results


@pytest.fixture(scope="session")
def launch_ranks() -> Callable[..., dict[int, dict]]:
    """``launch_ranks(worker, world, tmp, timeout_s=600) -> {rank: report}`` (see the module docstring)."""
    return _launch


def _check(results: dict[int, dict], scenario: str) -> None:
    failures = {r: res.get(scenario, "scenario did not run") for r, res in results.items()}
    failures = {r: msg for r, msg in failures.items() if msg != "ok"}
    assert not failures, "\n".join(f"--- rank {r}:\n{msg}" for r, msg in failures.items())


@pytest.fixture(scope="session")
def check_scenario() -> Callable[[dict[int, dict], str], None]:
    """``check_scenario(results, name)``: assert the scenario reported ``"ok"`` on every rank."""
    return _check
