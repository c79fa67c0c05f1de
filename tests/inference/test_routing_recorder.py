"""RoutingRecorder (worker-side routed-experts store) on synthetic engine steps: no vLLM needed."""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.inference.request_ids import completion_external_id, parse_engine_request_id
from moe_rl.inference.routing_capture import RoutingRecorder

M, K, E, BS = 2, 2, 16, 4


def _row(req: int, pos: int) -> np.ndarray:
    """A distinct, recognisable [M, K] row for (request, position)."""
    base = (req * 5 + pos * 3) % (E - 1)
    return np.array([[base, base + 1], [(base + 7) % (E - 1), (base + 7) % (E - 1) + 1]])


def _step(rec: RoutingRecorder, reqs: list[tuple[str, int, list[int]]], blocks: dict[str, list[int]], pad: int = 0):
    """One engine step: ``reqs`` = (engine id, request number, positions forwarded), then ``pad`` padding rows."""
    rows = [_row(n, p) for _, n, ps in reqs for p in ps] + [np.full((M, K), 9)] * pad
    ids = np.stack(rows)  # [N, M, K]
    qsl = np.cumsum([0] + [len(ps) for _, _, ps in reqs])
    positions = np.array([p for _, _, ps in reqs for p in ps] + [0] * pad)
    width = max(len(b) for b in blocks.values())
    table = np.array([blocks[r] + [0] * (width - len(blocks[r])) for r, _, _ in reqs])  # [num_reqs, max_blocks]
    rec.begin_step()
    for m in range(M):
        rec.capture(m, ids[:, m])
    rec.end_step([r for r, _, _ in reqs], qsl, positions, table)


def test_concurrent_prefill_decode_padding_and_prefix_hit():
    rec = RoutingRecorder(M, K, E, BS, 32)
    blocks = {"a": [10, 11, 12], "b": [20, 21], "c": [10, 11, 30]}
    # step 1: a prefills 0..5, b prefills 0..2 (chunk), 3 padding rows (must be ignored)
    _step(rec, [("a", 0, list(range(6))), ("b", 1, [0, 1, 2])], blocks, pad=3)
    # step 2: b's next chunk first (decode-first reordering does not matter), a decodes position 6;
    # c arrives with 8 prompt tokens cached (blocks 10, 11 shared with a) and forwards 8, 9
    _step(rec, [("b", 1, [3, 4]), ("a", 0, [6]), ("c", 2, [8, 9])], blocks)
    a, b, c = rec.pop("a"), rec.pop("b"), rec.pop("c")
    np.testing.assert_array_equal(a["rows"], np.stack([_row(0, p) for p in range(7)]))
    np.testing.assert_array_equal(b["rows"], np.stack([_row(1, p) for p in range(5)]))
    assert a["missing_rows"] == b["missing_rows"] == 0
    # c: positions 0..3 come from block 10 (written by a), 4..6 from block 11 (a's positions 4, 5 and, in this
    # same step, 6); nobody wrote position 7 -> that row is missing (counted, never guessed).
    assert c["recovered_rows"] == 7 and c["missing_rows"] == 1
    np.testing.assert_array_equal(c["rows"][:7], np.stack([_row(0, p) for p in range(7)]))
    assert (c["rows"][7] == -1).all()
    np.testing.assert_array_equal(c["rows"][8:], np.stack([_row(2, p) for p in (8, 9)]))
    assert rec.mixed_steps == 1 and rec.steps == 2  # step 2 mixes prefill chunks with a decode and rec.pop("a") is None


def test_prefix_hit_on_blocks_written_in_the_same_step():
    """vLLM may admit a request on a hit against blocks another request computes in the same step."""
    rec = RoutingRecorder(M, K, E, BS, 32)
    blocks = {"w": [5, 6], "r": [5, 7]}
    _step(rec, [("r", 1, [4, 5]), ("w", 0, list(range(8)))], blocks)  # the reader comes first in the batch
    r = rec.pop("r")
    assert r["missing_rows"] == 0 and r["recovered_rows"] == 4
    np.testing.assert_array_equal(r["rows"][:4], np.stack([_row(0, p) for p in range(4)]))


