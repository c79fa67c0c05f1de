"""FP8 block-scaled GEMM (torch reference backend, CPU) vs the fp32 and bf16 torch matmul of the same shape.

Shapes: a DeepSeek-V2-Lite-like ``kv_a_proj`` (K=2048 -> N=576, B03) and a square 1024 projection, at 512 tokens.
Entries per group: fp32 matmul (baseline), bf16 matmul, fp8 GEMM on pre-quantized operands, and quantize +
GEMM (the full forward cost of one FP8 linear). On CPU the FP8 path is an emulation (dequantize, fp32 matmul),
so it is expected to be slower than the baseline; the numbers bound the cost of running the reference in tests.
"""

import pytest
import torch

from moe_rl.fp8 import fp8_block_gemm, quantize_1x128, quantize_128x128

SHAPES = {"kv_a_proj": (512, 576, 2048), "square1024": (512, 1024, 1024)}
ENTRIES = ["fp32_matmul", "bf16_matmul", "fp8_gemm_torch", "fp8_gemm_kslice", "fp8_quant_and_gemm_torch"]


def _gemm_kslice(aq, as_, bq, bs):
    """Rejected CPU candidate, kept here as evidence: per-128-K-slice fp32 matmul of the codes, scaled by
    ``sa[:, j] * sb[:, j]`` and summed (the kernel's promotion order). It loses to dequantize-then-matmul
    because it does K/128 small matmuls plus K/128 full [M, N] scale passes."""
    M, K = aq.shape
    N = bq.shape[0]
    af, bf = aq.float(), bq.float()
    sb_n = bs.repeat_interleave(128, 0)[:N]  # [N, SK]
    out = torch.zeros(M, N)
    for j in range(-(-K // 128)):
        sl = slice(128 * j, 128 * (j + 1))
        out += (af[:, sl] @ bf[:, sl].T) * (as_[:, j : j + 1] * sb_n[None, :, j])
    return out.bfloat16()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_block_gemm(benchmark, shape, entry):
    M, N, K = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.02
    aq, as_ = quantize_1x128(a)
    bq, bs = quantize_128x128(b)
    a16, b16 = a.bfloat16(), b.bfloat16()
    fns = {
        "fp32_matmul": lambda: a @ b.T,
        "bf16_matmul": lambda: a16 @ b16.T,
        "fp8_gemm_torch": lambda: fp8_block_gemm(aq, as_, bq, bs),
        "fp8_gemm_kslice": lambda: _gemm_kslice(aq, as_, bq, bs),
        "fp8_quant_and_gemm_torch": lambda: fp8_block_gemm(*quantize_1x128(a), *quantize_128x128(b)),
    }
    benchmark.group = f"fp8 block gemm {shape} M={M} N={N} K={K}"
    benchmark.extra_info["role"] = "baseline" if entry == "fp32_matmul" else "candidate"
    benchmark.extra_info["tflops"] = None
    out = benchmark.pedantic(fns[entry], rounds=10, warmup_rounds=2)
    benchmark.extra_info["tflops"] = 2 * M * N * K / benchmark.stats.stats.median / 1e12
    assert out.shape == (M, N)
