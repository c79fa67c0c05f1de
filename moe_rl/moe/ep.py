"""Expert-parallel token dispatch and combine (functional core), with autograd, chunking and alignment padding.

Shape legend:
    T  tokens on this rank (may be 0)
    D  hidden size
    K  experts per token (top_k)
    E  routed experts in total; expert e lives on rank ``e // L``
    R  ranks in the expert-parallel group (ep size)
    L  local experts per rank, L = E / R
    n  valid token-slots this rank sends (slots whose expert id is not -1), n <= T * K
    M  rows this rank receives for its L experts (unpadded)
    P  rows handed to the local experts, P = M when ``align == 1``, else each expert's segment padded up
       to a multiple of ``align`` with zero rows

Data flow of the ``"torch"`` backend (torchtitan's all2all token dispatcher,
``torchtitan/models/common/token_dispatcher.py``, and DeepEP normal-mode ``Buffer.dispatch``/``combine``
semantics, ``deep_ep/buffers/legacy.py``)::

    dispatch:
      slots sorted by expert (stable)          ids_TK -> slot_n, counts_E
      count exchange   all_to_all_single(counts_E)             -> recv_counts_RL
      row exchange     all_to_all_single(x_TD[token_n])        -> rank-major rows (e0r0, e1r0, .., e0r1, ..)
      permute to expert-major                                  -> (e0r0, e0r1, .., e1r0, ..)
      pad each local expert segment to ``align`` (-1 in the layout)  -> recv_x_PD
    combine:
      drop padding, expert-major -> rank-major, reverse row exchange -> slot rows
      slot rows -> [T, K, D] (zeros for id -1), then  out_TD = sum_k w_TK[:, k] * y_TKD[:, k]  in fp32

As in DeepEP, the gate weights are applied in combine, after the experts, in fp32 (DeepEP's normal-mode
``combine`` is an unweighted sum and its callers weight before it; we weight inside combine, which is the same
place in the math). The final sum over K is an einsum over a dense ``[T, K, D]`` tensor filled by
``index_copy`` with unique indices, so the result does not depend on atomics or thread order (deterministic),
and it is the same expression as :class:`moe_rl.moe.MoE`.

Autograd: the backward of dispatch is "combine without weights" of the gradient (sum over K), and the backward
of combine is "dispatch" of the gradient with the same layout (DeepEP: ``dispatch`` backward = ``combine``,
``combine`` backward = ``dispatch`` with the cached handle). Gradients reach ``x_TD``, the expert outputs and
``topk_weights_TK``.

Collective count: with ``chunk_size`` the tokens are cut into chunks and every rank runs
``max over ranks of ceil(T / chunk_size)`` chunks (at least 1), empty chunks included, so ranks with few or no
tokens issue exactly as many collectives as the others, in forward and in backward (public bug case B04;
prime-rl PR #3411, sglang PR #25397, NeMo Automodel PRs #935/#3680, Megatron-LM PR #4851).

Gloo notes (CPU tests): ``all_to_all_single`` with uneven splits works; float8 tensors are sent viewed as
``uint8``; the list form ``all_to_all`` needs equal sizes and is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DispatchHandle", "EPBackend", "combine", "dispatch"]

EPBackend = Literal["torch", "deep_ep"]

_DEEP_EP_INSTALL = (
    "backend='deep_ep' needs the deep_ep package (DeepEP, https://github.com/deepseek-ai/DeepEP), which "
    "requires CUDA GPUs and NVSHMEM and is built from source: clone the repository, install NVSHMEM as its "
    "README describes, then `NVSHMEM_DIR=/path/to/nvshmem pip install .` (or install moe_rl's `gpu` extra on "
    "a CUDA machine). Use backend='torch' on CPU or without DeepEP."
)

_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


@dataclass(slots=True)
class _ChunkLayout:
    """Layout of one chunk of tokens ``[token_start, token_start + num_tokens)``."""

    token_start: int
    num_tokens: int
    slot_n: Tensor
    """``[n]`` int64 flat slot indices (into the whole ``T * K``) of the chunk's valid slots, sorted by expert."""
    token_n: Tensor
    """``[n]`` int64 token index (into the whole T) of each sorted slot."""
    slot_src_S: Tensor
    """``[num_tokens * K]`` int64: for each slot of the chunk, its row among the n sorted rows (n = a zero row,
    for slots with expert id -1)."""
    has_dropped: bool
    """Some slot of the chunk has expert id -1."""
    send_splits: list[int]
    """Rows sent to each rank, ``[R]``."""
    recv_splits: list[int]
    """Rows received from each rank, ``[R]``."""
    recv_perm_m: Tensor
    """``[M_chunk]`` int64: expert-major position -> index into the rank-major received rows."""
    recv_inv_m: Tensor
    """``[M_chunk]`` int64: the inverse permutation of ``recv_perm_m``."""
    counts_L: Tensor
    """``[L]`` int64 rows received per local expert in this chunk."""


