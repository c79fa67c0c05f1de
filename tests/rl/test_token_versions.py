"""Version segments (``moe_rl.rl.token_versions``) and the client-side reload bookkeeping
(``moe_rl.inference.token_versions``) against a brute-force event simulation.

The simulation plays one engine: requests arrive, wait, get scheduled, sample tokens one per step, finish;
reloads happen between steps. It knows the true version of every token and produces the same reports the
worker extension produces (running counts, first-scheduled ids since the previous reload). The tracker only
sees what the client sees (send order, reports when the RPC returns, responses) and must reproduce the truth.
"""

import random

import pytest

from moe_rl.inference.token_versions import VersionTracker, parse_internal_request_id
from moe_rl.rl.token_versions import check_segments, normalize_segments, token_versions_from_segments


def test_normalize_and_expand():
    assert normalize_segments([(4, 0), (5, 3), (7, 6)], 7) == [(4, 0), (5, 3), (7, 6)]
    assert token_versions_from_segments([(4, 0), (5, 3), (7, 6)], 7) == [4, 4, 4, 5, 5, 5, 7]
    # two loads between the same two tokens: the later one sampled the token
    assert normalize_segments([(0, 0), (1, 0), (2, 0)], 5) == [(2, 0)]
    assert normalize_segments([(0, 0), (1, 2), (2, 2)], 5) == [(0, 0), (2, 2)]
    # a load after the last token changes nothing; equal versions merge
    assert normalize_segments([(0, 0), (1, 5)], 5) == [(0, 0)]
    assert normalize_segments([(3, 0), (3, 2)], 5) == [(3, 0)]
    with pytest.raises(ValueError, match="start at token 0"):
        normalize_segments([(0, 1)], 3)
    with pytest.raises(ValueError, match="go backwards"):
        normalize_segments([(2, 0), (1, 1)], 3)
    with pytest.raises(ValueError, match="strictly increase"):
        check_segments([(0, 0), (0, 2)], 3)
    with pytest.raises(ValueError, match="num_tokens=2"):
        token_versions_from_segments([(0, 0), (1, 2)], 2)


def test_parse_internal_request_id():
    assert parse_internal_request_id("cmpl-moe_rl-9f-0-0123456789abcdef") == ("moe_rl-9f", 0)
    assert parse_internal_request_id("7_cmpl-moe_rl-9f-0-0123456789abcdef") == ("moe_rl-9f", 7)
    assert parse_internal_request_id("chatcmpl-x-0123") is None
    assert parse_internal_request_id("cmpl-moe_rl-9f-1-0123456789abcdef") is None  # second prompt: not ours


def _internal(rid, choice, n):
    return (f"{choice}_" if n > 1 else "") + f"cmpl-{rid}-0-{random.getrandbits(64):016x}"


def simulate(seed, n_requests=40, max_batch=4):
    """Random interleaving; returns (true versions per (rid, choice), segments from the tracker)."""
    rng = random.Random(seed)
    tracker = VersionTracker()
    tracker.start(version=3, seq=5)
    engine_version, reload_seq = 3, 5
    waiting, running, finished_tokens = [], {}, {}  # internal id -> list of versions
    internal_of, new_since = {}, []
    truth, got = {}, {}
    to_send = list(range(n_requests))
    pending_reload = None  # (version, report) delivered to the client later (RPC reply in transit)
    pending_responses = []  # (rid, n, lengths) responses in transit
    reloads_in_flight = 0
    budgets = {}
    while to_send or waiting or running or pending_reload or pending_responses:
        ev = rng.random()
        if to_send and ev < 0.2:  # client sends a request
            k = to_send.pop(0)
            rid, n = f"moe_rl-{k}", rng.choice([1, 1, 2, 3])
            tracker.begin(rid)
            for c in range(n):
                iid = _internal(rid, c, n)
                internal_of[iid] = (rid, c, n)
                waiting.append(iid)
                budgets[iid] = rng.randint(1, 12)
        elif ev < 0.3 and pending_reload is None:  # engine processes a reload between two steps
            engine_version += rng.randint(1, 2)
            report = {"seq": reload_seq, "running": {i: len(v) for i, v in running.items()}, "new": list(new_since),
                      "new_dropped": 0, "exact": True}
            reload_seq += 1
            new_since = []
            pending_reload = (engine_version, report)
            reloads_in_flight += 1
        elif ev < 0.4 and pending_reload is not None:  # the reload's RPC reply reaches the client
            tracker.add_reload(pending_reload[1], pending_reload[0])
            pending_reload = None
            reloads_in_flight -= 1
        elif ev < 0.5 and pending_responses and reloads_in_flight == 0:  # client resolves a finished request
            rid, n, lengths = pending_responses.pop(0)
            for c in range(n):
                got[(rid, c)] = tracker.segments(rid, c, lengths[c])
            tracker.end(rid)
        else:  # one engine step: schedule up to max_batch, sample one token each
            while waiting and len(running) < max_batch:
                iid = waiting.pop(0)
                running[iid] = []
                new_since.append(iid)
            for iid in list(running):
                running[iid].append(engine_version)
                if len(running[iid]) == budgets[iid]:
                    finished_tokens[iid] = running.pop(iid)
                    rid, c, n = internal_of[iid]
                    truth[(rid, c)] = finished_tokens[iid]
                    if all((rid, cc) in truth for cc in range(n)):
                        pending_responses.append((rid, n, [len(truth[(rid, cc)]) for cc in range(n)]))
    return truth, got, tracker


@pytest.mark.parametrize("seed", range(30))
def test_tracker_reproduces_true_token_versions(seed):
    truth, got, tracker = simulate(seed)
    assert set(got) == set(truth)
    for key, versions in truth.items():
        assert got[key] is not None
        assert token_versions_from_segments(got[key], len(versions)) == versions, (key, got[key], versions)
    assert tracker.unknown == 0 and tracker.gaps == 0
    assert len(tracker._records) <= 1  # pruned once nothing is in flight


def test_tracker_marks_gap_and_truncation_unknown():
    t = VersionTracker()
    t.start(version=0, seq=0)
    t.begin("a")
    iid = "cmpl-a-0-00000000000000aa"
    t.add_reload({"seq": 1, "running": {iid: 2}, "new": [iid]}, 1)  # seq 0 missing: another client reloaded
    assert t.segments("a", 0, 5) is None and t.gaps == 1 and t.unknown == 1
    t.end("a")
    t.begin("b")
    t.add_reload({"seq": 2, "running": {}, "new": [], "new_dropped": 3}, 2)  # truncated "new": ambiguous
    assert t.segments("b", 0, 4) is None
    t.end("b")
    t.begin("c")  # after both: exact again
    t.add_reload({"seq": 3, "running": {"cmpl-c-0-00000000000000cc": 1}, "new": ["cmpl-c-0-00000000000000cc"]}, 3)
    assert t.segments("c", 0, 4) == [(2, 0), (3, 1)]
    with pytest.raises(ValueError, match="already in flight"):
        t.begin("c")
