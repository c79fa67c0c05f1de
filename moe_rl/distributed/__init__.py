"""Trainer parallelism: the layout (:class:`ParallelDims`), the per-GPU memory planner and a live-bytes meter.

Submodules are imported on first use (``moe_rl.distributed.memory`` needs no torch.distributed setup).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LiveBytesMeter", "MemoryPlan", "ParallelDims", "plan_memory"]

_WHERE = {
    "LiveBytesMeter": "moe_rl.distributed.meter",
    "MemoryPlan": "moe_rl.distributed.memory",
    "plan_memory": "moe_rl.distributed.memory",
    "ParallelDims": "moe_rl.distributed.parallel_dims",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'moe_rl.distributed' has no attribute {name!r}")
