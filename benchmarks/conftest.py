"""Shared benchmark plumbing: provenance in the saved JSON and ratio-to-baseline reporting.

Run: ``.venv/bin/pytest benchmarks --benchmark-json benchmarks/results/<theme>_<hardware>_<date>.json``.
Each benchmark group holds one ``baseline`` entry (``extra_info["role"] == "baseline"``); the terminal
summary and the JSON get every entry's median time as a ratio to that baseline, measured in the same run.
"""

from __future__ import annotations

import platform
import subprocess

import pytest


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
        "commit": _commit(),
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
