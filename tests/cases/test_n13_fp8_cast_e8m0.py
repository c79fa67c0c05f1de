"""N13: FP8 E4M3 cast (round-to-nearest-even, saturation) and power-of-two (UE8M0) scale rounding.

The quantizer under test is :func:`moe_rl.fp8.quant.quantize_blocks` (and the weight-transfer entry point
:func:`moe_rl.weights.fp8` uses the same ``quantize_128x128``). Expected values are exact: E4M3 values
and powers of two are exactly representable in fp32, so every comparison is bit-exact by construction.

* Scalar casts with scale 1: the value to cast sits next to a 448 in the same tile, which pins the scale to
  exactly ``448 / 448 = 1``. Saturation: values whose ``x / scale`` rounds above 448 get code 448, never NaN.
* Power-of-two scales: ``2 ** ceil(log2(amax / 448))``; the block maximum dequantizes with at most half an E4M3
  step of error (never the 12.5 % / 29.3 % loss of round-to-nearest scales).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.fp8.quant import FP8_MAX, dequantize, quantize_blocks

# (input, round-to-nearest-even E4M3FN value). E4M3 spacing is 32 in [256, 448], 16 in [128, 256).
CASTS = [
    (300.0, 288.0),  # nearest (288 vs 320); early saturation would give 448, fp16 double rounding 384
    (400.1, 416.0),  # just above the 400 midpoint: up (double rounding through fp16: 384)
    (400.0, 384.0),  # exact tie between 384 and 416: to the even mantissa (384 = 1.5 * 2^8)
    (272.1, 288.0),  # above the 272 midpoint (double rounding: 256)
    (136.05, 144.0),  # above the 136 midpoint (double rounding: 128)
]


@pytest.mark.parametrize("x,want", CASTS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_n13_e4m3_cast_round_to_nearest_even(x: float, want: float, sign: float) -> None:
    # column 0 holds 448, so the tile amax is 448 and the scale exactly 1: the cast sees x itself
    t = torch.tensor([[FP8_MAX, sign * x]], dtype=torch.float32)
    codes, scales = quantize_blocks(t, (1, 2))
    assert scales.item() == 1.0
    got = codes.float()[0, 1].item()
    assert got == sign * want, f"{sign * x} -> {got}, want {sign * want}"


@pytest.mark.parametrize("amax", [598.4617309570312, 329.6311340332031, 278.4530334472656, 226.7602081298828])
def test_n13_e4m3_cast_saturates_never_nan(amax: float) -> None:
    """Values past 448 saturate to 448, never NaN: for these amaxes ``amax / (amax / 448)`` rounds above 448 in fp32
    (460 and 480 in the case are the same rule at scale 1), and the block maximum's code must still be exactly 448."""
    x = torch.tensor([[amax, -amax]], dtype=torch.float32)
    assert (x / (x.abs().amax() / FP8_MAX)).abs().max().item() > FP8_MAX  # the input really crosses 448
    codes, _ = quantize_blocks(x, (1, 2))
    assert codes.float().tolist() == [[FP8_MAX, -FP8_MAX]]


def test_n13_fp32_fp8_cast_is_single_rounding() -> None:
    """The codes of the same values cast at scale 1: all five in one tile with amax 448 (exact scale 1)."""
    xs = torch.tensor([[FP8_MAX] + [x for x, _ in CASTS]], dtype=torch.float32)
    codes, scales = quantize_blocks(xs, (1, xs.shape[1]))
    assert scales.item() == 1.0
    assert codes.float()[0, 1:].tolist() == [w for _, w in CASTS]
    # and bf16 / fp16 inputs are cast from their own exact value (no detour through another 16-bit type)
    for dt in (torch.bfloat16, torch.float16):
        x16 = xs.to(dt)
        c16, _ = quantize_blocks(x16, (1, xs.shape[1]))
        ref = x16.float().to(torch.float8_e4m3fn).float()  # torch's RNE cast of the exact 16-bit values
        assert torch.equal(c16.float(), ref)


@pytest.mark.parametrize(
    "amax,exp,nearest_loss",
    [
        (1.0, -8, 0.125),  # ceil(log2(1/448)) = -8; nearest would pick 2^-9: 512 -> 448 -> 0.875
        (1.2362, -8, 0.2922),  # ratio 316.5 (exact at 2^-8); nearest picks 2^-9: 632.9 -> 448 -> 29.22 % loss
    ],
)
def test_n13_power_of_two_scale_rounds_up(amax: float, exp: int, nearest_loss: float) -> None:
    x = torch.tensor([[amax, amax / 3, -amax / 7, 0.0]], dtype=torch.float32)
    codes, scales = quantize_blocks(x, (1, 4), ue8m0=True)
    assert scales.item() == 2.0**exp
    assert scales.item() == 2.0 ** math.ceil(math.log2(amax / FP8_MAX))
    deq = dequantize(codes, scales, (1, 4))
    # the block maximum keeps at most half an E4M3 step (relative 2^-4 = 6.25 %) of error
    assert abs(deq[0, 0].item() - amax) <= amax * 2.0**-4
    if amax == 1.0:
        assert deq[0, 0].item() == 1.0  # 1.0 * 256 = 256 is an E4M3 value: exact
    # what round-to-nearest scale selection would have lost (the fault this rounding avoids)
    near = 2.0 ** round(math.log2(amax / FP8_MAX))
    lost = 1 - min(amax / near, FP8_MAX) * near / amax
    assert lost == pytest.approx(nearest_loss, abs=5e-5)


def test_n13_worst_case_nearest_loss_bound() -> None:
    """The supremum of round-to-nearest's block-max loss is 1 - 1/sqrt(2) = 29.29 %; rounding up caps it at 6.25 %."""
    amaxes = FP8_MAX * 2.0 ** torch.linspace(-9.0, -8.0, 4097, dtype=torch.float64)[1:-1]
    x = amaxes.float()[:, None]
    codes, scales = quantize_blocks(x, (1, 1), ue8m0=True)
    deq = dequantize(codes, scales, (1, 1)).double()[:, 0]
    rel = ((deq - x.double()[:, 0]).abs() / x.double()[:, 0]).max().item()
    assert rel <= 2.0**-4
    assert (scales[:, 0].double() >= x.double()[:, 0] / FP8_MAX).all()  # never saturates a block maximum
    assert 1 - 1 / math.sqrt(2) == pytest.approx(0.2929, abs=5e-5)
