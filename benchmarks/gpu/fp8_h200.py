"""Prepared GPU benchmark (not run in CI): FP8 block-scaled quantization bandwidth and GEMM TFLOP/s on one GPU.

    python benchmarks/gpu/fp8_h200.py --out "$OUT"            # H200 defaults: HBM peak 4.8 TB/s
    python benchmarks/gpu/fp8_h200.py --dry-run               # CPU-safe: prints the plan (shapes, cases) as JSON

Cases (median of ``--iters`` after ``--warmup``, CUDA events, one synchronize per call):

- **quantization** of a bf16 ``[M, K]`` tensor, moe_rl Triton kernels ``1x128`` / ``128x1`` (via the transposed
  view) / ``128x128`` and the torch reference: GB/s of (bf16 read + fp8 write + fp32 scales) and the fraction of
  ``--hbm-peak-tbps`` (goal >= 0.8).
- **dense GEMM** ``[M, K] x [N, K]^T`` at M in ``--m-list`` (default 4096, 8192) on DeepSeek-V3 layer shapes (the
  ``(N, K)`` list DeepGEMM's tests use; GLM-5 belongs to the same DSV3/MLA architecture class) and GLM-4.5-Air
  shapes taken from ``moe_rl.models.GlmMoeConfig.glm45_air()``: torch bf16 ``matmul`` (baseline), moe_rl
  ``fp8_block_gemm(backend="triton")`` and ``backend="deep_gemm"`` (``fp8_gemm_nt`` / ``gemm_fp8_fp8_bf16_nt``).
  Goals: Triton >= 0.7x DeepGEMM, DeepGEMM >= 1.5x bf16 (TFLOP/s ratios).
- **grouped GEMM** (MoE experts, m-grouped contiguous layout, 128-row padded segments, -1 padding ids):
  ``torch._grouped_mm`` bf16 vs moe_rl ``fp8_grouped_gemm`` triton / deep_gemm at DeepSeek-V3 expert shapes
  (8 local experts = 256 experts over EP32; gate_up ``N=4096, K=7168``, down ``N=7168, K=2048``), M routed rows
  in total with uneven per-expert loads.

Every FP8 result is also checked against the torch reference backend (SQNR in dB, must be >= 40: same
quantized operands, only fp32 summation order differs). Writes ``fp8_h200_<gpu>_<date>.json`` with provenance
(commit, GPU, torch / CUDA / triton / deep_gemm versions, args) to ``--out`` (default ``$OUT``, else
``benchmarks/results``). Without CUDA it exits with status 2 and says why; deep_gemm missing only skips its rows.
"""

# run_all: timeout=240
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench_common.py
from _bench_common import commit, cuda_times_ms, dry_run_or_no_cuda, results_dir  # noqa: E402

# DeepSeek-V3 dense (N, K) shapes, as in DeepGEMM's tests/test_core.py (q_a/kv_a, q_b, kv_b/wkv, o, shared/dense MLP)
DSV3_DENSE_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
# DeepSeek-V3 routed experts, 8 local experts (256 over EP32): gate_up (2 x 2048, 7168), down (7168, 2048)
DSV3_GROUPED = {"num_groups": 8, "nk": [(4096, 7168), (7168, 2048)]}
H200_HBM_TBPS = 4.8


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="moe_rl FP8 block-scaled quantization and GEMM benchmark (GPU)")
    p.add_argument("--m-list", type=int, nargs="+", default=[4096, 8192], help="token counts M")
    p.add_argument("--quant-shape", type=int, nargs=2, default=[8192, 7168], help="[M, K] for quantization")
    p.add_argument("--hbm-peak-tbps", type=float, default=H200_HBM_TBPS, help="HBM peak for the fraction")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip-glm", action="store_true", help="DeepSeek-V3 shapes only")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: $OUT or benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit (no GPU needed)")
    return p.parse_args(argv)


def glm_dense_nk() -> list[tuple[int, int]]:
    """GLM-4.5-Air projection shapes (N, K) from moe_rl's config: q, kv, o, dense MLP gate_up and down."""
    from moe_rl.models import GlmMoeConfig

    c = GlmMoeConfig.glm45_air()
    q = c.num_attention_heads * c.head_dim
    kv = 2 * c.num_key_value_heads * c.head_dim
    return [(q, c.hidden_size), (kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size)]


