"""Trainer side: RL trainer process (torchrun; EP x CP x FSDP2 via ``moe_rl.distributed.parallelize``, one step in
``moe_rl.runtime.trainer.step``), SFT warm-up and their configs. Imports are lazy."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "OptimizerConfig": "config",
    "SftConfig": "config",
    "TrainerConfig": "config",
    "TrainerParallelConfig": "config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moe_rl.runtime.trainer.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moe_rl.runtime.trainer' has no attribute {name!r}")
