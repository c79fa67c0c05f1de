"""Property tests of AsyncRolloutBuffer (hypothesis): random interleavings of group starts, token emissions,
weight updates, finishes (with failed members), cancellations, batch takes and trainer steps, under every
policy and group rule.

Checked after every event and at the end:
- no trained token exceeds the bound: ``consume_version - token_version <= max_off_policy_steps`` for every
  token with loss (all tokens under drop/withhold, the ``train_mask`` ones under mask);
- the counters add up (``BufferCounters.check``) and match an independent per-sample ledger;
- every started sample ends trained, dropped or withheld exactly once (after a drain phase);
- no deadlock: after every in-flight rollout goes stale at once (a burst of weight updates), driving the
  loop as the orchestrator does (admit, finish, take, train) always produces the next batch.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.rl.buffer import AsyncRolloutBuffer, RolloutGroup, Sample, may_take, token_versions

POLICIES = ["drop", "withhold", "mask"]
GROUPS = ["survivors", "drop_group"]
GROUP_SIZE = 2
GPS = 2  # groups per batch


class Loop:
    """A minimal orchestrator + engine + trainer around the buffer, with an independent ledger."""

    def __init__(self, limit: int, policy: str, partial: str, admission: str):
        self.limit = limit
        self.policy = policy
        self.buf = AsyncRolloutBuffer(limit, policy=policy, partial_groups=partial, max_retries=2,
                                      admission=admission)
        self.engine_v = 0   # version the engine serves
        self.trainer_v = 0  # batches trained
        self.next_batch = 0
        self.batches: list[list[RolloutGroup]] = []
        self.inflight: dict[int, dict] = {}  # gid -> {"v": start, "tokens": [[versions per member]]}
        self.gid = 0
        self.ledger: dict[tuple[int, int], str] = {}  # (gid, member) -> state
        self.trained_ids: set[int] = set()
        self.keep_alive: list[Sample] = []

    # -- events
    def start(self, force: bool = False) -> None:
        cap = self.buf.start_capacity(self.engine_v, self.next_batch, GPS, max_inflight=6)
        if cap <= 0 and not force:
            return
        retry = self.buf.next_retry()
        prompt = retry[0] if retry else f"p{self.gid}"
        self.buf.start(self.gid, self.engine_v, GROUP_SIZE, prompt=prompt, retries=retry[1] if retry else 0)
        self.inflight[self.gid] = {"v": self.engine_v, "tokens": [[] for _ in range(GROUP_SIZE)]}
        for m in range(GROUP_SIZE):
            self.ledger[(self.gid, m)] = "inflight"
        self.gid += 1

    def emit(self, which: int, k: int) -> None:
        if self.inflight:
            gid = sorted(self.inflight)[which % len(self.inflight)]
            for toks in self.inflight[gid]["tokens"]:
                toks.extend([self.engine_v] * k)

    def update(self) -> None:
        # the engine adopts the trainer's newest version (it may skip several)
        self.engine_v = self.trainer_v

    def finish(self, which: int, failed: int) -> None:
        if not self.inflight:
            return
        gid = sorted(self.inflight)[which % len(self.inflight)]
        rec = self.inflight.pop(gid)
        samples = []
        for m, toks in enumerate(rec["tokens"]):
            if m < failed:
                self.ledger[(gid, m)] = "dropped"  # a failed member
                continue
            toks = toks or [self.engine_v]
            segs = [(toks[0], 0)] + [(v, i) for i, v in enumerate(toks) if i and v != toks[i - 1]]
            s = Sample([1], [5] * len(toks), [-0.1] * len(toks), reward=float(m), version_segments=segs)
            s.member = m  # type: ignore[attr-defined]
            samples.append(s)
        withheld_before = self.buf.counters.withheld
        self.buf.put(RolloutGroup(gid, rec["v"], "", samples, version_end=self.engine_v))
        for s in samples:
            self.ledger[(gid, s.member)] = "queued"
        if self.buf.counters.withheld > withheld_before:  # withheld in flight: the whole group
            for s in samples:
                self.ledger[(gid, s.member)] = "gone"
        if failed and self.buf.partial_groups == "drop_group":
            for s in samples:
                self.ledger[(gid, s.member)] = "gone"

    def take(self) -> bool:
        if not may_take(self.next_batch, self.engine_v):
            return False
        got = self.buf.take(GPS, consume_version=self.next_batch)
        if got is None:
            return False
        n = self.next_batch
        for g in got:
            for s in g.samples:
                assert id(s) not in self.trained_ids, "a sample was handed to two batches"
                self.trained_ids.add(id(s))
                self.keep_alive.append(s)  # ids stay unique only while the objects live
                self.ledger[(g.group_id, s.member)] = "in_batch"
                versions = token_versions(len(s.completion_ids), g.version_start, s.version_segments)
                mask = s.train_mask if s.train_mask is not None else [True] * len(versions)
                ages = [n - v for v, keep in zip(versions, mask, strict=True) if keep]
                assert ages and max(ages) <= self.limit, (self.policy, n, g.version_start, versions, mask)
                if self.policy != "mask":
                    assert n - g.version_start <= self.limit
        self.batches.append(got)
        self.next_batch += 1
        for gid in self.buf.expire_inflight(self.next_batch):
            self.cancel(gid)
        return True

    def cancel(self, gid: int) -> None:
        self.inflight.pop(gid)
        self.buf.fail(gid, "stale_inflight")
        for m in range(GROUP_SIZE):
            self.ledger[(gid, m)] = "dropped"

    def train(self) -> bool:
        if not self.batches:
            return False
        got = self.batches.pop(0)
        self.buf.mark_trained(sum(g.size for g in got))
        for g in got:
            for s in g.samples:
                self.ledger[(g.group_id, s.member)] = "trained"
        self.trainer_v += 1
        return True

    def check(self) -> None:
        c = self.buf.counters
        c.check()
        states = list(self.ledger.values())
        assert c.started == len(states)
        assert c.inflight == states.count("inflight")
        assert c.in_batch == states.count("in_batch")
        assert c.trained == states.count("trained")

    def drain(self, target_batches: int) -> None:
        """Drive the loop as the orchestrator does until ``target_batches`` more batches are trained; fails if it
        cannot (a deadlock)."""
        goal = self.trainer_v + target_batches
        for _ in range(200):
            if self.trainer_v >= goal:
                return
            self.update()
            self.start()
            for i in range(len(self.inflight)):
                self.emit(i, 1)
            while self.inflight:
                self.finish(0, failed=0)
            while self.take():
                pass
            self.train()
            self.check()
        raise AssertionError(f"no progress: {self.buf.counters}, next batch {self.next_batch}, "
                             f"engine v{self.engine_v}, trainer v{self.trainer_v}")

    def finish_everything(self) -> None:
        """End of run: finish what is in flight, train what is batched, release what is queued."""
        while self.inflight:
            self.finish(0, failed=0)
        while self.batches:
            self.train()
        self.buf.drop_stale(consume_version=10**6)  # everything queued is now too old
        c = self.buf.counters
        assert (c.inflight, c.queued, c.in_batch) == (0, 0, 0)
        assert c.started == c.trained + c.dropped + c.withheld


EVENTS = st.lists(
    st.tuples(st.sampled_from(["start", "force_start", "emit", "update", "finish", "take", "train", "all_stale"]),
              st.integers(0, 7), st.integers(0, 3)),
    max_size=70,
)


@pytest.mark.parametrize("partial", GROUPS)
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(limit=st.integers(0, 3), admission=st.sampled_from(["inflight", "queued"]), events=EVENTS)
def test_random_interleavings(policy, partial, limit, admission, events):
    loop = Loop(limit, policy, partial, admission)
    for kind, a, b in events:
        if kind == "start":
            loop.start()
        elif kind == "force_start":
            loop.start(force=True)
        elif kind == "emit":
            loop.emit(a, b + 1)
        elif kind == "update":
            loop.update()
        elif kind == "finish":
            loop.finish(a, failed=1 if b == 3 else 0)
        elif kind == "take":
            loop.take()
        elif kind == "train":
            loop.train()
        elif kind == "all_stale":
            # every in-flight rollout goes stale at once: the trainer trains what is batched, then limit + 1
            # batches made of rollouts outside this test, and the engine adopts the new version
            while loop.train():
                pass
            loop.next_batch += limit + 1
            loop.trainer_v = loop.next_batch
            loop.update()
            for gid in loop.buf.expire_inflight(loop.next_batch):
                loop.cancel(gid)
        loop.check()
    loop.drain(target_batches=2)
    loop.finish_everything()