@dataclass(slots=True)
class DispatchHandle:
    """Everything :func:`combine` and the backward passes need to reverse a :func:`dispatch`.

    Holds index tensors only (plus the gate weights); no communication buffers. :func:`dispatch` does not yet
    accept a cached handle, so every dispatch recomputes the layout (one count exchange per chunk).
    """

    group: dist.ProcessGroup | None
    rank: int
    """This rank's index in the EP group."""
    world_size: int
    """R."""
    num_experts: int
    """E."""
    num_tokens: int
    """T on this rank."""
    top_k: int
    """K."""
    hidden: int
    """D."""
    chunks: tuple[_ChunkLayout, ...]
    """One layout per chunk; the same number of chunks on every rank."""
    merge_perm_M: Tensor | None
    """``[M]`` int64: global expert-major position -> row of the chunk-wise concatenation (``None``: 1 chunk)."""
    merge_inv_M: Tensor | None
    """``[M]`` int64: the inverse permutation of ``merge_perm_M``."""
    counts_L: Tensor
    """``[L]`` int64 rows received per local expert (unpadded)."""
    align: int
    """Each local expert's segment is padded to a multiple of this."""
    padded_counts_L: Tensor
    """``[L]`` int64 segment sizes after padding (equal to ``counts_L`` when ``align == 1``)."""
    dest_M: Tensor | None
    """``[M]`` int64 row of each received row in the padded layout (``None`` when ``align == 1``)."""
    layout_P: Tensor
    """``[P]`` int64 local expert id of each row handed to the experts, -1 on padding rows (DeepGEMM's
    ``m_indices`` for the contiguous grouped layout)."""
    topk_weights_TK: Tensor
    """``[T, K]`` gate weights, applied by :func:`combine` in fp32."""

    @property
    def num_local_experts(self) -> int:
        """L."""
        return self.num_experts // self.world_size

    @property
    def num_chunks(self) -> int:
        """Dispatch/combine rounds (collective pairs) this handle runs; equal on every rank."""
        return len(self.chunks)

    @property
    def num_recv_rows(self) -> int:
        """P, the rows handed to the local experts (padding included)."""
        return int(self.layout_P.shape[0])


# --------------------------------------------------------------------------------------------- validation


def _local_problem(
    x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, num_experts: int, align: int, chunk_size
) -> str | None:
    if x_TD.dim() != 2:
        return f"x_TD must be [T, D], got shape {tuple(x_TD.shape)}"
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0]:
        return f"topk_ids_TK must be [T, K] with T={x_TD.shape[0]}, got shape {tuple(topk_ids_TK.shape)}"
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        return f"topk_ids_TK must be an integer tensor, got dtype {topk_ids_TK.dtype}"
    if tuple(topk_weights_TK.shape) != tuple(topk_ids_TK.shape):
        return (
            f"topk_weights_TK has shape {tuple(topk_weights_TK.shape)} but topk_ids_TK has "
            f"{tuple(topk_ids_TK.shape)}; they must match"
        )
    if align < 1:
        return f"align={align} must be >= 1 (1 = no padding; 128 = DeepGEMM contiguous layout)"
    if chunk_size is not None and chunk_size < 1:
        return f"chunk_size={chunk_size} must be >= 1 or None (no chunking)"
    if topk_ids_TK.numel():
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < -1 or hi >= num_experts:
            return (
                f"topk_ids_TK holds values in [{lo}, {hi}], outside [-1, num_experts - 1 = {num_experts - 1}] "
                "(-1 means 'no expert' for that slot)"
            )
    return None


