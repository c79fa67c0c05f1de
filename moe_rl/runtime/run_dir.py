"""``RunPaths``: the directories and files of one run's directory (the file protocol between the processes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import overload

__all__ = ["RunPaths"]


class _UnderRoot:
    """A read-only ``RunPaths`` attribute: ``root / name`` (on the class: this descriptor, for ``help``)."""

    def __init__(self, name: str, doc: str | None = None) -> None:
        self.name = name
        self.__doc__ = doc or f"``root / {name!r}``."

    @overload
    def __get__(self, paths: None, owner: type | None = None) -> _UnderRoot: ...
    @overload
    def __get__(self, paths: RunPaths, owner: type | None = None) -> Path: ...
    def __get__(self, paths: RunPaths | None, owner: type | None = None) -> Path | _UnderRoot:
        return self if paths is None else paths.root / self.name

    def __set__(self, paths: RunPaths, value: object) -> None:
        raise AttributeError(f"RunPaths: root / {self.name!r} is read-only; build RunPaths(other_root) instead")


@dataclass
class RunPaths:
    """Directories and files of one run under ``root``."""

    root: Path

    weights = _UnderRoot("weights")
    batches = _UnderRoot("batches")
    trainer = _UnderRoot("trainer")
    logs = _UnderRoot("logs")
    metrics = _UnderRoot("metrics.jsonl")
    engine_events = _UnderRoot("engine_events.jsonl")
    rollouts = _UnderRoot("rollouts.jsonl", "One line per finished group: id, start/end version, start/end time "
                                            "(s since start), token counts.")

    def trainer_step(self, step: int) -> Path:
        return self.trainer / f"step_{step}.json"
