"""Group-baseline advantages (Dr. GRPO: reward minus the group mean, no std normalisation; the default of
prime-rl 0.6.0; Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

Partial groups: when members of a group are lost (an engine error, or under the ``"mask"`` staleness policy
a member with no trainable token), ``AsyncRolloutBuffer`` with ``partial_groups="survivors"`` hands over the
group with only its survivors, and the baseline is the mean over the survivors (prime-rl's ``TrainSink``
does the same): ``group_advantages([r_i for surviving i])``. A single survivor gets advantage 0 (no signal,
no bias). With ``partial_groups="drop_group"`` the whole group is removed instead, which is required when the
reward itself depends on the whole group (e.g. pairwise or rank-based rewards). Masked tokens of a surviving
member keep the member's advantage; they only lose their loss weight (``Sample.train_mask``)."""

from __future__ import annotations

import math

__all__ = ["group_advantages"]


def group_advantages(rewards: list[float]) -> list[float]:
    """Advantage of each member of one group: ``r_i - mean(r)``.

    Args:
        rewards: the rewards of the group's surviving members (at least one; see the module docstring for
            partial groups).

    Returns:
        One float per member, summing to 0 (up to rounding).

    Raises:
        ValueError: ``rewards`` is empty, or a reward is NaN or infinite (it would turn every advantage of the
            group into NaN).
    """
    if not rewards:
        raise ValueError("rewards is empty: a group needs at least one member to form a baseline")
    bad = [(i, r) for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(
            f"rewards has {len(bad)} non-finite value(s), first rewards[{bad[0][0]}]={bad[0][1]!r}; every reward "
            "must be a finite float (fix the reward function, or fail the sample instead of rewarding it NaN)"
        )
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]
