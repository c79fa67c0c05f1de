"""Autograd-aware collectives for context parallelism (gloo and NCCL): all-to-all, all-gather, ring P2P.

Shape legend:
    cp   ranks in the CP process group
    R    rows per rank (equal on every rank)

All functions take an explicit process group (``None`` = the default group) and keep no global state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_rows", "all_to_all_rows", "check_same_across_ranks", "ring_exchange"]


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class _AllToAllRows(torch.autograd.Function):
    """``x [cp * R, ...]`` -> ``[cp * R, ...]``: block j of the input goes to rank j; block i of the output
    came from rank i. The backward is the same exchange applied to the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        g = g.contiguous()
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g, group=ctx.group)
        return out, None


def all_to_all_rows(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable equal-split ``all_to_all_single`` along dim 0 (``x.shape[0]`` divisible by cp)."""
    cp, _ = _world(group)
    if x.shape[0] % cp:
        raise ValueError(f"all_to_all_rows needs dim 0 ({x.shape[0]}) divisible by the group size {cp}")
    return _AllToAllRows.apply(x, group)


class _AllGatherRows(torch.autograd.Function):
    """``x [R, ...]`` -> ``[cp * R, ...]`` in rank order; the backward reduce-scatters (sums) the gradient so
    each owner receives the gradient of its rows from every rank."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        cp, _ = _world(group)
        x = x.contiguous()
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        cp, _ = _world(ctx.group)
        g = g.contiguous()
        out = g.new_empty((g.shape[0] // cp, *g.shape[1:]))
        dist.reduce_scatter_single(out, g, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def all_gather_rows(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable all-gather along dim 0 (equal rows per rank); gradients are summed back to owners."""
    if not x.requires_grad:
        cp, _ = _world(group)
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out
    return _AllGatherRows.apply(x, group)


def check_same_across_ranks(values: Sequence[int], names: Sequence[str], what: str,
                            group: dist.ProcessGroup | None = None) -> None:
    """One small all-gather; raise the same ``ValueError`` on every rank if any value differs across ranks.

    Use it before the payload collectives so a shape mismatch is an error on all ranks, not a hang or a size
    error deep inside a collective.
    """
    cp, _ = _world(group)
    t = torch.tensor(list(values), dtype=torch.int64)
    out = torch.empty(cp * t.numel(), dtype=torch.int64)
    dist.all_gather_single(out, t, group=group)
    table = out.view(cp, -1)
    bad = [n for j, n in enumerate(names) if bool((table[:, j] != table[0, j]).any())]
    if bad:
        rows = {n: table[:, names.index(n)].tolist() for n in bad}
        raise ValueError(f"{what}: these sizes must be equal on every CP rank but differ (per rank): {rows}")


def ring_exchange(
    send: Sequence[Tensor], group: dist.ProcessGroup | None = None
) -> tuple[list[Tensor], list[dist.Work]]:
    """Start sending ``send`` to the next rank and receiving same-shaped tensors from the previous rank.

    Returns ``(received, works)``; call ``w.wait()`` on every work before reading ``received``. The send buffers
    must not be modified until then. Uses ``batch_isend_irecv`` (works on gloo and NCCL).
    """
    cp, rank = _world(group)
    nxt = dist.get_global_rank(group, (rank + 1) % cp) if group is not None else (rank + 1) % cp
    prv = dist.get_global_rank(group, (rank - 1) % cp) if group is not None else (rank - 1) % cp
    recv = [torch.empty_like(t) for t in send]
    ops = []
    for t, r in zip(send, recv, strict=True):
        ops.append(dist.P2POp(dist.isend, t.contiguous(), nxt, group=group))
        ops.append(dist.P2POp(dist.irecv, r, prv, group=group))
    works = dist.batch_isend_irecv(ops)
    return recv, works