def plan(args: argparse.Namespace) -> dict:
    """The cases this run measures (CPU-safe)."""
    dense = {"deepseek_v3": DSV3_DENSE_NK}
    if not args.skip_glm:
        dense["glm45_air"] = glm_dense_nk()
    return {
        "m_list": args.m_list,
        "quant_shape": args.quant_shape,
        "quant_cases": ["1x128_triton", "128x1_triton", "128x128_triton", "1x128_torch"],
        "dense_nk": dense,
        "dense_cases": ["torch_bf16", "fp8_triton", "fp8_deep_gemm"],
        "grouped": DSV3_GROUPED,
        "grouped_cases": ["torch_grouped_mm_bf16", "fp8_grouped_triton", "fp8_grouped_deep_gemm"],
        "hbm_peak_tbps": args.hbm_peak_tbps,
        "goals": {"quant_frac_of_hbm_peak": 0.8, "triton_over_deep_gemm": 0.7, "deep_gemm_over_bf16": 1.5},
    }


def _uneven_counts(total: int, groups: int) -> list[int]:
    """Deterministic uneven split of ``total`` rows over ``groups`` (loads 0.5x..1.5x of the mean)."""
    w = [0.5 + i / max(1, groups - 1) for i in range(groups)]
    counts = [int(total * x / sum(w)) for x in w]
    counts[-1] += total - sum(counts)
    return counts