def _validate_and_count_chunks(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None,
    num_experts: int,
    align: int,
    chunk_size: int | None,
) -> int:
    """One ``all_gather`` of a few ints: check that ranks agree, raise the same ValueError on every rank,
    and return the agreed number of chunks (max over ranks of ``ceil(T / chunk_size)``, at least 1).

    Raising on every rank (not only on the rank with the bad input) keeps the others from waiting in a
    collective that will never come.
    """
    world = dist.get_world_size(group)
    problem = _local_problem(x_TD, topk_ids_TK, topk_weights_TK, num_experts, align, chunk_size)
    num_tokens = x_TD.shape[0]
    local_chunks = 1 if chunk_size is None or problem is not None else math.ceil(num_tokens / chunk_size)
    hidden = x_TD.shape[-1] if x_TD.dim() == 2 else -1
    mine = torch.tensor(
        [num_experts, world, hidden, chunk_size or 0, local_chunks, int(problem is not None)],
        dtype=torch.int64,
    )
    gathered = torch.empty(world * mine.numel(), dtype=torch.int64)
    dist.all_gather_single(gathered, mine, group=group)
    per_rank = gathered.view(world, -1).tolist()

    def column(i: int) -> list[int]:
        return [row[i] for row in per_rank]

    bad_ranks = [r for r, row in enumerate(per_rank) if row[5]]
    if bad_ranks:
        here = f"; on this rank: {problem}" if problem is not None else ""
        raise ValueError(f"invalid dispatch input on EP rank(s) {bad_ranks}{here}")
    for i, name in (
        (0, "num_experts"),
        (1, "world size"),
        (2, "hidden size D"),
        (3, "chunk_size (0 = None)"),
    ):
        if len(set(column(i))) != 1:
            raise ValueError(
                f"EP ranks disagree on {name}: per-rank values {column(i)}; every rank of the group must pass "
                "the same value"
            )
    if num_experts < 1 or num_experts % world != 0:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the EP group size {world} "
            "(each rank holds num_experts / ep experts)"
        )
    return max(1, max(column(4)))


# ------------------------------------------------------------------------------------------------- layout


def _inverse(perm: Tensor) -> Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))


