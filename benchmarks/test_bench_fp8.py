"""FP8 block scaling: quantization throughput and (grouped) GEMM throughput per backend, with ratios to the torch
bf16 matmul of the same shape measured in the same run (``role == "baseline"``).

Backends: ``torch`` (reference) always; ``triton`` and ``deep_gemm`` only when the tensors can live on CUDA and the
package imports (skipped otherwise: the Triton interpreter on CPU is a correctness tool, not a speed one). On CPU
the FP8 path is an emulation (dequantize, fp32 matmul), so it is expected to be slower than bf16; the numbers
bound the cost of running the reference in tests and CI. The GPU goals (quantization >= 80% of HBM bandwidth,
Triton >= 0.7x DeepGEMM, DeepGEMM >= 1.5x bf16 at M >= 4096) are measured by ``benchmarks/gpu/fp8_h200.py``.

Shapes: DeepSeek-V2-Lite-like ``kv_a_proj`` (K=2048 -> N=576, B03 tails) and a square 1024 projection at 512
tokens; grouped: 8 experts, 512 routed rows, D=1024 -> 2F=512 (uneven expert loads, one empty expert).
Extra info: ``tflops`` for GEMMs, ``gb_per_s`` (bytes read + written) for quantizers.
"""

import pytest
import torch

from moe_rl.fp8 import (
    contiguous_layout,
    fp8_block_gemm,
    fp8_grouped_gemm,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
    quantize_128x128_grouped,
)

SHAPES = {"kv_a_proj": (512, 576, 2048), "square1024": (512, 1024, 1024)}
ENTRIES = ["bf16_matmul", "fp32_matmul", "fp8_gemm_torch", "fp8_gemm_kslice", "fp8_quant_and_gemm_torch",
           "fp8_gemm_triton", "fp8_gemm_deep_gemm"]


def _cuda_backend_ok(backend: str) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        if backend == "triton":
            import triton  # noqa: F401
        else:
            import deep_gemm  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def _device_for(entry: str) -> str:
    for b in ("triton", "deep_gemm"):
        if entry.endswith(b):
            if not _cuda_backend_ok(b):
                pytest.skip(f"{b} needs CUDA and the package")
            return "cuda"
    return "cpu"


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


def _sync(dev: str):
    if dev == "cuda":
        torch.cuda.synchronize()


def _timed(benchmark, fn, dev: str, group: str, *, baseline: bool):
    """Time ``fn`` on ``dev`` (synchronized on CUDA; 10 rounds after 2 warm-up rounds) in benchmark ``group`` with
    the role ``baseline`` or ``candidate``; returns ``fn``'s output."""

    def run():
        out = fn()
        _sync(dev)
        return out

    benchmark.group = group
    benchmark.extra_info["role"] = "baseline" if baseline else "candidate"
    benchmark.extra_info["device"] = dev
    return benchmark.pedantic(run, rounds=10, warmup_rounds=2)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_block_gemm(benchmark, shape, entry):
    dev = _device_for(entry)
    M, N, K = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(M, K, generator=g).to(dev), (torch.randn(N, K, generator=g) * 0.02).to(dev)
    aq, as_ = quantize_1x128(a)
    bq, bs = quantize_128x128(b)
    a16, b16 = a.bfloat16(), b.bfloat16()
    fns = {
        "bf16_matmul": lambda: a16 @ b16.T,
        "fp32_matmul": lambda: a @ b.T,
        "fp8_gemm_torch": lambda: fp8_block_gemm(aq, as_, bq, bs),
        "fp8_gemm_kslice": lambda: _gemm_kslice(aq, as_, bq, bs),
        "fp8_quant_and_gemm_torch": lambda: fp8_block_gemm(*quantize_1x128(a), *quantize_128x128(b)),
        "fp8_gemm_triton": lambda: fp8_block_gemm(aq, as_, bq, bs, backend="triton"),
        "fp8_gemm_deep_gemm": lambda: fp8_block_gemm(aq, as_, bq, bs, backend="deep_gemm"),
    }
    out = _timed(benchmark, fns[entry], dev, f"fp8 block gemm {shape} M={M} N={N} K={K}",
                 baseline=entry == "bf16_matmul")
    benchmark.extra_info["tflops"] = 2 * M * N * K / benchmark.stats.stats.median / 1e12
    assert out.shape == (M, N)


QUANT_SHAPE = (2048, 2048)
QUANT_ENTRIES = ["bf16_copy", "1x128_torch", "128x128_torch", "128x1_torch", "1x128_triton", "128x128_triton",
                 "128x1_triton"]


@pytest.mark.parametrize("entry", QUANT_ENTRIES)
def test_fp8_quantize_throughput(benchmark, entry):
    """Quantizers on a bf16 ``[2048, 2048]`` tensor; baseline: a bf16 copy of it (pure memory traffic)."""
    dev = _device_for(entry)
    M, K = QUANT_SHAPE
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dev).bfloat16()
    kind, _, backend = entry.partition("_")
    fn = {"1x128": quantize_1x128, "128x128": quantize_128x128, "128x1": quantize_128x1}.get(kind)
    out = _timed(benchmark, x.clone if fn is None else lambda: fn(x, backend=backend), dev,
                 f"fp8 quantize bf16 {M}x{K}", baseline=fn is None)
    # bytes moved: read bf16 (2 B/elt) + write fp8 codes (1 B/elt) + fp32 scales; the copy reads and writes bf16
    moved = M * K * 4 if fn is None else M * K * 3 + out[1].numel() * 4
    benchmark.extra_info["gb_per_s"] = moved / benchmark.stats.stats.median / 1e9
    if fn is not None:
        assert out[0].shape == (M, K)


GROUPED_COUNTS = [120, 0, 64, 90, 30, 100, 50, 58]  # 512 routed rows over 8 experts, one empty
GROUPED_NK = (512, 1024)
GROUPED_ENTRIES = ["bf16_grouped_mm", "fp8_grouped_torch", "fp8_grouped_triton", "fp8_grouped_deep_gemm"]


@pytest.mark.parametrize("entry", GROUPED_ENTRIES)
def test_fp8_grouped_gemm(benchmark, entry):
    """m-grouped contiguous GEMM (padded layout) vs ``torch._grouped_mm`` in bf16 on the unpadded rows."""
    dev = _device_for(entry)
    N, K = GROUPED_NK
    counts = torch.tensor(GROUPED_COUNTS)
    lay = contiguous_layout(counts.to(dev))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(lay.num_rows, K, generator=g).to(dev)
    x[lay.m_indices < 0] = 0
    w = (torch.randn(len(GROUPED_COUNTS), N, K, generator=g) * 0.02).to(dev)
    aq, as_ = quantize_1x128(x)
    bq, bs = quantize_128x128_grouped(w)
    x16 = x[lay.rows].bfloat16()
    w16t = w.bfloat16().transpose(1, 2)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    backend = entry.rpartition("_")[2] if entry != "fp8_grouped_deep_gemm" else "deep_gemm"

    def run():
        if entry == "bf16_grouped_mm":
            return torch._grouped_mm(x16, w16t, offs=offs)
        return fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.bfloat16, backend=backend)

    out = _timed(benchmark, run, dev, f"fp8 grouped gemm E={len(GROUPED_COUNTS)} rows={int(counts.sum())} N={N} K={K}",
                 baseline=entry == "bf16_grouped_mm")
    benchmark.extra_info["tflops"] = 2 * int(counts.sum()) * N * K / benchmark.stats.stats.median / 1e12
    assert out.shape[1] == N
