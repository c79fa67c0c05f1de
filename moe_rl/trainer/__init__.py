"""Trainer side: RL trainer process (torchrun, FSDP2), SFT warm-up and their configs."""

from moe_rl.trainer.config import OptimizerConfig, SftConfig, TrainerConfig

__all__ = ["OptimizerConfig", "SftConfig", "TrainerConfig"]
