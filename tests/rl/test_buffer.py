"""AsyncRolloutBuffer: staleness rules (shared/cases B18), the drop / withhold / mask policies, partial groups,
prompt retries, the admission rule, and accounting. Expected values are hand-computed in the comments."""

import pytest

from moe_rl.rl.advantage import group_advantages
from moe_rl.rl.buffer import (
    AsyncRolloutBuffer,
    RolloutGroup,
    Sample,
    admission_capacity,
    may_take,
    token_train_mask,
    token_versions,
)


def _sample(n_tokens: int = 2, reward: float = 0.0, segments=None) -> Sample:
    return Sample([1, 5], [6] * n_tokens, [-0.1] * n_tokens, reward=reward, version_segments=segments)


def _group(gid: int, v_start: int, n: int = 2, v_end: int | None = None, samples=None) -> RolloutGroup:
    samples = samples if samples is not None else [_sample(reward=float(i)) for i in range(n)]
    return RolloutGroup(gid, v_start, f"salt-v{v_start}", samples, version_end=v_start if v_end is None else v_end)


def _start_put(buf: AsyncRolloutBuffer, gid: int, v: int, n: int = 2, prompt=None, samples=None) -> None:
    buf.start(gid, v, n, prompt=prompt)
    buf.put(_group(gid, v, n=n, samples=samples))


# ------------------------------------------------------------------------------------------- B18
def _run_b18(limit: int) -> dict[str, bool]:
    """R1: starts v5, finishes v5 (consumed at v5). R2: starts v5, update to v6 mid-generation (consumed at v6).
    R3: starts v4, consumed when the trainer is at v6."""
    buf = AsyncRolloutBuffer(max_off_policy_steps=limit)
    return {
        "R1": buf.usable(version_start=5, consume_version=5),
        "R2": buf.usable(version_start=5, consume_version=6),
        "R3": buf.usable(version_start=4, consume_version=6),
    }


def test_b18_limit_0_accepts_only_single_policy_rollouts():
    assert _run_b18(0) == {"R1": True, "R2": False, "R3": False}


def test_b18_limit_1_rejects_staleness_2():
    assert _run_b18(1) == {"R1": True, "R2": True, "R3": False}
    assert AsyncRolloutBuffer.staleness(4, 6) == 2


def test_b18_sync_mode_step0_needs_no_newer_checkpoint():
    buf = AsyncRolloutBuffer(0)
    # trainer step 0, latest checkpoint 0, async level 0: rollouts may start right away (one batch of 3 groups)
    assert buf.may_start(engine_version=0, next_batch=0)
    assert buf.start_capacity(engine_version=0, next_batch=0, groups_per_step=3, max_inflight=10) == 3
    assert not buf.may_start(engine_version=0, next_batch=1)
    assert buf.start_capacity(engine_version=0, next_batch=1, groups_per_step=3, max_inflight=10) == 0


def test_b18_through_the_buffer_r2_mixed_versions():
    """R2 through take(): started v5, segments [(5,0),(6,1)], consumed at v6: trained whole at limit 1, dropped
    at limit 0 (drop) and, under mask with limit 0, only its v6 token is trained."""
    for limit, policy, expect in [(1, "drop", (1, None)), (0, "drop", (0, None)), (0, "mask", (1, [False, True]))]:
        buf = AsyncRolloutBuffer(limit, policy=policy)
        _start_put(buf, 0, 5, n=1, samples=[_sample(2, segments=[(5, 0), (6, 1)])])
        got = buf.take(1, consume_version=6)
        n = 0 if got is None else len(got)
        assert (n, got[0].samples[0].train_mask if got else None) == expect, (limit, policy)
        buf.counters.check()


def test_b18_queue_time_counts_and_all_rejected_does_not_deadlock():
    buf = AsyncRolloutBuffer(1)
    for gid in range(3):
        _start_put(buf, gid, 0)
    # finished at v0 but consumed at v2: too stale although they finished long ago (queue time counts)
    assert buf.take(1, consume_version=2) is None
    assert buf.counters.dropped == 6 and buf.counters.dropped_by_reason == {"stale_queued": 6}
    buf.counters.check()
    # admission reopens and the buffer keeps producing batches from fresh groups afterwards
    assert buf.start_capacity(engine_version=2, next_batch=2, groups_per_step=1, max_inflight=4) == 2
    _start_put(buf, 9, 2)
    got = buf.take(1, consume_version=2)
    assert got is not None and got[0].group_id == 9
    buf.mark_trained(2)
    buf.counters.check()
    assert buf.counters.trained == 2


