"""Runs the Triton FP8 kernels in Triton's CPU interpreter; driven by ``test_fp8_triton.py`` in a subprocess.

``TRITON_INTERPRET=1`` must be in the environment before ``triton`` is first imported (triton reads it at
import/JIT-decoration time), hence a fresh process. Usage: ``python _triton_interp_worker.py OUT.json [CASE ...]``;
writes ``{case: "ok" | traceback}``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton (moe_rl.fp8 imports it lazily, but be safe)

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # tests/: tolerance rule
from _tolerance import assert_normwise_close  # noqa: E402

from moe_rl.fp8 import gemm as gemm_mod  # noqa: E402
from moe_rl.fp8 import triton_kernels as tk  # noqa: E402
from moe_rl.fp8.gemm import fp8_block_gemm  # noqa: E402
from moe_rl.fp8.linear import Fp8BlockLinear  # noqa: E402
from moe_rl.fp8.quant import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
)


def _ref_scaled_1x128(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The torch reference's pre-cast values ``clamp(x / scale, ±448)`` in fp32 (as in ``quantize_blocks``)."""
    M, K = x.shape
    SK = scales.shape[1]
    xp = torch.nn.functional.pad(x.float(), (0, SK * 128 - K)).view(M, SK, 128)
    return (xp / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(M, SK * 128)[:, :K]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def case_quant_exact() -> None:
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(6, 300, generator=g) * 30  # tail group of 44 columns
    x1[1, 128:256] = 0.0  # all-zero group -> amax floor
    x1[2, :128] *= 1e-9  # tiny group
    x2 = (torch.randn(4, 256, generator=g) * 5).to(torch.bfloat16)  # bf16 input (bf16 -> f32 load is exact)
    x3 = torch.randn(256, 5, generator=g).T  # non-contiguous [5, 256] view: strides
    for x in (x1, x2, x3):
        for ue8m0 in (False, True):
            for floor in (1e-12, 1e-4):
                codes, scales, q = tk.quantize_1x128_triton(x, ue8m0=ue8m0, amax_floor=floor, return_scaled=True)
                r_codes, r_scales = quantize_1x128(x, ue8m0=ue8m0, amax_floor=floor)
                tag = f"shape={tuple(x.shape)} {x.dtype} ue8m0={ue8m0} floor={floor}"
                assert codes.dtype == FP8_DTYPE and codes.shape == x.shape, tag
                assert torch.equal(_bits(scales), _bits(r_scales)), f"scales differ: {tag}"
                assert torch.equal(_bits(q), _bits(_ref_scaled_1x128(x, r_scales))), f"x/scale differs: {tag}"
                # the E4M3 cast done by torch (RTNE) on the kernel's fp32 values = the reference codes
                assert torch.equal(_bits(q.to(FP8_DTYPE)), _bits(r_codes)), f"codes differ: {tag}"
    # the public entry point dispatches to the kernel
    c, s = quantize_1x128(x1, backend="triton")
    assert torch.equal(_bits(s), _bits(quantize_1x128(x1)[1]))


def _assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, tag: str, k: int | None = None, depth: int = 2) -> None:
    """Two fp32 paths of the same FP8 GEMM(s) on identical codes and scales (the interpreter's tl.dot sums
    128-K partial products through numpy, torch through MKL: other orders). Each is within the fp32 rounding
    bound of the exact product, so they agree normwise within ``depth * c * sqrt(K) * eps32`` relative
    (tests/_tolerance.py; depth 2 = two paths of one GEMM). A wrong scale block, tile offset or expert is off by
    O(1) relative. ``k``: the reduction size (default: ``ref``'s last dim is not K, so callers pass it)."""
    if k is None:
        raise ValueError(f"{tag}: pass k (the reduction size) to _assert_gemm_close")
    assert_normwise_close(out, ref, dtype=torch.float32, k=k, depth=depth, what=tag)


def case_gemm_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    for (M, N, K) in ((50, 200, 300), (64, 128, 256)):
        a = torch.randn(M, K, generator=g)
        b = torch.randn(N, K, generator=g) * 0.02
        aq, as_ = quantize_1x128(a)
        bq, bs = quantize_128x128(b)
        ref = fp8_block_gemm(aq, as_, bq, bs, torch.float32, backend="torch")
        ref64 = dequantize(aq, as_, (1, 128)).double() @ dequantize(bq, bs, (128, 128)).double().T
        for bm, bn in ((64, 64), (16, 32)):
            out = tk.fp8_block_gemm_triton(aq, as_, bq, bs, torch.float32, block_m=bm, block_n=bn)
            _assert_gemm_close(out, ref, f"M,N,K={M, N, K} tile={bm, bn}", K)
            _assert_gemm_close(out.double(), ref64, f"vs float64 M,N,K={M, N, K}", K, depth=1)
        out = fp8_block_gemm(aq, as_, bq, bs, torch.float32, backend="triton")
        _assert_gemm_close(out, ref, "fp8_block_gemm(backend='triton')", K)


