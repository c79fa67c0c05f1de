"""Grouped (MoE) FP8: contiguous layout, grouped GEMM, grouped linear autograd, FP8 experts, model conversion.

References: hand-written layouts; a float64 GEMM of the dequantized operands (the grouped GEMM must equal it up
to fp32 summation order); the dense :func:`fp8_block_linear` applied per expert (the grouped path must give the
same numbers: 1x128 groups are per row, weight blocks per expert, and 128-row token groups of the 128-aligned
segments are exactly the dense per-expert groups); and a float64 high-precision model for SQNR.

SQNR floors: one FP8 GEMM (two E4M3 operands) measures ~28-29 dB on Gaussian data, so 25 dB (the project floor)
for each grouped linear's output and its three gradients. The whole expert block chains two FP8 GEMMs around the
SwiGLU product (whose relative error is the sum of its two factors'), measured ~24 dB: floor 22 dB for the block,
while its exactness is covered by the per-expert dense comparison.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _tolerance import abs_matmul, assert_close_to_reference, assert_paths_agree

from moe_rl.fp8 import (
    Fp8Config,
    contiguous_layout,
    dequantize,
    fp8_grouped_gemm,
    fp8_grouped_linear,
    quantize_1x128,
    quantize_128x128_grouped,
    sqnr_db,
)
from moe_rl.fp8.linear import Fp8BlockLinear, fp8_block_linear
from moe_rl.moe.experts import GroupedExperts, grouped_experts_forward
from moe_rl.moe.fp8_convert import convert_model_to_fp8
from moe_rl.moe.fp8_experts import Fp8GroupedExperts, fp8_experts_forward

torch.set_num_threads(1)

LINEAR_FLOOR_DB = 25.0
BLOCK_FLOOR_DB = 22.0


def test_contiguous_layout_hand_computed():
    lay = contiguous_layout(torch.tensor([3, 0, 130]))
    assert lay.padded == [128, 0, 256] and lay.starts == [0, 128, 128] and lay.counts == [3, 0, 130]
    want = torch.full((384,), -1, dtype=torch.int32)
    want[0:3] = 0
    want[128:258] = 2
    assert lay.m_indices.dtype == torch.int32 and torch.equal(lay.m_indices, want)
    assert torch.equal(lay.rows, torch.cat([torch.arange(3), torch.arange(128, 258)]))
    assert lay.num_padding_rows == 384 - 133
    empty = contiguous_layout(torch.zeros(4, dtype=torch.int64))
    assert empty.num_rows == 0 and empty.rows.numel() == 0


def test_contiguous_layout_rejects_bad_counts():
    with pytest.raises(ValueError, match="negative"):
        contiguous_layout(torch.tensor([2, -1]))
    with pytest.raises(ValueError, match="1-D integer"):
        contiguous_layout(torch.tensor([2.0, 1.0]))


def _grouped_abs_scale(a64, bq, bs, lay):
    """``sum_k |a[m, k]| |b[e(m), n, k]|`` per output element (float64; zero on padding rows)."""
    scale = torch.zeros(lay.num_rows, bq.shape[1], dtype=torch.float64)
    for e in range(bq.shape[0]):
        rows = (lay.m_indices == e).nonzero().squeeze(1)
        if len(rows):
            scale[rows] = abs_matmul(a64[rows], dequantize(bq[e], bs[e], (128, 128)).double().T)
    return scale


def _operands(counts, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = contiguous_layout(torch.tensor(counts))
    x = torch.randn(lay.num_rows, K, generator=g)
    x[lay.m_indices < 0] = 0
    w = torch.randn(len(counts), N, K, generator=g) * 0.05
    return lay, x, w


@pytest.mark.parametrize(("N", "K"), [(128, 256), (200, 72)], ids=["aligned", "b03_tails"])
def test_grouped_gemm_equals_float64_of_dequantized(N, K):
    lay, x, w = _operands([70, 0, 200, 1], N, K)
    aq, as_ = quantize_1x128(x)
    bq, bs = quantize_128x128_grouped(w)
    out = fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.float32, backend="torch")
    a64 = dequantize(aq, as_, (1, 128)).double()
    ref = torch.zeros(lay.num_rows, N, dtype=torch.float64)
    for m in range(lay.num_rows):  # row by row, independent of the implementation's grouping
        e = int(lay.m_indices[m])
        if e >= 0:
            ref[m] = a64[m] @ dequantize(bq[e], bs[e], (128, 128)).double().T
    # fp32 GEMM of exactly representable dequantized operands vs float64: K-term rounding only (a wrong expert
    # or scale block changes elements by ~|ref|, >1e3 times the bound).
    assert_close_to_reference(out, ref, dtype=torch.float32, k=K, scale=_grouped_abs_scale(a64, bq, bs, lay),
                              what="grouped GEMM vs float64")
    assert (out[lay.m_indices < 0] == 0).all()
    bf = fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out.bfloat16())


def test_grouped_gemm_validates_layout():
    lay, x, w = _operands([70, 60], 128, 128)
    aq, as_ = quantize_1x128(x)
    bq, bs = quantize_128x128_grouped(w)
    mixed = lay.m_indices.clone()
    mixed[100] = 1  # expert 1 row inside expert 0's 128-row block
    with pytest.raises(ValueError, match="mix two experts"):
        fp8_grouped_gemm(aq, as_, bq, bs, mixed)
    bad = lay.m_indices.clone()
    bad[0] = 2
    with pytest.raises(ValueError, match=r"ids must be in \[-1, 2\)"):
        fp8_grouped_gemm(aq, as_, bq, bs, bad)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fp8_grouped_gemm(aq[:200], as_[:200], bq, bs, lay.m_indices[:200])
    with pytest.raises(ValueError, match="m_indices: expected int32"):
        fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices.long())
    with pytest.raises(ValueError, match="backend="):
        fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, backend="cutlass")  # type: ignore[arg-type]


def test_deep_gemm_backend_missing_raises_importerror():
    pytest.importorskip("torch")
    try:
        import deep_gemm  # noqa: F401
    except (ImportError, OSError):
        pass
    else:  # pragma: no cover - GPU machines
        pytest.skip("deep_gemm is installed")
    lay, x, w = _operands([5], 128, 128)
    aq, as_ = quantize_1x128(x)
    bq, bs = quantize_128x128_grouped(w)
    with pytest.raises(ImportError, match="DeepGEMM"):
        fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, backend="deep_gemm")


@pytest.mark.parametrize(("N", "K"), [(128, 128), (200, 72)], ids=["aligned", "b03_tails"])
def test_grouped_linear_equals_dense_fp8_linear_per_expert(N, K):
    """Same quantization groups => same FP8 codes and scales as the dense FP8 linear run expert by expert, so the
    outputs and gradients are the same numbers up to fp32 summation order: the grouped GEMMs run on the padded
    segment (other M, and for dW other K, than the dense GEMMs), so MKL may pick another kernel and order.
    Bound (tests/_tolerance.py): twice the fp32 rounding bound of each GEMM's reduction; the FP8 operands'
    magnitudes are at most (1 + 2^-4) (E4M3 rounding) times the unquantized ones, hence the factor Q below.
    A wrong expert, row or scale block changes elements by ~|y| (>1e3 times the bound)."""
    counts = [100, 0, 37, 300]
    lay = contiguous_layout(torch.tensor(counts))
    g = torch.Generator().manual_seed(1)
    x_real = torch.randn(sum(counts), K, generator=g)
    w = (torch.randn(4, N, K, generator=g) * 0.05).requires_grad_()
    x = x_real.new_zeros(lay.num_rows, K).index_copy(0, lay.rows, x_real).requires_grad_()
    dy = torch.randn(lay.num_rows, N, generator=g)
    y = fp8_grouped_linear(x, w, lay)
    y.backward(dy)
    assert (y[lay.m_indices < 0] == 0).all() and (x.grad[lay.m_indices < 0] == 0).all()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            assert (w.grad[e] == 0).all()  # expert without tokens: exactly zero weight gradient
            continue
        xe = x_real[start : start + c].clone().requires_grad_()
        we = w.detach()[e].clone().requires_grad_()
        seg = slice(lay.starts[e], lay.starts[e] + c)
        ye = fp8_block_linear(xe, we)
        ye.backward(dy[seg])
        Q = (1 + 2**-4) ** 2 * 1.01  # both operands quantized (+1% for E4M3 subnormals near zero)
        xs, ws, dys = x_real[start : start + c], w.detach()[e], dy[seg]
        f32 = torch.float32
        assert_paths_agree(y[seg], ye, dtype=f32, k=K, scale=Q * abs_matmul(xs, ws.T), what=f"y[{e}]")
        assert_paths_agree(x.grad[seg], xe.grad, dtype=f32, k=N, scale=Q * abs_matmul(dys, ws), what=f"dx[{e}]")
        # dW reduces over tokens: the grouped path over the padded segment (zero rows of x add exact zeros)
        assert_paths_agree(w.grad[e], we.grad, dtype=f32, k=int(lay.padded[e]), scale=Q * abs_matmul(dys.T, xs),
                           what=f"dW[{e}]")
        start += c


def test_grouped_linear_sqnr_vs_float64_glm_shapes():
    """GLM-5 / DeepSeek-V3 expert projection shapes scaled to the CPU (D 7168 -> 512, F 2048 -> 256)."""
    counts = [300, 0, 129, 64, 250]
    D, Fi = 512, 256
    lay = contiguous_layout(torch.tensor(counts))
    g = torch.Generator().manual_seed(2)
    x_real = torch.randn(sum(counts), D, generator=g)
    w = (torch.randn(len(counts), 2 * Fi, D, generator=g) * D**-0.5).requires_grad_()
    x = x_real.new_zeros(lay.num_rows, D).index_copy(0, lay.rows, x_real).requires_grad_()
    dy = torch.randn(lay.num_rows, 2 * Fi, generator=g).masked_fill((lay.m_indices < 0)[:, None], 0)
    y = fp8_grouped_linear(x, w, lay)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = torch.cat([x64[st : st + p] @ w64[e].T for e, (st, p) in enumerate(zip(lay.starts, lay.padded, strict=True))])
    y64.backward(dy.double())  # padding rows of x are zero: they add nothing to dW
    for name, r, o in (("y", y64, y), ("dx", x64.grad, x.grad), ("dW", w64.grad, w.grad)):
        assert sqnr_db(r, o) >= LINEAR_FLOOR_DB, (name, sqnr_db(r, o))


def _experts_case(seed=0, T=60, E=8, D=128, Fi=64, K=2):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * Fi, D, generator=g) * D**-0.5
    dn = torch.randn(E, D, Fi, generator=g) * Fi**-0.5
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[ids == 3] = 4  # expert 3 receives no tokens
    return torch.randn(T, D, generator=g), ids, gu, dn, torch.randn(T, K, D, generator=g)


def test_fp8_experts_block_sqnr_and_empty_expert():
    x, ids, gu, dn, g = _experts_case()
    leaves64 = [t.double().requires_grad_() for t in (x, gu, dn)]
    y64 = grouped_experts_forward(leaves64[0], ids, leaves64[1], leaves64[2], backend="loop")
    y64.backward(g.double())
    leaves = [t.clone().requires_grad_() for t in (x, gu, dn)]
    y = fp8_experts_forward(leaves[0], ids, leaves[1], leaves[2])
    y.backward(g)
    assert y.shape == y64.shape and y.dtype == torch.float32
    assert sqnr_db(y64, y) >= BLOCK_FLOOR_DB
    for r, o in zip(leaves64, leaves, strict=True):
        assert sqnr_db(r.grad, o.grad) >= BLOCK_FLOOR_DB
    assert (leaves[1].grad[3] == 0).all() and (leaves[2].grad[3] == 0).all()


@pytest.mark.parametrize("where", ["input", "expert_weight", "grad_output"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises_on_every_quantizer_path(where, bad):
    x, ids, gu, dn, g = _experts_case(seed=1)
    if where == "input":
        x[5, 7] = bad
    elif where == "expert_weight":
        dn[2, 1, 1] = bad
    else:
        g[0, 1, 3] = bad
    leaves = [t.clone().requires_grad_() for t in (x, gu, dn)]
    with pytest.raises(ValueError, match=rf"{where}: \d+ non-finite"):  # a token is routed to top_k rows
        y = fp8_experts_forward(leaves[0], ids, leaves[1], leaves[2])
        y.backward(g)


def test_all_zero_inputs_weights_and_grads_stay_finite_b01():
    x, ids, gu, dn, g = _experts_case(seed=2)
    x[:10] = 0.0  # all-zero tokens
    gu[1] = 0.0  # an all-zero expert
    g[10:20] = 0.0  # all-zero output gradients
    leaves = [t.clone().requires_grad_() for t in (x, gu, dn)]
    y = fp8_experts_forward(leaves[0], ids, leaves[1], leaves[2])
    y.backward(g)
    assert (y[:10] == 0).all()
    assert (y[ids == 1] == 0).all()  # silu(0) * 0 through the zero expert
    for t in (y, *[lf.grad for lf in leaves]):
        assert torch.isfinite(t).all()
    assert (leaves[2].grad[1] == 0).all()  # down_proj of the zero expert sees zero activations


def test_fp8_grouped_experts_module_and_model_conversion():
    from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM

    torch.manual_seed(0)
    cfg = GlmMoeConfig.tiny_debug()
    model = GlmMoeForCausalLM(cfg)
    ref = copy.deepcopy(model)  # the unconverted twin, same weights
    keys = list(model.state_dict())
    counts = convert_model_to_fp8(model, Fp8Config(enabled=True, backend="torch"))
    assert list(model.state_dict()) == keys  # same parameters, same names
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert counts["experts"] == n_moe and counts["linear"] > 0 and counts["skipped_linear"] >= 1
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, Fp8BlockLinear)
    assert all("router" not in n for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear))
    exps = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert exps and all(isinstance(m, Fp8GroupedExperts) for m in exps)
    ids = torch.randint(3, cfg.vocab_size, (2, 24))
    logits, logits_ref = model(ids), ref(ids)
    assert sqnr_db(logits_ref, logits) >= LINEAR_FLOOR_DB - 5  # chained FP8 GEMMs over 2 layers; measured 24.4 dB
    logits.float().logsumexp(-1).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_fp8_config_accepts_bool_shorthand():
    assert Fp8Config.model_validate(True).enabled is True
    assert Fp8Config.model_validate("false").enabled is False
    assert Fp8Config.model_validate({"backend": "torch"}).enabled is False
    with pytest.raises(ValueError):
        Fp8Config.model_validate({"backend": "cutlass"})


@pytest.mark.parametrize("api", ["m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"])
def test_deep_gemm_grouped_shim_both_api_names(api):
    """The deep_gemm adapter (run on CPU against a fake module that checks DeepGEMM's documented contract):
    K zero-padded to 128, (codes, scales) tuples, the old API's MN-major TMA-aligned LHS scales, int32
    m_indices, and padding rows zeroed afterwards (DeepGEMM leaves them undefined)."""
    import types

    from moe_rl.fp8 import grouped

    lay, x, w = _operands([70, 0, 130], 96, 200)
    aq, as_ = quantize_1x128(x)
    bq, bs = quantize_128x128_grouped(w)
    seen = {}

    def fake(a, b, d, m_indices):
        (a_c, a_s), (b_c, b_s) = a, b
        assert a_c.shape[1] % 128 == 0 and b_c.shape[2] % 128 == 0  # K padded 200 -> 256
        assert m_indices.dtype == torch.int32
        if api.startswith("m_grouped_gemm_fp8_fp8_bf16"):
            assert a_s.stride(0) == 1  # MN-major
        seen["called"] = True
        ref = fp8_grouped_gemm(a_c, a_s.contiguous(), b_c, b_s, m_indices, torch.bfloat16, backend="torch")
        d.copy_(ref)
        d[m_indices < 0] = 7.0  # garbage on padding rows, as a real kernel may leave

    mod = types.SimpleNamespace(**{api: fake})
    out = grouped._grouped_deep_gemm(mod, aq, as_, bq, bs, lay.m_indices, torch.bfloat16)
    ref = fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.bfloat16, backend="torch")
    assert seen["called"] and (out[lay.m_indices < 0] == 0).all()
    # The fake runs the reference on K padded 200 -> 256 (other GEMM shape than `ref`, so MKL may sum in another
    # order) and both round to bf16: compare each to the float64 product of the dequantized operands with the fp32
    # rounding bound plus half a bf16 ulp (tests/_tolerance.py). A scale read in the wrong layout (MN-major vs
    # K-major) or a mis-padded K changes elements by ~|ref| (>1e2 bf16 ulps).
    a64 = dequantize(aq, as_, (1, 128)).double()
    ref64 = torch.zeros(lay.num_rows, bq.shape[1], dtype=torch.float64)
    for e in range(bq.shape[0]):
        rows = (lay.m_indices == e).nonzero().squeeze(1)
        ref64[rows] = a64[rows] @ dequantize(bq[e], bs[e], (128, 128)).double().T
    scale = _grouped_abs_scale(a64, bq, bs, lay)
    for name, got in (("deep_gemm shim", out), ("torch backend", ref)):
        assert_close_to_reference(got, ref64, dtype=torch.float32, k=256, scale=scale, out_dtype=torch.bfloat16,
                                  what=name)
    with pytest.raises(ImportError, match="exports none of"):
        grouped._grouped_deep_gemm(types.SimpleNamespace(), aq, as_, bq, bs, lay.m_indices, torch.bfloat16)
