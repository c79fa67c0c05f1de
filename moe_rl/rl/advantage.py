"""Group-baseline advantages (Dr. GRPO: reward minus the group mean, no std normalisation; the default of
prime-rl 0.6.0, see ``shared/notes/prime-rl.md`` §2)."""

from __future__ import annotations

__all__ = ["group_advantages"]


def group_advantages(rewards: list[float]) -> list[float]:
    """Advantage of each member of one group: ``r_i - mean(r)``.

    Args:
        rewards: the rewards of the group's surviving members (at least one).

    Raises:
        ValueError: ``rewards`` is empty.
    """
    if not rewards:
        raise ValueError("rewards is empty: a group needs at least one member to form a baseline")
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]
