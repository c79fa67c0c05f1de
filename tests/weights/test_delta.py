"""Delta encoding of weight versions (moe_rl.weights.delta): exact over 20 updates, and every fault raises.

Every comparison is bit-equality on integer views: the codec copies bit patterns, it does no arithmetic on values.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.weights import delta as D
from moe_rl.weights.delta import (
    DeltaBaseError,
    DeltaChecksumError,
    DeltaDecoder,
    DeltaEncoder,
    DeltaPayloadError,
    DeltaUpdate,
    bit_view,
    encode_tensor,
    tensor_checksum,
)

M64 = (1 << 64) - 1


def _reference_checksum(t: torch.Tensor) -> int:
    """The documented hash in plain Python integers (explicit mod 2**64): pins torch's int64 wrap-around."""
    data = bit_view(t).contiguous().view(torch.uint8).numpy().tobytes()
    data += b"\0" * (-len(data) % 8)
    total = 0
    for k in range(len(data) // 8):
        z = int.from_bytes(data[8 * k:8 * k + 8], "little") ^ (((k + 1) * 0x9E3779B97F4A7C15) & M64)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        total = (total + (z ^ (z >> 31))) & M64
    return total


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bit_view(a), bit_view(b))


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_bits_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype,n", [(torch.bfloat16, 1000), (torch.bfloat16, 5), (torch.float32, 333),
                                     (torch.float8_e4m3fn, 77), (torch.int64, 10), (torch.bool, 9)])
def test_checksum_matches_reference_and_is_chunk_free(dtype, n, monkeypatch):
    g = torch.Generator().manual_seed(n)
    t = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16).to(torch.float32)
    t = (t > 0) if dtype == torch.bool else t.to(dtype)
    ref = _reference_checksum(t)
    assert tensor_checksum(t) == ref
    monkeypatch.setattr(D, "_CHUNK_WORDS", 3)  # chunking changes the summation order only
    assert tensor_checksum(t) == ref
    assert tensor_checksum(t[1:]) != ref  # an unaligned view hashes its own bytes


def test_checksum_sees_one_bit_and_position():
    t = torch.zeros(64, dtype=torch.bfloat16)
    base = tensor_checksum(t)
    for i in (0, 17, 63):
        u = t.clone()
        bit_view(u)[i] = 1
        assert tensor_checksum(u) != base
    a, b = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    a[0], b[1] = 5, 5  # same multiset of words, other positions
    assert tensor_checksum(a) != tensor_checksum(b)


def _step(state: dict, g: torch.Generator, frac: float) -> dict:
    """An RL-like step: ``frac`` of each bf16 tensor's elements move by one ulp (bits +-1); fp32 drifts densely."""
    out = {}
    for name, t in state.items():
        t = t.clone()
        if t.dtype == torch.bfloat16:
            bits = bit_view(t)
            k = max(1, int(frac * bits.numel()))
            idx = torch.randint(0, bits.numel(), (k,), generator=g)  # a repeat moves once: C <= k
            bits[idx] += torch.where(torch.rand(k, generator=g) < 0.5, 1, -1).to(torch.int16)
        elif t.dtype == torch.float32:
            t += 1e-3 * torch.randn(t.shape, generator=g)
        out[name] = t
    return out


