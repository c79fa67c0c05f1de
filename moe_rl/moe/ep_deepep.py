"""DeepEP normal-mode backend of :func:`moe_rl.moe.ep.dispatch` / :func:`moe_rl.moe.ep.combine`.

Shape legend:
    T  tokens on this rank            D  hidden size
    K  experts per token (top_k)      E  routed experts, expert e on rank ``e // L``
    R  ranks in the EP group          L  local experts per rank, ``E / R``
    N  tokens this rank receives (each token at most once per rank, whatever number of its K experts live here)
    P  rows handed to the local experts, expert-major, each expert's segment padded to ``align``

DeepEP (github.com/deepseek-ai/DeepEP, V1 ``deep_ep.Buffer``; semantics read from its ``tests/test_intranode.py``
and ``docs/legacy.md``) moves each token **once per destination
rank**, not once per token-slot as the ``torch`` backend does::

    dispatch:  get_dispatch_layout(topk_ids, E) -> per-rank / per-expert counts, is_token_in_rank [T, R]
               Buffer.dispatch(x, topk_idx, topk_weights, ...) -> recv_x [N, D] (source-rank-major, token order),
                   recv_topk_idx [N, K] (LOCAL expert ids, -1 where that slot's expert is on another rank),
                   recv_topk_weights [N, K] (0 at -1 slots), handle
               local: slots with a local id, stable-sorted by expert, gathered into recv_x_PD [P, D]
    combine:   local: y_PD -> dense [N, K, D] (zero rows at -1 slots), weighted by recv_topk_weights in fp32
                   (a [N, 1, K] @ [N, K, D] bmm, deterministic) -> [N, D] partial sums per token
               Buffer.combine(partial, handle) -> [T, D]: an UNWEIGHTED sum over the ranks that held the token

So, unlike the ``torch`` backend (which weights at the source, after the return trip), the gate weights are
applied on the expert's rank, before DeepEP's combine: the same sum, rounded once more (each rank's partial sum
is cast to ``y``'s dtype before it travels; DeepEP then accumulates in fp32).

Autograd (DeepEP's documented pairing): backward of ``Buffer.dispatch`` is ``Buffer.combine`` of the gradient
with the same handle, including ``topk_weights`` (the gradient of the received gate weights is summed back to
its source slot, each slot having one owner); backward of ``Buffer.combine`` is a cached ``Buffer.dispatch``
(``handle=``) of the gradient. Gradients reach ``x_TD``, the expert outputs and ``topk_weights_TK``.

FP8 (``fp8=True``): ``x_TD`` is quantized 1x128 per token (:func:`moe_rl.fp8.quant.quantize_1x128`, fp32 scales)
and DeepEP moves the ``(codes [T, D] e4m3, scales [T, D/128] fp32)`` pair, as DeepSeek-V3 trains; backward is
the straight-through estimator. ``combine(..., fp8_backward=True)`` dispatches the gradient as FP8 the same way.

Requirements of real DeepEP (checked by DeepEP itself, not emulated here): CUDA tensors, ``x`` in bf16 (or the FP8
pair), D a multiple of 128 for FP8, int64 ``topk_idx`` and fp32 ``topk_weights``. ``chunk_size`` is not used with
this backend (DeepEP pipelines internally; pass ``chunk_size=None``). Before the first token moves, the same
cross-rank validation as the ``torch`` backend runs (one small ``all_gather``), so bad input raises on every rank.

The communication buffer is created once per process group and grown when a larger hidden size needs more
bytes (DeepEP README's ``get_buffer`` pattern: the size hints of ``Buffer.get_dispatch_config(R)`` and
``Buffer.get_combine_config(R)``); :func:`set_num_sms` forwards to ``Buffer.set_num_sms``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DeepEPHandle", "deepep_combine", "deepep_dispatch", "get_buffer", "set_num_sms"]

_BUFFERS: dict[Any, Any] = {}


def _deep_ep():
    from moe_rl.moe.ep import _DEEP_EP_INSTALL

    try:
        import deep_ep
    except ImportError as err:
        raise ImportError(_DEEP_EP_INSTALL) from err
    return deep_ep


def set_num_sms(num_sms: int) -> None:
    """SMs DeepEP's normal-mode kernels use (``deep_ep.Buffer.set_num_sms``; DeepEP's default is 20).

    Raises:
        ValueError: ``num_sms`` is not a positive even number (DeepEP runs channel pairs).
        ImportError: DeepEP is not installed.
    """
    if num_sms < 2 or num_sms % 2:
        raise ValueError(f"num_sms={num_sms} must be a positive even number (DeepEP uses 2 SMs per channel)")
    _deep_ep().Buffer.set_num_sms(num_sms)


def get_buffer(group: dist.ProcessGroup | None, hidden_bytes: int):
    """The ``deep_ep.Buffer`` for ``group``, (re)allocated when ``hidden_bytes`` needs more NVL/RDMA bytes.

    Args:
        group: the EP process group (``None`` = default group).
        hidden_bytes: bytes of one token row (``D * element size``; bf16 is the worst case DeepEP sizes for).

    Raises:
        ImportError: DeepEP is not installed (the message says how to install it).
    """
    deep_ep = _deep_ep()
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    nvl = rdma = 0
    for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)):
        nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, world))
        rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, world))
    buf = _BUFFERS.get(group)
    if buf is None or buf.num_nvl_bytes < nvl or buf.num_rdma_bytes < rdma:
        buf = deep_ep.Buffer(group, nvl, rdma)
        _BUFFERS[group] = buf
    return buf


@dataclass(slots=True)
class DeepEPHandle:
    """What :func:`deepep_combine`, the backward passes and a reused :func:`deepep_dispatch` need."""

    group: dist.ProcessGroup | None
    buffer: Any
    """The ``deep_ep.Buffer``."""
    deep_handle: Any
    """DeepEP's own (opaque) dispatch handle, set by the forward of the dispatch."""
    layout: tuple
    """``(num_tokens_per_rank [R], num_tokens_per_rdma_rank | None, num_tokens_per_expert [E],
    is_token_in_rank [T, R])`` from ``get_dispatch_layout``, reused by a dispatch with ``handle=``."""
    num_experts: int
    world_size: int
    num_tokens: int
    top_k: int
    hidden: int
    align: int
    num_recv_tokens: int
    """N."""
    counts_L: Tensor
    """``[L]`` int64 slots received per local expert (unpadded)."""
    padded_counts_L: Tensor
    """``[L]`` int64 segment sizes after padding to ``align``."""
    num_recv_rows: int
    """P."""
    layout_P: Tensor
    """``[P]`` int64 local expert id of each row handed to the experts, -1 on padding rows (DeepGEMM's
    ``m_indices`` for the contiguous grouped layout)."""
    src_P: Tensor
    """``[P]`` int64 received token (row of ``recv_x``, N = the zero row) at each position of the layout."""
    slot_to_P: Tensor
    """``[N * K]`` int64 row of the ``[P, D]`` layout holding each received slot (P = the zero row for -1)."""
    recv_topk_weights_NK: Tensor | None = None
    """``[N, K]`` fp32 gate weights received by the latest dispatch (0 at -1 slots), in the autograd graph."""
    recv_fp8: tuple[Tensor, Tensor] | None = None
    """``(codes [N, D] e4m3, scales [N, G] fp32)`` received by the latest FP8 dispatch."""
    """``[N, K]`` fp32 gate weights received by the latest dispatch (0 at -1 slots), in the autograd graph."""
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


