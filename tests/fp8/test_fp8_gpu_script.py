"""The prepared GPU benchmark ``benchmarks/gpu/fp8_h200.py`` imports and its CPU-safe parts run here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "fp8_h200.py"


def _load():
    spec = importlib.util.spec_from_file_location("fp8_h200", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_prints_plan(capsys):
    mod = _load()
    assert mod.main(["--dry-run", "--m-list", "4096", "8192"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["m_list"] == [4096, 8192] and plan["hbm_peak_tbps"] == 4.8
    assert (7168, 2048) in map(tuple, plan["dense_nk"]["deepseek_v3"])
    assert all(n > 0 and k > 0 for n, k in plan["dense_nk"]["glm45_air"])
    counts = mod._uneven_counts(4096, 8)
    assert sum(counts) == 4096 and min(counts) > 0 and max(counts) > 2 * min(counts)


def test_without_cuda_exits_2():
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        return
    assert _load().main(["--iters", "1"]) == 2