def case_gemm_wgrad_recipe() -> None:
    g = torch.Generator().manual_seed(2)
    T, N, K = 200, 24, 40  # dW[N, K] = dy^T [N, T] @ x [T, K]; contraction over T (tail group of 72)
    dy, x = torch.randn(T, N, generator=g), torch.randn(T, K, generator=g)
    gq, gs = quantize_128x1(dy)
    xq, xs = quantize_128x1(x)
    args = (gq.T.contiguous(), gs.T.contiguous(), xq.T.contiguous(), xs.T.contiguous())
    ref = fp8_block_gemm(*args, torch.float32, backend="torch", recipe=(1, 1, 128))
    out = fp8_block_gemm(*args, torch.float32, backend="triton", recipe=(1, 1, 128))
    _assert_gemm_close(out, ref, "recipe (1, 1, 128)", T)


def case_gemm_bf16_out() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(32, 256, generator=g), torch.randn(64, 256, generator=g)
    aq, as_ = quantize_1x128(a)
    bq, bs = quantize_128x128(b)
    ref = fp8_block_gemm(aq, as_, bq, bs, torch.float32, backend="torch")
    out = fp8_block_gemm(aq, as_, bq, bs, torch.bfloat16, backend="triton")
    assert out.dtype == torch.bfloat16
    # The interpreter's f32->bf16 cast truncates (GPU rounds to nearest): allow 1 bf16 ulp (2^-7 relative).
    err = (out.float() - ref).abs()
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref)[1] - 8)
    assert bool((err <= ulp * 1.0001 + 1e-30).all()), f"bf16 out off by more than 1 ulp: {float((err / ulp).max())}"


class _TorchCastQuantizers:
    """Route the Triton quantizers' E4M3 cast through torch (RTNE) while keeping the kernels' own scales and
    pre-cast values: the interpreter mis-rounds f32->fp8 casts (module docstring of test_fp8_triton.py), a GPU
    does not. Counts the calls, which proves the Triton quantizer path ran."""

    def __init__(self) -> None:
        self.calls = {"1x128": 0, "128x128": 0}
        self.orig = (tk.quantize_1x128_triton, tk.quantize_128x128_triton)

    def __enter__(self):
        q1, q2 = self.orig

        def w1(x, **k):
            self.calls["1x128"] += 1
            _, s, q = q1(x, return_scaled=True, **k)
            return q.to(FP8_DTYPE), s

        def w2(x, **k):
            self.calls["128x128"] += 1
            _, s, q = q2(x, return_scaled=True, **k)
            return q.to(FP8_DTYPE), s

        tk.quantize_1x128_triton, tk.quantize_128x128_triton = w1, w2
        return self

    def __exit__(self, *exc):
        tk.quantize_1x128_triton, tk.quantize_128x128_triton = self.orig


def case_quant_128x128_exact() -> None:
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(300, 200, generator=g) * 0.02  # tail blocks on both axes (B03)
    w1[128:256, 128:] = 0.0  # an all-zero block (B01)
    w2 = (torch.randn(128, 256, generator=g)).to(torch.bfloat16)
    w3 = torch.randn(200, 130, generator=g).T  # non-contiguous
    for w in (w1, w2, w3):
        for ue8m0 in (False, True):
            codes, scales, q = tk.quantize_128x128_triton(w, ue8m0=ue8m0, return_scaled=True)
            r_codes, r_scales = quantize_128x128(w, ue8m0=ue8m0)
            tag = f"shape={tuple(w.shape)} {w.dtype} ue8m0={ue8m0}"
            assert codes.dtype == FP8_DTYPE and codes.shape == w.shape, tag
            assert torch.equal(_bits(scales), _bits(r_scales)), f"scales differ: {tag}"
            assert torch.equal(_bits(q.to(FP8_DTYPE)), _bits(r_codes)), f"codes differ: {tag}"
    # 128x1 through the 1x128 kernel on the transpose: same scales, contiguous transposes for Wgrad
    x = torch.randn(200, 40, generator=g)
    c, s = quantize_128x1(x, backend="triton")
    rc, rs = quantize_128x1(x)
    assert c.shape == rc.shape and s.shape == rs.shape and c.T.is_contiguous()
    assert torch.equal(_bits(s.contiguous()), _bits(rs))
    for bad in (float("nan"), float("inf")):
        w = w1.clone()
        w[3, 4] = bad
        try:
            tk.quantize_128x128_triton(w, name="weight")
        except ValueError as e:
            assert "weight: 1 non-finite" in str(e), e
        else:
            raise AssertionError("non-finite weight accepted")


