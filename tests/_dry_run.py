"""Shared by the ``moe-rl cluster ... --dry-run`` tests: run the command in-process and check its trainer plan table."""

from __future__ import annotations

from moe_rl import cli
from moe_rl.distributed.memory import GiB


def run_cluster(capsys, *args: str) -> tuple[int, str, str]:
    """``moe-rl cluster *args`` in this process: ``(exit code, stdout, stderr)`` (``capsys``: pytest's fixture)."""
    rc = cli.main(["cluster", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_plan_printed(out: str, plan) -> None:
    """Every component of ``plan`` (a ``plan_memory`` result) and its peak stand in the printed plan table of ``out``
    (GiB, two decimals)."""
    for name, value in plan.components.items():
        assert f"| {name} | {value / GiB:.2f} |" in out
    assert f"| **peak** | **{plan.peak_bytes / GiB:.2f}** | 100% |" in out


def assert_recipe_fits(capsys, recipe: str, plan_header: str, plan) -> str:
    """``moe-rl cluster @ recipe --dry-run`` exits 0 with no errors, prints ``plan_header`` (the trainer plan's first
    line) and ``plan``'s table (:func:`assert_plan_printed`), and models every component; returns its stdout."""
    rc, out, err = run_cluster(capsys, "@", recipe, "--dry-run")
    assert rc == 0, err
    assert out.splitlines()[0].startswith("OK (0 errors, ")
    assert plan_header in out
    assert_plan_printed(out, plan)
    assert "NOT MODELLED" not in out
    return out
