"""Engine rows -> sample record (B13), multi-turn stitching, batch-first/packed alignment, transport."""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.replay import (
    FILL_ROW,
    OWN_ROW,
    RoutedExperts,
    batch_rows,
    complete_engine_rows,
    decode_rows,
    delta_start,
    encode_rows,
    stitch_records,
)


def _pattern(positions, k: int = 2, num_experts: int = 64) -> np.ndarray:
    """Row for position p: ids (2p mod E, 2p+1 mod E): distinct per row and visibly tied to p."""
    p = np.asarray(list(positions))[:, None, None]
    return (p * k + np.arange(k)[None, None, :]) % num_experts


def test_b13_two_turns_boundary_row():
    """Case B13: turn 1 = 4 prompt + 3 completion tokens, turn 2 = those 7 + 2 prompt + 2 completion."""
    turn1 = RoutedExperts.from_array(_pattern(range(6)), 64)  # engine: 7 - 1 rows, positions 0..5
    s1 = complete_engine_rows(turn1, 7)
    assert s1.num_tokens == 7 and s1.row_valid.tolist() == [True] * 6 + [False]
    assert s1.to_numpy()[6].tolist() == [[-1, -1]]  # placeholder, not expert 0

    # Turn 2 returns a delta from delta_start(7) = 6 (the old last token) up to position 9 (11 tokens - 1).
    assert delta_start(7) == 6 and delta_start(0) == 0
    turn2 = RoutedExperts.from_array(_pattern(range(6, 10)), 64, start=6)
    out = stitch_records([s1, turn2], 11)
    assert out.complete and out.conflicts == 0
    rows = out.record.to_numpy()
    assert rows.shape == (11, 1, 2)
    np.testing.assert_array_equal(rows[:10], _pattern(range(10)))  # every row at its own position
    assert rows[10].tolist() == [[-1, -1]]  # only the final sampled token is a placeholder

    # A full (non-delta) turn-2 record gives the same sample; rows 0..5 are kept from turn 1.
    full2 = RoutedExperts.from_array(_pattern(range(10)), 64)
    assert stitch_records([s1, full2], 11).record == out.record


def test_stitch_counts_conflicts_and_missing_rows():
    s1 = complete_engine_rows(RoutedExperts.from_array(_pattern(range(4)), 64), 5)
    other = _pattern(range(4, 8))
    other[0] = [[63, 62]]  # position 4 was turn 1's placeholder: turn 2's row fills it, no conflict
    t2 = RoutedExperts.from_array(other, 64, start=4)
    out = stitch_records([s1, t2], 9)
    assert out.conflicts == 0 and out.complete
    t2_overlap = RoutedExperts.from_array(np.concatenate([[[[5, 6]]], other]), 64, start=3)
    out = stitch_records([s1, t2_overlap], 9)
    assert out.conflicts == 1  # position 3 recorded twice with different ids; turn 1 kept
    assert out.record.to_numpy()[3].tolist() == _pattern([3])[0].tolist()
    gap = stitch_records([s1, RoutedExperts.from_array(_pattern(range(6, 8)), 64, start=6)], 9)
    assert gap.missing_rows == 2 and not gap.complete  # positions 4 and 5 were never recorded


def test_engine_row_count_mismatch_names_both_shapes():
    rec = RoutedExperts.from_array(_pattern(range(7)), 64)
    with pytest.raises(ValueError, match=r"shape \(7, 1, 2\).*needs \[6, 1, 2\]"):
        complete_engine_rows(rec, 7)


def _sample_records(lengths, layers=3, k=2, num_experts=16, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for n in lengths:
        ids = np.argsort(rng.random((n, layers, num_experts)), axis=-1)[..., :k]
        ids[-1] = -1
        recs.append(RoutedExperts.from_array(ids, num_experts))
    return recs


def test_every_token_gets_its_own_row_batch_first_and_packed():
    lengths = [5, 9, 3]
    recs = _sample_records(lengths)
    bf, stats = batch_rows(recs, lengths, num_layers=3, k=2, layout="batch_first", pad_to=12)
    pk, _ = batch_rows(recs, lengths, num_layers=3, k=2, layout="packed", pad_to=20)
    assert bf.shape == (3, 12, 3, 2) and pk.shape == (20, 3, 2) and stats.replayed_samples == 3
    off = 0
    for i, (rec, n) in enumerate(zip(recs, lengths, strict=True)):
        expect = rec.to_numpy(np.int64)
        np.testing.assert_array_equal(bf[i, :n], expect)
        np.testing.assert_array_equal(pk[off : off + n], expect)
        assert (bf[i, n:] == FILL_ROW).all()
        off += n
    assert (pk[off:] == FILL_ROW).all()
    # The packed layout is the batch-first one with the padding squeezed out, token for token.
    valid = np.arange(12)[None, :] < np.array(lengths)[:, None]
    np.testing.assert_array_equal(bf[valid], pk[:off])


def test_missing_or_incomplete_samples_route_themselves_and_are_counted():
    lengths = [4, 4, 4]
    recs = _sample_records(lengths)
    ids = recs[1].to_numpy(np.int64)
    ids[1] = -1
    recs[1] = RoutedExperts.from_array(ids, 16)
    rows, stats = batch_rows([recs[0], recs[1], None], lengths, num_layers=3, k=2)
    assert (stats.replayed_samples, stats.incomplete_samples, stats.no_record_samples) == (1, 1, 1)
    assert (rows[1:] == OWN_ROW).all()


def test_record_length_mismatch_names_both_shapes():
    recs = _sample_records([5])
    with pytest.raises(ValueError, match=r"sample 0: its record has shape \(5, 3, 2\).*holds 6 tokens"):
        batch_rows(recs, [6], num_layers=3, k=2)
    with pytest.raises(ValueError, match=r"pad_to=4 is shorter"):
        batch_rows(recs, [5], num_layers=3, k=2, pad_to=4)


@pytest.mark.parametrize(("num_experts", "dtype"), [(16, np.uint8), (384, np.int16)])
def test_transport_roundtrip(num_experts, dtype):
    lengths = [4, 6]
    recs = _sample_records(lengths, num_experts=num_experts)
    rows, _ = batch_rows([recs[0], None], lengths, num_layers=3, k=2)
    ids, state = encode_rows(rows, num_experts)
    assert ids.dtype == dtype and state.dtype == np.int8 and state.shape == (2, 6)
    assert state[0].tolist() == [0, 0, 0, FILL_ROW, FILL_ROW, FILL_ROW] and (state[1] == OWN_ROW).all()
    np.testing.assert_array_equal(decode_rows(ids, state), rows)
    with pytest.raises(ValueError, match="state has shape"):
        decode_rows(ids, state[:, :3])
