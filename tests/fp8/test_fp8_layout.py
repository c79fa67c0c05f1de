"""DeepGEMM scale layouts (moe_rl.fp8.layout): explicit small examples and round trips."""

from __future__ import annotations

import pytest
import torch

from moe_rl.fp8.layout import (
    from_mn_major,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    unpack_ue8m0,
)
from moe_rl.fp8.quant import quantize_1x128, quantize_128x128

torch.set_num_threads(1)


def _storage(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of ``t``'s storage from its offset (includes padding)."""
    return torch.as_strided(t, (n,), (1,))


@pytest.mark.parametrize(
    ("x", "elem", "want"), [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (33, 4, 36), (5, 2, 8), (9, 1, 16)]
)
def test_get_tma_aligned_size(x, elem, want):
    assert get_tma_aligned_size(x, elem) == want


def test_get_tma_aligned_size_rejects_bad_element_size():
    with pytest.raises(ValueError, match="element_size=3"):
        get_tma_aligned_size(8, 3)


def test_mn_major_explicit_example():
    sf = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # MN=2, SK=3 -> AM=4
    t = get_mn_major_tma_aligned_tensor(sf)
    assert t.shape == (2, 3) and t.stride() == (1, 4)
    assert torch.equal(t, sf)
    assert _storage(t, 12).tolist() == [1, 4, 0, 0, 2, 5, 0, 0, 3, 6, 0, 0]
    assert torch.equal(from_mn_major(t), sf) and from_mn_major(t).is_contiguous()


def test_mn_major_grouped_and_round_trip():
    _, sf = quantize_1x128(torch.randn(37, 576))  # [37, 5]
    t = get_mn_major_tma_aligned_tensor(sf)
    assert t.stride() == (1, 40) and torch.equal(t, sf)
    g = torch.stack([sf, 2 * sf])  # [G=2, 37, 5]
    tg = get_mn_major_tma_aligned_tensor(g)
    assert tg.shape == (2, 37, 5) and tg.stride() == (5 * 40, 1, 40)
    assert torch.equal(tg, g)


def test_packed_ue8m0_explicit_example():
    # MN=2, SK=5 -> PK=2 int32 per row, AM=4. fp32 exponent byte of 2**p is 127 + p.
    p = torch.tensor([[0, 1, -1, 2, -3], [3, 0, 0, 0, 1]])
    sf = torch.ldexp(torch.ones(2, 5), p.to(torch.int32))
    out = get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    assert out.dtype == torch.int32 and out.shape == (2, 2) and out.stride() == (1, 4)
    e = (p + 127).tolist()
    row0 = [e[0][0] | e[0][1] << 8 | e[0][2] << 16 | e[0][3] << 24, e[0][4]]
    row1 = [e[1][0] | e[1][1] << 8 | e[1][2] << 16 | e[1][3] << 24, e[1][4]]
    to_i32 = [v - 2**32 if v >= 2**31 else v for v in (row0[0], row1[0], row0[1], row1[1])]
    assert _storage(out, 8).tolist() == [to_i32[0], to_i32[1], 0, 0, to_i32[2], to_i32[3], 0, 0]
    assert torch.equal(unpack_ue8m0(out, 5), sf)


def test_packed_ue8m0_matches_little_endian_byte_view():
    # DeepGEMM's torch reference: exponent bytes, zero-padded to 4 along K, viewed as int32 (little endian).
    _, sf = quantize_1x128(torch.randn(13, 1000) * torch.logspace(-4, 4, 1000), ue8m0=True)  # SK = 8
    out = get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    e8 = (sf.view(torch.int32) >> 23).to(torch.uint8)
    ref = e8.contiguous().view(torch.int32)  # [13, 2], native byte order
    if torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0] == 1:  # little-endian host
        assert torch.equal(out, ref)
    assert torch.equal(unpack_ue8m0(out, sf.shape[1]), sf)


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (130, 9), (3, 40, 17)])
def test_packed_ue8m0_round_trip(shape):
    g = torch.Generator().manual_seed(0)
    sf = torch.ldexp(torch.ones(shape), torch.randint(-126, 127, shape, generator=g, dtype=torch.int32))
    out = get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    mn, sk = shape[-2], shape[-1]
    assert out.shape == (*shape[:-1], -(-sk // 4))
    assert out.stride()[-2:] == (1, get_tma_aligned_size(mn, 4))
    assert torch.equal(unpack_ue8m0(out, sk), sf)


def test_packed_ue8m0_weight_scales_round_trip():
    _, ws = quantize_128x128(torch.zeros(300, 700), ue8m0=True)  # all-zero: floored scales must still pack
    assert torch.equal(unpack_ue8m0(get_mn_major_tma_aligned_packed_ue8m0_tensor(ws), ws.shape[1]), ws)


def test_packed_ue8m0_rejects_non_power_of_two():
    _, sf = quantize_1x128(torch.randn(4, 256))  # fp32 scales, not powers of two
    with pytest.raises(ValueError, match="not positive normal powers of two.*ue8m0=True"):
        get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    with pytest.raises(ValueError, match="sk=9"):
        unpack_ue8m0(torch.zeros(2, 2, dtype=torch.int32), 9)
