"""Prepared GPU benchmark (not run in CI): moe_rl's ``torch`` EP backend vs DeepEP ``ElasticBuffer`` normal mode.

DeepSeek-V3 shapes by default (T=4096 tokens per rank, D=7168, E=256, top-8; the defaults of DeepEP's
``tests/elastic/test_ep.py`` apart from top-8). Intranode: one process per GPU on one node, NCCL, at least 2 GPUs (8 for EP8)::

    torchrun --nproc_per_node=8 benchmarks/gpu/ep_deepep.py --out "$OUT"

Cases (median of ``--iters`` after ``--warmup``, CUDA events, ranks aligned by a barrier before each call):

- ``torch.a2a_same_bytes``: one ``all_to_all_single`` of the rows ``dispatch`` moves (the overhead baseline).
- ``torch.dispatch`` / ``torch.dispatch_reuse_handle`` / ``torch.combine``: ``moe_rl.moe.ep`` (bf16 rows).
- ``deep_ep.dispatch_bf16`` / ``deep_ep.dispatch_fp8`` (e4m3 + 1x128 fp32 scales) /
  ``deep_ep.dispatch_cached`` (``handle=``) / ``deep_ep.combine_bf16``: ``deep_ep.ElasticBuffer`` (DeepEP >= 2.0),
  on the buffer :func:`moe_rl.moe.ep.make_deepep_buffer` makes (sized with ``ElasticBuffer.get_buffer_size_hint``).
- ``moe_rl.deep_ep.dispatch`` / ``..._reuse_handle`` / ``moe_rl.deep_ep.combine``: ``moe_rl.moe.ep`` with
  ``backend="deep_ep"`` on the same buffer (the adapter: validation, local expert-major permutation, fp32 gate
  weighting), with its ratio to the raw ``ElasticBuffer`` calls (goal <= 1.3x), and the max difference of
  identity-expert outputs vs the ``torch`` backend.

Each case records the median/mean/min/max time, the bytes this rank received, and GB/s. Rank 0 writes
``ep_deepep_<gpu>_<date>.json`` with provenance (commit, GPU, torch/CUDA/NCCL/deep_ep versions, world size, the
config) into ``--out`` (default ``$OUT``, else ``benchmarks/results``). On a machine without CUDA or without
deep_ep it exits with status 2 and says why; it imports torch.cuda and deep_ep only inside :func:`main`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _bench_common.py
from _bench_common import commit, cuda_times_ms, results_dir  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="moe_rl torch EP backend vs DeepEP ElasticBuffer normal mode (GPU)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (T)")
    p.add_argument("--hidden", type=int, default=7168, help="D")
    p.add_argument(
        "--num-experts", type=int, default=256, help="E (rounded down to a multiple of the world size)"
    )
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--num-sms", type=int, default=0, help="SMs per DeepEP call (0: DeepEP's analytical choice)")
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: $OUT or benchmarks/results)"
    )
    return p.parse_args(argv)


def _stats(times_ms: list[float], recv_bytes: float) -> dict[str, float]:
    med = statistics.median(times_ms)
    return {
        "median_ms": med,
        "mean_ms": statistics.fmean(times_ms),
        "std_ms": statistics.pstdev(times_ms),
        "min_ms": min(times_ms),
        "max_ms": max(times_ms),
        "recv_bytes": recv_bytes,
        "recv_GBps": recv_bytes / (med * 1e-3) / 1e9 if med > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "ep_deepep.py needs CUDA GPUs (NCCL + DeepEP); torch.cuda.is_available() is False here. "
            "Run it with torchrun on a GPU node.",
            file=sys.stderr,
        )
        return 2
    from moe_rl.moe.ep._checks import import_deep_ep

    try:
        deep_ep = import_deep_ep()  # DeepEP >= 2.0 (ElasticBuffer); the message says what to install
    except ImportError as err:
        print(f"ep_deepep.py: {err}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from moe_rl.moe.ep import combine, dispatch, make_deepep_buffer

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        print("ep_deepep.py needs at least 2 ranks (torchrun --nproc_per_node=N, N >= 2)", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    T, D, K = args.tokens, args.hidden, args.top_k
    E = args.num_experts // world * world
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    x = torch.randn(T, D, dtype=torch.bfloat16, device=dev)
    scores = torch.randn(T, E, dtype=torch.float32, device=dev).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=False).indices  # int64, as DeepEP's topk_idx
    topk_w = torch.softmax(torch.randn(T, K, device=dev), dim=-1)

    def bench(fn) -> list[float]:
        cuda_times_ms(torch, fn, args.warmup, before=dist.barrier)
        return cuda_times_ms(torch, fn, args.iters, before=dist.barrier)

    results: dict[str, dict[str, float]] = {}
    row = D * 2

    # ----------------------------------------------------------------------------------- moe_rl torch backend
    recv, _, h = dispatch(x, topk_idx, topk_w, group, num_experts=E)
    torch_recv_bytes = recv.shape[0] * row
    chunk = h.chunks[0]
    rows = x.index_select(0, chunk.token_n)
    a2a_out = rows.new_empty(sum(chunk.recv_splits), D)
    results["torch.a2a_same_bytes"] = _stats(
        bench(
            lambda: dist.all_to_all_single(a2a_out, rows, chunk.recv_splits, chunk.send_splits, group=group)
        ),
        torch_recv_bytes,
    )
    results["torch.dispatch"] = _stats(
        bench(lambda: dispatch(x, topk_idx, topk_w, group, num_experts=E)), torch_recv_bytes
    )
    results["torch.dispatch_reuse_handle"] = _stats(
        bench(lambda: dispatch(x, topk_idx, topk_w, group, num_experts=E, handle=h)), torch_recv_bytes
    )
    results["torch.combine"] = _stats(bench(lambda: combine(recv, h)), torch_recv_bytes)

    # ------------------------------------------------------------------------------- DeepEP ElasticBuffer
    buffer = make_deepep_buffer(group, hidden=D, top_k=K, max_tokens_per_rank=T)
    topk_w32 = topk_w.float()

    def ep_dispatch(payload):
        return buffer.dispatch(
            payload, topk_idx=topk_idx, topk_weights=topk_w32, num_experts=E, num_sms=args.num_sms
        )

    blocks = x.float().view(T, D // 128, 128)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4) / torch.finfo(torch.float8_e4m3fn).max
    x_fp8 = ((blocks / scale).to(torch.float8_e4m3fn).view(T, D), scale.squeeze(-1).contiguous())

    recv_x, _, _, ep_handle, _ = ep_dispatch(x)
    ep_rows = recv_x.shape[0]  # one row per (token, destination rank): DeepEP deduplicates
    results["deep_ep.dispatch_bf16"] = _stats(bench(lambda: ep_dispatch(x)), ep_rows * row)
    results["deep_ep.dispatch_fp8"] = _stats(bench(lambda: ep_dispatch(x_fp8)), ep_rows * (D + 4 * D // 128))
    results["deep_ep.dispatch_cached"] = _stats(
        bench(lambda: buffer.dispatch(x, handle=ep_handle, num_sms=args.num_sms)), ep_rows * row
    )
    results["deep_ep.combine_bf16"] = _stats(
        bench(lambda: buffer.combine(recv_x, handle=ep_handle, num_sms=args.num_sms)), ep_rows * row
    )
    # ------------------------------------------------- moe_rl's deep_ep backend (adapter over the same buffer)
    dep = dict(num_experts=E, backend="deep_ep", buffer=buffer)
    mrecv, _, mh = dispatch(x, topk_idx, topk_w, group, **dep)
    results["moe_rl.deep_ep.dispatch"] = _stats(
        bench(lambda: dispatch(x, topk_idx, topk_w, group, **dep)), ep_rows * row
    )
    results["moe_rl.deep_ep.dispatch_reuse_handle"] = _stats(
        bench(lambda: dispatch(x, topk_idx, topk_w, group, handle=mh, **dep)), ep_rows * row
    )
    results["moe_rl.deep_ep.combine"] = _stats(bench(lambda: combine(mrecv, mh)), ep_rows * row)
    results["moe_rl.deep_ep.dispatch"]["ratio_to_raw_deep_ep"] = (
        results["moe_rl.deep_ep.dispatch"]["median_ms"] / results["deep_ep.dispatch_bf16"]["median_ms"]
    )
    results["moe_rl.deep_ep.combine"]["ratio_to_raw_deep_ep"] = (
        results["moe_rl.deep_ep.combine"]["median_ms"] / results["deep_ep.combine_bf16"]["median_ms"]
    )
    # correctness on the GPU: identity experts through both backends give the same combine
    diff = (combine(mrecv, mh).float() - combine(recv, h).float()).abs().max().item()
    results["moe_rl.deep_ep.vs_torch_backend"] = {"max_abs_diff_identity_experts": diff}
    base = results["torch.a2a_same_bytes"]["median_ms"]
    for r in results.values():
        if "median_ms" in r:
            r["ratio_to_torch_a2a"] = r["median_ms"] / base if base > 0 else float("nan")

    if rank == 0:
        try:
            from importlib.metadata import version

            deep_ep_version = version("deep_ep")
        except Exception:  # noqa: BLE001 - provenance only
            deep_ep_version = getattr(deep_ep, "__version__", "unknown")
        gpu = torch.cuda.get_device_name(dev)
        now = _dt.datetime.now(_dt.UTC)
        report = {
            "theme": "ep_dispatch_combine",
            "config": {
                "tokens_per_rank": T,
                "hidden": D,
                "num_experts": E,
                "top_k": K,
                "world_size": world,
                "num_sms": args.num_sms,
                "deep_ep_buffer_bytes": buffer.num_bytes,
                "warmup": args.warmup,
                "iters": args.iters,
                "dtype": "bf16 (fp8 case: e4m3 + 1x128 fp32 scales)",
            },
            "provenance": {
                "commit": commit(),
                "gpu": gpu,
                "gpu_count": world,
                "machine": platform.platform(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "deep_ep": deep_ep_version,
                "timestamp": now.isoformat(),
            },
            "results": results,
        }
        out_dir = results_dir(args.out)
        name = f"ep_deepep_{gpu.replace(' ', '-')}x{world}_{now:%Y%m%d}.json"
        (out_dir / name).write_text(json.dumps(report, indent=1))
        for case, r in results.items():
            print(
                f"{case:32s} {r['median_ms']:8.3f} ms  {r['recv_GBps']:7.1f} GB/s  "
                f"{r['ratio_to_torch_a2a']:5.2f}x torch a2a"
            )
        print(f"wrote {out_dir / name}")
    dist.barrier()
    buffer = None
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
