"""Trainer parallelism: the layout (:class:`ParallelDims`), the generic parallelism appliers (``parallelize``: EP, CP,
activation checkpointing, FSDP2; each model family composes them in its own ``parallelize.py``), the per-GPU memory
planner (model shapes through each config's ``arch_spec()``) and a live-bytes meter. Imports no model family.

Submodules are imported on first use (``moe_rl.distributed.memory`` needs no torch.distributed setup).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

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

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
