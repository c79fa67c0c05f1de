"""Trainer parallelism: the layout (:class:`ParallelDims`), the per-GPU memory planner and a live-bytes meter.

Submodules are imported on first use (``moe_rl.distributed.memory`` needs no torch.distributed setup).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LiveBytesMeter": "meter",
    "MemoryPlan": "memory",
    "ParallelDims": "parallel_dims",
    "ParallelMesh": "parallel_dims",
    "clip_grad_norm_": "parallelize",
    "parallelize_model": "parallelize",
    "plan_memory": "memory",
    "shard_for_context_parallel": "parallelize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moe_rl.distributed.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moe_rl.distributed' has no attribute {name!r}")
