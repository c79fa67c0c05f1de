"""Trainer parallelism: the layout (:class:`ParallelDims`), the per-GPU memory planner and a live-bytes meter.

Submodules are imported on first use (``moe_rl.distributed.memory`` needs no torch.distributed setup).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LiveBytesMeter",
    "MemoryPlan",
    "ParallelDims",
    "ParallelMesh",
    "clip_grad_norm_",
    "parallelize_model",
    "plan_memory",
    "shard_for_context_parallel",
]

_WHERE = {
    "LiveBytesMeter": "moe_rl.distributed.meter",
    "MemoryPlan": "moe_rl.distributed.memory",
    "plan_memory": "moe_rl.distributed.memory",
    "ParallelDims": "moe_rl.distributed.parallel_dims",
    "ParallelMesh": "moe_rl.distributed.parallel_dims",
    "parallelize_model": "moe_rl.distributed.parallelize",
    "shard_for_context_parallel": "moe_rl.distributed.parallelize",
    "clip_grad_norm_": "moe_rl.distributed.parallelize",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'moe_rl.distributed' has no attribute {name!r}")
