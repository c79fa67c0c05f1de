"""FP8 block quantizers (moe_rl.fp8.quant): public cases B01/B03, error bounds, UE8M0, non-finite policy."""

from __future__ import annotations

import pytest
import torch

from moe_rl.fp8.quant import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
    quantize_blocks,
)

torch.set_num_threads(1)

QUANTIZERS = {
    "1x128": (quantize_1x128, (1, 128)),
    "128x128": (quantize_128x128, (128, 128)),
    "128x1": (quantize_128x1, (128, 1)),
}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _assert_within_e4m3(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block) -> None:
    """|x - dq| <= 2^-4 |x| (normal range, 3 mantissa bits, RNE) + scale * 2^-10 (half the subnormal step)."""
    bm, bk = block
    dq = dequantize(codes, scales, block)
    s = scales.repeat_interleave(bm, 0)[: x.shape[0]].repeat_interleave(bk, 1)[:, : x.shape[1]]
    bound = x.float().abs() * 2.0**-4 + s * 2.0**-10
    assert ((x.float() - dq).abs() <= bound * (1 + 1e-6)).all()


# ---- B01: all-zero tiles give finite positive scales and zero codes, never NaN (every quantizer path) ----


def test_b01_zero_tile_weight_128x128():
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    w[0, 0] = 1.0
    codes, scales = quantize_128x128(w)
    assert scales.shape == (2, 2) and scales.dtype == torch.float32
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert scales[0, 0] == pytest.approx(1 / 448)
    assert scales[0, 0].item() == (torch.tensor(1.0) / FP8_MAX).item()
    assert codes.dtype == FP8_DTYPE and codes.float()[0, 0] == 448
    cf = codes.float()
    assert torch.isfinite(cf).all() and (cf.flatten()[1:] == 0).all()
    dq = dequantize(codes, scales, (128, 128))
    assert torch.equal(dq, w.float())


@pytest.mark.parametrize("kind", list(QUANTIZERS))
@pytest.mark.parametrize("ue8m0", [False, True])
def test_b01_all_zero_every_path(kind, ue8m0):
    quant, block = QUANTIZERS[kind]
    x = torch.zeros(200, 300)
    codes, scales = quant(x, ue8m0=ue8m0)
    assert scales.shape == (_ceil(200, block[0]), _ceil(300, block[1]))
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert (codes.float() == 0).all()
    assert torch.equal(dequantize(codes, scales, block), x)
    if not ue8m0:
        assert torch.allclose(scales, torch.full_like(scales, AMAX_FLOOR / FP8_MAX))


def test_b01_tiny_block_not_flushed_and_no_overflow():
    # A near-zero tile must neither overflow (inf -> clamp) nor be flushed by the floor: amax 1e-9 > 1e-12.
    x = torch.zeros(128, 128)
    x[3, 5] = 1e-9
    codes, scales = quantize_128x128(x)
    assert codes.float()[3, 5] == 448
    assert dequantize(codes, scales, (128, 128))[3, 5].item() == pytest.approx(1e-9, rel=1e-6)


# ---- B03: partial tail blocks, configured block in dequant ----


def test_b03_tail_band_1000x256():
    w = torch.empty(1000, 256)
    for b in range(8):
        w[128 * b : 128 * (b + 1)] = b + 1  # band 7 is rows 896..999 (104 rows)
    w[:, 1::2] *= -1
    codes, scales = quantize_128x128(w)
    assert scales.shape == (8, 2)
    for b in range(8):
        assert torch.allclose(scales[b], torch.full((2,), (b + 1) / FP8_MAX))
    assert (codes.float().abs() == 448).all()
    dq = dequantize(codes, scales, (128, 128))
    assert dq.shape == (1000, 256)
    # dq = code (+-448, exact) * scale, scale = amax / 448 rounded once, the product rounded once: relative
    # <= 2u = eps32 (+ u^2), so rtol 2 eps32; a wrong band's scale is off by >= 1/8 relative
    assert torch.allclose(dq, w, rtol=2 * torch.finfo(torch.float32).eps, atol=0)


def test_b03_tail_band_has_own_amax():
    torch.manual_seed(0)
    w = torch.randn(1000, 256)
    w[896:] *= 100  # the partial tail band has a much larger amax than the rest
    codes, scales = quantize_128x128(w)
    for j in range(2):
        assert scales[7, j] == w[896:, 128 * j : 128 * (j + 1)].abs().amax() / FP8_MAX
        assert scales[6, j] == w[768:896, 128 * j : 128 * (j + 1)].abs().amax() / FP8_MAX
    _assert_within_e4m3(w, codes, scales, (128, 128))


