"""Validate the weight-sync time model (``moe_rl.weights.sync_model``) on this machine, then estimate GLM-5.1.

Measures real transfers between 2-4 gloo processes on this machine (loopback TCP; one thread each). Receivers
write into memory they already touched (zero-filled outside the timed region), as an engine writes into its
parameters:

- ``p2p_pair``: rank 0 -> rank 1, ``isend``/``irecv`` in 64 MiB buckets (1, 64, 256, 1024 MiB);
- ``p2p_2x2``: owners 0, 1 hold half each; engines 2, 3 pull concurrently, either everything (``replicated``:
  4 flows of S/2) or half (``ep``: 4 flows of S/4), like replicated dense weights and sharded experts;
- ``bcast``: ``torch.distributed.broadcast`` (gloo: binomial tree) of S from rank 0 in 64 MiB buckets to 2 or 3
  receivers;
- ``fs``: safetensors ``save_file`` of each owner's share into its own file (page cache, no fsync, like the
  ``filesystem`` transport), then every reader ``load_file`` s every file and copies each tensor into its own
  memory, as an engine's load does (1 writer/1 reader: 1, 64, 256, 1024 MiB; 2 writers/2 readers: 256, 512 MiB).
  Each writer first writes and deletes a file of the same size outside the timed region, so the page cache of the
  timed write is memory touched recently, as the receivers' buffers are: on the virtual machine these figures come
  from, memory left free for a while goes back to the host and its first touch runs at ~0.4 GB/s (a new 1 GiB file
  took 2.5 s in a fresh process and 0.26-0.29 s right after, against 0.13-0.15 s to overwrite it in place), a
  property of the VM's memory, not of the filesystem the model describes.

Each point runs ``--reps`` times after a barrier, repetitions interleaved over the points; a repetition's time is
the slowest rank's. The **minimum** over repetitions counts (``--stat``): the machine is shared with other jobs, and
the minimum is each point's least-disturbed run (medians, every repetition and the machine's runnable-task count
during each, sampled from ``/proc/loadavg`` every 10 ms, are in the JSON). The model's link
parameters are then fitted on a stated subset (``FIT``: the pair at 1 MiB (latency) and 256 MiB (bandwidth) for the
loopback link, the replicated 2x2 at 256 MiB for the node's aggregate, the single writer/reader at 1 and 256 MiB for
the filesystem, the 2x2 filesystem at 256 MiB for its aggregate) and every other point (64 MiB-1 GiB) is predicted
and compared.

Then the delta codec (``moe_rl.weights.delta``) runs on a bf16 payload whose 1-3% of elements change per step
(wire ratio and encode/apply seconds), and the model prints its estimate for the GLM-5.1 recipe
(``recipes/glm5_1/rl.toml``; parameter counts from ``GlmMoeDsaConfig.glm5_1()``) under the cluster assumptions
of :data:`H200_CLUSTER`, next to peers' published figures. ``--plot`` draws both.

Writes ``benchmarks/results/weight_sync_model_<hardware>_<date>.json`` (provenance: commit, tree state, torch,
CPU, load average) and prints markdown tables (the ones in ``docs/weight-sync-model.md``).

Usage: ``python benchmarks/weight_sync_validate.py [--quick] [--reps 3] [--glm-only] [--plot PNG] [--out PATH]``
(about 3 minutes on 2 shared cores; ``--glm-only`` skips the measurements and reads the latest results file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import queue as queue_mod
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from _bench_common import commit, tree_dirty

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MIB = 2**20
BUCKET = 64 * MIB
STAT = "min"  # or "median" (--stat)
FS_TENSOR = 16 * MIB  # one safetensors entry

# (kind, ranks, MiB): every point runs in one 4-rank gloo group (fewer ranks: a subgroup, the rest wait)
PLAN = [("p2p_pair", 2, 1), ("p2p_pair", 2, 64), ("p2p_pair", 2, 256), ("p2p_pair", 2, 1024),
        ("p2p_2x2_replicated", 4, 128), ("p2p_2x2_replicated", 4, 256), ("p2p_2x2_replicated", 4, 512),
        ("p2p_2x2_ep", 4, 256), ("p2p_2x2_ep", 4, 1024),
        ("bcast", 3, 64), ("bcast", 3, 256), ("bcast", 3, 512),
        ("bcast", 4, 64), ("bcast", 4, 256), ("bcast", 4, 512),
        ("fs_1x1", 2, 1), ("fs_1x1", 2, 64), ("fs_1x1", 2, 256), ("fs_1x1", 2, 1024),
        ("fs_2x2", 4, 256), ("fs_2x2", 4, 512)]
QUICK = [("p2p_pair", 2, 1), ("p2p_pair", 2, 256), ("p2p_2x2_replicated", 4, 256), ("p2p_2x2_ep", 4, 256),
         ("bcast", 4, 64), ("fs_1x1", 2, 1), ("fs_1x1", 2, 256), ("fs_2x2", 4, 256)]
# the fit: latency from 1 MiB, bandwidth from 256 MiB (per link class); every other point is predicted
FIT = {"link": [("p2p_pair", 2, 1), ("p2p_pair", 2, 256)],
       "node": [("p2p_2x2_replicated", 4, 256)],
       "fs": [("fs_1x1", 2, 1), ("fs_1x1", 2, 256)],
       "fs_aggregate": [("fs_2x2", 4, 256)]}

# ---------------------------------------------------------------------------------------------------------------
# GLM-5.1 cluster assumptions (stated in docs/weight-sync-model.md)
H200_CLUSTER = {
    "intra_bw": 450e9,  # NVLink 4: 900 GB/s per GPU bidirectional (datasheet) = 450 GB/s per direction
    "intra_latency": 5e-6,
    "inter_bw": 50e9,  # one 400 Gb/s RDMA NIC (ConnectX-7) per GPU, per direction
    "inter_latency": 10e-6,  # per large RDMA message (post + completion)
    "node_bw": 400e9,  # 8 NICs per node
    "stage_bw": 50e9,  # trainer shard device -> pinned host (PCIe Gen5 x16); the FP8 cast runs at HBM speed
    "fs_write_bw": 2e9,  # one writer process on a parallel filesystem
    "fs_read_bw": 4e9,  # one reader process
    "fs_aggregate_write_bw": 100e9,  # the whole filesystem (a mid-size all-flash parallel filesystem)
    "fs_aggregate_read_bw": 200e9,
    "fs_latency": 0.05,  # per file: create/open, metadata, rename
    "collective_latency": 50e-6,  # NCCL launch per bucket
}
PEERS = [
    ("prime-rl, GLM-5.2, pull over RDMA, median (64 trainer + 32 inference H200)", 2.84),
    ("miles, 744B, RDMA", 8.48),
    ("miles, 744B, NCCL broadcast", 58.3),
]


# ---------------------------------------------------------------------------------------------------------------
# measurement (worker processes)


def _worker(rank: int, world: int, init: str, points: list, reps: int, tmp: str, queue) -> None:
    """One rank of the ``world``-rank gloo group; runs every point ``reps`` times, repetitions interleaved (so a
    change of the machine's load from other processes spreads over all points). Points of fewer ranks use a
    subgroup; the other ranks wait at the barrier."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    groups = {w: dist.new_group(list(range(w))) for w in range(2, world + 1)}

    def buckets(t: torch.Tensor) -> list[torch.Tensor]:
        return [t[i:i + BUCKET] for i in range(0, t.numel(), BUCKET)]

    def timed(fn, *args) -> float:
        dist.barrier()
        t0, w0 = time.perf_counter(), time.time()
        fn(*args)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        spans.append((w0, w0 + float(dt)))  # wall-clock span, for the driver's runnable-task samples
        return float(dt)

    def flows(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        reqs = [dist.isend(b, dst) for dst, t in sends for b in buckets(t)]
        reqs += [dist.irecv(b, src) for src, t in recvs for b in buckets(t)]
        for r in reqs:
            r.wait()

    def bcast(buf: torch.Tensor | None, group) -> None:
        if buf is not None:
            for b in buckets(buf):
                dist.broadcast(b, 0, group=group)

    def write(path: Path, tensors: dict | None) -> None:
        if tensors is not None:
            save_file(tensors, str(path / f"rank{rank}.tmp"))
            os.replace(path / f"rank{rank}.tmp", path / f"rank{rank}.safetensors")

    def read(path: Path, writers: int, dst: torch.Tensor | None) -> None:
        """What an engine's load does: every tensor copied into the engine's own (preallocated) memory."""
        if dst is not None:
            off = 0
            for w in range(writers):
                for t in load_file(str(path / f"rank{w}.safetensors")).values():
                    dst[off:off + t.numel()].copy_(t)
                    off += t.numel()
            assert off == dst.numel(), (off, dst.numel())

    spans: list[tuple[float, float]] = []
    timed(lambda: dist.broadcast(torch.zeros(1024, dtype=torch.uint8), 0))  # connect every pair once
    out = {(kind, w, mib): {} for kind, w, mib in points}
    spans_of: dict = {}
    for rep in range(reps):
        for kind, w, mib in points:
            s = mib * MIB
            times = out[(kind, w, mib)]
            spans = spans_of.setdefault((kind, w, mib), [])
            if kind == "p2p_pair":
                buf = torch.ones(s, dtype=torch.uint8) if rank == 0 else torch.zeros(s, dtype=torch.uint8)
                sends, recvs = ([(1, buf)], []) if rank == 0 else ([], [(0, buf)] if rank == 1 else [])
                times.setdefault("total", []).append(timed(flows, sends, recvs))
            elif kind.startswith("p2p_2x2"):
                share = s // 2 if kind.endswith("replicated") else s // 4
                if rank < 2:
                    own = torch.ones(s // 2, dtype=torch.uint8)
                    # replicated: all of ``own`` to each engine; ep: its first half to 2, second half to 3
                    sends = [(e, own if share == s // 2 else own[(e - 2) * share:(e - 1) * share]) for e in (2, 3)]
                    recvs = []
                else:
                    sends, recvs = [], [(t, torch.zeros(share, dtype=torch.uint8)) for t in (0, 1)]
                times.setdefault("total", []).append(timed(flows, sends, recvs))
            elif kind == "bcast":
                buf = None
                if rank < w:
                    buf = torch.ones(s, dtype=torch.uint8) if rank == 0 else torch.zeros(s, dtype=torch.uint8)
                times.setdefault("total", []).append(timed(bcast, buf, groups[w]))
            elif kind.startswith("fs_"):
                writers = 1 if kind == "fs_1x1" else 2
                path = Path(tmp) / f"{kind}_{mib}_{rep}"
                path.mkdir(exist_ok=True)
                share = s // writers
                tensors = ({f"w{rank}.{i}": torch.ones(min(FS_TENSOR, share - i * FS_TENSOR), dtype=torch.uint8)
                            for i in range(-(-share // FS_TENSOR))} if rank < writers else None)
                dst = torch.zeros(s, dtype=torch.uint8) if writers <= rank < 2 * writers else None
                if tensors is not None:  # untimed: the page cache gets memory touched recently (docstring)
                    save_file(tensors, str(path / f"warm{rank}.tmp"))
                    (path / f"warm{rank}.tmp").unlink()
                times.setdefault("write", []).append(timed(write, path, tensors))
                times.setdefault("read", []).append(timed(read, path, writers, dst))
                dist.barrier()
                if rank == 0:
                    for f in path.iterdir():
                        f.unlink()
                    path.rmdir()
            else:
                raise ValueError(f"unknown point kind {kind!r}")
    if rank == 0:
        queue.put([{"kind": k, "world": w, "mib": m, "times": t, "spans": spans_of[(k, w, m)]}
                   for (k, w, m), t in out.items()])
    dist.destroy_process_group()


def measure(points: list, reps: int) -> list[dict]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    world = max(w for _, w, _ in points)
    with tempfile.TemporaryDirectory(prefix="wsync_") as tmp:
        q = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, str(Path(tmp) / "init"), points, reps, tmp, q))
                 for r in range(world)]
        samples: list[tuple[float, int]] = []
        done = threading.Event()

        def sample() -> None:  # the machine's runnable tasks, minus this sampler, every 10 ms
            while not done.is_set():
                with open("/proc/loadavg") as f:
                    samples.append((time.time(), int(f.read().split()[3].split("/")[0]) - 1))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for p in procs:
            p.start()
        try:
            results = None
            while results is None:
                try:
                    results = q.get(timeout=5)
                except queue_mod.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        for p in procs:
                            p.kill()
                        raise RuntimeError(f"a worker failed (exit codes {dead}); see its traceback above") from None
        finally:
            done.set()
        for p in procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"worker exited with {p.exitcode}")
    for r in results:
        phases = list(r["times"])
        r["runnable"] = {ph: [] for ph in phases}
        for i, (a, b) in enumerate(r.pop("spans")):
            inside = [n for t, n in samples if a <= t <= b]
            if not inside:  # shorter than one sampling period: the nearest sample
                inside = [min(samples, key=lambda x: abs(x[0] - (a + b) / 2))[1]] if samples else [0]
            r["runnable"][phases[i % len(phases)]].append(statistics.mean(inside))
    return results


def summarise(results: list[dict]) -> None:
    """Add each point's ``min`` and ``median`` seconds per phase, and print them with the machine's mean number
    of runnable tasks during the repetitions (``/proc/loadavg``, sampled every 10 ms: the other jobs' load)."""
    for r in results:
        r["median"] = {k: statistics.median(v) for k, v in r["times"].items()}
        r["min"] = {k: min(v) for k, v in r["times"].items()}
        print(f"  {r['kind']:20s} ranks={r['world']} {r['mib']:5d} MiB  "
              + "  ".join(f"{k}: min {r['min'][k]:.3f}s median {v:.3f}s (runnable tasks "
                          f"{statistics.mean(r['runnable'][k]) if 'runnable' in r else float('nan'):.1f})"
                          for k, v in r["median"].items()), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# model: layouts of the measured points, fit, prediction


def _layout(kind: str, world: int, mib: int):
    from moe_rl.weights.sync_model import SyncLayout

    s = float(mib * MIB)
    if kind in ("p2p_pair", "fs_1x1"):
        return SyncLayout((0,), (s,), (0,), (s,))
    if kind == "p2p_2x2_replicated" or kind == "fs_2x2":
        return SyncLayout((0, 0), (s / 2, s / 2), (0, 0), (s, s))
    if kind == "p2p_2x2_ep":
        return SyncLayout((0, 0), (s / 2, s / 2), (0, 0), (s / 2, s / 2))
    if kind == "bcast":
        return SyncLayout((0,), (s,), (0,) * (world - 1), (s,) * (world - 1))
    raise ValueError(kind)


def predict(point: dict, links) -> dict[str, float]:
    """The model's seconds for one measured point (same phases as measured)."""
    from moe_rl.weights.sync_model import SyncOptions, estimate

    kind, world, mib = point["kind"], point["world"], point["mib"]
    lay = _layout(kind, world, mib)
    if kind.startswith("fs_"):
        e = estimate("filesystem", lay, links, SyncOptions(files_per_rank=1))
        return {"write": e.phases["write"], "read": e.phases["read"]}
    if kind == "bcast":
        e = estimate("broadcast", lay, links, SyncOptions(bucket_bytes=BUCKET, broadcast_algorithm="binomial"))
        return {"total": e.total_s}
    return {"total": estimate("p2p", lay, links, SyncOptions(bucket_bytes=BUCKET)).total_s}


def _find(results: list[dict], kind: str, world: int, mib: int) -> dict:
    for r in results:
        if (r["kind"], r["world"], r["mib"]) == (kind, world, mib):
            return r
    raise KeyError(f"no measured point {kind} world={world} {mib} MiB (needed by the fit)")


def _line_fit(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a * x0 + b * x1``; returns ``(a, b)`` clipped at >= 0."""
    import numpy as np

    a, b = np.linalg.lstsq(np.array(xs, dtype=float), np.array(ys, dtype=float), rcond=None)[0]
    return max(float(a), 0.0), max(float(b), 1e-15)


def fit(results: list[dict]):
    """Fit ``LinkParams`` of the loopback machine on the :data:`FIT` points (their ``STAT`` times)."""
    from moe_rl.weights.sync_model import LinkParams

    xs, ys = [], []
    for kind, world, mib in FIT["link"]:  # t = ceil(S/b) a + S / B
        xs.append((math.ceil(mib * MIB / BUCKET), mib * MIB))
        ys.append(_find(results, kind, world, mib)[STAT]["total"])
    alpha, beta = _line_fit(xs, ys)
    link = LinkParams(intra_bw=1 / beta, intra_latency=alpha)
    # node aggregate: the replicated 2x2 moves 2 S inside the node; t = latency part + 2 S / node_bw
    kind, world, mib = FIT["node"][0]
    t_node = _find(results, kind, world, mib)[STAT]["total"]
    lat = 2 * math.ceil(mib * MIB / 2 / BUCKET) * alpha
    node_bw = max(2 * mib * MIB / max(t_node - lat, 1e-9), link.intra_bw)
    # filesystem: write t = fs_latency + S / fs_write_bw (one file per rank), read likewise
    fs = {}
    for phase in ("write", "read"):
        xs, ys = [], []
        for kind, world, mib in FIT["fs"]:
            xs.append((1.0, mib * MIB))
            ys.append(_find(results, kind, world, mib)[STAT][phase])
        fs[phase] = _line_fit(xs, ys)
    fs_latency = (fs["write"][0] + fs["read"][0]) / 2
    kind, world, mib = FIT["fs_aggregate"][0]
    med = _find(results, kind, world, mib)[STAT]
    agg_w = max(mib * MIB / max(med["write"] - fs_latency, 1e-9), 1 / fs["write"][1])
    agg_r = max(2 * mib * MIB / max(med["read"] - 2 * fs_latency, 1e-9), 1 / fs["read"][1])
    return LinkParams(intra_bw=link.intra_bw, intra_latency=alpha, node_bw=node_bw,
                      fs_write_bw=1 / fs["write"][1], fs_read_bw=1 / fs["read"][1],
                      fs_aggregate_write_bw=agg_w, fs_aggregate_read_bw=agg_r, fs_latency=fs_latency)


def compare(results: list[dict], links) -> list[dict]:
    fitted = {p for ps in FIT.values() for p in ps}
    rows = []
    for r in results:
        pred = predict(r, links)
        for phase, p in pred.items():
            m = r[STAT][phase]
            rows.append({"kind": r["kind"], "world": r["world"], "mib": r["mib"], "phase": phase,
                         "measured_s": m, "predicted_s": p, "error": (p - m) / m,
                         "fit": (r["kind"], r["world"], r["mib"]) in fitted})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# delta codec on this machine


def delta_figures(mib: int = 64, steps: int = 3) -> dict:
    import torch

    from moe_rl.weights.delta import DeltaDecoder, DeltaEncoder, bit_view

    g = torch.Generator().manual_seed(0)
    n = mib * MIB // 2 // 4
    state = {f"w{i}": (0.02 * torch.randn(n, generator=g)).bfloat16() for i in range(4)}
    enc, dec = DeltaEncoder(full_every=100), DeltaDecoder()
    dec.apply(enc.encode(state, 0))
    rows = []
    for v in range(1, steps + 1):
        frac = 0.01 * v  # 1%, 2%, 3%
        for t in state.values():
            bits = bit_view(t)
            idx = torch.randperm(bits.numel(), generator=g)[: int(frac * bits.numel())]
            bits[idx] += 1
        t0 = time.perf_counter()
        up = enc.encode(state, v)
        t1 = time.perf_counter()
        dec.apply(up)
        t2 = time.perf_counter()
        assert all(torch.equal(bit_view(dec.state[k]), bit_view(state[k])) for k in state)
        rows.append({"changed_fraction": frac, "wire_ratio": up.wire_bytes / up.raw_bytes,
                     "encode_s": t1 - t0, "apply_s": t2 - t1, "raw_bytes": up.raw_bytes})
    return {"payload_mib": mib, "steps": rows}


# ---------------------------------------------------------------------------------------------------------------
# GLM-5.1


def glm5_1_layout(recipe: Path) -> tuple[object, dict]:
    """The recipe's trainer (FSDP over every trainer GPU) and its wide-EP prefill/decode replicas."""
    from moe_rl.distributed.memory import arch_spec
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
    from moe_rl.weights.sync_model import moe_layout

    cfg = tomllib.loads(recipe.read_text())
    gpn = cfg["cluster"]["gpus_per_node"]
    spec = arch_spec(GlmMoeDsaConfig.glm5_1())
    total, expert = spec.total_params, spec.expert_params
    groups = []
    for side in ("prefill", "decode"):
        s = cfg["inference"][side]
        ranks = s["nodes_per_replica"] * gpn
        ep = ranks if s.get("wide_ep") else 1
        groups += [(ranks, ep)] * s.get("replicas", 1)
    trainer_ranks = cfg["trainer"]["num_nodes"] * gpn
    layout = moe_layout(dense_bytes=2.0 * (total - expert), expert_bytes=2.0 * expert, trainer_ranks=trainer_ranks,
                        trainer_ranks_per_node=gpn, engine_groups=groups, engine_ranks_per_node=gpn)
    info = {"recipe": str(recipe.relative_to(REPO)), "total_params": total, "expert_params": expert,
            "embed_params": spec.embed_params, "trainer_ranks": trainer_ranks, "engine_groups": groups,
            "bf16_bytes": layout.total, "served_bytes_per_rank": sorted(set(layout.served))}
    return layout, info


def glm5_1_estimates(recipe: Path, delta_ratio: float) -> dict:
    from moe_rl.weights.sync_model import LinkParams, SyncOptions, estimate_all, fp8_wire_ratio, moe_layout

    layout, info = glm5_1_layout(recipe)
    links = LinkParams(**H200_CLUSTER)
    quantized = 1.0 - info["embed_params"] / info["total_params"]  # embedding + head stay bf16
    x_fp8 = fp8_wire_ratio(quantized)
    bucket = 256 * MIB
    variants = {"bf16": SyncOptions(bucket_bytes=bucket),
                "fp8": SyncOptions(bucket_bytes=bucket, wire_ratio=x_fp8),
                "bf16+delta": SyncOptions(bucket_bytes=bucket, wire_ratio=delta_ratio)}
    out = {"layout": info, "assumptions": H200_CLUSTER, "bucket_bytes": bucket, "fp8_wire_ratio": x_fp8,
           "delta_wire_ratio": delta_ratio, "estimates": {}}
    for name, opts in variants.items():
        est = estimate_all(layout, links, opts)
        out["estimates"][name] = {t: {"total_s": e.total_s, "blocking_s": e.blocking_s,
                                      "bytes_moved": e.bytes_moved, "bottleneck": e.bottleneck,
                                      "phases": dict(e.phases)} for t, e in est.items()}
    # the same model on a layout like prime-rl's published run: 64 trainer + 32 inference GPUs (one EP-32 replica)
    peer_like = moe_layout(dense_bytes=2.0 * (info["total_params"] - info["expert_params"]),
                           expert_bytes=2.0 * info["expert_params"], trainer_ranks=64, trainer_ranks_per_node=8,
                           engine_groups=[(32, 32)], engine_ranks_per_node=8)
    e = estimate_all(peer_like, links, variants["fp8"])["p2p"]
    out["p2p_fp8_64_trainer_32_engine"] = {"total_s": e.total_s, "blocking_s": e.blocking_s,
                                           "bottleneck": e.bottleneck, "phases": dict(e.phases)}
    out["peers"] = PEERS
    return out


# ---------------------------------------------------------------------------------------------------------------
# output


def print_tables(report: dict) -> None:
    if "fit" in report:
        f = report["fit"]
        print("\nFitted on", ", ".join(f"{k} {w}r {m} MiB" for ps in FIT.values() for k, w, m in ps))
        print("  " + ", ".join(f"{k}={v:.4g}" for k, v in f.items() if v not in (math.inf,)))
        print("\n| point | ranks | MiB | phase | measured s | predicted s | error | role |")
        print("|---|---|---|---|---|---|---|---|")
        for r in report["comparison"]:
            print(f"| {r['kind']} | {r['world']} | {r['mib']} | {r['phase']} | {r['measured_s']:.3f} | "
                  f"{r['predicted_s']:.3f} | {100 * r['error']:+.1f}% | {'fit' if r['fit'] else 'predicted'} |")
        pred = [abs(r["error"]) for r in report["comparison"] if not r["fit"]]
        if pred:
            print(f"\npredicted points: {len(pred)}, max |error| {100 * max(pred):.1f}%, "
                  f"median {100 * statistics.median(pred):.1f}%")
    if "delta" in report:
        print("\n| changed | wire / full bytes | encode s | apply s |")
        print("|---|---|---|---|")
        for r in report["delta"]["steps"]:
            print(f"| {100 * r['changed_fraction']:.0f}% | {r['wire_ratio']:.4f} | {r['encode_s']:.3f} | "
                  f"{r['apply_s']:.3f} |")
    g = report["glm5_1"]
    info = g["layout"]
    print(f"\nGLM-5.1: {info['total_params'] / 1e9:.1f}B params ({info['expert_params'] / 1e9:.1f}B routed experts), "
          f"{info['trainer_ranks']} trainer ranks, engines {info['engine_groups']} (ranks, EP); "
          f"FP8 wire ratio {g['fp8_wire_ratio']:.4f}, delta {g['delta_wire_ratio']:.4f}")
    print("\n| transport | wire | update s | trainer blocking s | bottleneck |")
    print("|---|---|---|---|---|")
    for variant, ests in g["estimates"].items():
        for t, e in ests.items():
            print(f"| {t} | {variant} | {e['total_s']:.2f} | {e['blocking_s']:.2f} | {e['bottleneck']} |")
    pl = g["p2p_fp8_64_trainer_32_engine"]
    print(f"\np2p, fp8, on a 64-trainer + 32-engine layout (one EP-32 replica): {pl['total_s']:.2f} s "
          f"({pl['bottleneck']})")
    print("\nPeers (published):")
    for name, s in g["peers"]:
        print(f"  {name}: {s} s")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.5]})
    ax = axes[0]
    rows = report.get("comparison", [])
    for fitted, marker, label in ((True, "s", "fit points"), (False, "o", "predicted points")):
        pts = [(r["measured_s"], r["predicted_s"]) for r in rows if r["fit"] == fitted]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, label=label)
    if rows:
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 0.8
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="0.85", label="+-25%")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured s (gloo / safetensors, this machine)")
    ax.set_ylabel("model s")
    ax.set_title("Model vs measured, 2-4 processes, 64 MiB-1 GiB")
    ax.legend(fontsize=8)

    ax = axes[1]
    g = report["glm5_1"]
    labels, values, colors = [], [], []
    palette = {"bf16": "tab:blue", "fp8": "tab:green", "bf16+delta": "tab:purple"}
    for variant in ("bf16", "fp8", "bf16+delta"):
        for t, e in g["estimates"][variant].items():
            labels.append(f"{t} ({variant})")
            values.append(e["total_s"])
            colors.append(palette[variant])
    labels.append("p2p (fp8), model on a 64 trainer + 32 engine GPU layout")
    values.append(g["p2p_fp8_64_trainer_32_engine"]["total_s"])
    colors.append("tab:olive")
    for name, s in g["peers"]:
        labels.append("published: " + name)
        values.append(s)
        colors.append("tab:gray")
    y = range(len(labels))
    ax.barh(list(y), values, color=colors)
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(5.0, color="tab:red", ls="--", lw=0.8)
    ax.text(5.0, len(labels) - 0.5, " 5 s", color="tab:red", fontsize=8)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
    ax.set_xlabel("seconds per weight update (log)")
    ax.set_title("GLM-5.1 recipe, model estimate (stated H200 assumptions) vs peers' published")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller points (a smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stat", choices=("min", "median"), default="min", help="the statistic of the repetitions")
    ap.add_argument("--glm-only", action="store_true", help="skip the measurements: reuse the latest results file")
    ap.add_argument("--plot", type=Path, default=None, help="write the figure (PNG) here")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, default=None,
                    help="refit and compare the points of an earlier results file instead of measuring")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "glm5_1" / "rl.toml")
    args = ap.parse_args(argv)
    global STAT
    STAT = args.stat
    today = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"weight_sync_model_cpu{os.cpu_count()}core_{today}.json"
    if args.glm_only:
        prev = sorted((REPO / "benchmarks" / "results").glob("weight_sync_model_*.json"))
        report = json.loads(prev[-1].read_text()) if prev else {}
        delta_ratio = statistics.mean(r["wire_ratio"] for r in report["delta"]["steps"]) if report else 0.06
    else:
        import torch

        load0 = os.getloadavg()
        t0 = time.perf_counter()
        if args.from_json:
            prev = json.loads(args.from_json.read_text())
            results, provenance = prev["points"], dict(prev["provenance"], stat=STAT, refit_of=str(args.from_json),
                                                       model_commit=commit(),
                                                       model_tree_dirty=tree_dirty("moe_rl/weights", "benchmarks"))
        else:
            results = measure(QUICK if args.quick else PLAN, args.reps)
            provenance = {"commit": commit(), "tree_dirty": tree_dirty("moe_rl/weights", "benchmarks"),
                          "torch": torch.__version__, "machine": platform.platform(),
                          "processor": platform.processor(), "cpus": os.cpu_count(),
                          "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                          "measure_s": time.perf_counter() - t0, "reps": args.reps, "stat": STAT,
                          "bucket_bytes": BUCKET,
                          "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        summarise(results)
        links = fit(results)
        report = {
            "provenance": provenance,
            "points": results,
            "fit_points": {k: [list(p) for p in v] for k, v in FIT.items()},
            "fit": {k: getattr(links, k) for k in ("intra_bw", "intra_latency", "node_bw", "fs_write_bw",
                                                   "fs_read_bw", "fs_aggregate_write_bw", "fs_aggregate_read_bw",
                                                   "fs_latency")},
        }
        report["comparison"] = compare(results, links)
        report["delta"] = prev["delta"] if args.from_json else delta_figures(mib=16 if args.quick else 64)
        delta_ratio = statistics.mean(r["wire_ratio"] for r in report["delta"]["steps"])
    report["glm5_1"] = glm5_1_estimates(args.recipe, delta_ratio)
    print_tables(report)
    if not args.glm_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
        print(f"\nwrote {out}")
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
