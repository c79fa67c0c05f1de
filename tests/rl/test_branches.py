"""Episodes that branch (several trajectories by token prefix, one sample each): the group baseline counts episodes,
not samples (``moe_rl.rl.advantage.episode_advantages``, ``build_batch``), and the buffer's accounting stays exact
when the number of samples of an episode is known only once it has finished (``AsyncRolloutBuffer.put``).

Rewards are dyadic fractions, so every mean and advantage is exact in float32 and compared with ``==``."""

from __future__ import annotations

import pytest

from moe_rl.rl.advantage import episode_advantages, group_advantages
from moe_rl.rl.batch import build_batch
from moe_rl.rl.buffer import AsyncRolloutBuffer, RolloutGroup, Sample


def sample(reward: float, episode: int | None, segments=None, n: int = 2) -> Sample:
    return Sample([1, 2], [5 + i for i in range(n)], [-0.5] * n, reward, "stop", version_segments=segments,
                  episode=episode)


# episode 0: 3 branches (reward 1), episode 1: 1 sample (0.5), episode 2: 2 branches (0)
REWARDS = [1.0, 1.0, 1.0, 0.5, 0.0, 0.0]
EPISODES = [0, 0, 0, 1, 2, 2]


def test_baseline_is_the_mean_over_episodes_not_samples():
    adv = episode_advantages(REWARDS, EPISODES)
    assert adv == [0.5, 0.5, 0.5, 0.0, -0.5, -0.5]  # baseline (1 + 0.5 + 0) / 3 = 0.5
    # the naive per-sample baseline (3.5 / 6) weighs episode 0 three times: it would give other numbers
    assert group_advantages(REWARDS) != adv
    # the episodes' advantages sum to 0; every branch carries its episode's advantage
    assert sum({e: a for e, a in zip(EPISODES, adv, strict=True)}.values()) == 0.0
    # no branches (every episode None or distinct): the plain group baseline
    assert episode_advantages([1.0, 0.5, 0.0], [None, None, None]) == group_advantages([1.0, 0.5, 0.0])
    assert episode_advantages([1.0, 0.5, 0.0], [0, 1, 2]) == group_advantages([1.0, 0.5, 0.0])
    # a None sample next to a branching episode is an episode of its own
    assert episode_advantages([1.0, 1.0, 0.25], [4, 4, None]) == [0.375, 0.375, -0.375]


def test_build_batch_uses_the_episode_baseline():
    g = RolloutGroup(0, 0, "s", [sample(r, e) for r, e in zip(REWARDS, EPISODES, strict=True)])
    b = build_batch([g], step=0, pad_id=0)
    assert b.num_samples == 6
    assert b.advantages.tolist() == [0.5, 0.5, 0.5, 0.0, -0.5, -0.5]
    assert b.rewards.tolist() == REWARDS
    # an SFT sample takes no part in the baseline, branches or not
    sft = Sample([1, 2], [7], [0.0], 0.0, "stop", sft=True)
    b = build_batch([RolloutGroup(0, 0, "s", [*g.samples, sft])], step=0, pad_id=0)
    assert b.advantages.tolist() == [0.5, 0.5, 0.5, 0.0, -0.5, -0.5, 0.0]


