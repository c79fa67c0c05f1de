"""KV-cache salt derivation.

vLLM mixes a request's ``cache_salt`` into the hash of the first prefix-cache block; later blocks chain
from it, so only requests with equal salts share KV (vLLM PR #17045). An RL run salts each rollout with
the policy version that *started* it: new rollouts never reuse KV computed by older weights, while all
turns of one rollout and all members of one group keep sharing their own prompt KV
(``shared/cases`` B17; prime-rl ``orchestrator/dispatcher.py`` uses ``str(policy_version_at_start)``).

The salt is a pure function of what changes the KV (the weights' version and dtype, and the run), never of
the trainer step alone: a frozen model keeps its cache (prime-rl PR #2266 review finding).
"""

from __future__ import annotations

__all__ = ["cache_salt_for"]


def cache_salt_for(policy_version: int, *, weight_dtype: str = "float32", run_id: str = "") -> str:
    """Return the ``cache_salt`` for a rollout that starts under ``policy_version``.

    Args:
        policy_version: version of the weights the engine serves when the rollout starts (>= 0).
        weight_dtype: dtype the engine computes KV in (a dtype change changes KV).
        run_id: distinguishes runs that share an engine (optional).

    Returns:
        A stable string, e.g. ``"moe_rl-v3-float32"``; equal inputs give equal salts in every process.

    Raises:
        TypeError: ``policy_version`` is not an int.
        ValueError: ``policy_version`` is negative.
    """
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__} {policy_version!r}")
    if policy_version < 0:
        raise ValueError(f"policy_version={policy_version} must be >= 0")
    run = f"-{run_id}" if run_id else ""
    return f"moe_rl{run}-v{policy_version}-{weight_dtype}"