# ------------------------------------------------------------------------------------------- FIFO, accounting
def test_take_is_fifo_and_counts_staleness():
    buf = AsyncRolloutBuffer(2)
    for gid, v in enumerate([0, 1, 1, 2]):
        _start_put(buf, gid, v)
    groups = buf.take(2, consume_version=2)
    assert [g.group_id for g in groups] == [0, 1]
    assert dict(buf.staleness_hist) == {2: 2, 1: 2}
    assert buf.counters.in_batch == 4 and buf.counters.queued == 4
    buf.counters.check()


def test_inflight_failure_and_partial_group_accounting():
    buf = AsyncRolloutBuffer(1)
    buf.start(0, 0, 4)
    buf.fail(0, "stale_inflight")
    buf.start(1, 0, 4)
    buf.put(_group(1, 0, n=3))  # one sample failed
    c = buf.counters
    assert (c.started, c.inflight, c.queued, c.dropped) == (8, 0, 3, 5)
    assert c.dropped_by_reason == {"stale_inflight": 4, "error": 1}
    c.check()


# ------------------------------------------------------------------------------------------- drop policy
def test_drop_cancels_stale_inflight_and_requeues_prompt_with_priority():
    buf = AsyncRolloutBuffer(1, policy="drop", max_retries=2)
    buf.start(0, 0, 2, prompt="p0")
    buf.start(1, 1, 2, prompt="p1")
    # batch 2 is next: v0 rollouts (staleness 2) can no longer be trained; v1 ones can
    assert buf.expire_inflight(next_batch=2) == [0]
    buf.fail(0, "stale_inflight")
    assert buf.counters.dropped_by_reason == {"stale_inflight": 2}
    assert buf.next_retry() == ("p0", 1) and buf.next_retry() is None
    assert buf.counters.retried == 1
    # the same prompt lost twice more: retried once more (2 = max_retries), then abandoned
    buf.start(2, 2, 2, prompt="p0", retries=1)
    buf.fail(2, "stale_inflight")
    assert buf.next_retry() == ("p0", 2)
    buf.start(3, 3, 2, prompt="p0", retries=2)
    buf.fail(3, "stale_inflight")
    assert buf.next_retry() is None
    assert (buf.counters.retried, buf.counters.abandoned) == (2, 1)
    # an engine error is not a staleness loss: no retry
    buf.start(4, 3, 2, prompt="p4")
    buf.fail(4, "error")
    assert buf.next_retry() is None
    buf.counters.check()


def test_drop_discards_stale_queued_and_requeues():
    buf = AsyncRolloutBuffer(0, policy="drop")
    _start_put(buf, 0, 0, prompt="a")
    _start_put(buf, 1, 1, prompt="b")
    got = buf.take(1, consume_version=1)
    assert [g.group_id for g in got] == [1]
    assert buf.counters.dropped_by_reason == {"stale_queued": 2}
    assert buf.next_retry() == ("a", 1)


# ------------------------------------------------------------------------------------------- withhold policy
def test_withhold_lets_stale_rollouts_finish_and_never_trains_them():
    buf = AsyncRolloutBuffer(1, policy="withhold")
    buf.start(0, 0, 2, prompt="p")
    buf.start(1, 1, 2)
    assert buf.expire_inflight(next_batch=2) == []  # nothing to cancel
    # a withheld group uses an engine slot but no batch slot: capacity for batches 2..2 (engine v1) = 1 - 1
    assert buf.start_capacity(engine_version=1, next_batch=2, groups_per_step=1, max_inflight=5) == 0
    buf.put(_group(0, 0))
    buf.put(_group(1, 1))
    assert buf.counters.withheld_by_reason == {"stale_inflight": 2}
    assert buf.next_retry() == ("p", 1)
    got = buf.take(1, consume_version=2)
    assert [g.group_id for g in got] == [1]
    # a queued group that goes stale is withheld too
    _start_put(buf, 2, 2)
    assert buf.take(1, consume_version=4) is None
    assert buf.counters.withheld_by_reason == {"stale_inflight": 2, "stale_queued": 2}
    assert buf.counters.dropped == 0
    buf.counters.check()