def _chunk_layout(
    ids_TK: Tensor, token_start: int, num_experts: int, world: int, group: dist.ProcessGroup | None
) -> _ChunkLayout:
    """Sort this chunk's slots by expert and exchange per-expert counts (one ``all_to_all_single``)."""
    num_tokens, top_k = ids_TK.shape
    local = num_experts // world
    key_N = ids_TK.reshape(-1).to(torch.int64)
    key_N = torch.where(key_N < 0, torch.full_like(key_N, num_experts), key_N)  # -1 sorts last, then dropped
    perm_N = torch.argsort(key_N, stable=True)
    counts_E = torch.zeros(num_experts + 1, dtype=torch.int64, device=key_N.device)
    counts_E.scatter_add_(0, key_N, torch.ones_like(key_N))
    counts_E = counts_E[:num_experts].contiguous()
    recv_counts_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_E, counts_E, group=group)
    recv_counts_RL = recv_counts_E.view(world, local)
    send_splits = counts_E.view(world, local).sum(1).tolist()
    recv_splits = recv_counts_RL.sum(1).tolist()
    num_valid = sum(send_splits)
    slot_perm_n = perm_N[:num_valid]
    slot_src_S = torch.full_like(perm_N, num_valid).scatter_(
        0, slot_perm_n, torch.arange(num_valid, device=perm_N.device)
    )
    seg_m = torch.repeat_interleave(
        torch.arange(world * local, device=key_N.device), recv_counts_RL.reshape(-1)
    )
    recv_perm_m = torch.argsort((seg_m % local) * world + seg_m // local, stable=True)
    return _ChunkLayout(
        token_start=token_start,
        num_tokens=num_tokens,
        slot_n=slot_perm_n + token_start * top_k,
        token_n=slot_perm_n // max(top_k, 1) + token_start,
        slot_src_S=slot_src_S,
        has_dropped=num_valid < num_tokens * top_k,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_perm_m=recv_perm_m,
        recv_inv_m=_inverse(recv_perm_m),
        counts_L=recv_counts_RL.sum(0),
    )


def _merge_and_pad(chunks: list[_ChunkLayout], align: int, device: torch.device):
    """Expert-major order across chunks (stable: chunk order within an expert) and alignment padding."""
    local = chunks[0].counts_L.shape[0]
    arange_L = torch.arange(local, device=device)
    counts_L = torch.stack([c.counts_L for c in chunks]).sum(0)
    merge_perm_M = merge_inv_M = None
    if len(chunks) > 1:
        ids_M = torch.cat([torch.repeat_interleave(arange_L, c.counts_L) for c in chunks])
        merge_perm_M = torch.argsort(ids_M, stable=True)
        merge_inv_M = _inverse(merge_perm_M)
    ids_M = torch.repeat_interleave(arange_L, counts_L)
    if align == 1:
        return counts_L, (merge_perm_M, merge_inv_M), counts_L, None, ids_M
    padded_L = (counts_L + align - 1) // align * align
    start_L = torch.cumsum(counts_L, 0) - counts_L
    padded_start_L = torch.cumsum(padded_L, 0) - padded_L
    dest_M = padded_start_L[ids_M] + torch.arange(ids_M.shape[0], device=device) - start_L[ids_M]
    layout_P = torch.full((int(padded_L.sum()),), -1, dtype=torch.int64, device=device)
    layout_P[dest_M] = ids_M
    return counts_L, (merge_perm_M, merge_inv_M), padded_L, dest_M, layout_P


# ------------------------------------------------------------------------------------------ data movement


def _exchange(rows: Tensor, in_splits: list[int], out_splits: list[int], group) -> Tensor:
    """``all_to_all_single`` of rows with uneven splits; float8 travels as uint8 (gloo has no float8)."""
    rows = rows.contiguous()
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    send, recv = rows, out
    if rows.dtype in _FLOAT8_DTYPES:
        send, recv = rows.view(torch.uint8), out.view(torch.uint8)
    dist.all_to_all_single(
        recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return out


def _to_experts(rows_per_chunk: list[Tensor], h: DispatchHandle) -> Tensor:
    """Per-chunk sorted slot rows ``[n_c, D]`` -> rows for the local experts ``[P, D]``."""
    expert_major = []
    for chunk, rows in zip(h.chunks, rows_per_chunk, strict=True):
        recv = _exchange(rows, chunk.send_splits, chunk.recv_splits, h.group)
        expert_major.append(recv.index_select(0, chunk.recv_perm_m))
    out = expert_major[0] if len(expert_major) == 1 else torch.cat(expert_major)
    if h.merge_perm_M is not None:
        out = out.index_select(0, h.merge_perm_M)
    if h.dest_M is not None:
        out = out.new_zeros((h.num_recv_rows, out.shape[1])).index_copy(0, h.dest_M, out)
    return out


def _from_experts(y_PD: Tensor, h: DispatchHandle) -> list[Tensor]:
    """Rows of the local experts ``[P, D]`` -> per-chunk sorted slot rows ``[n_c, D]`` back on their owners."""
    y = y_PD.contiguous()
    if h.dest_M is not None:
        y = y.index_select(0, h.dest_M)
    if h.merge_inv_M is not None:
        y = y.index_select(0, h.merge_inv_M)
    sizes = [sum(c.recv_splits) for c in h.chunks]
    out = []
    for chunk, y_c in zip(h.chunks, torch.split(y, sizes), strict=True):
        rank_major = y_c.index_select(0, chunk.recv_inv_m)
        out.append(_exchange(rank_major, chunk.recv_splits, chunk.send_splits, h.group))
    return out


def _slots_to_TKD(rows_per_chunk: list[Tensor], h: DispatchHandle) -> Tensor:
    """Per-chunk sorted slot rows -> ``[T, K, D]`` in slot order, zeros on slots with expert id -1."""
    parts = []
    for chunk, rows in zip(h.chunks, rows_per_chunk, strict=True):
        if chunk.has_dropped:
            rows = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
        parts.append(rows.index_select(0, chunk.slot_src_S))
    dense = parts[0] if len(parts) == 1 else torch.cat(parts)
    return dense.view(h.num_tokens, h.top_k, dense.shape[1])


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, h: DispatchHandle) -> Tensor:  # type: ignore[override]
        ctx.handle = h
        rows = [x_TD.index_select(0, c.token_n) for c in h.chunks]
        return _to_experts(rows, h)

    @staticmethod
    def backward(ctx, grad_PD: Tensor):  # type: ignore[override]
        h: DispatchHandle = ctx.handle
        return _slots_to_TKD(_from_experts(grad_PD, h), h).sum(dim=1), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_PD: Tensor, h: DispatchHandle) -> Tensor:  # type: ignore[override]
        ctx.handle = h
        return _slots_to_TKD(_from_experts(y_PD, h), h)

    @staticmethod
    def backward(ctx, grad_TKD: Tensor):  # type: ignore[override]
        h: DispatchHandle = ctx.handle
        grad_ND = grad_TKD.reshape(h.num_tokens * h.top_k, grad_TKD.shape[2])
        rows = [grad_ND.index_select(0, c.slot_n) for c in h.chunks]
        return _to_experts(rows, h), None


