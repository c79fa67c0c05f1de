"""``RunPaths``: the directories and files of one run's directory (the file protocol between the processes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunPaths"]


@dataclass
class RunPaths:
    """Directories and files of one run under ``root``."""

    root: Path

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def batches(self) -> Path:
        return self.root / "batches"

    @property
    def trainer(self) -> Path:
        return self.root / "trainer"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def engine_events(self) -> Path:
        return self.root / "engine_events.jsonl"

    @property
    def rollouts(self) -> Path:
        """One line per finished group: id, start/end version, start/end time (s since start), token counts."""
        return self.root / "rollouts.jsonl"

    def trainer_step(self, step: int) -> Path:
        return self.trainer / f"step_{step}.json"