def test_b03_shapes_576x2048_and_k576():
    torch.manual_seed(1)
    w = torch.randn(576, 2048)
    codes, scales = quantize_128x128(w)
    assert scales.shape == (5, 16) and codes.shape == (576, 2048)
    _assert_within_e4m3(w, codes, scales, (128, 128))
    x = torch.randn(33, 576)
    xc, xs = quantize_1x128(x)
    assert xs.shape == (33, 5)
    assert xs[:, 4].eq(x[:, 512:].abs().amax(1) / FP8_MAX).all()  # 64-channel tail group, own scale
    _assert_within_e4m3(x, xc, xs, (1, 128))


def test_b03_dequant_rejects_scale_grid_of_other_block():
    w = torch.arange(1000, dtype=torch.float32).div(128).floor().add(1)[:, None].expand(1000, 256)  # band b = b+1
    codes, scales = quantize_128x128(w)
    with pytest.raises(ValueError, match=r"expected \(8, 2\)"):
        dequantize(codes, scales[:, :1], (128, 128))
    # as in test_b03_tail_band_1000x256: two roundings of eps32 / 2 each
    assert torch.allclose(dequantize(codes, scales, (128, 128)), w, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    # why dequant must take the configured block: the block derived from shapes, 1000 / 8 = 125, fits the same
    # grid but shifts every band boundary (row 125 would get band 1's scale)
    wrong = dequantize(codes, scales, (125, 128))
    assert wrong[125, 0] == 2 * w[125, 0]


# ---- general numerics ----


@pytest.mark.parametrize("kind", list(QUANTIZERS))
@pytest.mark.parametrize("shape", [(1, 1), (130, 129), (256, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bound(kind, shape, dtype):
    quant, block = QUANTIZERS[kind]
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])).to(dtype)
    codes, scales = quant(x)
    assert codes.shape == x.shape and codes.dtype == FP8_DTYPE
    assert scales.shape == (_ceil(shape[0], block[0]), _ceil(shape[1], block[1]))
    _assert_within_e4m3(x, codes, scales, block)
    # the element holding each block's amax maps to the top code (saturating range is used fully)
    assert codes.float().abs().max() == 448


def test_codes_saturate_at_fp8_max():
    x = torch.tensor([[-3.0, 1.0, 2.5, 3.0]])
    codes, scales = quantize_1x128(x)
    assert codes.float().abs().max() == FP8_MAX
    assert codes.float()[0, 0] == -FP8_MAX and codes.float()[0, 3] == FP8_MAX


def test_128x1_is_1x128_of_transpose():
    x = torch.randn(300, 70)
    c1, s1 = quantize_128x1(x)
    c2, s2 = quantize_1x128(x.T.contiguous())
    assert s1.shape == (3, 70)
    assert torch.equal(s1.T, s2) and torch.equal(c1.T.float(), c2.float())


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_ue8m0_scales_are_powers_of_two_rounded_up(kind):
    quant, block = QUANTIZERS[kind]
    x = torch.randn(256, 256) * 3
    x[:128, :128] = 0
    x[0, 0] = 448 * 2.0**-3  # amax/448 exactly a power of two: scale must stay 2^-3 (no spurious round-up)
    codes, scales = quant(x, ue8m0=True)
    mant, _ = torch.frexp(scales)
    assert (mant == 0.5).all()
    _, plain = quant(x)
    assert (scales >= plain).all() and (scales < 2 * plain).all()
    assert scales[0, 0] == 2.0**-3
    assert codes.float().abs().max() <= FP8_MAX
    _assert_within_e4m3(x, codes, scales, block)


# ---- non-finite policy: raise, naming the tensor and the count ----


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_non_finite_input_raises(kind):
    quant, _ = QUANTIZERS[kind]
    x = torch.randn(130, 260)
    x[0, 0], x[5, 7], x[129, 259] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(ValueError, match=r"^act: 3 non-finite value\(s\)"):
        quant(x, name="act")


def test_invalid_arguments():
    with pytest.raises(ValueError, match="2-D"):
        quantize_1x128(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="block="):
        quantize_blocks(torch.randn(4, 4), (0, 128))
    with pytest.raises(ValueError, match="amax_floor"):
        quantize_1x128(torch.randn(4, 4), amax_floor=0.0)


def test_dequant_table_lookup_is_bitwise_the_cast():
    from moe_rl.fp8.quant import _codes_to_float

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).view(16, 16)
    assert torch.equal(_codes_to_float(codes).view(torch.int32), codes.float().view(torch.int32))
    assert torch.equal(_codes_to_float(codes.T).view(torch.int32), codes.T.float().view(torch.int32))
