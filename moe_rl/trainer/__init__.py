"""Trainer side: RL trainer process (torchrun; EP x CP x FSDP2 via ``moe_rl.distributed.parallelize``, one step in
``moe_rl.trainer.step``), SFT warm-up and their configs."""

from moe_rl.trainer.config import OptimizerConfig, SftConfig, TrainerConfig, TrainerParallelConfig

__all__ = ["OptimizerConfig", "SftConfig", "TrainerConfig", "TrainerParallelConfig"]