def test_episode_arguments_are_checked():
    with pytest.raises(ValueError, match="same reward"):
        episode_advantages([1.0, 0.5], [0, 0])
    with pytest.raises(ValueError, match="one episode key"):
        episode_advantages([1.0, 0.5], [0])
    with pytest.raises(ValueError, match="non-finite"):
        episode_advantages([1.0, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="empty"):
        episode_advantages([], [])
    with pytest.raises(TypeError, match=r"rewards\[1\]='x' is a str"):
        episode_advantages([1.0, "x"], [0, 1])
    with pytest.raises(TypeError, match=r"episodes\[0\]=\[0\] is a list, not hashable"):
        episode_advantages([1.0], [[0]])
    with pytest.raises(ValueError, match="same reward"):
        build_batch([RolloutGroup(0, 0, "s", [sample(1.0, 0), sample(0.0, 0)])], step=0, pad_id=0)
    with pytest.raises(ValueError, match="Sample.episode=-1 must be >= 0"):
        sample(1.0, -1)
    for bad in (True, 1.5):
        with pytest.raises(TypeError, match="Sample.episode"):
            sample(1.0, bad)


def _buffer(**kw) -> AsyncRolloutBuffer:
    return AsyncRolloutBuffer(1, **kw)


def _invariant(buf: AsyncRolloutBuffer) -> None:
    c = buf.counters
    c.check()
    assert c.started == c.inflight + c.queued + c.in_batch + c.trained + c.dropped + c.withheld


def test_branch_samples_join_started_when_the_episode_finishes():
    """4 episodes started; they come back as 3 + 1 + 2 samples and one failed episode: started grows by the 3
    branch samples at ``put``, the failed episode is one dropped sample, and the invariant holds at every step."""
    buf = _buffer()
    buf.start(0, 0, 4, prompt="p")
    c = buf.counters
    assert (c.started, c.inflight, c.branches) == (4, 4, 0)
    _invariant(buf)
    group = RolloutGroup(0, 0, "s", [sample(r, e) for r, e in zip(REWARDS, EPISODES, strict=True)])
    buf.put(group, expected_samples=4)
    assert (c.started, c.branches, c.inflight, c.queued) == (7, 3, 0, 6)
    assert c.dropped_by_reason == {"error": 1}
    _invariant(buf)
    (g,) = buf.take(1, consume_version=0)
    assert g.size == 6 and c.in_batch == 6
    _invariant(buf)
    buf.mark_trained(g.size)
    assert (c.trained, c.in_batch) == (6, 0)
    _invariant(buf)


def test_branches_of_a_withheld_or_partial_group_are_counted():
    buf = _buffer(policy="withhold")
    buf.start(0, 0, 2)
    buf._inflight[0].withheld = True  # as expire_inflight marks a stale in-flight group
    buf.put(RolloutGroup(0, 0, "s", [sample(1.0, 0), sample(1.0, 0), sample(0.0, 1)]))
    c = buf.counters
    assert (c.started, c.branches, c.withheld, c.queued) == (3, 1, 3, 0)
    _invariant(buf)

    buf = _buffer(partial_groups="drop_group")
    buf.start(0, 0, 3)
    buf.put(RolloutGroup(0, 0, "s", [sample(1.0, 0), sample(1.0, 0), sample(0.0, 2)]))  # episode 1 failed
    c = buf.counters
    assert c.started == 4 and c.dropped_by_reason == {"error": 1, "partial_group": 3} and c.queued == 0
    _invariant(buf)

    buf = _buffer(partial_groups="drop_group")
    buf.start(0, 0, 2)
    buf.put(RolloutGroup(0, 0, "s", [sample(1.0, 0), sample(1.0, 0), sample(0.0, 1)]))  # complete: not partial
    assert buf.counters.queued == 3 and buf.counters.dropped == 0
    _invariant(buf)


def test_put_refuses_episodes_that_were_not_started():
    buf = _buffer()
    buf.start(0, 0, 2)
    with pytest.raises(ValueError, match="episode=2 but only 2 episodes"):
        buf.put(RolloutGroup(0, 0, "s", [sample(1.0, 0), sample(1.0, 2)]))
    with pytest.raises(ValueError, match="3 episodes"):
        buf.put(RolloutGroup(0, 0, "s", [sample(1.0, None), sample(1.0, None), sample(0.0, 1)]))
    assert buf.counters.inflight == 2  # nothing was counted
    _invariant(buf)


@pytest.mark.parametrize("partial_groups", ["survivors", "drop_group"])
def test_mask_policy_withholds_a_fully_masked_branch_and_keeps_its_episode(partial_groups):
    """``mask`` at max staleness 0, consumed at version 1: episode 0's first branch (all tokens of version 0) is
    withheld, its second branch (a version-1 token) keeps episode 0 in the group, so a ``drop_group`` group is not
    partial; the baseline is over the two surviving episodes."""
    buf = AsyncRolloutBuffer(1, policy="mask", partial_groups=partial_groups)
    buf.start(0, 0, 2)
    old, mixed = [(0, 0)], [(0, 0), (1, 1)]
    buf.put(RolloutGroup(0, 0, "s", [sample(1.0, 0, old), sample(1.0, 0, mixed), sample(0.5, 1, [(1, 0)])]))
    buf.max_off_policy_steps = 0
    (g,) = buf.take(1, consume_version=1)
    c = buf.counters
    assert g.size == 2 and c.withheld_by_reason == {"fully_masked": 1} and c.masked_tokens == 1
    _invariant(buf)
    assert build_batch([g], step=1, pad_id=0).advantages.tolist() == [0.25, -0.25]

    # an episode that loses every sample makes the group partial
    buf = AsyncRolloutBuffer(1, policy="mask", partial_groups=partial_groups)
    buf.start(0, 0, 2)
    buf.put(RolloutGroup(0, 0, "s", [sample(1.0, 0, old), sample(1.0, 0, old), sample(0.5, 1, [(1, 0)])]))
    buf.max_off_policy_steps = 0
    got = buf.take(1, consume_version=1)
    c = buf.counters
    if partial_groups == "drop_group":
        assert got is None and c.withheld_by_reason == {"partial_group": 3}
    else:
        assert got[0].size == 1 and c.withheld_by_reason == {"fully_masked": 2}
    _invariant(buf)
