"""RoutedExperts / DsaIndices container: validation, storage dtype, raw and bit-packed codec."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_rl.replay import DsaIndices, RoutedExperts, TokenIndices, bits_per_id, storage_dtype


def _routing(rng: np.random.Generator, seq: int, layers: int, k: int, num_experts: int) -> np.ndarray:
    """Random distinct top-k ids per (token, layer), last row a placeholder."""
    ids = np.argsort(rng.random((seq, layers, num_experts)), axis=-1)[..., :k].astype(np.int64)
    ids[-1] = -1
    return ids


@pytest.mark.parametrize(
    ("num_ids", "sentinel", "dtype"),
    [(2, False, np.uint8), (256, False, np.uint8), (257, False, np.int16), (384, False, np.int16),
     (32768, False, np.int16), (32769, False, np.int32), (256, True, np.int16), (2048, True, np.int16),
     (131072, True, np.int32)],
)
def test_storage_dtype(num_ids, sentinel, dtype):
    assert storage_dtype(num_ids, entry_sentinel=sentinel) == np.dtype(dtype)


@pytest.mark.parametrize(("num_ids", "bits"), [(2, 1), (8, 3), (9, 4), (160, 8), (256, 8), (384, 9)])
def test_bits_per_id(num_ids, bits):
    assert bits_per_id(num_ids) == bits == math.ceil(math.log2(num_ids))
    assert bits_per_id(num_ids, entry_sentinel=True) == math.ceil(math.log2(num_ids + 1))


@pytest.mark.parametrize("num_experts", [8, 256, 384])
@pytest.mark.parametrize("packed", [False, True])
def test_routed_experts_roundtrip(num_experts, packed):
    rng = np.random.default_rng(num_experts)
    arr = _routing(rng, seq=37, layers=5, k=8, num_experts=num_experts)
    arr[10] = -1  # a placeholder row in the middle
    rec = RoutedExperts.from_array(arr, num_experts, start=3)
    assert rec.ids.dtype == storage_dtype(num_experts)
    assert rec.num_placeholder_rows == 2 and rec.shape == (37, 5, 8)
    data = rec.to_bytes(packed=packed)
    back = TokenIndices.from_bytes(data)
    assert type(back) is RoutedExperts and back == rec and back.start == 3
    np.testing.assert_array_equal(back.to_numpy(), arr)
    header_and_mask = 32 + math.ceil(37 / 8)
    per_token = rec.nbytes_per_token(packed)
    assert len(data) == header_and_mask + math.ceil(37 * per_token)
    if packed:
        assert per_token == 5 * 8 * math.ceil(math.log2(num_experts)) / 8
    else:
        assert per_token == 5 * 8 * (1 if num_experts <= 256 else 2)


def test_bytes_per_token_glm5_class():
    """GLM-5-class routing: 75 MoE layers x top-8 of 256 experts -> 600 B/token raw; 9-bit ids for Kimi-K2."""
    glm = RoutedExperts.placeholder(1, 75, 8, 256)
    assert glm.nbytes_per_token() == 600 and glm.nbytes_per_token(packed=True) == 600
    kimi = RoutedExperts.placeholder(1, 60, 8, 384)
    assert kimi.nbytes_per_token() == 960 and kimi.nbytes_per_token(packed=True) == 540


def test_placeholder_is_minus_one_not_expert_zero():
    arr = np.array([[[0, 1]], [[-1, -1]]])
    rec = RoutedExperts.from_array(arr, 4)
    assert rec.row_valid.tolist() == [True, False]
    assert rec.to_numpy().tolist() == [[[0, 1]], [[-1, -1]]]
    back = TokenIndices.from_bytes(rec.to_bytes(packed=True))
    assert back.to_numpy().tolist() == [[[0, 1]], [[-1, -1]]]


@pytest.mark.parametrize(
    ("arr", "pattern"),
    [
        ([[[0, 4]]], r"ids\[0, 0, 1\] = 4 is outside \[0, N\).*N = num_ids = 4"),
        ([[[0, -1]]], r"ids\[0, 0, 1\] = -1 is outside"),
        ([[[2, 2]]], r"row 0, layer 0 repeats an id \[2, 2\]"),
        ([[0, 1]], r"shape \(1, 2\); expected \[S, L, K\]"),
    ],
)
def test_routed_experts_validation(arr, pattern):
    with pytest.raises(ValueError, match=pattern):
        RoutedExperts.from_array(np.array(arr), 4)


def test_float_ids_rejected():
    with pytest.raises(TypeError, match="integer dtype"):
        RoutedExperts.from_array(np.zeros((1, 1, 2)), 4)


def test_dsa_indices_codec_with_causal_sentinels():
    """DSA index replay record: query i keeps min(topk, i+1) keys <= i, the rest -1 (int16 up to 32768 keys)."""
    rng = np.random.default_rng(0)
    seq, layers, topk = 300, 3, 64
    arr = np.full((seq, layers, topk), -1, dtype=np.int64)
    for i in range(seq):
        for layer in range(layers):
            n = min(topk, i + 1)
            arr[i, layer, :n] = np.sort(rng.choice(i + 1, size=n, replace=False))
    arr[-1] = -1  # last token never forwarded
    rec = DsaIndices.from_array(arr, num_ids=4096)
    assert rec.ids.dtype == np.int16 and rec.num_placeholder_rows == 1
    for packed in (False, True):
        data = rec.to_bytes(packed=packed)
        back = TokenIndices.from_bytes(data)
        assert type(back) is DsaIndices
        np.testing.assert_array_equal(back.to_numpy(), arr)
    assert rec.nbytes_per_token(packed=True) == layers * topk * 13 / 8  # ceil(log2(4097)) = 13 bits
    big = DsaIndices.from_array(np.array([[[70000, -1]]]), num_ids=131072, start=70000)  # causal: key <= position
    assert big.ids.dtype == np.int32
    assert TokenIndices.from_bytes(big.to_bytes(packed=True)).to_numpy().tolist() == [[[70000, -1]]]


def test_from_bytes_errors():
    rec = RoutedExperts.from_array(np.array([[[0, 1]]]), 4)
    data = rec.to_bytes()
    with pytest.raises(ValueError, match="magic"):
        TokenIndices.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="format version 9"):
        TokenIndices.from_bytes(data[:4] + bytes([9]) + data[5:])
    with pytest.raises(ValueError, match="payload is 1 bytes, header says 2"):
        TokenIndices.from_bytes(data[:-1])
    with pytest.raises(ValueError, match="shorter than"):
        TokenIndices.from_bytes(data[:10])


def test_no_pickle_in_wire_format():
    data = RoutedExperts.from_array(np.array([[[3, 1]], [[-1, -1]]]), 4).to_bytes()
    assert data[:4] == b"MRIX" and b"\x80\x04" not in data[:2]  # not a pickle stream
    assert data[32:33] == bytes([0b01])  # row mask: row 0 valid, row 1 placeholder
    assert data[33:] == bytes([3, 1, 0, 0])  # raw uint8 payload, placeholder row zeroed


def test_from_bytes_rejects_ids_outside_num_ids_raw_and_packed():
    rec = RoutedExperts.from_array(np.array([[[0, 1]], [[2, 3]], [[-1, -1]]]), 5)
    raw = bytearray(rec.to_bytes())
    raw[32 + 1 + 3] = 200  # row 1, slot 1 (uint8 payload after the 32-byte header and 1-byte row mask)
    with pytest.raises(ValueError, match=r"corrupt payload .*ids\[1, 0, 1\] = 200 is outside \[0, N\).*num_ids = 5"):
        TokenIndices.from_bytes(bytes(raw))
    packed = bytearray(rec.to_bytes(packed=True))  # 3 bits per id: values 5..7 fit the field but exceed N = 5
    assert packed[33] & 0b111 == 0  # row 0, slot 0 holds id 0 in the low 3 bits
    packed[33] |= 0b111
    with pytest.raises(ValueError, match=r"ids\[0, 0, 0\] = 7 is outside \[0, N\).*num_ids = 5"):
        TokenIndices.from_bytes(bytes(packed))
    dup = bytearray(rec.to_bytes())
    dup[32 + 1 + 1] = 0  # row 0 becomes [0, 0]
    with pytest.raises(ValueError, match=r"corrupt payload.*row 0, layer 0 repeats an id \[0, 0\]"):
        TokenIndices.from_bytes(bytes(dup))
    assert TokenIndices.from_bytes(rec.to_bytes(packed=True)) == rec  # untouched payloads still decode


def test_from_bytes_rejects_recorded_row_of_only_fill():
    rec = DsaIndices.from_array(np.array([[[0, -1]], [[1, 0]]]), 4)
    raw = bytearray(rec.to_bytes())  # int16 payload: row 1 = bytes 32+1+4 .. +8
    raw[37:41] = np.array([-1, -1], dtype="<i2").tobytes()
    with pytest.raises(ValueError, match="row 1 is marked recorded in the row mask but holds only -1"):
        TokenIndices.from_bytes(bytes(raw))


def test_dsa_indices_reject_repeats_and_non_causal_keys():
    ok = DsaIndices.from_array(np.array([[[0, -1, -1]], [[1, 0, -1]], [[2, 0, 1]]]), 8)  # repeated -1 fill is fine
    assert ok.to_numpy()[:, 0].tolist() == [[0, -1, -1], [1, 0, -1], [2, 0, 1]]
    with pytest.raises(ValueError, match=r"row 1, layer 0 repeats an id \[1, 1, -1\]; a token's key indices"):
        DsaIndices.from_array(np.array([[[0, -1, -1]], [[1, 1, -1]]]), 8)
    with pytest.raises(ValueError, match=r"ids\[1, 0, 1\] = 5 is a key after its query \(row 1 is position start \+ 1 = 1"):
        DsaIndices.from_array(np.array([[[0, -1]], [[0, 5]]]), 8)
    # a multi-turn delta: row 0 is sample position 3, so keys up to 3 (then 4) are causal
    delta = DsaIndices.from_array(np.array([[[3, 0]], [[4, 2]]]), 8, start=3)
    assert delta.slice_rows(4, 5).to_numpy().tolist() == [[[4, 2]]]
    with pytest.raises(ValueError, match=r"= 4 is a key after its query \(row 0 is position start \+ 0 = 3"):
        DsaIndices.from_array(np.array([[[4, 0]]]), 8, start=3)
    # routed experts are ids, not positions: no causal rule
    assert RoutedExperts.from_array(np.array([[[7, 6]]]), 8).to_numpy().tolist() == [[[7, 6]]]


@pytest.mark.parametrize(("kwargs", "pattern"), [
    (dict(num_ids=8.5), r"num_ids=8.5 has type float; expected an int"),
    (dict(num_ids=8.0), r"num_ids=8.0 has type float"),
    (dict(num_ids=True), r"num_ids=True has type bool"),
    (dict(num_ids=8, start=1.5), r"start=1.5 has type float; expected an int"),
])
def test_from_array_rejects_non_int_sizes(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        RoutedExperts.from_array(np.array([[[0, 1]]]), **kwargs)
    assert RoutedExperts.from_array(np.array([[[0, 1]]]), np.int64(8), start=np.int32(2)).start == 2
