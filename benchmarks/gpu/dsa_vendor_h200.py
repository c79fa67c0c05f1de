"""Prepared GPU benchmark (not run in CI): DSA with the vendor kernels vs the torch memory-bounded path, one GPU.

    python benchmarks/gpu/dsa_vendor_h200.py --out "$OUT"      # T in 8k 16k 32k, bf16, GLM-5 head sizes
    python benchmarks/gpu/dsa_vendor_h200.py --dry-run         # CPU-safe: prints the plan as JSON

Per sequence length T (one causal sequence), GLM-5 sizes (H = 64 query heads, Dk = 576, Dv = 512, indexer
HI = 32 x DI = 128, index_topk K = 2048), bf16 inputs, two stages timed and measured separately:

* ``indexer``: top-K selection, ``torch`` = :func:`moe_rl.attention.dsa_chunked.chunked_indexer_topk` (fp32
  scores) vs ``deep_gemm`` = :func:`moe_rl.attention.dsa_vendor.deepgemm_indexer_topk` (DeepGEMM FP8 MQA logits +
  our top-k). Also the fraction of equal index slots (FP8 rounding moves near-equal scores).
* ``attention`` forward + backward on the same indices, ``torch`` =
  :func:`moe_rl.attention.dsa_chunked.sparse_latent_attention_chunked` vs ``flashmla`` =
  :func:`moe_rl.attention.dsa_vendor.flashmla_sparse_attention` (FlashMLA forward, torch recomputing backward),
  plus forward only; output max abs difference between the two.

Per row: ``torch.cuda.max_memory_allocated`` above the inputs (``peak_gib``), the median of ``--iters`` timed runs
(CUDA events), and the vendor / torch time ratio. ``torch.OutOfMemoryError`` is recorded as ``"oom"``. A stage
whose vendor package is missing is recorded as ``"unavailable"`` with the ImportError text; when neither
``flash_mla`` nor ``deep_gemm`` imports, or without CUDA, the script exits with status 2 (``run_all.sh``:
"unavailable"). Writes ``dsa_vendor_h200_<gpu>_<date>.json`` with provenance to ``--out`` (default ``$OUT``, else
``benchmarks/results``).
"""

# run_all: timeout=300
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench_common.py
from _bench_common import cuda_times_ms, dry_run_or_no_cuda, gpu_provenance, results_dir  # noqa: E402

DK, DV, HI, DI = 576, 512, 32, 128


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="moe_rl DSA vendor kernels (FlashMLA, DeepGEMM) vs torch path (GPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--index-topk", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="output directory (default: $OUT or benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit (no GPU needed)")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> dict:
    return {"tokens": args.tokens, "heads": args.heads, "index_topk": args.index_topk, "Dk": DK, "Dv": DV,
            "HI": HI, "DI": DI, "dtype": "bfloat16", "stages": ["indexer", "attention_fwd_bwd", "attention_fwd"],
            "warmup": args.warmup, "iters": args.iters}


