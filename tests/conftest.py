"""Fixtures shared by every test package.

``launch_ranks`` runs a multi-rank worker script (one Python process per rank on a gloo group, initialised through a
file in the test's temporary folder) and returns each rank's JSON report. Workers follow one protocol::

    python WORKER RANK WORLD INIT_FILE OUT_DIR   ->   OUT_DIR/rank<RANK>.json  {scenario: "ok" | traceback, ...}

(the rank side of it is ``tests/_rank_worker.py``'s ``run_rank_worker``).

``check_scenario`` turns one scenario's per-rank results into an assertion that shows every failing rank's traceback.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests/_tolerance.py (the numeric-tolerance rule) is imported as `from _tolerance import ...`.
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

# torch's intra-op threads for every test and worker process: MOE_RL_TEST_THREADS (default 1). The numeric tests
# must pass at any count (their tolerances do not depend on the summation order); run e.g.
# `MOE_RL_TEST_THREADS=2 pytest ...` to check. Exported so subprocesses (rank workers, torchrun, Triton interpreter
# runs) use the same count.
_threads = os.environ.setdefault("MOE_RL_TEST_THREADS", "1")
if not _threads.isdigit() or int(_threads) < 1:
    raise pytest.UsageError(f"MOE_RL_TEST_THREADS={_threads!r} must be an integer >= 1 (torch threads per test "
                            "process); unset it for the default 1")
TEST_THREADS = int(_threads)


@pytest.fixture(autouse=True)
def _torch_threads() -> None:
    """Set torch's thread count before every test (a module may change it at import or in a test)."""
    torch = sys.modules.get("torch")  # no import: tests that do not use torch stay cheap
    if torch is not None and torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


def _launch(worker: Path, world: int, tmp: Path, timeout_s: float = 600) -> dict[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(TEST_THREADS),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
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


@pytest.fixture(scope="session")
def check_scenario() -> Callable[[dict[int, dict], str], None]:
    """``check_scenario(results, name)``: assert the scenario reported ``"ok"`` on every rank."""
    from _ranks import check_scenario

    return check_scenario


# ------------------------------------------------------------------------------------------------ test tiers
# Markers (registered in pyproject.toml): multirank, vllm, slow, gpu. The fast development tier is
#     pytest -m "not slow and not multirank and not vllm"
# multirank and vllm are applied here from what a test uses, so a new test lands in the right tier without
# remembering the marker; slow and gpu are set by hand (pytestmark or a decorator).
_MULTIRANK_SRC = re.compile(r"torch\.distributed\.run|--nproc-per-node|\btorchrun\b.*\[|mp\.spawn\(")
_SUBPROCESS_SRC = re.compile(r"subprocess\.|Popen\(")  # runs the command (not just builds or checks it)
_VLLM_SRC = re.compile(r"importorskip\(\s*[\"']vllm|^\s*(import vllm|from vllm\b)|vllm\.entrypoints", re.MULTILINE)
_VLLM_FIXTURES = {"vllm_engine"}


def _function_source(item: pytest.Item) -> str:
    fn = getattr(item, "function", None)
    try:
        return inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return ""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add ``multirank`` (uses ``launch_ranks`` or runs ``torch.distributed.run`` in a subprocess) and ``vllm`` (uses the
    in-process vLLM engine fixture, imports vllm or starts its API server) to the tests that qualify."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        src = _function_source(item)
        if "launch_ranks" in names or (_MULTIRANK_SRC.search(src) and _SUBPROCESS_SRC.search(src)):
            item.add_marker(pytest.mark.multirank)
        if names & _VLLM_FIXTURES or _VLLM_SRC.search(src):
            item.add_marker(pytest.mark.vllm)