class _Dispatch(torch.autograd.Function):
    """``Buffer.dispatch`` of tokens and gate weights; backward = ``Buffer.combine`` of both gradients."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, w_TK: Tensor, ids_TK: Tensor, h: DeepEPHandle, fp8: bool):  # type: ignore[override]
        payload = _quantize(x_TD) if fp8 else x_TD
        n_rank, n_rdma, n_expert, in_rank = h.layout
        recv_x, recv_idx, recv_w, _, deep_handle, _ = h.buffer.dispatch(
            x=payload,
            num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert,
            topk_idx=ids_TK,
            topk_weights=w_TK.float(),
        )
        if fp8:
            h.recv_fp8 = (recv_x[0], recv_x[1])
            recv_x = _dequantize(recv_x[0], recv_x[1], x_TD.dtype)
        h.deep_handle = deep_handle
        ctx.h = h
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx, grad_x_ND: Tensor, grad_w_NK: Tensor, _grad_idx):  # type: ignore[override]
        h: DeepEPHandle = ctx.h
        grad_x, grad_w, _ = h.buffer.combine(
            x=grad_x_ND.contiguous(), handle=h.deep_handle, topk_weights=grad_w_NK.float().contiguous()
        )
        return grad_x, grad_w, None, None, None


class _Combine(torch.autograd.Function):
    """``Buffer.combine`` (unweighted sum over ranks); backward = cached ``Buffer.dispatch`` of the gradient."""

    @staticmethod
    def forward(ctx, y_ND: Tensor, h: DeepEPHandle, fp8_backward: bool) -> Tensor:  # type: ignore[override]
        out, _, _ = h.buffer.combine(x=y_ND.contiguous(), handle=h.deep_handle)
        ctx.h, ctx.fp8_backward, ctx.dtype = h, fp8_backward, y_ND.dtype
        return out

    @staticmethod
    def backward(ctx, grad_TD: Tensor):  # type: ignore[override]
        h: DeepEPHandle = ctx.h
        grad_TD = grad_TD.contiguous()
        if ctx.fp8_backward:
            from moe_rl.moe.ep import _agree_finite

            _agree_finite(grad_TD, h.group, "combine(fp8_backward=True): the gradient of combine's output")
            recv = h.buffer.dispatch(x=_quantize(grad_TD), handle=h.deep_handle)[0]
            grad_ND = _dequantize(recv[0], recv[1], grad_TD.dtype)
        else:
            grad_ND = h.buffer.dispatch(x=grad_TD, handle=h.deep_handle)[0]
        return grad_ND.to(ctx.dtype), None, None


def deepep_dispatch(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    align: int = 1,
    handle: DeepEPHandle | None = None,
    fp8: bool = False,
    fp8_output: str = "dequant",
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor, DeepEPHandle]:
    """DeepEP normal-mode dispatch; same contract as :func:`moe_rl.moe.ep.dispatch` (call that, with
    ``backend="deep_ep"``, rather than this function).

    Returns:
        ``(recv_x_PD [P, D], padded_counts_L [L] int64, DeepEPHandle)``; with ``fp8_output="codes"`` the first item
        is ``(codes_PD e4m3, scales_PG fp32)`` (not differentiable).

    Raises:
        ValueError: on every rank before any token moves for the inputs :func:`moe_rl.moe.ep.dispatch` rejects;
            with ``handle=``, on this rank, when shapes or arguments differ from the handle's.
        ImportError: DeepEP is not installed.
    """
    from moe_rl.moe.ep import _agree_finite, _check_reuse, _validate_and_count

    if handle is not None:
        _check_reuse(handle, x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, None)
        if fp8:
            _agree_finite(x_TD, group, "dispatch(handle=..., fp8=True): x_TD")
        h = replace(handle, topk_ids_TK=topk_ids_TK, topk_weights_TK=topk_weights_TK)
    else:
        _validate_and_count(x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, None, fp8)
        elem = 2 if fp8 else max(2, x_TD.element_size())
        buffer = get_buffer(group, x_TD.shape[1] * elem)
        ids = topk_ids_TK.to(torch.int64)
        n_rank, n_rdma, n_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
        world = dist.get_world_size(group)
        h = DeepEPHandle(
            group=group,
            buffer=buffer,
            deep_handle=None,
            layout=(n_rank, n_rdma, n_expert, in_rank),
            num_experts=num_experts,
            world_size=world,
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
    recv_x_ND, recv_w_NK, recv_idx_NK = _Dispatch.apply(x_TD, topk_weights_TK, h.topk_ids_TK.to(torch.int64), h, fp8)
    if h.num_recv_tokens < 0:  # new layout: the local expert-major permutation, computed once per handle
        counts, padded, rows, layout_P, src_P, slot_to_P = _local_layout(recv_idx_NK, h.num_local_experts, align)
        h.num_recv_tokens, h.counts_L, h.padded_counts_L, h.num_recv_rows = recv_x_ND.shape[0], counts, padded, rows
        h.layout_P, h.src_P, h.slot_to_P = layout_P, src_P, slot_to_P
    h.recv_topk_weights_NK = recv_w_NK
    if fp8 and fp8_output == "codes":
        codes, scales = h.recv_fp8
        codes_PD = _with_zero_row(codes.view(torch.uint8))[h.src_P].view(codes.dtype)
        return (codes_PD, _with_zero_row(scales)[h.src_P]), h.padded_counts_L, h
    recv_x_PD = _with_zero_row(recv_x_ND)[h.src_P]
    return recv_x_PD, h.padded_counts_L, h


def deepep_combine(y_PD: Tensor, handle: DeepEPHandle, *, fp8_backward: bool = False) -> Tensor:
    """Weight each received slot's expert output by its gate (fp32), sum per received token, then DeepEP
    ``Buffer.combine`` (unweighted sum over ranks). Same contract as :func:`moe_rl.moe.ep.combine`.

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
