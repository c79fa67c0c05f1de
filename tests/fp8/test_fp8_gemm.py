"""fp8_block_gemm (moe_rl.fp8.gemm): exactness vs a float64 reference of the dequantized operands, SQNR vs the
un-quantized matmul, backend selection and the DeepGEMM shim (old and new API names).

SQNR floor, 25 dB: E4M3 keeps 3 mantissa bits, so round-to-nearest leaves a relative error uniform in about
[-2^-4, 2^-4] per element, i.e. ~31 dB per operand for Gaussian data (measured: 31.6-31.8 dB in
test_fp8_quant-like data). The GEMM output carries the noise of both operands (-3 dB, ~28-29 dB measured);
25 dB (torchao's float8 gate) leaves ~3 dB margin for seeds and shapes.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from _tolerance import abs_matmul, assert_close_to_reference

from moe_rl.fp8.gemm import _gemm_deep_gemm, fp8_block_gemm, resolve_backend
from moe_rl.fp8.quant import dequantize, quantize_1x128, quantize_128x1, quantize_128x128, sqnr_db

torch.set_num_threads(1)

SQNR_FLOOR_DB = 25.0


def _operands(M, N, K, seed=0, ue8m0=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g)
    b = torch.randn(N, K, generator=g) * 0.02
    aq, as_ = quantize_1x128(a, ue8m0=ue8m0)
    bq, bs = quantize_128x128(b, ue8m0=ue8m0)
    return a, b, aq, as_, bq, bs


def _ref64(aq, as_, bq, bs, a_block=(1, 128), b_block=(128, 128)):
    return dequantize(aq, as_, a_block).double() @ dequantize(bq, bs, b_block).double().T


def _abs64(aq, as_, bq, bs, a_block=(1, 128), b_block=(128, 128)):
    """``sum_k |a_mk| |b_nk|`` of the dequantized operands: the scale of the fp32 rounding bound."""
    return abs_matmul(dequantize(aq, as_, a_block), dequantize(bq, bs, b_block).T)


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [(64, 256, 512), (33, 300, 576), (1, 128, 128), (200, 129, 7168 // 8)],
    ids=["aligned", "b03_k576_tails", "one_row", "k896"],
)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_torch_backend_matches_float64_reference(M, N, K, ue8m0):
    a, b, aq, as_, bq, bs = _operands(M, N, K, ue8m0=ue8m0)
    out = fp8_block_gemm(aq, as_, bq, bs, out_dtype=torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32
    ref = _ref64(aq, as_, bq, bs)
    # fp32 accumulation of K products of exactly representable dequantized values, in MKL's (CPU-dependent)
    # order: within c*sqrt(K)*eps32*sum|a||b| (tests/_tolerance.py). A wrong scale block or a missing scale is
    # off by ~|ref| (>1e3 times the bound).
    assert_close_to_reference(out, ref, dtype=torch.float32, k=K, scale=_abs64(aq, as_, bq, bs))
    assert sqnr_db(a @ b.T, out) >= SQNR_FLOOR_DB


def test_b03_gemm_k576_equals_dequantized_reference():
    a, b, aq, as_, bq, bs = _operands(48, 576, 576, seed=3)  # 576x576 weight: 5x5 blocks, 64-wide tail
    assert as_.shape == (48, 5) and bs.shape == (5, 5)
    out = fp8_block_gemm(aq, as_, bq, bs, out_dtype=torch.float32)
    ref = _ref64(aq, as_, bq, bs)
    assert_close_to_reference(out, ref, dtype=torch.float32, k=576, scale=_abs64(aq, as_, bq, bs))


def test_bf16_output_is_rounded_fp32_result():
    _, _, aq, as_, bq, bs = _operands(32, 256, 384)
    out = fp8_block_gemm(aq, as_, bq, bs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_block_gemm(aq, as_, bq, bs, out_dtype=torch.float32).to(torch.bfloat16))


def test_wgrad_recipe_1_1_128():
    g = torch.Generator().manual_seed(4)
    dy, x = torch.randn(300, 64, generator=g), torch.randn(300, 96, generator=g)  # T=300 tokens (tail of 44)
    gq, gs = quantize_128x1(dy)
    xq, xs = quantize_128x1(x)
    a, a_s, b, b_s = gq.T.contiguous(), gs.T.contiguous(), xq.T.contiguous(), xs.T.contiguous()
    out = fp8_block_gemm(a, a_s, b, b_s, out_dtype=torch.float32, recipe=(1, 1, 128))
    ref = _ref64(a, a_s, b, b_s, (1, 128), (1, 128))
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert sqnr_db(dy.T @ x, out) >= SQNR_FLOOR_DB


def test_operand_validation():
    _, _, aq, as_, bq, bs = _operands(8, 128, 256)
    with pytest.raises(ValueError, match="disagree on K"):
        fp8_block_gemm(aq, as_, bq[:, :128], bs[:, :1])
    with pytest.raises(ValueError, match=r"b_scale: .* expected float32 \(1, 2\)"):
        fp8_block_gemm(aq, as_, bq, bs[:, :1])
    with pytest.raises(ValueError, match="a: expected 2-D"):
        fp8_block_gemm(aq.float(), as_, bq, bs)
    with pytest.raises(ValueError, match="backend='cublas'"):
        fp8_block_gemm(aq, as_, bq, bs, backend="cublas")


# ---- backends: explicit, never a silent fallback ----


def test_triton_backend_refuses_cpu_tensors_outside_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, _, aq, as_, bq, bs = _operands(8, 128, 128)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        fp8_block_gemm(aq, as_, bq, bs, backend="triton")


def test_triton_backend_missing_raises_importerror_with_instructions(monkeypatch):
    from moe_rl.fp8 import triton_kernels

    triton_kernels._kernels.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)
    _, _, aq, as_, bq, bs = _operands(8, 128, 128)
    try:
        with pytest.raises(ImportError, match=r"pip install triton"):
            fp8_block_gemm(aq, as_, bq, bs, backend="triton")
        with pytest.raises(ImportError, match=r"pip install triton"):
            quantize_1x128(aq.float(), backend="triton")
    finally:
        triton_kernels._kernels.cache_clear()


def test_deep_gemm_missing_raises_importerror_with_instructions(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # makes `import deep_gemm` raise ImportError
    _, _, aq, as_, bq, bs = _operands(8, 128, 128)
    with pytest.raises(ImportError, match=r"pip install 'moe_rl\[gpu\]'.*DeepGEMM"):
        fp8_block_gemm(aq, as_, bq, bs, backend="deep_gemm")


def test_auto_on_cpu_resolves_to_torch_and_logs(caplog):
    _, _, aq, as_, bq, bs = _operands(8, 128, 128)
    assert resolve_backend("auto", "cpu") == "torch"
    with caplog.at_level(logging.INFO, logger="moe_rl.fp8.gemm"):
        out = fp8_block_gemm(aq, as_, bq, bs, backend="auto")
    assert "resolved to 'torch'" in caplog.text
    assert torch.equal(out, fp8_block_gemm(aq, as_, bq, bs))


def test_auto_on_cuda_without_deep_gemm_resolves_to_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    assert resolve_backend("auto", "cuda") == "torch"


@pytest.mark.parametrize("api", ["fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt"])
def test_deep_gemm_shim_calls_either_api_name(api):
    """A fake deep_gemm records the call: proves the dispatch path runs and the old API gets MN-major SFA."""
    calls = []

    def fake(lhs, rhs, d, **kw):
        calls.append((lhs, rhs, kw))
        d.copy_(fp8_block_gemm(lhs[0], lhs[1].contiguous(), rhs[0], rhs[1]))

    mod = types.SimpleNamespace(**{api: fake})
    _, _, aq, as_, bq, bs = _operands(6, 128, 256)
    out = _gemm_deep_gemm(mod, aq, as_, bq, bs, torch.bfloat16, (1, 128, 128))
    assert len(calls) == 1 and torch.equal(out, fp8_block_gemm(aq, as_, bq, bs))
    sfa = calls[0][0][1]
    if api == "gemm_fp8_fp8_bf16_nt":
        assert sfa.stride() == (1, 8)  # MN-major, M=6 padded to 8
        with pytest.raises(ValueError, match="old API"):
            _gemm_deep_gemm(mod, aq, as_, bq, bs, torch.float32, (1, 128, 128))
    else:
        assert sfa is as_ and calls[0][2] == {"recipe": None}


def test_deep_gemm_without_known_names_raises():
    _, _, aq, as_, bq, bs = _operands(6, 128, 128)
    with pytest.raises(ImportError, match="exports none of"):
        _gemm_deep_gemm(types.SimpleNamespace(), aq, as_, bq, bs, torch.bfloat16, (1, 128, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deep_gemm_matches_torch_on_gpu():
    pytest.importorskip("deep_gemm")
    _, _, aq, as_, bq, bs = _operands(256, 512, 1024)
    ref = fp8_block_gemm(aq, as_, bq, bs, out_dtype=torch.float32)
    dev = [t.cuda() for t in (aq, as_, bq, bs)]
    out = fp8_block_gemm(*dev, backend="deep_gemm").float().cpu()
    assert resolve_backend("auto", "cuda") == "deep_gemm"
    assert sqnr_db(ref, out) >= 40  # bf16 output rounding (~2^-9 relative) dominates
