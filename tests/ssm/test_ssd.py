"""The chunked SSD scan (:func:`moe_rl.ssm.ssd_scan`) against the sequential float64 recurrence
(:func:`moe_rl.ssm.ssd_sequential`), forward and backward, for several chunk sizes (a sequence length that is not a
multiple of the chunk, a chunk longer than the sequence, one-token chunks), with and without an initial state.

Tolerances (``tests/_tolerance.py``'s rules):

* forward, per element: ``y_t`` is a sum of ``K = T N + N + 1`` products (``C_t . B_s`` over the state for every
  earlier token, the initial state's term, the ``D`` skip) each weighted by a decay ``exp(segment sum)``. The sum is
  within ``rounding_bound(S, K)`` of exact, ``S = sum |terms|`` (the float64 recurrence run on ``|x|, |B|, |C|,
  |D|, |h0|``: every decay is positive, so it returns exactly that sum). Each decay's exponent is a sum of at most
  ``T`` log-decays of one sign, off by ``<= c sqrt(T) eps |exponent|``, which moves the term by that relative
  amount: a second term ``c sqrt(T) eps A_max S`` with ``A_max`` the largest total log-decay of a row and head;
  ``8 eps S`` covers the roundings of ``dt A``, ``dt x``, ``exp`` and the chunk's off-diagonal product.
  The issue's acceptance, fp32 ``atol 1e-5``, is asserted on top (inputs of unit scale, B and C scaled by
  ``N^-1/2`` as a normalized projection: ``|y| <~ 10``). The derived bound is the rule; at these sizes it is
  ``~1e-5 .. 1e-4`` per element, so ``1e-5`` is the stricter of the two on most elements. A dropped chunk state
  or a wrong decay changes elements by ``~|y| ~ 1``, >= 1e4 x either.
* backward: every gradient normwise (``assert_normwise_close``) with ``k = max(T N, b T P)`` and ``depth = 10``
  (the forward's five chained reductions: ``C B^T``, the weighted sum, the chunk states, the chunk recurrence,
  ``C . h``; and their five transposes), plus ``atol 1e-5`` per element on the per-token gradients (x, dt, B, C,
  the initial state). ``dA`` and ``dD`` sum over all ``b T P`` tokens and channels (magnitude ~ ``sqrt(b T P)``):
  their element error is ``~ sqrt(b T P) eps`` times that, so they get the normwise bound only.
"""

from __future__ import annotations

import math

import pytest
import torch
from _ssd_inputs import ssd_inputs
from _tolerance import assert_normwise_close, assert_within, eps

from moe_rl.ssm import segment_sum, ssd_scan, ssd_sequential

ATOL = 1e-5  # the acceptance (fp32)
F32 = torch.float32


def _run(fn, ins, gy, gh, dtype, with_init, **kw):
    ts = [t.detach().to(dtype).requires_grad_() for t in ins]
    x, dt, A, B, C, D, h0 = ts
    o = fn(x, dt, A, B, C, D=D, initial_state=h0 if with_init else None, **kw)
    ((o.y * gy.to(dtype)).sum() + (o.final_state * gh.to(dtype)).sum()).backward()
    grads = {n: t.grad for n, t in zip(("x", "dt", "A", "B", "C", "D", "h0"), ts, strict=True)}
    if not with_init:
        grads.pop("h0")
    return o, grads


