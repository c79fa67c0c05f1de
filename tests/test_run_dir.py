"""``moe_rl.runtime.run_dir.RunPaths``: its paths, their read-only guard, and their rows on the API page."""

import re
from pathlib import Path

import pytest

from moe_rl.runtime.run_dir import RunPaths, _UnderRoot

REPO = Path(__file__).resolve().parents[1]
PATHS = sorted(name for name, value in vars(RunPaths).items() if isinstance(value, _UnderRoot))


def test_paths_are_under_root(tmp_path):
    assert set(PATHS) == {"weights", "batches", "trainer", "logs", "metrics", "engine_events", "rollouts"}
    paths = RunPaths(tmp_path)
    for name in PATHS:
        got = getattr(paths, name)
        assert isinstance(got, Path) and got.parent == tmp_path, (name, got)
    assert paths.metrics == tmp_path / "metrics.jsonl"
    assert paths.trainer_step(7) == tmp_path / "trainer" / "step_7.json"
    assert RunPaths(tmp_path) == RunPaths(tmp_path) != RunPaths(tmp_path / "other")


@pytest.mark.parametrize("name", PATHS)
def test_paths_are_read_only(tmp_path, name):
    paths = RunPaths(tmp_path)
    message = re.escape(f"RunPaths: root / {getattr(paths, name).name!r} is read-only; build RunPaths(other_root)")
    with pytest.raises(AttributeError, match=message):
        setattr(paths, name, tmp_path / "x")
    with pytest.raises(AttributeError, match=message):
        delattr(paths, name)
    assert getattr(paths, name).parent == tmp_path  # unchanged


def test_api_page_lists_every_path():
    """The generated summary page (docs/api/runtime.md) has a documented row for each path."""
    page = (REPO / "docs" / "api" / "runtime.md").read_text()
    section = page.split("## `RunPaths`", 1)[1].split("\n## ", 1)[0]
    for name in PATHS:
        row = next((line for line in section.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/api/runtime.md: RunPaths has no `{name}` row"
        assert "root / " in row and "(no docstring)" not in row, row