# ------------------------------------------------------------------------------------------------ public


def _check_backend(backend: str) -> None:
    if backend == "torch":
        return
    if backend == "deep_ep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as err:
            raise ImportError(_DEEP_EP_INSTALL) from err
        raise NotImplementedError(
            "backend='deep_ep': deep_ep is importable but moe_rl's DeepEP dispatcher is not implemented yet; "
            "use backend='torch'"
        )
    raise ValueError(f"backend={backend!r} is not supported; use 'torch' or 'deep_ep'")


def dispatch(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    backend: EPBackend = "torch",
    align: int = 1,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, DispatchHandle]:
    """Send every token-slot to the rank that owns its expert (DeepEP normal-mode ``dispatch`` semantics).

    Collective: every rank of ``group`` must call it, with the same ``num_experts``, D and ``chunk_size``.

    Args:
        x_TD: ``[T, D]`` tokens on this rank, any dtype gloo/NCCL can move (float8 is sent as uint8); T may be 0.
        topk_ids_TK: ``[T, K]`` integer expert ids in ``[0, E)``; -1 marks a slot that goes nowhere.
        topk_weights_TK: ``[T, K]`` gate weights (any float dtype; applied in fp32 by :func:`combine`). Kept
            in the handle; gradients reach it through :func:`combine`.
        group: the expert-parallel process group (``None`` = default group). Rank r owns experts
            ``[r * L, (r + 1) * L)``.
        num_experts: E, a multiple of the group size.
        backend: ``"torch"`` (``all_to_all_single``, works on gloo and NCCL) or ``"deep_ep"`` (needs DeepEP;
            raises ImportError with install instructions when it is missing; never falls back silently).
        align: pad each local expert's rows to a multiple of ``align`` with zero rows (128 = DeepGEMM
            contiguous grouped layout); ``handle.layout_P`` then marks padding with -1.
        chunk_size: if set, exchange tokens in chunks of this many tokens; all ranks run the same number of
            chunks, ``max over ranks of ceil(T / chunk_size)``.

    Returns:
        ``(recv_x_PD, recv_counts_L, handle)``: ``recv_x_PD`` ``[P, D]`` in ``x_TD``'s dtype, expert-major
        (all rows of local expert 0, then 1, ...), ``recv_counts_L`` ``[L]`` int64 rows per local expert
        (padded counts when ``align > 1``, as DeepEP's ``num_recv_tokens_per_expert_list``), and the
        :class:`DispatchHandle` for :func:`combine`. Differentiable w.r.t. ``x_TD``.

    Raises:
        ValueError: on every rank, before any token moves, if the ranks disagree on ``num_experts``, D or
            ``chunk_size``, if E is not a multiple of the group size, or if any rank passes bad shapes or
            ids out of range. The message names the values.
        ImportError: ``backend="deep_ep"`` without DeepEP installed.
    """
    _check_backend(backend)
    num_chunks = _validate_and_count_chunks(
        x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, chunk_size
    )
    world = dist.get_world_size(group)
    num_tokens, top_k = topk_ids_TK.shape
    step = num_tokens if chunk_size is None else chunk_size
    chunks = []
    for i in range(num_chunks):
        start, stop = min(i * step, num_tokens), min((i + 1) * step, num_tokens)
        chunks.append(_chunk_layout(topk_ids_TK[start:stop], start, num_experts, world, group))
    counts_L, (merge_perm_M, merge_inv_M), padded_L, dest_M, layout_P = _merge_and_pad(
        chunks, align, x_TD.device
    )
    handle = DispatchHandle(
        group=group,
        rank=dist.get_rank(group),
        world_size=world,
        num_experts=num_experts,
        num_tokens=num_tokens,
        top_k=top_k,
        hidden=x_TD.shape[1],
        chunks=tuple(chunks),
        merge_perm_M=merge_perm_M,
        merge_inv_M=merge_inv_M,
        counts_L=counts_L,
        align=align,
        padded_counts_L=padded_L,
        dest_M=dest_M,
        layout_P=layout_P,
        topk_weights_TK=topk_weights_TK,
    )
    return _Dispatch.apply(x_TD, handle), padded_L, handle