@pytest.mark.parametrize("with_init", [True, False], ids=["h0", "zero-start"])
@pytest.mark.parametrize("chunk", [1, 5, 8, 16, 64])
def test_chunked_scan_equals_float64_recurrence(chunk, with_init):
    x, dt, A, B, C, D, h0, gy, gh = ins = ssd_inputs()
    b, T, H, P = x.shape
    N = B.shape[-1]
    ref, ref_g = _run(ssd_sequential, ins[:7], gy, gh, torch.float64, with_init)
    out, got_g = _run(ssd_scan, ins[:7], gy, gh, F32, with_init, chunk_size=chunk)
    assert out.y.dtype == F32 and out.final_state.dtype == F32

    # forward: per-element bound from the absolute-value recurrence (module docstring)
    absd = [t.double().abs() for t in (x, dt, A, B, C, D, h0)]
    scale = ssd_sequential(absd[0], dt.double(), A.double(), absd[3], absd[4], D=absd[5],
                           initial_state=absd[6] if with_init else None)
    a_max = float((dt.double() * A.double()).abs().sum(1).max())
    K = T * N + N + 1
    factor = 4 * math.sqrt(K) * eps(F32) + 4 * math.sqrt(T) * eps(F32) * a_max + 8 * eps(F32)
    assert_within(out.y, ref.y, factor * scale.y, f"y chunk={chunk}")
    assert_within(out.final_state, ref.final_state, factor * scale.final_state, f"final_state chunk={chunk}")
    assert_within(out.y, ref.y, ATOL, f"y chunk={chunk} (atol)")
    assert_within(out.final_state, ref.final_state, ATOL, f"final_state chunk={chunk} (atol)")

    # backward
    k = max(T * N, b * T * P)
    for name, r in ref_g.items():
        assert_normwise_close(got_g[name], r, dtype=F32, k=k, depth=10, what=f"d{name} chunk={chunk}")
        if name not in ("A", "D"):
            assert_within(got_g[name], r, ATOL, f"d{name} chunk={chunk} (atol)")


def test_scan_promotes_low_precision_and_keeps_float64():
    x, dt, A, B, C, D, h0, _, _ = ssd_inputs(T=9)
    o = ssd_scan(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), chunk_size=4)
    assert o.y.dtype == F32
    o64 = ssd_scan(*(t.double() for t in (x, dt, A, B, C)), chunk_size=4, D=D.double(),
                   initial_state=h0.double())
    ref = ssd_sequential(*(t.double() for t in (x, dt, A, B, C)), D=D.double(), initial_state=h0.double())
    assert o64.y.dtype == torch.float64
    # float64 both ways: the same bound with eps(float64) is ~1e-14; 1e-12 leaves 100x for the decay exponents
    assert_within(o64.y, ref.y, 1e-12, "float64 y")


def test_padding_tokens_do_not_touch_the_state():
    """A chunk longer than the row pads with dt = 0: the final state equals the scan of the row alone, and the
    state is continued exactly by a second scan of the next tokens (the decode/CP contract)."""
    x, dt, A, B, C, D, _, _, _ = ssd_inputs(T=24)
    full = ssd_scan(x, dt, A, B, C, chunk_size=8, D=D)
    first = ssd_scan(x[:, :11], dt[:, :11], A, B[:, :11], C[:, :11], chunk_size=64, D=D)
    rest = ssd_scan(x[:, 11:], dt[:, 11:], A, B[:, 11:], C[:, 11:], chunk_size=5, D=D,
                    initial_state=first.final_state)
    # two fp32 paths of the same reductions in other orders: atol as in the main test (the values are <~ 10)
    assert_within(torch.cat([first.y, rest.y], 1), full.y, 2 * ATOL, "split scan y")
    assert_within(rest.final_state, full.final_state, 2 * ATOL, "split scan final state")


def test_segment_sum():
    a = torch.tensor([1.0, 2.0, 4.0])
    s = segment_sum(a)
    inf = float("-inf")
    assert torch.equal(s, torch.tensor([[0.0, inf, inf], [2.0, 0.0, inf], [6.0, 4.0, 0.0]]))


def test_bad_inputs_raise():
    x, dt, A, B, C, D, h0, _, _ = ssd_inputs(T=5)
    with pytest.raises(ValueError, match="chunk_size=0"):
        ssd_scan(x, dt, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="multiple of G"):
        ssd_scan(x, dt, A, B[:, :, :1].expand(-1, -1, 3, -1), C[:, :, :1].expand(-1, -1, 3, -1), chunk_size=4)
    with pytest.raises(ValueError, match=r"dt has shape"):
        ssd_scan(x, dt[:, :-1], A, B, C, chunk_size=4)
    with pytest.raises(ValueError, match=r"initial_state has shape"):
        ssd_scan(x, dt, A, B, C, chunk_size=4, initial_state=h0[:1])
    with pytest.raises(TypeError, match="floating-point"):
        ssd_sequential(x.long(), dt, A, B, C)
