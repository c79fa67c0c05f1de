"""One rank of the N06 EP scenarios (launched by ``tests/cases/test_n06_ep_duplicate_slots_local_ids.py``).

Usage: ``python _n06_ep_worker.py RANK WORLD INIT_FILE OUT_DIR`` -> ``OUT_DIR/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.moe.ep import combine, dispatch

torch.set_num_threads(1)
E = 8
REPORT: dict[str, object] = {}


def duplicate_slots() -> None:
    """(a) one token on rank 0 picks expert 3 in both slots (p = 0.3, 0.2); expert 3 computes y = 2x."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = E // world
    if rank == 0:
        x = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
        ids = torch.tensor([[3, 3]])
        w = torch.tensor([[0.3, 0.2]], dtype=torch.float64, requires_grad=True)
    else:
        x = torch.zeros(0, 1, dtype=torch.float64, requires_grad=True)
        ids = torch.zeros(0, 2, dtype=torch.int64)
        w = torch.zeros(0, 2, dtype=torch.float64, requires_grad=True)
    recv, counts, h = dispatch(x, ids, w, num_experts=E)
    owner = 3 // local
    assert int(counts.sum()) == (2 if rank == owner else 0), f"rank {rank} got {counts.tolist()} rows"
    gids = h.layout_P + rank * local
    assert bool(((gids == 3) | (h.layout_P < 0)).all()), f"rows for {gids.tolist()}"
    y = 2.0 * recv  # the expert
    out = combine(y, h)
    out.sum().backward()
    if rank == 0:
        REPORT["dup_out"] = out.item()
        REPORT["dup_dw"] = w.grad[0].tolist()
        REPORT["dup_dx"] = x.grad.item()


def local_ids() -> None:
    """(b) 8 experts on 4 ranks (rank r owns 2r, 2r+1), top-1, rank 0 sends 7 tokens with ids [6,1,3,3,4,0,7];
    every other rank sends a few tokens of its own so that all ranks both send and receive."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = E // world
    if rank == 0:
        ids = torch.tensor([[6], [1], [3], [3], [4], [0], [7]])
    else:
        ids = torch.tensor([[(rank * 3 + 1) % E], [(rank * 5) % E]])
    T = ids.shape[0]
    # feature 0: the source token index, feature 1: the source rank, feature 2: a value
    x = torch.stack([torch.arange(T, dtype=torch.float64), torch.full((T,), float(rank)),
                     (1 + torch.arange(T, dtype=torch.float64)) / 4], dim=1)  # exact in fp32
    w = torch.full((T, 1), 0.75, dtype=torch.float64)
    recv, counts, h = dispatch(x, ids, w, num_experts=E)
    lid = h.layout_P
    assert bool(((lid >= 0) & (lid < local)).all()), f"local ids outside [0, {local}): {lid.tolist()}"
    from_rank0 = recv[:, 1] == 0
    tok = recv[from_rank0, 0].long()
    order = tok.argsort()
    REPORT["local_ids_from_rank0"] = lid[from_rank0][order].tolist()
    REPORT["tokens_from_rank0"] = tok[order].tolist()
    # the local expert e_l (global rank*L + e_l) computes y = (global id + 1) * x
    gid = (lid + rank * local).to(torch.float64)
    y = (gid + 1)[:, None] * recv
    out = combine(y, h)
    ref = 0.75 * (ids.to(torch.float64) + 1) * x  # single-rank reference: every expert on one rank
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # small dyadic values: every product exact in fp32


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results: dict[str, object] = {}
    for fn in (duplicate_slots, local_ids):
        try:
            fn()
            results[fn.__name__] = "ok"
        except Exception:
            results[fn.__name__] = traceback.format_exc()
    results["report"] = REPORT
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
