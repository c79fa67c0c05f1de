"""Async RL core: rollout groups and the staleness-bounded buffer, cache_salt derivation, advantages,
off-policy losses and mismatch metrics, trajectory interleaving by token prefix, sequence packing plans, the
training-batch transport and the pipeline simulator.

Blocks only: no process, no torch.distributed, no engine. The orchestrator process is ``moe_rl.runtime.orchestrator``.

Imports are lazy: ``import moe_rl.rl.buffer`` or ``moe_rl.rl.salt`` loads neither torch nor pydantic; a name
from this package loads only its submodule. The helpers of :mod:`moe_rl.rl.token_versions` are exported by
name, but not its function ``token_versions``, so the attribute ``moe_rl.rl.token_versions`` stays the submodule.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "AgeWeightConfig": "loss",
    "AsyncRolloutBuffer": "buffer",
    "BufferCounters": "buffer",
    "GspoConfig": "loss",
    "IcePopConfig": "loss",
    "LossConfig": "loss",
    "LossOutput": "loss",
    "MisConfig": "loss",
    "ModelCall": "trajectory",
    "PackPlan": "packing",
    "PackedMicroBatch": "packing",
    "PipelineSimConfig": "simulator",
    "PipelineSimResult": "simulator",
    "RolloutGroup": "buffer",
    "Sample": "buffer",
    "TisConfig": "loss",
    "TrainingBatch": "batch",
    "TrajectorySample": "trajectory",
    "admission_capacity": "buffer",
    "build_batch": "batch",
    "cache_salt_for": "salt",
    "check_segments": "token_versions",
    "compute_loss": "loss",
    "dppo_kl_loss": "loss",
    "episode_advantages": "advantage",
    "group_advantages": "advantage",
    "interleave_calls": "trajectory",
    "loss_normalizer": "loss",
    "may_take": "buffer",
    "mismatch_kl": "loss",
    "normalize_segments": "token_versions",
    "plan_packing": "packing",
    "ratio_quantiles": "loss",
    "read_batch": "batch",
    "simulate_pipeline": "simulator",
    "token_versions_from_segments": "token_versions",
    "version_runs": "token_versions",
    "write_batch": "batch",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
