"""Cases of ``benchmarks/test_bench_cp.py`` and the peer process that runs them on ranks 1..cp-1.

Rank 0 is the pytest process (it times the cases); the other ranks run this file as a script and obey rank 0's
commands, broadcast as ``[command, case index, calls]`` int64 tensors (command 0 = stop), so every rank issues
the same collectives in the same order whatever subset of benchmarks pytest selects.

Each case is one forward + backward of a CP attention method on this rank's shard of the same global problem
(fp32, zigzag layout, causal, one sequence of ``T`` tokens). Besides time, :func:`measure` reports per rank
(deterministic, no timing):

* ``saved_bytes``: bytes of the tensors autograd saves for the backward (``torch.autograd.graph.
  saved_tensors_hooks``, each storage counted once) -- the activation memory the method holds between forward
  and backward;
* ``sent_bytes``: payload bytes this rank sends, counted at the collectives with the ideal algorithm's volume
  (all-to-all and reduce-scatter: (cp-1)/cp of the input; all-gather: (cp-1) x the input; P2P: the message).

Usage (started by the benchmark fixture): ``python _cp_bench_peer.py RANK WORLD INIT_FILE``
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_rl.attention import (
    attention_reference,
    dsa_attention,
    dsa_cp_attention,
    make_shard_plan,
    ring_attention,
    ulysses_attention,
)

T, H, HKV, D = 1024, 8, 2, 64
"""Global tokens, query heads, KV heads (GQA), head dim (ring / Ulysses)."""
DK, DV, K, HI, DI = 576, 512, 256, 4, 64
"""DSA: latent key dim (512 + 64 rope), latent value dim, index_topk, indexer heads and head dim."""
CASES = ["reference", "ring", "ulysses", "dsa_reference", "dsa_cp"]
"""``reference`` / ``dsa_reference``: the single-process functions on all T tokens (the baselines: same total
work, rank 0 alone, the peers idle); the others run on every rank of the group."""


def _global(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(T, H, D, generator=g), k=torch.randn(T, HKV, D, generator=g), v=torch.randn(T, HKV, D, generator=g),
        go=torch.randn(T, H, D, generator=g),
        qa=torch.randn(T, H, DK, generator=g), kv=torch.randn(T, DK, generator=g),
        iq=torch.randn(T, HI, DI, generator=g), iw=torch.randn(T, HI, generator=g), ik=torch.randn(T, DI, generator=g),
        goa=torch.randn(T, H, DV, generator=g),
    )


def make_case(name: str, group: dist.ProcessGroup | None = None) -> Callable[[], object]:
    """Build one case and return its step (forward + backward). Collective cases must run on every rank."""
    x = _global()
    cu = torch.tensor([0, T])
    if name in ("reference", "dsa_reference"):
        if name == "reference":
            leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v")]

            def step():
                attention_reference(*leaves, cu_seqlens=cu).out.backward(x["go"])
        else:
            leaves = [x[n].clone().requires_grad_() for n in ("qa", "kv")]

            def step():
                dsa_attention(*leaves, v_head_dim=DV, index_q=x["iq"], index_weights=x["iw"], index_k=x["ik"],
                              index_topk=K, cu_seqlens=cu).out.backward(x["goa"])
        return step
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = make_shard_plan(T, cp, "zigzag")
    tok = plan.local_token_idx(rank)
    loc = {n: plan.shard(t, rank) for n, t in x.items()}
    if name in ("ring", "ulysses"):
        fn = ring_attention if name == "ring" else ulysses_attention
        leaves = [loc[n].clone().requires_grad_() for n in ("q", "k", "v")]

        def step():
            fn(*leaves, token_idx=tok, cu_seqlens=cu, group=group).out.backward(loc["go"])
        return step
    if name == "dsa_cp":
        leaves = [loc[n].clone().requires_grad_() for n in ("qa", "kv")]

        def step():
            dsa_cp_attention(*leaves, v_head_dim=DV, token_idx=tok, cu_seqlens=cu, index_q=loc["iq"],
                             index_weights=loc["iw"], index_k=loc["ik"], index_topk=K, group=group
                             ).out.backward(loc["goa"])
        return step
    raise ValueError(f"unknown case {name!r}; known: {CASES}")


class _Meter:
    """Counts saved-for-backward bytes and sent payload bytes while active (patches torch.distributed)."""

    def __init__(self, group) -> None:
        self.cp = dist.get_world_size(group)
        self.saved: dict[int, int] = {}
        self.sent = 0

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        self.saved[key] = max(self.saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    def run(self, step: Callable[[], object]) -> tuple[int, int]:
        cp = self.cp
        orig = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_single", "reduce_scatter_single",
                                              "batch_isend_irecv")}

        def a2a(out, inp, *a, **k):
            self.sent += inp.nbytes * (cp - 1) // cp
            return orig["all_to_all_single"](out, inp, *a, **k)

        def ag(out, inp, *a, **k):
            self.sent += inp.nbytes * (cp - 1)
            return orig["all_gather_single"](out, inp, *a, **k)

        def rs(out, inp, *a, **k):
            self.sent += inp.nbytes * (cp - 1) // cp
            return orig["reduce_scatter_single"](out, inp, *a, **k)

        def p2p(ops):
            self.sent += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
            return orig["batch_isend_irecv"](ops)

        for n, f in (("all_to_all_single", a2a), ("all_gather_single", ag), ("reduce_scatter_single", rs),
                     ("batch_isend_irecv", p2p)):
            setattr(dist, n, f)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                step()
        finally:
            for n, f in orig.items():
                setattr(dist, n, f)
        return sum(self.saved.values()), self.sent


def measure(step: Callable[[], object], group=None) -> tuple[int, int]:
    """``(saved_bytes, sent_bytes)`` of one call of ``step`` on this rank (collective when ``step`` is)."""
    return _Meter(group).run(step)


def command(cmd: int, case: int = 0, calls: int = 0) -> tuple[int, int, int]:
    """Rank 0 broadcasts a command; peers receive it. Returns ``(cmd, case, calls)``."""
    t = torch.tensor([cmd, case, calls], dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t[0]), int(t[1]), int(t[2])


def main() -> None:
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        while True:
            cmd, case, calls = command(0)
            if cmd == 0:
                break
            name = CASES[case]
            if name in ("reference", "dsa_reference"):
                continue  # single-process baselines: rank 0 alone
            step = make_case(name)
            if cmd == 2:  # rank 0 also measures on a 1-rank group, whose creation is collective
                measure(step)
                dist.new_group([0])
            else:
                for _ in range(calls):
                    step()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