# ------------------------------------------------------------------------------------------- mask policy
def test_token_versions_and_mask_hand_computed():
    # 5 tokens, start v2, update to v3 before token 2, to v4 before token 4
    v = token_versions(5, 2, [(2, 0), (3, 2), (4, 4)])
    assert v == [2, 2, 3, 3, 4]
    assert token_versions(3, 7, None) == [7, 7, 7]
    assert token_versions(3, 7, [(8, 1)]) == [7, 8, 8]  # tokens before the first segment: version_start
    # consumed at v5 with bound 2: age 3, 3, 2, 2, 1
    assert token_train_mask(v, 5, 2) == [False, False, True, True, True]
    with pytest.raises(ValueError, match=r"version_segments\[1\]"):
        token_versions(5, 2, [(3, 2), (2, 3)])
    with pytest.raises(ValueError, match="must increase"):
        token_versions(5, 2, [(3, 2), (4, 2)])


def test_mask_trains_only_recent_tokens_and_counts_fully_masked_samples():
    buf = AsyncRolloutBuffer(2, policy="mask")
    samples = [
        _sample(5, reward=1.0, segments=[(2, 0), (3, 2), (4, 4)]),  # ages 3,3,2,2,1 -> F,F,T,T,T
        _sample(3, reward=0.0),                                      # all v2 -> age 3: fully masked
        _sample(2, reward=0.5, segments=[(2, 0), (5, 0 + 1)]),       # ages 3,0 -> F,T
    ]
    buf.start(0, 2, 3)
    assert buf.expire_inflight(next_batch=5) == []  # mask never cancels
    buf.put(_group(0, 2, samples=samples))
    got = buf.take(1, consume_version=5)
    g = got[0]
    assert [s.reward for s in g.samples] == [1.0, 0.5]  # survivors
    assert [s.train_mask for s in g.samples] == [[False, False, True, True, True], [False, True]]
    c = buf.counters
    assert (c.masked_tokens, c.masked_samples, c.withheld, c.in_batch) == (3, 2, 1, 2)
    assert c.withheld_by_reason == {"fully_masked": 1}
    c.check()
    # survivors train with a baseline over the survivors: mean(1.0, 0.5) = 0.75
    assert group_advantages([s.reward for s in g.samples]) == [0.25, -0.25]


def test_mask_removes_groups_with_no_trainable_token_and_requeues():
    buf = AsyncRolloutBuffer(1, policy="mask")
    _start_put(buf, 0, 0, prompt="q")
    assert buf.take(1, consume_version=2) is None
    assert buf.counters.withheld_by_reason == {"fully_masked": 2}
    assert buf.next_retry() == ("q", 1)
    buf.counters.check()


# ------------------------------------------------------------------------------------------- partial groups
def test_partial_groups_drop_group_removes_whole_group():
    buf = AsyncRolloutBuffer(1, partial_groups="drop_group")
    buf.start(0, 0, 4)
    buf.put(_group(0, 0, n=3))
    assert buf.counters.dropped_by_reason == {"error": 1, "partial_group": 3}
    assert buf.num_queued_groups == 0
    # under mask, one fully masked member withholds the whole group
    buf = AsyncRolloutBuffer(0, policy="mask", partial_groups="drop_group")
    _start_put(buf, 0, 0, n=2, samples=[_sample(2), _sample(2, segments=[(0, 0), (1, 1)])])
    assert buf.take(1, consume_version=1) is None
    assert buf.counters.withheld_by_reason == {"partial_group": 2}
    buf.counters.check()


def test_partial_groups_survivors_keeps_the_rest():
    buf = AsyncRolloutBuffer(1, partial_groups="survivors")
    buf.start(0, 0, 4)
    buf.put(_group(0, 0, n=3))
    got = buf.take(1, consume_version=0)
    assert got[0].size == 3 and buf.counters.dropped_by_reason == {"error": 1}


