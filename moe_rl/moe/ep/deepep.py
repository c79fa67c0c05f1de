"""The ``"deep_ep"`` backend of :func:`moe_rl.moe.ep.dispatch` / :func:`moe_rl.moe.ep.combine`: DeepEP's current
(V2, ``deep_ep.ElasticBuffer``) normal-mode kernels, on a communication buffer the caller owns.

Shape legend:
    T  tokens on this rank            D  hidden size
    K  experts per token (top_k)      E  routed experts, expert e on rank ``e // L``
    R  ranks in the EP group          L  local experts per rank, ``E / R``
    N  tokens this rank receives (each token at most once per rank, whatever number of its K experts live here)
    P  rows handed to the local experts, expert-major, each expert's segment padded to ``align``
    G  FP8 scale groups per row, ``ceil(D / 128)``

DeepEP >= 2.0 (github.com/deepseek-ai/DeepEP, ``deep_ep/buffers/elastic.py``; semantics as its
``tests/elastic/test_ep.py`` and ``deep_ep/utils/refs.py`` check them) moves each token **once per destination
rank**, not once per token-slot as the ``torch`` backend does. This adapter uses the non-expanded layout::

    dispatch:  ElasticBuffer.dispatch(x, topk_idx=ids [T, K] int64, topk_weights=w [T, K] fp32, num_experts=E,
                   expert_alignment=align) -> recv_x [N, D] (or the FP8 pair), recv_topk_idx [N, K] (LOCAL expert
                   ids, -1 where that slot's expert lives on another rank), recv_topk_weights [N, K] (unspecified
                   at -1 slots: masked to 0 here), EPHandle, event
               local: slots with a local id, stable-sorted by expert, gathered into recv_x_PD [P, D]
    combine:   local: y_PD -> dense [N, K, D] (zero rows at -1 slots), weighted by the received gate weights in
                   fp32 (a [N, 1, K] @ [N, K, D] bmm, deterministic) -> [N, D] partial sums per received token
               ElasticBuffer.combine(partial, handle) -> [T, D]: an UNWEIGHTED sum over the ranks that held the token

So, unlike the ``torch`` backend (which weights at the source, after the return trip), the gate weights are
applied on the expert's rank, before DeepEP's combine: the same sum, rounded once more (each rank's partial sum
is cast to ``y``'s dtype before it travels; DeepEP then accumulates in fp32).

Autograd (DeepEP's documented pairing): the backward of ``dispatch`` is ``combine`` of the gradient with the same
``EPHandle`` and ``topk_weights=`` the gradient of the received gate weights (DeepEP returns each slot's weight
from the rank that owns its expert; the gradient is zero elsewhere); the backward of ``combine`` is a cached
``dispatch(grad, handle=EPHandle)``. Gradients reach ``x_TD``, the expert outputs and ``topk_weights_TK``.

Row order: DeepEP delivers received tokens in arbitrary order unless the buffer is ``deterministic`` (then sorted
by source rank, then source token, the ``torch`` backend's order); :func:`make_deepep_buffer` makes deterministic
buffers by default. Nothing here depends on the order: combine always goes through the handle.

FP8 (``fp8=True``): ``x_TD`` is quantized 1x128 per token (:func:`moe_rl.fp8.quant.quantize_1x128`, fp32 scales)
and DeepEP moves the ``(codes [T, D] e4m3, scales [T, G] fp32)`` pair, as DeepSeek-V3 trains; backward is the
straight-through estimator. ``combine(..., fp8_backward=True)`` sends combine's backward (a cached dispatch of the
gradient) as FP8 the same way.

The buffer: one ``deep_ep.ElasticBuffer`` per EP group, created by the caller with :func:`make_deepep_buffer`
(sized with ``ElasticBuffer.get_buffer_size_hint``) and passed to every dispatch (``dispatch(..., buffer=buf)``,
or held by :class:`moe_rl.moe.ep.ExpertParallelMoE`); the handle keeps a reference for combine and the backward
passes. This module keeps no buffer, cache or other global state.

Requirements of real DeepEP (checked by DeepEP itself, not emulated here): CUDA tensors, ``x`` in bf16 (or the FP8
pair), D a multiple of 128 for FP8, at most ``num_max_tokens_per_rank`` tokens per rank (checked here, on every
rank). Before the first token moves, the same cross-rank validation as the ``torch`` backend runs (one small
``all_gather``), so bad input raises on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.moe.ep._checks import (
    FLOAT8_DTYPES,
    agree_finite,
    check_reuse,
    fp8_problem,
    import_deep_ep,
    validate_and_count,
)

__all__ = ["DeepEPHandle", "deepep_combine", "deepep_dispatch", "make_deepep_buffer"]

_SIZE_KWARGS = ("allow_hybrid_mode", "allow_multiple_reduction")
"""``ElasticBuffer`` options that also change ``get_buffer_size_hint``: passed to both."""


def make_deepep_buffer(
    group: dist.ProcessGroup | None,
    *,
    hidden: int,
    top_k: int,
    max_tokens_per_rank: int,
    fp8_dispatch: bool = False,
    deterministic: bool = True,
    **buffer_kwargs: Any,
) -> Any:
    """Create the ``deep_ep.ElasticBuffer`` the ``"deep_ep"`` backend communicates through; the caller owns it.

    Collective: every rank of ``group`` must call it (DeepEP sets up its NCCL communicator and ends with a
    barrier). Make one buffer per EP group, pass it to every :func:`moe_rl.moe.ep.dispatch` with
    ``backend="deep_ep"`` (or to :class:`moe_rl.moe.ep.ExpertParallelMoE`), and keep it alive as long as those
    dispatches' handles; it is sized once, here, with DeepEP's own hint::

        num_bytes = ElasticBuffer.get_buffer_size_hint(group, max_tokens_per_rank, hidden, num_topk=top_k,
                                                       use_fp8_dispatch=fp8_dispatch)
        ElasticBuffer(group, num_bytes=num_bytes, num_max_tokens_per_rank=max_tokens_per_rank, hidden=hidden,
                      num_topk=top_k, use_fp8_dispatch=fp8_dispatch, deterministic=deterministic, ...)

    Args:
        group: the EP process group (``None`` = the default group).
        hidden: D, the largest hidden size dispatched through the buffer.
        top_k: K.
        max_tokens_per_rank: the most tokens any rank dispatches in one call (DeepEP ``num_max_tokens_per_rank``,
            the same on every rank); a dispatch with more raises ValueError on every rank.
        fp8_dispatch: size for FP8 dispatch payloads only (smaller); leave ``False`` when any dispatch sends
            bf16 (``dispatch(..., fp8=False)``).
        deterministic: DeepEP's deterministic mode (received tokens sorted by source rank and token, so every
            run gives the same rows in the same order: the ``torch`` backend's order). ``False`` skips that sort.
        **buffer_kwargs: further ``ElasticBuffer`` options (``allow_hybrid_mode``, ``allow_multiple_reduction``,
            ``prefer_overlap_with_compute``, ``num_allocated_qps``, timeouts, ...); the two that change the size
            (``allow_hybrid_mode``, ``allow_multiple_reduction``) also go to the size hint.

    Returns:
        The ``deep_ep.ElasticBuffer``.

    Raises:
        ValueError: ``hidden``, ``top_k`` or ``max_tokens_per_rank`` is not a positive integer, or
            ``buffer_kwargs`` sets ``num_bytes`` (the size comes from the hint).
        ImportError: DeepEP is missing or V1-only (the message says what to install).
    """
    for name, value in (("hidden", hidden), ("top_k", top_k), ("max_tokens_per_rank", max_tokens_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_deepep_buffer: {name}={value!r} must be a positive int")
    if "num_bytes" in buffer_kwargs:
        raise ValueError(
            "make_deepep_buffer: do not pass num_bytes; the size comes from ElasticBuffer.get_buffer_size_hint "
            "(raise hidden / top_k / max_tokens_per_rank instead)"
        )
    deep_ep = import_deep_ep()
    group = group if group is not None else dist.group.WORLD
    size_kwargs = {k: buffer_kwargs[k] for k in _SIZE_KWARGS if k in buffer_kwargs}
    num_bytes = deep_ep.ElasticBuffer.get_buffer_size_hint(
        group, max_tokens_per_rank, hidden, num_topk=top_k, use_fp8_dispatch=fp8_dispatch, **size_kwargs
    )
    return deep_ep.ElasticBuffer(
        group,
        num_bytes=num_bytes,
        num_max_tokens_per_rank=max_tokens_per_rank,
        hidden=hidden,
        num_topk=top_k,
        use_fp8_dispatch=fp8_dispatch,
        deterministic=deterministic,
        **buffer_kwargs,
    )


@dataclass(slots=True)
class DeepEPHandle:
    """What :func:`moe_rl.moe.ep.combine`, the backward passes and a reused dispatch need (``"deep_ep"``)."""

    group: dist.ProcessGroup | None
    buffer: Any
    """The caller's ``deep_ep.ElasticBuffer``."""
    ep_handle: Any
    """DeepEP's ``EPHandle`` (routing metadata), set by the forward of the first dispatch of this layout."""
    num_experts: int
    world_size: int
    num_tokens: int
    top_k: int
    hidden: int
    align: int
    num_recv_tokens: int
    """N (-1 until the first dispatch of this layout ran)."""
    counts_L: Tensor
    """``[L]`` int64 slots received per local expert (unpadded)."""
    padded_counts_L: Tensor
    """``[L]`` int64 segment sizes after padding to ``align`` (DeepEP's ``num_recv_tokens_per_expert_list``)."""
    num_recv_rows: int
    """P."""
    layout_P: Tensor
    """``[P]`` int64 local expert id of each row handed to the experts, -1 on padding rows (DeepGEMM's
    ``m_indices`` for the contiguous grouped layout)."""
    src_P: Tensor
    """``[P]`` int64 received token (row of ``recv_x``, N = the zero row) at each position of the layout."""
    slot_to_P: Tensor
    """``[N * K]`` int64 row of the ``[P, D]`` layout holding each received slot (P = the zero row for -1)."""
    recv_idx_NK: Tensor | None = None
    """``[N, K]`` int64 local expert id of each received slot, -1 where the expert lives on another rank."""
    recv_topk_weights_NK: Tensor | None = None
    """``[N, K]`` fp32 gate weights received by the latest dispatch (0 at -1 slots), in the autograd graph."""
    recv_fp8: tuple[Tensor, Tensor] | None = None
    """``(codes [N, D] e4m3, scales [N, G] fp32)`` received by the latest FP8 dispatch."""
    topk_ids_TK: Tensor | None = None
    topk_weights_TK: Tensor | None = None

    @property
    def num_local_experts(self) -> int:
        """L."""
        return self.num_experts // self.world_size


