"""Prepared GPU benchmark (not run in CI): DSA forward + backward peak memory and time, dense reference vs the
memory-bounded path (``moe_rl.attention.dsa_attention(backend="dense" | "torch")``), one GPU, GLM-5 head sizes.

    python benchmarks/gpu/dsa_h200.py --out "$OUT"         # T in 4k 8k 16k 32k, bf16
    python benchmarks/gpu/dsa_h200.py --dry-run            # CPU-safe: prints the plan as JSON

One DSA layer's attention core at GLM-5 sizes: H = 64 query heads on one rank (``--heads`` for a TP/CP shard),
latent Dk = 576 (Dv = 512 + 64 rope), indexer HI = 32 x DI = 128, index_topk K = 2048, one causal sequence of T
tokens in bf16 (fp32 math inside both paths). Per case: lightning indexer (no grad), sparse latent attention,
backward into ``q`` and ``kv``; ``torch.cuda.max_memory_allocated`` above the inputs (``peak_gib``), the median
of ``--iters`` timed runs (CUDA events), and the growth of the peak from T/2 to T per backend. A case whose run
raises ``torch.OutOfMemoryError`` is recorded as ``"oom"`` (the dense reference at long T: its ``[T, T]`` indexer
scores and ``[T, K, Dk]`` gathered rows). The torch path is also compared with the dense one where both ran
(identical top-k indices expected up to exact score ties, output max abs difference recorded).

Writes ``dsa_h200_<gpu>_<date>.json`` with provenance to ``--out`` (default ``$OUT``, else
``benchmarks/results``). Without CUDA it exits with status 2 and says why.
"""

# run_all: timeout=300
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench_common.py
from _bench_common import cuda_times_ms, dry_run_or_no_cuda, gpu_provenance, results_dir  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="moe_rl DSA dense vs memory-bounded benchmark (GPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--index-topk", type=int, default=2048)
    p.add_argument("--backends", nargs="+", default=["dense", "torch"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="output directory (default: $OUT or benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit (no GPU needed)")
    return p.parse_args(argv)


DK, DV, HI, DI = 576, 512, 32, 128


def plan(args: argparse.Namespace) -> dict:
    return {"tokens": args.tokens, "heads": args.heads, "index_topk": args.index_topk, "backends": args.backends,
            "Dk": DK, "Dv": DV, "HI": HI, "DI": DI, "dtype": "bfloat16", "warmup": args.warmup, "iters": args.iters}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    status = dry_run_or_no_cuda(args.dry_run, lambda: plan(args), "dsa_h200.py")
    if status is not None:
        return status
    import torch

    from moe_rl.attention import dsa_attention

    dev = torch.device("cuda")
    H, K = args.heads, args.index_topk
    rows: list[dict] = []
    peaks: dict[tuple[str, int], float] = {}
    outs: dict[int, tuple] = {}
    for T in args.tokens:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(T, H, DK, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
        kv = torch.randn(T, DK, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
        iq = torch.randn(T, HI, DI, device=dev, generator=g, dtype=torch.bfloat16)
        iw = torch.randn(T, HI, device=dev, generator=g) * (HI * DI) ** -0.5
        ik = torch.randn(T, DI, device=dev, generator=g, dtype=torch.bfloat16)
        go = torch.randn(T, H, DV, device=dev, generator=g, dtype=torch.bfloat16)

        def step(backend: str, q=q, kv=kv, iq=iq, iw=iw, ik=ik, go=go):
            r = dsa_attention(q, kv, v_head_dim=DV, scale=DK**-0.5, index_q=iq, index_weights=iw, index_k=ik,
                              index_topk=K, backend=backend)
            dq, dkv = torch.autograd.grad(r.out, (q, kv), go)
            return r, dq, dkv

        for backend in args.backends:
            row: dict = {"backend": backend, "tokens": T}
            try:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                r, dq, dkv = step(backend)
                torch.cuda.synchronize()
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                peaks[(backend, T)] = row["peak_gib"]
                if (backend, T // 2) in peaks:
                    row["peak_growth_vs_half_T"] = row["peak_gib"] / peaks[(backend, T // 2)]
                if backend == "dense":
                    outs[T] = (r.topk_indices, r.out.detach().float())
                elif T in outs:
                    row["same_indices_fraction"] = float((r.topk_indices == outs[T][0]).float().mean())
                    row["out_max_abs_diff_vs_dense"] = float((r.out.float() - outs[T][1]).abs().max())
                del r, dq, dkv
                for _ in range(args.warmup):
                    step(backend)
                row["median_ms"] = statistics.median(cuda_times_ms(torch, lambda b=backend: step(b), args.iters))
            except torch.OutOfMemoryError as exc:
                row["status"] = "oom"
                row["error"] = str(exc)[:300]
            else:
                row["status"] = "ok"
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        outs.pop(T, None)
    name = torch.cuda.get_device_name(0).replace(" ", "_")
    path = results_dir(args.out) / f"dsa_h200_{name}_{_dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"provenance": gpu_provenance(torch), "plan": plan(args), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