def _add_rates(row: dict, flops: int, baseline: str, triton: str, deep_gemm: str) -> dict:
    """Add to every entry of ``row`` (``{case: {"median_ms": ...}}``, the bf16 ``baseline`` first) its TFLOP/s for
    ``flops`` and its ratio to the baseline's, and ``triton_over_deep_gemm`` when both FP8 cases ran; returns ``row``."""
    for r in row.values():
        r["tflops"] = flops / (r["median_ms"] * 1e-3) / 1e12
        r["ratio_to_torch_bf16"] = r["tflops"] / row[baseline]["tflops"]
    if triton in row and deep_gemm in row:
        row["triton_over_deep_gemm"] = row[triton]["tflops"] / row[deep_gemm]["tflops"]
    return row


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - a linear script
    args = _parse(argv)
    the_plan = plan(args)
    status = dry_run_or_no_cuda(args.dry_run, lambda: the_plan, "fp8_h200.py",
                                needs=" (an SM90 GPU for DeepGEMM; --dry-run prints the plan)")
    if status is not None:
        return status
    import torch

    from moe_rl.fp8 import (
        contiguous_layout,
        fp8_block_gemm,
        fp8_grouped_gemm,
        quantize_1x128,
        quantize_128x1,
        quantize_128x128,
        quantize_128x128_grouped,
        sqnr_db,
    )

    try:
        import deep_gemm  # noqa: F401

        have_dg, dg_err = True, None
    except (ImportError, OSError) as e:
        have_dg, dg_err = False, str(e)
    dev = torch.device("cuda")

    def bench(fn) -> float:
        for _ in range(args.warmup):
            fn()
        return statistics.median(cuda_times_ms(torch, fn, args.iters))

    results: dict = {"quant": {}, "dense": {}, "grouped": {}, "errors": {}}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(dev)
    out_dir = results_dir(args.out)
    path = out_dir / f"fp8_h200_{gpu.replace(' ', '_').replace('/', '_')}_{_dt.date.today().isoformat()}.json"

    def write() -> None:  # after every section, so a run killed by its timeout keeps what it measured
        report = {
            "theme": "fp8_block_scaling",
            "plan": the_plan,
            "results": results,
            "provenance": {
                "commit": commit(),
                "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "gpu": gpu, "capability": list(torch.cuda.get_device_capability(dev)),
                "machine": platform.platform(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": triton_version,
                "deep_gemm": (getattr(sys.modules.get("deep_gemm"), "__version__", "unknown") if have_dg else None),
                "deep_gemm_import_error": dg_err, "args": {k: str(v) for k, v in vars(args).items()},
            },
        }
        path.write_text(json.dumps(report, indent=1))

    # ------------------------------------------------------------------------------------------ quantization
    M, K = args.quant_shape
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    for case in the_plan["quant_cases"]:
        kind, _, backend = case.partition("_")
        fn = {"1x128": quantize_1x128, "128x1": quantize_128x1, "128x128": quantize_128x128}[kind]
        try:
            ms = bench(lambda fn=fn, backend=backend: fn(x, backend=backend))
            codes, scales = fn(x, backend=backend)
            ref_codes, ref_scales = fn(x, backend="torch")
            moved = M * K * 3 + scales.numel() * 4
            results["quant"][case] = {
                "median_ms": ms, "GBps": moved / (ms * 1e-3) / 1e9,
                "frac_of_hbm_peak": moved / (ms * 1e-3) / (args.hbm_peak_tbps * 1e12),
                "bit_exact_vs_torch": bool(torch.equal(codes.contiguous().view(torch.uint8),
                                                       ref_codes.contiguous().view(torch.uint8))
                                           and torch.equal(scales.contiguous(), ref_scales.contiguous())),
            }
        except Exception as e:  # noqa: BLE001 - report and continue with the other cases
            results["errors"][f"quant.{case}"] = repr(e)
    write()
    # ------------------------------------------------------------------------------------------- dense GEMM
    for family, nks in the_plan["dense_nk"].items():
        for N, K in nks:
            for M in args.m_list:
                key = f"{family}.M{M}.N{N}.K{K}"
                a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                b = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
                aq, as_ = quantize_1x128(a, backend="triton")
                bq, bs = quantize_128x128(b, backend="triton")
                flops = 2 * M * N * K
                row: dict = {}
                ref = fp8_block_gemm(aq, as_, bq, bs, torch.float32, backend="torch")
                row["torch_bf16"] = {"median_ms": bench(lambda a=a, b=b: a @ b.T)}
                for case, backend in (("fp8_triton", "triton"), ("fp8_deep_gemm", "deep_gemm")):
                    if backend == "deep_gemm" and not have_dg:
                        continue
                    try:
                        f = lambda aq=aq, as_=as_, bq=bq, bs=bs, be=backend: fp8_block_gemm(aq, as_, bq, bs, backend=be)  # noqa: E731
                        row[case] = {"median_ms": bench(f), "sqnr_vs_torch_backend_db": sqnr_db(ref, f().float())}
                    except Exception as e:  # noqa: BLE001
                        results["errors"][f"dense.{key}.{case}"] = repr(e)
                results["dense"][key] = _add_rates(row, flops, "torch_bf16", "fp8_triton", "fp8_deep_gemm")
    write()
    # ----------------------------------------------------------------------------------------- grouped GEMM
    G = DSV3_GROUPED["num_groups"]
    for N, K in DSV3_GROUPED["nk"]:
        for M in args.m_list:
            key = f"deepseek_v3.G{G}.M{M}.N{N}.K{K}"
            counts = _uneven_counts(M, G)
            lay = contiguous_layout(torch.tensor(counts, device=dev))
            xg = torch.zeros(lay.num_rows, K, device=dev, dtype=torch.bfloat16)
            xg[lay.rows] = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
            aq, as_ = quantize_1x128(xg, backend="triton")
            bq, bs = quantize_128x128_grouped(w, backend="triton")
            x16 = xg[lay.rows]
            w16t = w.transpose(1, 2)
            offs = torch.cumsum(torch.tensor(counts, device=dev), 0).to(torch.int32)
            flops = 2 * M * N * K
            row = {"torch_grouped_mm_bf16": {
                "median_ms": bench(lambda x16=x16, w16t=w16t, offs=offs: torch._grouped_mm(x16, w16t, offs=offs))}}
            ref = fp8_grouped_gemm(aq, as_, bq, bs, lay.m_indices, torch.float32, backend="torch")
            for case, backend in (("fp8_grouped_triton", "triton"), ("fp8_grouped_deep_gemm", "deep_gemm")):
                if backend == "deep_gemm" and not have_dg:
                    continue
                try:
                    f = lambda be=backend, aq=aq, as_=as_, bq=bq, bs=bs, ids=lay.m_indices: fp8_grouped_gemm(  # noqa: E731
                        aq, as_, bq, bs, ids, torch.bfloat16, backend=be)
                    row[case] = {"median_ms": bench(f), "sqnr_vs_torch_backend_db": sqnr_db(ref, f().float()),
                                 "padding_rows": lay.num_padding_rows}
                except Exception as e:  # noqa: BLE001
                    results["errors"][f"grouped.{key}.{case}"] = repr(e)
            results["grouped"][key] = _add_rates(row, flops, "torch_grouped_mm_bf16", "fp8_grouped_triton",
                                                 "fp8_grouped_deep_gemm")
    # ---------------------------------------------------------------------------------------------- goals
    goals = the_plan["goals"]
    q = results["quant"].get("1x128_triton")
    big = [r for k, r in results["dense"].items() if int(k.split(".M")[1].split(".")[0]) >= 4096]
    results["goals_met"] = {
        "quant_1x128_frac_of_hbm_peak": None if q is None else q["frac_of_hbm_peak"] >= goals["quant_frac_of_hbm_peak"],
        "triton_over_deep_gemm_all_dense": None if not have_dg else all(
            r.get("triton_over_deep_gemm", 0) >= goals["triton_over_deep_gemm"] for r in big),
        "deep_gemm_over_bf16_all_dense_M_ge_4096": None if not have_dg else all(
            r.get("fp8_deep_gemm", {}).get("ratio_to_torch_bf16", 0) >= goals["deep_gemm_over_bf16"] for r in big),
    }
    write()
    print(json.dumps({"goals_met": results["goals_met"], "quant": results["quant"], "errors": results["errors"]},
                     indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
