"""Shared by the tests of Triton kernels on CPU: a worker run in Triton's interpreter, and a module imported with
no triton installed.

``TRITON_INTERPRET=1`` must be set before triton is imported (triton reads it on import and when ``@triton.jit``
decorates), so the kernels run in a subprocess that writes ``{case: "ok" | traceback}`` as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType


def run_interpreter_worker(worker: Path, out: Path, *args: str, timeout_s: float = 300) -> dict[str, str]:
    """Run ``python worker OUT [args]`` with ``TRITON_INTERPRET=1`` (and the tests' thread count); assert it exited
    0 and return the ``{case: "ok" | traceback}`` it wrote to ``out``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ["MOE_RL_TEST_THREADS"]}
    proc = subprocess.run([sys.executable, str(worker), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, f"worker failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def import_without_triton(monkeypatch, module: str) -> ModuleType:
    """A fresh import of ``module`` while ``triton`` and ``triton.language`` cannot be imported (``monkeypatch``
    undoes it after the test)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    return importlib.import_module(module)