def _local_layout(recv_idx_NK: Tensor, local: int, align: int):
    """Expert-major layout of the received slots: counts, padded counts, P, layout_P, src_P, slot_to_P."""
    n_tok, top_k = recv_idx_NK.shape
    flat = recv_idx_NK.reshape(-1).to(torch.int64)
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, local))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=local + 1)[:local]
    padded = (counts + align - 1) // align * align
    n_valid = int(counts.sum())
    num_rows = int(padded.sum())
    slots = order[:n_valid]
    e_sorted = flat[slots]
    start_pad = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    pos = start_pad[e_sorted] + torch.arange(n_valid, device=flat.device) - start[e_sorted]
    layout_P = torch.full((num_rows,), -1, dtype=torch.int64, device=flat.device)
    layout_P[pos] = e_sorted
    src_P = torch.full((num_rows,), n_tok, dtype=torch.int64, device=flat.device)
    src_P[pos] = torch.div(slots, top_k, rounding_mode="floor")
    slot_to_P = torch.full((n_tok * top_k,), num_rows, dtype=torch.int64, device=flat.device)
    slot_to_P[slots] = pos
    return counts, padded, num_rows, layout_P, src_P, slot_to_P


def _with_zero_row(x: Tensor) -> Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _quantize(x_TD: Tensor) -> tuple[Tensor, Tensor]:
    from moe_rl.fp8.quant import quantize_1x128

    return quantize_1x128(x_TD)


