"""Async RL core: rollout groups and the staleness-bounded buffer, cache_salt derivation, advantages,
off-policy losses and mismatch metrics, the training-batch transport and the pipeline simulator.

Blocks only: no process, no torch.distributed, no engine. The orchestrator process is ``moe_rl.runtime.orchestrator``.
"""

from moe_rl.rl.advantage import group_advantages
from moe_rl.rl.batch import TrainingBatch, build_batch, read_batch, write_batch
from moe_rl.rl.buffer import (
    AsyncRolloutBuffer,
    BufferCounters,
    RolloutGroup,
    Sample,
    admission_capacity,
    may_take,
)
from moe_rl.rl.loss import (
    AgeWeightConfig,
    GspoConfig,
    IcePopConfig,
    LossConfig,
    LossOutput,
    MisConfig,
    TisConfig,
    compute_loss,
    dppo_kl_loss,
    loss_normalizer,
    mismatch_kl,
    ratio_quantiles,
)
from moe_rl.rl.salt import cache_salt_for
from moe_rl.rl.simulator import PipelineSimConfig, PipelineSimResult, simulate_pipeline

# the helpers of the submodule moe_rl.rl.token_versions, by name: its function ``token_versions`` is not
# re-exported here, so the attribute ``moe_rl.rl.token_versions`` stays the submodule
from moe_rl.rl.token_versions import (
    check_segments,
    normalize_segments,
    token_versions_from_segments,
    version_runs,
)

__all__ = [
    "AgeWeightConfig",
    "AsyncRolloutBuffer",
    "BufferCounters",
    "GspoConfig",
    "IcePopConfig",
    "LossConfig",
    "LossOutput",
    "MisConfig",
    "PipelineSimConfig",
    "PipelineSimResult",
    "RolloutGroup",
    "Sample",
    "TisConfig",
    "TrainingBatch",
    "admission_capacity",
    "build_batch",
    "cache_salt_for",
    "check_segments",
    "compute_loss",
    "dppo_kl_loss",
    "group_advantages",
    "loss_normalizer",
    "may_take",
    "mismatch_kl",
    "normalize_segments",
    "ratio_quantiles",
    "read_batch",
    "simulate_pipeline",
    "token_versions_from_segments",
    "version_runs",
    "write_batch",
]