def combine(y_PD: Tensor, handle: DispatchHandle) -> Tensor:
    """Return expert outputs to the tokens' ranks and sum them with the gate weights (fp32).

    Collective: every rank of the handle's group must call it.

    Args:
        y_PD: ``[P, D]`` outputs of the local experts, rows in the order :func:`dispatch` returned (padding rows
            are ignored).
        handle: the :class:`DispatchHandle` from :func:`dispatch`.

    Autograd caveat (public bug case B04): the backward of combine and of dispatch are collectives too, so on
    every rank ``y_PD`` must be computed from the dispatched rows inside the autograd graph, even when this rank
    received no rows (run the experts on the empty tensor, as :func:`moe_rl.moe.ep_moe.local_experts_forward`
    does; do not replace the output by a fresh ``zeros`` tensor), or the other ranks wait forever in backward.

    Returns:
        ``[T, D]`` in ``y_PD``'s dtype: ``sum_k topk_weights_TK[t, k] * y[slot (t, k)]`` computed in fp32, slots
        with id -1 contribute nothing. Differentiable w.r.t. ``y_PD`` and ``topk_weights_TK``.
    """
    if y_PD.dim() != 2 or y_PD.shape[0] != handle.num_recv_rows:
        raise ValueError(
            f"combine expects y of shape [P={handle.num_recv_rows}, D] (the rows dispatch returned), "
            f"got {tuple(y_PD.shape)}"
        )
    y_TKD = _Combine.apply(y_PD, handle)
    return torch.einsum("tkd,tk->td", y_TKD.float(), handle.topk_weights_TK.float()).to(y_PD.dtype)