def case_grouped_gemm() -> None:
    from moe_rl.fp8.grouped import contiguous_layout, fp8_grouped_gemm, quantize_128x128_grouped

    g = torch.Generator().manual_seed(6)
    counts = torch.tensor([70, 0, 130, 5])  # an empty expert; segments of 128, 0, 256, 128 rows
    lay = contiguous_layout(counts)
    for (N, K) in ((96, 200), (128, 128)):
        x = torch.randn(lay.num_rows, K, generator=g)
        x[lay.m_indices < 0] = 0
        w = torch.randn(4, N, K, generator=g) * 0.05
        aq, as_ = quantize_1x128(x)
        bq, bs = quantize_128x128_grouped(w)
        ref = fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.float32, backend="torch")
        for bm in (64, 16):
            out = tk.fp8_grouped_gemm_triton(aq, as_, bq, bs, lay.m_indices, torch.float32, block_m=bm, block_n=32)
            _assert_gemm_close(out, ref, f"grouped N,K={N, K} block_m={bm}", K)
            assert bool((out[lay.m_indices < 0] == 0).all()), "padding rows must be zero"
        out = fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.float32, backend="triton")
        _assert_gemm_close(out, ref, "fp8_grouped_gemm(backend='triton')", K)


def case_experts_triton_vs_torch() -> None:
    from moe_rl.moe.fp8_experts import fp8_experts_forward

    torch.manual_seed(7)
    E, D, Fi, T, K = 4, 128, 64, 40, 2
    gu, dn = torch.randn(E, 2 * Fi, D) * 0.05, torch.randn(E, D, Fi) * 0.05
    ids = torch.randint(0, E, (T, K))
    ids[ids == 1] = 2  # expert 1 gets no tokens
    x = torch.randn(T, D)
    g = torch.randn(T, K, D)
    outs = []
    with _TorchCastQuantizers() as qc:
        for backend in ("torch", "triton"):
            xi, gui, dni = (t.clone().requires_grad_(True) for t in (x, gu, dn))
            y = fp8_experts_forward(xi, ids, gui, dni, backend=backend)
            y.backward(g)
            outs.append((y.detach(), xi.grad, gui.grad, dni.grad))
    # 2 grouped linears x (fwd: x 1x128 + w 128x128; dgrad: dy 1x128; wgrad: 2x 128x1 via the 1x128 kernel)
    assert qc.calls == {"1x128": 8, "128x128": 2}, qc.calls
    for name, r, o in zip(("y", "dx", "dgate_up", "ddown"), *outs, strict=True):
        # the intermediate SwiGLU output is re-quantized: a 1-ulp fp32 difference can flip one E4M3 code of it
        # (rare: ~fp32 error / E4M3 step ~1e-5 per element); chain depth 4 (two GEMMs and their backward)
        _assert_gemm_close(o, r, f"experts triton vs torch {name}", max(D, 2 * Fi, T), depth=2 * 4)


def case_linear_triton_vs_torch() -> None:
    calls = {"gemm": 0}
    orig = tk.fp8_block_gemm_triton

    def counting(*a, **k):
        calls["gemm"] += 1
        return orig(*a, **k)

    tk.fp8_block_gemm_triton = counting  # gemm.py imports it lazily per call, so this proves the path ran
    qc = _TorchCastQuantizers().__enter__()
    try:
        torch.manual_seed(4)
        lin_t = Fp8BlockLinear(256, 128, bias=True, backend="torch")
        lin_k = Fp8BlockLinear(256, 128, bias=True, backend="triton")
        lin_k.load_state_dict(lin_t.state_dict())
        x = torch.randn(2, 16, 256)
        outs = []
        for lin in (lin_t, lin_k):
            xi = x.clone().requires_grad_(True)
            y = lin(xi)
            (y * torch.linspace(-1, 1, 128)).sum().backward()
            outs.append((y.detach(), xi.grad, lin.weight.grad, lin.bias.grad))
        for name, r, o in zip(("y", "dx", "dW", "db"), *outs, strict=True):
            # fprop K=256, dgrad K=128, wgrad and bias over the 32 tokens: one GEMM per output, two paths
            _assert_gemm_close(o, r, f"Fp8BlockLinear {name}", 256)
        assert calls["gemm"] == 3, calls  # fprop, dgrad, wgrad
        # Triton quantizers: input + grad 1x128, weight 128x128, grad + input 128x1 (1x128 kernel on .T)
        assert qc.calls == {"1x128": 4, "128x128": 1}, qc.calls
    finally:
        tk.fp8_block_gemm_triton = orig
        qc.__exit__(None, None, None)
    assert gemm_mod.resolve_backend("triton", "cpu") == "triton"


CASES = {k[len("case_"):]: v for k, v in dict(globals()).items() if k.startswith("case_")}


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:] or list(CASES)
    res = {}
    for n in names:
        try:
            CASES[n]()
            res[n] = "ok"
        except Exception:  # report per case; the test prints the traceback
            res[n] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