def test_stale_rows_of_a_reused_block_are_overwritten_before_any_hit():
    rec = RoutingRecorder(M, K, E, BS, 32)
    _step(rec, [("old", 0, list(range(4)))], {"old": [3]})
    _step(rec, [("new", 1, list(range(4)))], {"new": [3]})  # block 3 freed and reused
    _step(rec, [("hit", 2, [4])], {"hit": [3, 8]})
    np.testing.assert_array_equal(rec.pop("hit")["rows"][:4], np.stack([_row(1, p) for p in range(4)]))


def test_partial_capture_and_eviction_are_reported():
    rec = RoutingRecorder(M, K, E, BS, 32, max_requests=2)
    for i in range(3):
        _step(rec, [(f"q{i}", i, [0, 1])], {f"q{i}": [i]})
    assert rec.evicted == 1 and rec.pop("q0") is None
    rec.begin_step()
    rec.capture(0, np.zeros((1, K), dtype=np.int64))
    with pytest.raises(RuntimeError, match="1 of 2 MoE layers reported ids"):
        rec.end_step(["x"], np.array([0, 1]), np.array([0]), np.zeros((1, 1), dtype=np.int64))


@pytest.mark.parametrize(
    ("engine_id", "external", "choice"),
    [("cmpl-moe_rl-ab-0-1a2b3c4d", "cmpl-moe_rl-ab-0", 0), ("3_cmpl-moe_rl-ab-0-1a2b3c4d", "cmpl-moe_rl-ab-0", 3),
     ("12_0-deadbeef", "0", 12)],
)
def test_engine_request_ids(engine_id, external, choice):
    parsed = parse_engine_request_id(engine_id)
    assert parsed == (external, choice) and parsed.external_id == external and parsed.choice_index == choice
    assert completion_external_id("moe_rl-ab") == "cmpl-moe_rl-ab-0"
    with pytest.raises(ValueError, match="no 8-hex-char random suffix"):
        parse_engine_request_id("cmpl-x-0")
    assert parse_engine_request_id("2_cmpl-x-0", randomized=False) == ("cmpl-x-0", 2)


def test_pop_for_clients_groups_records_by_client_request_and_choice():
    """The worker's ``pop_routed_experts``: records of the asked client requests only, keyed by external id and
    choice index, each decoding to the recorded rows (placeholder rows marked invalid); popped once; capture off is
    a RuntimeError naming the method that enables it."""
    import base64
    from types import SimpleNamespace

    from moe_rl.inference.routing_capture import pop_for_clients
    from moe_rl.replay.indices import TokenIndices

    rec = RoutingRecorder(M, K, E, BS, 32, layer_ids=[1, 3])
    ext = completion_external_id("moe_rl-ab")
    blocks = {f"{ext}-1a2b3c4d": [10, 11], f"1_{ext}-1a2b3c4d": [20, 21], "cmpl-other-0-1a2b3c4d": [30]}
    _step(rec, [(f"{ext}-1a2b3c4d", 0, [0, 1, 2]), (f"1_{ext}-1a2b3c4d", 1, [0, 1]),
                ("cmpl-other-0-1a2b3c4d", 2, [0])], blocks)
    worker = SimpleNamespace(_moe_rl_routing=rec)
    got = pop_for_clients(worker, [ext])
    assert got["layer_ids"] == [1, 3] and set(got["records"]) == {ext} and set(got["records"][ext]) == {"0", "1"}
    for choice, (req, n) in {"0": (0, 3), "1": (1, 2)}.items():
        entry = got["records"][ext][choice]
        assert (entry["length"], entry["recovered_rows"], entry["missing_rows"]) == (n, 0, 0)
        ti = TokenIndices.from_bytes(base64.b64decode(entry["data"]))
        assert np.asarray(ti.row_valid).all()
        np.testing.assert_array_equal(np.asarray(ti.ids).reshape(n, M, K), np.stack([_row(req, p) for p in range(n)]))
    assert pop_for_clients(worker, [ext]) == {"records": {}, "layer_ids": [1, 3]}  # popped
    assert set(pop_for_clients(worker, ["cmpl-other-0"])["records"]) == {"cmpl-other-0"}
    with pytest.raises(RuntimeError, match="pop_routed_experts: capture is off; call enable_routed_experts_capture"):
        pop_for_clients(SimpleNamespace(), [ext])