def _importable(name: str) -> str | None:
    try:
        importlib.import_module(name)
        return None
    except Exception as exc:  # noqa: BLE001 - record why (ImportError, or OSError from a CUDA extension)
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _measure(torch, fn, warmup: int, iters: int) -> tuple[float, float, object]:
    """(peak GiB above the current allocation, median ms, result of the first call)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    for _ in range(warmup):
        fn()
    return peak, statistics.median(cuda_times_ms(torch, fn, iters)), res


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    status = dry_run_or_no_cuda(args.dry_run, lambda: plan(args), "dsa_vendor_h200.py")
    if status is not None:
        return status
    import torch

    missing = {name: _importable(name) for name in ("flash_mla", "deep_gemm")}
    if all(missing.values()):
        print(f"dsa_vendor_h200.py: neither flash_mla nor deep_gemm imports ({missing}); nothing measured",
              file=sys.stderr)
        return 2
    from moe_rl.attention import key_windows
    from moe_rl.attention.dsa_chunked import chunked_indexer_topk, sparse_latent_attention_chunked
    from moe_rl.attention.dsa_vendor import deepgemm_indexer_topk, flashmla_sparse_attention

    dev = torch.device("cuda")
    H, K = args.heads, args.index_topk
    scale = 192**-0.5
    rows: list[dict] = []

    def record(row: dict, fn) -> object:
        try:
            row["peak_gib"], row["median_ms"], res = _measure(torch, fn, args.warmup, args.iters)
            row["status"] = "ok"
        except torch.OutOfMemoryError as exc:
            row.update(status="oom", error=str(exc)[:300])
            res = None
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        return res

    def one_length(T: int) -> None:
        g = torch.Generator(device=dev).manual_seed(0)
        q = (torch.randn(T, H, DK, device=dev, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
        kv = (torch.randn(T, DK, device=dev, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
        iq = torch.randn(T, HI, DI, device=dev, generator=g).to(torch.bfloat16)
        iw = torch.rand(T, HI, device=dev, generator=g) * (HI * DI) ** -0.5
        ik = torch.randn(T, DI, device=dev, generator=g).to(torch.bfloat16)
        go = torch.randn(T, H, DV, device=dev, generator=g).to(torch.bfloat16)
        ks, ke = key_windows(torch.arange(T, device=dev), torch.tensor([0, T], device=dev), causal=True)

        idx_t = record({"stage": "indexer", "backend": "torch", "tokens": T},
                       lambda: chunked_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke))
        if missing["deep_gemm"]:
            rows.append({"stage": "indexer", "backend": "deep_gemm", "tokens": T, "status": "unavailable",
                         "error": missing["deep_gemm"]})
        else:
            row = {"stage": "indexer", "backend": "deep_gemm", "tokens": T}
            idx_v = record(row, lambda: deepgemm_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke))
            if idx_v is not None and idx_t is not None:
                row["same_index_fraction_vs_torch"] = float((idx_v == idx_t).float().mean())
        idx = idx_t if idx_t is not None else torch.full((T, K), -1, dtype=torch.int64, device=dev)

        def fwd_bwd(fn):
            def run():
                out, _ = fn(q, kv, idx, v_head_dim=DV, scale=scale)
                return (out.detach(), torch.autograd.grad(out, (q, kv), go))
            return run

        def fwd(fn):
            def run():
                with torch.no_grad():
                    return fn(q, kv, idx, v_head_dim=DV, scale=scale)[0]
            return run

        ref = record({"stage": "attention_fwd_bwd", "backend": "torch", "tokens": T},
                     fwd_bwd(sparse_latent_attention_chunked))
        record({"stage": "attention_fwd", "backend": "torch", "tokens": T}, fwd(sparse_latent_attention_chunked))
        if missing["flash_mla"]:
            for stage in ("attention_fwd_bwd", "attention_fwd"):
                rows.append({"stage": stage, "backend": "flashmla", "tokens": T, "status": "unavailable",
                             "error": missing["flash_mla"]})
        else:
            row = {"stage": "attention_fwd_bwd", "backend": "flashmla", "tokens": T}
            got = record(row, fwd_bwd(flashmla_sparse_attention))
            if got is not None and ref is not None:
                row["out_max_abs_diff_vs_torch"] = float((got[0].float() - ref[0].float()).abs().max())
                row["dq_max_abs_diff_vs_torch"] = float((got[1][0].float() - ref[1][0].float()).abs().max())
            record({"stage": "attention_fwd", "backend": "flashmla", "tokens": T}, fwd(flashmla_sparse_attention))

    for T in args.tokens:
        one_length(T)
        torch.cuda.empty_cache()

    by_key = {(r["stage"], r["backend"], r["tokens"]): r for r in rows if r.get("status") == "ok"}
    for r in rows:
        base = by_key.get((r["stage"], "torch", r["tokens"]))
        if r.get("status") == "ok" and r["backend"] != "torch" and base:
            r["time_ratio_vs_torch"] = r["median_ms"] / base["median_ms"]
            r["peak_ratio_vs_torch"] = r["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None
    name = torch.cuda.get_device_name(0).replace(" ", "_")
    path = results_dir(args.out) / f"dsa_vendor_h200_{name}_{_dt.date.today().isoformat()}.json"
    versions = {}
    for mod in ("flash_mla", "deep_gemm"):
        versions[mod] = missing[mod] or getattr(sys.modules.get(mod), "__version__", "importable, no __version__")
    path.write_text(json.dumps({"provenance": gpu_provenance(torch, vendor=versions), "plan": plan(args), "rows": rows},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