# ------------------------------------------------------------------------------------------- admission
def test_admission_capacity_hand_computed():
    # engine v3, bound 1 -> batches up to 4; next batch 3 -> 2 batches x 4 groups = 8 slots, 5 pending -> 3
    kw = dict(engine_version=3, next_batch=3, max_off_policy_steps=1, groups_per_step=4, inflight_groups=5)
    assert admission_capacity(pending_groups=5, max_inflight=100, **kw) == 3
    assert admission_capacity(pending_groups=5, max_inflight=7, **kw) == 2  # in-flight cap
    assert admission_capacity(pending_groups=5, max_inflight=100, last_batch=3, **kw) == -1  # run ends at batch 3
    assert admission_capacity(pending_groups=9, max_inflight=100, **kw) == -1


def test_start_capacity_inflight_vs_queued_and_max_ahead():
    for admission, expect in [("inflight", 8 - 3), ("queued", 8 - 1)]:
        buf = AsyncRolloutBuffer(4, max_ahead=1, admission=admission)
        for gid in range(3):
            buf.start(gid, 0, 2)
        buf.put(_group(0, 0))
        # bound max_ahead=1: batches 0..1 of 4 groups; pending = 1 queued (+ 2 in flight)
        assert buf.start_capacity(engine_version=0, next_batch=0, groups_per_step=4, max_inflight=100) == expect
    assert may_take(3, engine_version=2) and not may_take(4, engine_version=2)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="max_off_policy_steps=-1"):
        AsyncRolloutBuffer(-1)
    with pytest.raises(ValueError, match="policy='keep'"):
        AsyncRolloutBuffer(1, policy="keep")
    with pytest.raises(ValueError, match="partial_groups='all'"):
        AsyncRolloutBuffer(1, partial_groups="all")
    with pytest.raises(ValueError, match="max_retries=-1"):
        AsyncRolloutBuffer(1, max_retries=-1)
    with pytest.raises(ValueError, match="max_ahead=3"):
        AsyncRolloutBuffer(2, max_ahead=3)
    with pytest.raises(ValueError, match="admission='x'"):
        AsyncRolloutBuffer(2, admission="x")
    with pytest.raises(ValueError, match="completion_logprobs"):
        Sample([1], [2, 3], [-0.5])
    buf = AsyncRolloutBuffer(1)
    buf.start(0, 0, 2)
    with pytest.raises(ValueError, match="group_id=0 is already in flight"):
        buf.start(0, 0, 2)
    with pytest.raises(ValueError, match="group 7 is not in flight"):
        buf.fail(7, "error")
    with pytest.raises(ValueError, match="group 7 is not in flight"):
        buf.put(_group(7, 0))
    with pytest.raises(ValueError, match="has 3 samples but only 2 started"):
        buf.put(_group(0, 0, n=3))
    with pytest.raises(ValueError, match="num_samples=2 exceeds"):
        buf.mark_trained(2)


def test_put_rejects_a_version_start_other_than_the_started_one():
    # started under v0 with bound 1; a group claiming v5 would pass as fresh at consume_version=5 (staleness 0)
    buf = AsyncRolloutBuffer(1)
    buf.start(0, 0, 2)
    with pytest.raises(ValueError, match=r"version_start=5 but start\(\) recorded version_start=0"):
        buf.put(_group(0, 5))
    # nothing moved: the group is still in flight and can be put correctly
    assert buf.num_inflight_groups == 1 and buf.counters.inflight == 2
    buf.put(_group(0, 0))
    assert buf.take(1, consume_version=5) is None  # staleness 5 > 1: dropped
    assert buf.counters.dropped_by_reason == {"stale_queued": 2}
    buf.counters.check()


def test_mark_trained_rejects_negative_and_check_covers_every_counter():
    from moe_rl.rl.buffer import BufferCounters

    buf = AsyncRolloutBuffer(1)
    _start_put(buf, 0, 0)
    buf.take(1, consume_version=0)
    with pytest.raises(ValueError, match="num_samples=-3 must be >= 0"):
        buf.mark_trained(-3)
    with pytest.raises(TypeError, match="num_samples=1.0 must be an int"):
        buf.mark_trained(1.0)
    assert (buf.counters.in_batch, buf.counters.trained) == (2, 0)  # nothing moved
    buf.mark_trained(2)
    buf.counters.check()
    # started == sum holds in each case below, but a counter is negative or per-reason counts disagree
    for bad in (dict(started=0, trained=-3, in_batch=3), dict(started=0, dropped=-1, withheld=1,
                                                               withheld_by_reason={"x": 1}, dropped_by_reason={"y": -1}),
                dict(masked_tokens=-1), dict(masked_samples=-1), dict(retried=-1), dict(abandoned=-2)):
        with pytest.raises(RuntimeError, match="negative counters"):
            BufferCounters(**bad).check()
    with pytest.raises(RuntimeError, match="dropped=2 but dropped_by_reason sums to 1"):
        BufferCounters(started=2, dropped=2, dropped_by_reason={"error": 1}).check()
    with pytest.raises(RuntimeError, match="started=3 but"):
        BufferCounters(started=3, trained=2).check()


