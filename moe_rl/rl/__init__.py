"""Async RL core: rollout groups and the staleness-bounded buffer, cache_salt derivation, advantages,
off-policy losses and mismatch metrics, the training-batch transport and the orchestrator loop.

No torch.distributed code lives here.
"""

from moe_rl.rl.advantage import group_advantages
from moe_rl.rl.batch import TrainingBatch, build_batch, read_batch, write_batch
from moe_rl.rl.buffer import AsyncRolloutBuffer, BufferCounters, RolloutGroup, Sample
from moe_rl.rl.loss import LossConfig, LossOutput, dppo_kl_loss, mismatch_kl
from moe_rl.rl.salt import cache_salt_for

__all__ = [
    "AsyncRolloutBuffer",
    "BufferCounters",
    "LossConfig",
    "LossOutput",
    "RolloutGroup",
    "Sample",
    "TrainingBatch",
    "build_batch",
    "cache_salt_for",
    "dppo_kl_loss",
    "group_advantages",
    "mismatch_kl",
    "read_batch",
    "write_batch",
]
