"""Context parallelism for the Mamba-2 scan: the recurrent state passed between CP ranks (gloo and NCCL).

Shape legend (as :mod:`moe_rl.ssm.ssd`):
    cp   ranks in the CP process group; rank ``r`` holds the ``r``-th contiguous slice of every row
    b    rows; ``Tl`` this rank's tokens per row (may differ across ranks)
    H, P, G, N   heads, head dim, B/C groups, state size

The scan is linear in its start state, so each rank scans its slice from a zero state and then adds what the
true start state contributes. Rank ``r``'s slice maps a start state ``h`` to the end state ``exp(a_r) h + s_r``,
with ``a_r = sum_t dt_t A`` (``[b, H]``, its total log-decay) and ``s_r`` its zero-start end state. One all-gather
of the pairs ``(a_j, s_j)`` gives every rank the exclusive scan over ranks
``h_in(r) = sum_{j < r} exp(a_{j+1} + ... + a_{r-1}) s_j`` (Horner order: ``h = exp(a_j) h + s_j`` for
``j = 0 .. r-1``), and the outputs are corrected by ``y_t += exp(sum_{s <= t} dt_s A) C_t . h_in(r)``; the end
state becomes ``exp(a_r) h_in(r) + s_r``. Communication: ``cp * b H (P N + 1)`` values per rank, independent of the
sequence length. The all-gather's backward sums every rank's gradient of each pair back to its owner, so the state
gradient flows to earlier ranks (the reverse-time recurrence of the backward pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.ssm.ssd import SSDOutput, _check, ssd_scan

__all__ = ["all_gather_stack", "check_same_across_ranks", "ssd_scan_cp"]


class _AllGatherStack(torch.autograd.Function):
    """``x [...] -> [cp, ...]`` (rank order); the backward all-reduces (sums) the gradient of the stack and hands
    each rank its own slice: the sum over ranks of the gradient of its tensor."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


def all_gather_stack(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable all-gather: ``x [...]`` (same shape on every rank) -> ``[cp, ...]`` in rank order.

    The backward returns to each rank the sum over all ranks of the gradient of its slice. Uses ``all_gather`` and
    ``all_reduce`` only (both on gloo and NCCL); every rank must run the backward.
    """
    if not x.requires_grad:
        out = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)
    return _AllGatherStack.apply(x, group)


def check_same_across_ranks(values: Sequence[int], names: Sequence[str], what: str,
                            group: dist.ProcessGroup | None = None) -> None:
    """One small all-gather; raise the same ``ValueError`` on every rank if any of ``values`` differs across ranks
    (so a shape mismatch is an error everywhere, not a hang or a size error inside a collective)."""
    table = all_gather_stack(torch.tensor(list(values), dtype=torch.int64), group)  # [cp, len(values)]
    bad = [n for j, n in enumerate(names) if bool((table[:, j] != table[0, j]).any())]
    if bad:
        rows = {n: table[:, names.index(n)].tolist() for n in bad}
        raise ValueError(f"{what}: these sizes must be equal on every CP rank but differ (per rank): {rows}")


def ssd_scan_cp(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, chunk_size: int,
                D: Tensor | None = None, initial_state: Tensor | None = None,
                group: dist.ProcessGroup | None = None) -> SSDOutput:
    """:func:`moe_rl.ssm.ssd_scan` over a sequence split across the CP ranks of ``group`` (module docstring).

    Args:
        x, dt, A, B, C, chunk_size, D: as :func:`moe_rl.ssm.ssd_scan`, with ``T = Tl`` this rank's contiguous
            slice of every row (rank order = sequence order).
        initial_state: ``[b, H, P, N]`` the state before the first token of the whole row, or None (zero). Only
            rank 0's value is used (pass it there; other ranks' values are ignored and get no gradient).
        group: the CP process group (None: the default group).

    Returns:
        :class:`moe_rl.ssm.SSDOutput`: ``y [b, Tl, H, P]`` equal to the single-process scan's rows of this slice,
        and ``final_state [b, H, P, N]`` the state after this rank's last token (the last rank's is the row's
        final state).

    Raises:
        ValueError: as :func:`moe_rl.ssm.ssd_scan`; and the same error on every rank when ``b, H, P, G, N``
            differ across ranks.
    """
    b, T, H, P, G, N = _check(x, dt, A, B, C, D, initial_state)
    check_same_across_ranks([b, H, P, G, N], ["b", "H", "P", "G", "N"], "ssd_scan_cp", group)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    local = ssd_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=initial_state if rank == 0 else None)
    if cp == 1:
        return local
    f = local.y.dtype
    a = dt.to(f) * A.to(f)  # [b, Tl, H]
    a_cum = torch.cumsum(a, dim=1)  # log-decay from this slice's start to t (inclusive)
    a_tot = a.sum(dim=1)  # [b, H]
    # one collective for both halves of the pair: one backward all-reduce, so every rank runs the same sequence
    # of collectives in its backward pass whatever order autograd picks
    packed = all_gather_stack(torch.cat([a_tot.reshape(-1), local.final_state.reshape(-1)]), group)
    a_all = packed[:, : b * H].view(cp, b, H)
    s_all = packed[:, b * H:].view(cp, b, H, P, N)
    if rank == 0:
        # rank 0 already holds the row's true start state. `+ 0 * sum` keeps its outputs connected to the
        # all-gather, so its backward takes part in the gather's all-reduce (the other ranks wait for it) and
        # receives the gradient of its end state from the later ranks.
        keep = packed.sum() * 0
        return SSDOutput(local.y + keep, local.final_state + keep)
    h_in = s_all[0]
    for j in range(1, rank):
        h_in = torch.exp(a_all[j])[..., None, None] * h_in + s_all[j]
    R = H // G
    corr = torch.einsum("btgn,bgrpn->btgrp", C.to(f), h_in.view(b, G, R, P, N)).reshape(b, T, H, P)
    y = local.y + torch.exp(a_cum).unsqueeze(-1) * corr
    final = torch.exp(a_tot)[..., None, None] * h_in + local.final_state
    return SSDOutput(y, final)