def test_put_validates_version_segments_and_mask_rejects_future_versions():
    cases = [
        ([(5, 0), (3, 1)], r"group 0, sample 1: version segments .* strictly increase"),  # decreasing version
        ([(2, 0), (3, 0)], "strictly increase"),                                         # repeated index
        ([(3, 1)], r"must start with \(version, 0\)"),                                   # not from token 0
        ([(2, 0), (3, 2)], "last start index 2 >= num_tokens=2"),                        # beyond the completion
        ([(1, 0), (3, 1)], "start at version 1 < version_start=2"),                      # older than the start
    ]
    for segs, msg in cases:
        buf = AsyncRolloutBuffer(1)
        buf.start(0, 2, 2)
        with pytest.raises(ValueError, match=msg):
            buf.put(_group(0, 2, samples=[_sample(2), _sample(2, segments=segs)]))
        assert buf.num_inflight_groups == 1 and buf.counters.inflight == 2  # rejected before any change
        buf.counters.check()
    # mask: a token of version 6 cannot be consumed at version 5 (age -1 must not count as fresh)
    buf = AsyncRolloutBuffer(1, policy="mask")
    _start_put(buf, 0, 2, n=1, samples=[_sample(3, segments=[(2, 0), (6, 2)])])
    _start_put(buf, 1, 2, n=1)
    with pytest.raises(ValueError, match="consume_version=5 but queued group 0 has a token of version 6"):
        buf.take(1, consume_version=5)
    assert buf.num_queued_groups == 2 and buf.counters.queued == 2  # nothing removed
    got = buf.take(1, consume_version=6)  # ages 4,4,0 (group 0) / 4,4 (group 1: fully masked) with bound 1
    assert [g.group_id for g in got] == [0]
    assert [s.train_mask for g in got for s in g.samples] == [[False, False, True]]
    assert buf.counters.withheld_by_reason == {"fully_masked": 1} and buf.num_queued_groups == 0
    buf.counters.check()


def test_loose_types_raise_naming_the_argument():
    for args, kw, exc, msg in [
        (("2",), {}, TypeError, "max_off_policy_steps='2' must be an int"),
        ((1.5,), {}, TypeError, "max_off_policy_steps=1.5 must be an int"),
        ((True,), {}, TypeError, "max_off_policy_steps=True must be an int"),
        ((2,), {"max_ahead": 0.5}, TypeError, "max_ahead=0.5 must be an int or None"),
        ((2,), {"max_retries": 1.0}, TypeError, "max_retries=1.0 must be an int"),
        ((-1,), {}, ValueError, "max_off_policy_steps=-1 must be >= 0"),
    ]:
        with pytest.raises(exc, match=msg):
            AsyncRolloutBuffer(*args, **kw)
    import numpy as np

    assert AsyncRolloutBuffer(np.int64(2), max_ahead=np.int64(1)).max_off_policy_steps == 2  # numpy ints are ints
    buf = AsyncRolloutBuffer(1)
    with pytest.raises(TypeError, match="num_samples=2.5 must be an int"):
        buf.start(0, 0, 2.5)
    with pytest.raises(ValueError, match="num_samples=0 must be >= 1"):
        buf.start(0, 0, 0)
    with pytest.raises(ValueError, match="version_start=-1 must be >= 0"):
        buf.start(0, -1, 2)
    assert buf.num_inflight_groups == 0 and buf.counters.started == 0  # nothing recorded by a rejected start
    _start_put(buf, 0, 0)
    with pytest.raises(ValueError, match="num_groups=-1 must be >= 1"):
        buf.take(-1, consume_version=0)
    with pytest.raises(TypeError, match="consume_version=0.0 must be an int"):
        buf.take(1, consume_version=0.0)
    assert buf.num_queued_groups == 1
    buf.counters.check()
