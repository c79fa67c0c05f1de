"""Group-baseline advantages (Dr. GRPO: reward minus the group mean, no std normalisation; the default of
prime-rl 0.6.0; Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

Partial groups: when members of a group are lost (an engine error, or under the ``"mask"`` staleness policy
a member with no trainable token), ``AsyncRolloutBuffer`` with ``partial_groups="survivors"`` hands over the
group with only its survivors, and the baseline is the mean over the survivors (prime-rl's ``TrainSink``
does the same): ``group_advantages([r_i for surviving i])``. A single survivor gets advantage 0 (no signal,
no bias). With ``partial_groups="drop_group"`` the whole group is removed instead, which is required when the
reward itself depends on the whole group (e.g. pairwise or rank-based rewards). Masked tokens of a surviving
member keep the member's advantage; they only lose their loss weight (``Sample.train_mask``).

Branching episodes: an agentic episode whose model calls form several trajectories by token prefix (a chat
template that re-renders history, a rollback; :func:`moe_rl.rl.trajectory.interleave_calls`) yields one sample
per trajectory (branch), each with the episode's reward. The baseline is the mean over the group's *episodes*,
not over its samples (:func:`episode_advantages`): an episode with three branches weighs one episode in the
baseline, as one with a single sample does, and every branch gets its episode's advantage (prime-rl trains the
branches of a multi-turn rollout the same way). A mean over samples would pull the baseline toward episodes that
happen to branch more and bias every advantage of the group."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence

__all__ = ["episode_advantages", "group_advantages"]


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


def episode_advantages(rewards: Sequence[float], episodes: Sequence[Hashable | None]) -> list[float]:
    """Advantage of each sample of one group whose samples may be branches of one episode: the sample's reward
    minus the mean reward over the group's episodes (each episode counted once, whatever its number of samples).

    Args:
        rewards: one reward per sample (the group's surviving samples), finite.
        episodes: one key per sample, same length: samples with the same key are branches of one episode and must
            carry the same reward; None = the sample is an episode of its own. With every key None (or distinct)
            this is :func:`group_advantages`.

    Returns:
        One float per sample, in order. The advantages of the episodes (one per episode) sum to 0 (up to rounding).

    Raises:
        ValueError: ``rewards`` is empty, the lengths differ, a reward is NaN or infinite, or two samples of one
            episode carry different rewards (every branch of an episode takes the episode's reward).
        TypeError: a reward is not a real number, or an episode key is not hashable.
    """
    if len(rewards) != len(episodes):
        raise ValueError(
            f"rewards has {len(rewards)} entries but episodes has {len(episodes)}; pass one episode key (or None) "
            "per sample"
        )
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise TypeError(f"rewards[{i}]={r!r} is a {type(r).__name__}; pass one real number per sample")
    rewards = [float(r) for r in rewards]
    group_advantages(rewards)  # validates: non-empty, every reward finite
    per_episode: dict[Hashable, float] = {}
    keys: list[Hashable] = []
    for i, (r, e) in enumerate(zip(rewards, episodes, strict=True)):
        if e is not None and not isinstance(e, Hashable):
            raise TypeError(f"episodes[{i}]={e!r} is a {type(e).__name__}, not hashable; pass an int episode index "
                            "(or None for a sample that is an episode of its own)")
        key: Hashable = ("sample", i) if e is None else ("episode", e)
        keys.append(key)
        if key in per_episode and per_episode[key] != r:
            raise ValueError(
                f"episode {e!r} has samples with rewards {per_episode[key]!r} and {r!r} (sample {i}); every branch "
                "of an episode carries the episode's reward -- give its samples the same reward"
            )
        per_episode.setdefault(key, r)
    base = group_advantages(list(per_episode.values()))
    adv_of = dict(zip(per_episode, base, strict=True))
    return [adv_of[k] for k in keys]
