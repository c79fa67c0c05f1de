"""AsyncRolloutBuffer staleness rules and accounting (shared/cases B18)."""

import pytest

from moe_rl.rl.buffer import AsyncRolloutBuffer, RolloutGroup, Sample


def _group(gid: int, v_start: int, v_end: int | None = None, n: int = 2) -> RolloutGroup:
    samples = [Sample([1, 5], [6, 2], [-0.1, -0.2], reward=float(i)) for i in range(n)]
    return RolloutGroup(gid, v_start, f"salt-v{v_start}", samples, version_end=v_start if v_end is None else v_end)


def _run_b18(limit: int) -> dict[str, bool]:
    """R1: starts v5, finishes v5. R2: starts v5, update to v6 mid-generation. R3: starts v4.
    All consumed by the trainer at v6... except R1/R2 which the case consumes at their finish version."""
    buf = AsyncRolloutBuffer(max_off_policy_steps=limit)
    # staleness is measured at consumption: R1 consumed at v5, R2 at v6, R3 at v6
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
    # trainer step 0, latest checkpoint 0, async level 0: rollouts may start right away
    assert buf.may_start(engine_version=0, next_batch=0)
    assert not buf.may_start(engine_version=0, next_batch=1)


def test_b18_queue_time_counts_and_all_rejected_does_not_deadlock():
    buf = AsyncRolloutBuffer(1)
    for gid in range(3):
        buf.on_started(2)
        buf.put(_group(gid, v_start=0), expected_samples=2)
    # finished at v0 but consumed at v2: too stale although they finished long ago (queue time counts)
    assert buf.take(1, consume_version=2) is None
    assert buf.counters.dropped == 6 and buf.counters.dropped_by_reason == {"stale_queued": 6}
    buf.counters.check()
    # the buffer keeps producing batches from fresh groups afterwards
    buf.on_started(2)
    buf.put(_group(9, v_start=2), expected_samples=2)
    got = buf.take(1, consume_version=2)
    assert got is not None and got[0].group_id == 9
    buf.mark_trained(2)
    buf.counters.check()
    assert buf.counters.trained == 2


def test_take_is_fifo_and_counts_staleness():
    buf = AsyncRolloutBuffer(2)
    for gid, v in enumerate([0, 1, 1, 2]):
        buf.on_started(2)
        buf.put(_group(gid, v), expected_samples=2)
    groups = buf.take(2, consume_version=2)
    assert [g.group_id for g in groups] == [0, 1]
    assert dict(buf.staleness_hist) == {2: 2, 1: 2}
    assert buf.counters.in_batch == 4 and buf.counters.queued == 4
    buf.counters.check()


def test_inflight_drop_and_partial_group_accounting():
    buf = AsyncRolloutBuffer(1)
    buf.on_started(4)
    buf.on_dropped_inflight(4, "stale_inflight")
    buf.on_started(4)
    buf.put(_group(1, 0, n=3), expected_samples=4)  # one sample failed
    c = buf.counters
    assert (c.started, c.inflight, c.queued, c.dropped) == (8, 0, 3, 5)
    assert c.dropped_by_reason == {"stale_inflight": 4, "error": 1}
    c.check()


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="max_off_policy_steps=-1"):
        AsyncRolloutBuffer(-1)
    with pytest.raises(ValueError, match="completion_logprobs"):
        Sample([1], [2, 3], [-0.5])


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.lists(st.tuples(st.sampled_from(["start", "finish", "drop", "take", "train"]),
                                             st.integers(0, 5)), max_size=60))
def test_accounting_invariant_under_any_event_order(limit, events):
    """Whatever happens, every started sample is inflight, queued, in a batch, trained or dropped, and no
    batch ever holds a group staler than the limit."""
    buf = AsyncRolloutBuffer(limit)
    inflight: list[int] = []  # start versions of in-flight groups (2 samples each)
    batches: list[int] = []   # sample counts of untrained batches
    version = 0
    gid = 0
    for kind, x in events:
        if kind == "start":
            buf.on_started(2)
            inflight.append(version)
        elif kind == "finish" and inflight:
            v = inflight.pop(0)
            n = 2 if x % 3 else 1  # sometimes one sample fails
            buf.put(_group(gid, v, n=n), expected_samples=2)
            gid += 1
        elif kind == "drop" and inflight:
            inflight.pop()
            buf.on_dropped_inflight(2, "stale_inflight")
        elif kind == "take":
            consume = version + (x % 2)
            groups = buf.take(1, consume_version=consume)
            if groups:
                assert all(consume - g.version_start <= limit for g in groups)
                batches.append(sum(g.size for g in groups))
        elif kind == "train" and batches:
            buf.mark_trained(batches.pop(0))
            version += 1
        buf.counters.check()
