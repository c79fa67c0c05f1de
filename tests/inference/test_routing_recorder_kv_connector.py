"""RoutingRecorder on an engine with a KV connector (``recover_prefix=False``): positions the engine did not forward
are reported missing, never filled from the KV-block table (whose rows may belong to an earlier request)."""

from __future__ import annotations

import numpy as np

from moe_rl.inference.routing_capture import RoutingRecorder

M, K, E, BS = 2, 2, 16, 4


def _row(req: int, pos: int) -> np.ndarray:
    base = (req * 5 + pos * 3) % (E - 1)
    return np.array([[base, base + 1], [(base + 7) % (E - 1), (base + 7) % (E - 1) + 1]])


def _step(rec: RoutingRecorder, reqs: list[tuple[str, int, list[int]]], blocks: dict[str, list[int]]) -> None:
    ids = np.stack([_row(n, p) for _, n, ps in reqs for p in ps])
    qsl = np.cumsum([0] + [len(ps) for _, _, ps in reqs])
    positions = np.array([p for _, _, ps in reqs for p in ps])
    width = max(len(b) for b in blocks.values())
    table = np.array([blocks[r] + [0] * (width - len(blocks[r])) for r, _, _ in reqs])
    rec.begin_step()
    for m in range(M):
        rec.capture(m, ids[:, m])
    rec.end_step([r for r, _, _ in reqs], qsl, positions, table)


def _reused_blocks(recover_prefix: bool) -> dict:
    """Request ``old`` forwards 8 tokens into blocks 3, 4; then ``new`` arrives with 8 tokens already computed in
    the same physical blocks (a prefix hit, or KV a connector injected into recycled blocks) and forwards 8, 9."""
    rec = RoutingRecorder(M, K, E, BS, 32, recover_prefix=recover_prefix)
    blocks = {"old": [3, 4], "new": [3, 4, 5]}
    _step(rec, [("old", 0, list(range(8)))], blocks)
    _step(rec, [("new", 1, [8, 9])], blocks)
    return rec.pop("new")


def test_default_recovers_the_block_rows():
    got = _reused_blocks(True)
    assert got["recovered_rows"] == 8 and got["missing_rows"] == 0
    np.testing.assert_array_equal(got["rows"][:8], np.stack([_row(0, p) for p in range(8)]))


def test_without_recovery_the_unforwarded_positions_are_missing():
    got = _reused_blocks(False)
    assert got["rows"].shape[0] == 10 and got["recovered_rows"] == 0 and got["missing_rows"] == 8
    assert (got["rows"][:8] == -1).all()
    np.testing.assert_array_equal(got["rows"][8:], np.stack([_row(1, p) for p in (8, 9)]))
