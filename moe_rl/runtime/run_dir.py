"""``RunPaths``: the directories and files of one run's directory (the file protocol between the processes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import overload

__all__ = ["RunPaths"]


class _UnderRoot:
    """A read-only ``RunPaths`` attribute: ``root / name`` (on the class: this descriptor, for ``help``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__doc__ = f"``root / {name!r}`` (read-only)."

    @overload
    def __get__(self, paths: None, owner: type | None = None) -> _UnderRoot: ...
    @overload
    def __get__(self, paths: RunPaths, owner: type | None = None) -> Path: ...
    def __get__(self, paths: RunPaths | None, owner: type | None = None) -> Path | _UnderRoot:
        return self if paths is None else paths.root / self.name

    def _read_only(self) -> AttributeError:
        return AttributeError(f"RunPaths: root / {self.name!r} is read-only; build RunPaths(other_root) instead")

    def __set__(self, paths: RunPaths, value: object) -> None:
        raise self._read_only()

    def __delete__(self, paths: RunPaths) -> None:
        raise self._read_only()


@dataclass
class RunPaths:
    """Directories and files of one run under ``root``.

    Every path below is ``root / <name>`` (a :class:`pathlib.Path`), computed on access and read-only: assigning or
    deleting one raises ``AttributeError`` (build ``RunPaths(other_root)`` for another run directory).
    """

    root: Path

    weights = _UnderRoot("weights")
    """``root / "weights"``: the trainer's published weight versions (``step_<v>/``) and their announcements."""
    batches = _UnderRoot("batches")
    """``root / "batches"``: the orchestrator's training batches (``step_<k>.safetensors``), read by the trainer."""
    trainer = _UnderRoot("trainer")
    """``root / "trainer"``: the trainer's per-step reports (:meth:`trainer_step`), rank pid files and resume
    requests."""
    logs = _UnderRoot("logs")
    """``root / "logs"``: the processes' log files."""
    metrics = _UnderRoot("metrics.jsonl")
    """``root / "metrics.jsonl"``: one JSON line of metrics per training step, written by the orchestrator."""
    engine_events = _UnderRoot("engine_events.jsonl")
    """``root / "engine_events.jsonl"``: one JSON line per weight version an inference engine loaded (with its
    probe)."""
    rollouts = _UnderRoot("rollouts.jsonl")
    """``root / "rollouts.jsonl"``: one line per finished group: id, start/end version, start/end time (s since
    start), token counts."""

    def trainer_step(self, step: int) -> Path:
        """``trainer / f"step_{step}.json"``: the trainer's report of training step ``step``."""
        return self.trainer / f"step_{step}.json"