def _expected_wire(p) -> int:
    """The rule: fewest bytes of sparse C(ib+s), bitmask ceil(N/8)+Cs, full Ns."""
    n, c = p.numel, p.changed
    s = torch.empty((), dtype=p.dtype).element_size()
    return 0 if c == 0 else min(c * (4 + s), -(-n // 8) + c * s, n * s)


def test_twenty_updates_bit_identical_to_full_send():
    g = torch.Generator().manual_seed(0)
    state = {
        "layers.0.mlp.experts.w1": (0.02 * torch.randn(128, 256, generator=g)).bfloat16(),
        "layers.0.mlp.experts.w2": (0.02 * torch.randn(256, 128, generator=g)).bfloat16(),
        "layers.0.attn.q": (0.02 * torch.randn(128, 256, generator=g)).bfloat16(),
        "layers.0.norm": torch.ones(256),  # fp32: changes everywhere -> full encoding
        "layers.0.fp8": torch.randn(64, 128, generator=g).to(torch.float8_e4m3fn),  # never changes
    }
    enc, enc_full = DeltaEncoder(full_every=8), DeltaEncoder(full_every=1)
    dec, dec_full = DeltaDecoder(), DeltaDecoder()
    wire = raw = 0
    kinds = []
    for v in range(1, 21):
        if v == 5:  # a step where nothing changed bit-wise
            state = {k: t.clone() for k, t in state.items()}
        elif v > 1:
            state = _step(state, g, frac=0.01 + 0.02 * torch.rand((), generator=g).item())
        if v == 9:  # dtype change, shape change, a new and a dropped tensor
            state["layers.0.attn.q"] = state["layers.0.attn.q"].float()
            state["layers.0.mlp.experts.w2"] = torch.cat([state["layers.0.mlp.experts.w2"]] * 2)
            state["layers.1.new"] = torch.randn(16, generator=g).bfloat16()
            del state["layers.0.fp8"]
        up = enc.encode(state, v)
        up = DeltaUpdate.from_bytes(up.to_bytes())  # through the wire format
        dec.apply(up)
        dec_full.apply(enc_full.encode(state, v))
        assert _state_equal(dec.state, state), f"version {v}"
        assert _state_equal(dec.state, dec_full.state), f"version {v}"
        assert dec.checksum == dec_full.checksum == up.checksum
        kinds.append("full" if up.is_full else "delta")
        for p in up.patches if not up.is_full else ():
            if p.dtype == state[p.name].dtype and p.encoding != "full":
                assert p.wire_bytes == _expected_wire(p), p.name
        if not up.is_full and v not in (5, 9):
            bf16 = [p for p in up.patches if p.dtype == torch.bfloat16]
            wire, raw = wire + sum(p.wire_bytes for p in bf16), raw + sum(p.raw_bytes for p in bf16)
    assert kinds == ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 7 + ["full"] + ["delta"] * 3
    # 1-3% of bf16 elements as int32 index + int16 value: 3-9% of the bf16 bytes
    assert 0.03 <= wire / raw <= 0.09, wire / raw


def test_empty_delta_moves_no_bytes():
    t = {"a": torch.randn(100).bfloat16()}
    enc, dec = DeltaEncoder(), DeltaDecoder()
    dec.apply(enc.encode(t, 1))
    up = enc.encode({"a": t["a"].clone()}, 2)
    assert up.wire_bytes == 0 and [p.encoding for p in up.patches] == ["unchanged"]
    dec.apply(DeltaUpdate.from_bytes(up.to_bytes()))
    assert dec.version == 2 and _state_equal(dec.state, t)


def test_encoding_choice_and_special_bits():
    base = torch.zeros(4096, dtype=torch.bfloat16)
    new = base.clone()
    assert encode_tensor("x", new, base).encoding == "unchanged"
    bit_view(new)[:10] = 0x7FC1  # a NaN payload
    assert encode_tensor("x", new, base).encoding == "sparse"
    bit_view(new)[::4] = -32768  # -0.0 == 0.0 as values, other bits
    p = encode_tensor("x", new, base)
    assert p.encoding == "bitmask" and p.changed == 1024 + 7
    bit_view(new)[:] = 1
    assert encode_tensor("x", new, base).encoding == "full"
    dec = DeltaDecoder({"x": base.clone()})
    dec.apply(DeltaEncoder().encode({"x": new}, 1))
    assert _bits_equal(dec.state["x"], new)


@pytest.fixture
def synced():
    """An encoder and decoder at version 2 (full at 1, a delta at 2) and the sender's state."""
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": (0.02 * torch.randn(64, 64, generator=g)).bfloat16() for i in range(3)}
    enc, dec = DeltaEncoder(full_every=100), DeltaDecoder()
    dec.apply(enc.encode(state, 1))
    state = _step(state, g, 0.02)
    dec.apply(enc.encode(state, 2))
    return enc, dec, state, g


def _snapshot(dec):
    return {k: t.clone() for k, t in dec.state.items()}, dec.version, dec.checksum


def test_wrong_base_raises_and_touches_nothing(synced):
    enc, dec, state, g = synced
    state3 = _step(state, g, 0.02)
    enc.encode(state3, 3)  # version 3 never reaches the decoder
    up4 = enc.encode(_step(state3, g, 0.02), 4)
    before = _snapshot(dec)
    with pytest.raises(DeltaBaseError, match=r"applies to version 3 .* holds version 2"):
        dec.apply(up4)
    assert _state_equal(dec.state, before[0]) and (dec.version, dec.checksum) == before[1:]
    with pytest.raises(DeltaBaseError, match="holds no version"):
        DeltaDecoder().apply(up4)
    enc.reset()
    dec.apply(enc.encode(_step(state3, g, 0.02), 5))  # the full version recovers
    assert dec.version == 5


def test_base_bits_changed_behind_the_decoder_are_caught_by_full_verify(synced):
    enc, dec, state, g = synced
    dec.verify = "full"
    bit_view(dec.state["w0"])[7] ^= 1
    with pytest.raises(DeltaBaseError, match=r"tensor 'w0': the receiver's tensor has checksum"):
        dec.apply(enc.encode(_step(state, g, 0.02), 3))


def test_truncated_or_padded_payload_raises(synced):
    enc, dec, state, g = synced
    data = enc.encode(_step(state, g, 0.02), 3).to_bytes()
    for bad in (data[:-1], data[:20], data[:5], data + b"\0"):
        with pytest.raises(DeltaPayloadError, match="truncated|trailing|does not start"):
            DeltaUpdate.from_bytes(bad)
    header, tensors = DeltaUpdate.from_bytes(data).to_tensors()
    key = next(iter(tensors))
    with pytest.raises(DeltaPayloadError, match="missing"):
        DeltaUpdate.from_tensors(header, {k: t for k, t in tensors.items() if k != key})
    with pytest.raises(DeltaPayloadError, match="truncated payload"):
        DeltaUpdate.from_tensors(header, {**tensors, key: tensors[key][:-1]})


def _tamper(up: DeltaUpdate, name: str, fn) -> DeltaUpdate:
    patches = []
    for p in up.patches:
        if p.name == name:
            bufs = {k: b.clone() for k, b in p.buffers.items()}
            fn(bufs)
            p = D.TensorPatch(p.name, p.dtype, p.shape, p.encoding, p.checksum, p.base_checksum, p.changed, bufs)
        patches.append(p)
    return DeltaUpdate(up.version, up.base_version, up.base_checksum, up.checksum, tuple(patches), up.removed)


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_checksum_mismatch_raises_and_rolls_back(synced, verify):
    enc, dec, state, g = synced
    dec.verify = verify
    up = enc.encode(_step(state, g, 0.02), 3)
    assert [p.encoding for p in up.patches] == ["sparse"] * 3
    before = _snapshot(dec)

    def flip_value(b):
        b["values"][0] ^= 1

    def move_index(b):  # still sorted, in range: only the checksum can tell
        b["index"][-1] = b["index"][-1] + 1 if b["index"][-1] + 1 < 64 * 64 else b["index"][-1] - 1
        b["index"][:] = b["index"].sort().values

    for bad in (_tamper(up, "w2", flip_value), _tamper(up, "w2", move_index)):  # w0, w1 applied first
        with pytest.raises(DeltaChecksumError, match="tensor 'w2': checksum .* restored"):
            dec.apply(bad)
        assert _state_equal(dec.state, before[0]) and (dec.version, dec.checksum) == before[1:]
    forged = DeltaUpdate(up.version, up.base_version, up.base_checksum, up.checksum ^ 1, up.patches, up.removed)
    with pytest.raises(DeltaChecksumError, match="version 3: checksum"):
        dec.apply(forged)
    assert _state_equal(dec.state, before[0])
    dec.apply(up)
    assert dec.version == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="full_every = 0 must be an int >= 1"):
        DeltaEncoder(full_every=0)
    enc = DeltaEncoder()
    enc.encode({"a": torch.zeros(2)}, 3)
    with pytest.raises(ValueError, match="version 3 must be larger than the last one encoded"):
        enc.encode({"a": torch.zeros(2)}, 3)
    with pytest.raises(TypeError, match=r"state\['a'\] is a list"):
        enc.encode({"a": [1.0]}, 4)
    with pytest.raises(TypeError, match="complex"):
        bit_view(torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(ValueError, match="verify must be"):
        DeltaDecoder(verify="sometimes")
    with pytest.raises(DeltaPayloadError, match="not JSON"):
        DeltaUpdate.from_tensors("{", {})