def _dequantize(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    from moe_rl.fp8.quant import dequantize

    return dequantize(codes, scales, (1, 128), out_dtype=dtype)


def _rows(recv: Tensor | tuple[Tensor, Tensor], n: int) -> Tensor | tuple[Tensor, Tensor]:
    """The first N rows of a (cached) dispatch's output: without a CPU sync DeepEP may allocate more."""
    if isinstance(recv, tuple):
        return recv[0][:n], recv[1][:n]
    return recv[:n]


def _cached(h: DeepEPHandle) -> dict[str, Any]:
    """Keyword arguments of a cached ``ElasticBuffer.dispatch``: the handle, and the SM count and E its first
    dispatch used (DeepEP derives a default SM count from ``num_experts`` before it reads the handle, so a cached
    call without either fails)."""
    return {"handle": h.ep_handle, "num_experts": h.num_experts, "num_sms": h.ep_handle.num_sms}


class _Dispatch(torch.autograd.Function):
    """``ElasticBuffer.dispatch`` of tokens and gate weights; backward = ``ElasticBuffer.combine`` of both."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, w_TK: Tensor, ids_TK: Tensor, h: DeepEPHandle, fp8: bool):  # type: ignore[override]
        payload = _quantize(x_TD) if fp8 else x_TD
        if h.ep_handle is None:  # a new layout: DeepEP computes it (one CPU sync for the exact N)
            recv_x, recv_idx, recv_w, ep_handle, _event = h.buffer.dispatch(
                payload,
                topk_idx=ids_TK,
                topk_weights=w_TK.float().contiguous(),
                num_experts=h.num_experts,
                expert_alignment=h.align,
            )
            h.ep_handle = ep_handle
            h.recv_idx_NK = recv_idx.to(torch.int64)
            h.num_recv_tokens = h.recv_idx_NK.shape[0]
        else:  # cached: the layout of the handle, new gate weights
            recv_x, _, recv_w, _, _event = h.buffer.dispatch(
                payload, topk_weights=w_TK.float().contiguous(), **_cached(h)
            )
            recv_x, recv_w = _rows(recv_x, h.num_recv_tokens), recv_w[: h.num_recv_tokens]
        if fp8:
            h.recv_fp8 = (recv_x[0], recv_x[1])
            recv_x = _dequantize(recv_x[0], recv_x[1], x_TD.dtype)
        ctx.h, ctx.w_dtype = h, w_TK.dtype
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_x_ND: Tensor, grad_w_NK: Tensor):  # type: ignore[override]
        h: DeepEPHandle = ctx.h
        grad_x, grad_w, _event = h.buffer.combine(
            grad_x_ND.contiguous(), handle=h.ep_handle, topk_weights=grad_w_NK.float().contiguous()
        )
        return grad_x, grad_w.to(ctx.w_dtype), None, None, None


class _Combine(torch.autograd.Function):
    """``ElasticBuffer.combine`` (unweighted sum over ranks); backward = cached ``dispatch`` of the gradient."""

    @staticmethod
    def forward(ctx, y_ND: Tensor, h: DeepEPHandle, fp8_backward: bool) -> Tensor:  # type: ignore[override]
        out, _, _event = h.buffer.combine(y_ND.contiguous(), handle=h.ep_handle)
        ctx.h, ctx.fp8_backward, ctx.dtype = h, fp8_backward, y_ND.dtype
        return out

    @staticmethod
    def backward(ctx, grad_TD: Tensor):  # type: ignore[override]
        h: DeepEPHandle = ctx.h
        grad_TD = grad_TD.contiguous()
        if ctx.fp8_backward:
            agree_finite(grad_TD, h.group, "combine(fp8_backward=True): the gradient of combine's output")
            recv = _rows(h.buffer.dispatch(_quantize(grad_TD), **_cached(h))[0], h.num_recv_tokens)
            grad_ND = _dequantize(recv[0], recv[1], grad_TD.dtype)
        else:
            grad_ND = _rows(h.buffer.dispatch(grad_TD, **_cached(h))[0], h.num_recv_tokens)
        return grad_ND.to(ctx.dtype), None, None


def _check_buffer(buffer: Any, group: dist.ProcessGroup | None) -> None:
    """Rank-local checks of the caller's buffer (the same on every rank, so a raise here is everywhere)."""
    if buffer is None:
        raise ValueError(
            "dispatch(backend='deep_ep') needs buffer=: the caller owns DeepEP's communication buffer; create it "
            "once per EP group with moe_rl.moe.ep.make_deepep_buffer(group, hidden=D, top_k=K, "
            "max_tokens_per_rank=T_max) and pass it to every dispatch"
        )
    if not hasattr(buffer, "dispatch") or not hasattr(buffer, "num_max_tokens_per_rank"):
        raise TypeError(
            f"buffer is a {type(buffer).__name__}, not a deep_ep.ElasticBuffer; create it with "
            "moe_rl.moe.ep.make_deepep_buffer"
        )
    want = group if group is not None else dist.group.WORLD
    if buffer.group is not want:
        raise ValueError(
            "dispatch(backend='deep_ep'): the buffer was made for another process group than group=; make the "
            "buffer with the EP group that dispatch runs on"
        )
    if buffer.num_max_tokens_per_rank < 1:
        raise ValueError(
            f"the deep_ep.ElasticBuffer has num_max_tokens_per_rank={buffer.num_max_tokens_per_rank}; create it "
            "with moe_rl.moe.ep.make_deepep_buffer(..., max_tokens_per_rank=...)"
        )


def deepep_dispatch(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None,
    *,
    buffer: Any,
    num_experts: int,
    align: int = 1,
    handle: DeepEPHandle | None = None,
    fp8: bool = False,
    fp8_output: str = "dequant",
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor, DeepEPHandle]:
    """DeepEP normal-mode dispatch; same contract as :func:`moe_rl.moe.ep.dispatch` (call that, with
    ``backend="deep_ep", buffer=...``, rather than this function).

    Returns:
        ``(recv_x_PD [P, D], padded_counts_L [L] int64, DeepEPHandle)``; with ``fp8_output="codes"`` the first item
        is ``(codes_PD e4m3, scales_PG fp32)`` (not differentiable).

    Raises:
        ValueError: on every rank before any token moves for the inputs :func:`moe_rl.moe.ep.dispatch` rejects and
            for more tokens than the buffer's ``num_max_tokens_per_rank``; on this rank, a missing buffer, one made
            for another group, or (``handle=``) shapes, arguments or a buffer that differ from the handle's, or a
            handle of the ``torch`` backend.
        TypeError: ``buffer`` is not a ``deep_ep.ElasticBuffer``.
        ImportError: DeepEP is missing or V1-only.
    """
    _check_buffer(buffer, group)
    if handle is not None:
        if not isinstance(handle, DeepEPHandle):
            raise ValueError(
                f"dispatch(backend='deep_ep', handle=...) got a {type(handle).__name__} from the 'torch' backend; "
                "reuse a handle only with the backend that built it"
            )
        check_reuse(handle, x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, None)
        if handle.buffer is not buffer:
            raise ValueError(
                "dispatch(backend='deep_ep', handle=...): buffer= is not the buffer the handle was built with; "
                "reuse a handle only with its own buffer"
            )
        if fp8:
            if not x_TD.dtype.is_floating_point or x_TD.dtype in FLOAT8_DTYPES:
                raise ValueError(f"dispatch(handle=...): {fp8_problem(x_TD)}")
            agree_finite(x_TD, group, "dispatch(handle=..., fp8=True): x_TD")
        h = replace(handle, topk_ids_TK=topk_ids_TK, topk_weights_TK=topk_weights_TK)
    else:
        max_tok = buffer.num_max_tokens_per_rank
        too_many = None
        if x_TD.dim() == 2 and x_TD.shape[0] > max_tok:
            too_many = (
                f"x_TD has T={x_TD.shape[0]} tokens but the DeepEP buffer holds at most "
                f"num_max_tokens_per_rank={max_tok} per rank; make the buffer with a larger max_tokens_per_rank "
                "(make_deepep_buffer) or dispatch fewer tokens per call"
            )
        validate_and_count(
            x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, None, fp8, extra_problem=too_many
        )
        h = DeepEPHandle(
            group=group,
            buffer=buffer,
            ep_handle=None,
            num_experts=num_experts,
            world_size=dist.get_world_size(group),
            num_tokens=x_TD.shape[0],
            top_k=topk_ids_TK.shape[1],
            hidden=x_TD.shape[1],
            align=align,
            num_recv_tokens=-1,
            counts_L=torch.empty(0, dtype=torch.int64),
            padded_counts_L=torch.empty(0, dtype=torch.int64),
            num_recv_rows=-1,
            layout_P=torch.empty(0, dtype=torch.int64),
            src_P=torch.empty(0, dtype=torch.int64),
            slot_to_P=torch.empty(0, dtype=torch.int64),
            topk_ids_TK=topk_ids_TK,
            topk_weights_TK=topk_weights_TK,
        )
    ids_TK = topk_ids_TK.to(
        import_deep_ep().topk_idx_t
    ).contiguous()  # DeepEP's index dtype (int64 by default)
    recv_x_ND, recv_w_NK = _Dispatch.apply(x_TD, topk_weights_TK, ids_TK, h, fp8)
    if h.num_recv_rows < 0:  # new layout: the local expert-major permutation, computed once per handle
        counts, padded, rows, layout_P, src_P, slot_to_P = _local_layout(
            h.recv_idx_NK, h.num_local_experts, align
        )
        h.counts_L, h.padded_counts_L, h.num_recv_rows = counts, padded, rows
        h.layout_P, h.src_P, h.slot_to_P = layout_P, src_P, slot_to_P
    # DeepEP leaves the weights of slots whose expert lives elsewhere unspecified: zero them (and their gradient)
    h.recv_topk_weights_NK = torch.where(
        h.recv_idx_NK >= 0, recv_w_NK, torch.zeros((), dtype=recv_w_NK.dtype)
    )
    if fp8 and fp8_output == "codes":
        codes, scales = h.recv_fp8
        codes_PD = _with_zero_row(codes.view(torch.uint8))[h.src_P].view(codes.dtype)
        return (codes_PD, _with_zero_row(scales)[h.src_P]), h.padded_counts_L, h
    recv_x_PD = _with_zero_row(recv_x_ND)[h.src_P]
    return recv_x_PD, h.padded_counts_L, h


def deepep_combine(y_PD: Tensor, handle: DeepEPHandle, *, fp8_backward: bool = False) -> Tensor:
    """Weight each received slot's expert output by its gate (fp32), sum per received token, then DeepEP
    ``ElasticBuffer.combine`` (unweighted sum over ranks). Same contract as :func:`moe_rl.moe.ep.combine`.

    Returns:
        ``[T, D]`` in ``y_PD``'s dtype.

    Raises:
        ValueError: ``y_PD`` is not ``[P, D]``.
    """
    h = handle
    if y_PD.dim() != 2 or y_PD.shape[0] != h.num_recv_rows:
        raise ValueError(
            f"combine expects y of shape [P={h.num_recv_rows}, D] (the rows dispatch returned), got {tuple(y_PD.shape)}"
        )
    n_tok, top_k = h.num_recv_tokens, h.top_k
    y_NKD = _with_zero_row(y_PD)[h.slot_to_P].view(n_tok, top_k, y_PD.shape[1])
    w_N1K = h.recv_topk_weights_NK.float().unsqueeze(1)
    partial_ND = torch.bmm(w_N1K, y_NKD.float()).squeeze(1).to(y_PD.dtype)
    return _Combine.apply(partial_ND, h, fp8_backward)
