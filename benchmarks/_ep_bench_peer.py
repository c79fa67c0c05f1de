"""Cases of ``benchmarks/test_bench_ep.py`` and the peer process that runs them on the other ranks.

Rank 0 is the pytest process (it times the cases); ranks 1.. run this file as a script and obey rank 0's
commands, broadcast as ``[command, case index, calls]`` int64 tensors (command 0 = stop), so that every rank
issues the same collectives in the same order whatever subset of benchmarks pytest selects.

Usage (started by the benchmark fixture): ``python _ep_bench_peer.py RANK WORLD INIT_FILE``
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_rl.moe.ep import combine, dispatch

T, D, E, K = 1024, 512, 8, 4
"""Tokens per rank, hidden size, experts, top_k (bf16 rows: 4 MiB of slots per rank per direction)."""
DTYPE = torch.bfloat16
CASES = [
    "a2a_same_bytes",
    "dispatch",
    "a2a_same_bytes_x4",
    "dispatch_combine_fwd_bwd",
    "a2a_same_bytes_fresh_out",
    "dispatch_reuse_handle",
    "dispatch_combine_fwd_bwd_reuse_handle",
    "a2a_plus_two_gathers",
    "a2a_x4_plus_gathers",
]
"""Baselines first: ``a2a_same_bytes`` moves exactly the rows ``dispatch`` moves with one
``all_to_all_single`` into a preallocated output; ``a2a_same_bytes_x4`` does it four times (dispatch, combine and
their backwards). ``a2a_same_bytes_fresh_out`` allocates its output every call, as any op returning a new tensor
must (on CPU the fresh pages cost about as much as a copy). ``*_reuse_handle`` pass ``handle=`` from a previous
dispatch of the same routing (no count collective, no sort).

The ``*_gathers`` rows are the copy floor of any dispatcher built on one ``all_to_all_single`` per direction with a
rank-major wire order and an expert-major output: ``a2a_plus_two_gathers`` = one row gather into the send buffer
(replicating each token per slot, sorted by destination), the exchange into a fresh buffer, one row gather into the
expert-major layout; ``a2a_x4_plus_gathers`` does that in each of the four exchanges of dispatch+combine forward and
backward (no gate weighting, no sum over K). What ``dispatch`` spends above these rows is layout/validation work;
what these rows spend above ``a2a_same_bytes`` is the two payload copies themselves."""


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g).to(DTYPE)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def make_case(name: str, group: dist.ProcessGroup | None = None) -> Callable[[], object]:
    """Build one case (collective: every rank calls it) and return its step function."""
    x, ids, w = _inputs(dist.get_rank(group))
    if name in ("a2a_same_bytes", "a2a_same_bytes_x4", "a2a_same_bytes_fresh_out"):
        _, _, h = dispatch(x, ids, w, group, num_experts=E)
        chunk = h.chunks[0]
        rows = x[chunk.token_n]
        out = rows.new_empty(sum(chunk.recv_splits), D)
        back = torch.empty_like(rows)
        repeats = 1 if name == "a2a_same_bytes" else 2

        if name == "a2a_same_bytes_fresh_out":
            return lambda: dist.all_to_all_single(
                rows.new_empty(sum(chunk.recv_splits), D),
                rows,
                chunk.recv_splits,
                chunk.send_splits,
                group=group,
            )

        def a2a() -> None:
            for _ in range(repeats):
                dist.all_to_all_single(out, rows, chunk.recv_splits, chunk.send_splits, group=group)
                if repeats > 1:
                    dist.all_to_all_single(back, out, chunk.send_splits, chunk.recv_splits, group=group)

        return a2a
    if name in ("a2a_plus_two_gathers", "a2a_x4_plus_gathers"):
        _, _, h = dispatch(x, ids, w, group, num_experts=E)
        chunk = h.chunks[0]

        def exchange(src: torch.Tensor, send_index, splits_in, splits_out, recv_index) -> torch.Tensor:
            rows = src.index_select(0, send_index)
            out = rows.new_empty(sum(splits_out), D)
            dist.all_to_all_single(out, rows, splits_out, splits_in, group=group)
            return out.index_select(0, recv_index)

        def floor() -> None:
            recv = exchange(x, chunk.token_n, chunk.send_splits, chunk.recv_splits, h.src_P)
            if name == "a2a_x4_plus_gathers":  # combine, combine's backward, dispatch's backward
                back = exchange(recv, chunk.dest_m, chunk.recv_splits, chunk.send_splits, h.src_S)
                recv = exchange(back, chunk.slot_n, chunk.send_splits, chunk.recv_splits, h.src_P)
                exchange(recv, chunk.dest_m, chunk.recv_splits, chunk.send_splits, h.src_S)

        return floor
    if name == "dispatch":
        return lambda: dispatch(x, ids, w, group, num_experts=E)
    if name == "dispatch_reuse_handle":
        _, _, cached = dispatch(x, ids, w, group, num_experts=E)
        return lambda: dispatch(x, ids, w, group, num_experts=E, handle=cached)
    if name in ("dispatch_combine_fwd_bwd", "dispatch_combine_fwd_bwd_reuse_handle"):
        x.requires_grad_()
        w.requires_grad_()
        grad = torch.randn(T, D).to(DTYPE)
        cached = None
        if name.endswith("reuse_handle"):
            _, _, cached = dispatch(x.detach(), ids, w.detach(), group, num_experts=E)

        def fwd_bwd() -> None:
            x.grad, w.grad = None, None
            recv, _, h = dispatch(x, ids, w, group, num_experts=E, handle=cached)
            combine(recv, h).backward(grad)  # identity experts

        return fwd_bwd
    raise ValueError(f"unknown case {name!r}; cases: {CASES}")


def command(cmd: int, case: int = 0, calls: int = 0) -> tuple[int, int, int]:
    """Broadcast ``[cmd, case, calls]`` from rank 0 (every rank calls this; non-zero ranks pass anything)."""
    t = torch.tensor([cmd, case, calls], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return tuple(t.tolist())  # type: ignore[return-value]


def main() -> None:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    while True:
        cmd, case, calls = command(0)
        if cmd == 0:
            break
        step = make_case(CASES[case])
        for _ in range(calls):
            step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
