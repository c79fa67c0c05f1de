"""Trainer side: RL trainer process (torchrun; EP x CP x FSDP2 via ``moe_rl.distributed.parallelize``, one step in
``moe_rl.runtime.trainer.step``), SFT warm-up and their configs. Imports are lazy."""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "OptimizerConfig": "config",
    "SftConfig": "config",
    "TrainerConfig": "config",
    "TrainerParallelConfig": "config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
