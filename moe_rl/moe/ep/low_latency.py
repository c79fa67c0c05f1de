"""Expert-parallel low-latency (decode) dispatch/combine in DeepEP's / DeepGEMM's *masked* layout, inference only.

Shape legend:
    T  tokens on this rank (0 <= T <= M)       H  hidden size
    K  experts per token (top_k)               E  routed experts; expert e lives on rank ``e // L``
    R  ranks in the EP group                   L  local experts per rank, ``E / R``
    M  ``max_tokens_per_rank`` (DeepEP ``num_max_dispatch_tokens_per_rank``), the same on every rank
    S  slots of one expert's slab, ``S = M * R``
    G  FP8 scale groups per row, ``H / 128``

Low-latency mode is DeepEP's decode path (github.com/deepseek-ai/DeepEP: the ``deep_ep.Buffer`` class, which DeepEP
>= 2.0 keeps as ``deep_ep.buffers.legacy.Buffer``, exported as ``deep_ep.Buffer``: ``low_latency_dispatch`` /
``low_latency_combine``, exercised by ``tests/legacy/test_low_latency.py``). Every shape is fixed by ``(M, H, E, R)``, never by the routing, so a
decode step needs no host sync and can be captured in a CUDA graph::

    low_latency_dispatch(x_TH, topk_ids_TK)  -> recv_LSH   one slab of S = M * R rows per local expert; expert l's
                                                recv_count[l] valid rows come first, grouped by source rank
                                                (rank 0's tokens, then rank 1's, ...); rows >= recv_count[l] are
                                                padding (garbage in DeepEP, never read here)
                                               recv_count_L int32 (DeepGEMM's ``masked_m``)
    masked_experts_forward(recv_LSH, recv_count_L, W) -> y_LSH   only the first recv_count[l] rows of slab l
    low_latency_combine(y_LSH, topk_weights_TK, h) -> out_TH = sum_k w[t, k] * y(row of slot (t, k)), in fp32

That slab layout is DeepGEMM's masked grouped layout (``m_grouped_fp8_gemm_nt_masked((a, sfa) [G=L, M=S, K=H],
(b, sfb) [L, N, H], d [L, S, N], masked_m [L] int32, expected_m)``; bf16: ``m_grouped_bf16_gemm_nt_masked``), which
computes the first ``masked_m[g]`` rows of each group only. :func:`masked_experts_forward` is the torch reference of
that expert step (SwiGLU experts with the stacked weights of :class:`moe_rl.moe.experts.GroupedExperts`).

Order of the rows inside a slab: DeepEP groups them by source rank (``handle[1]``, ``layout_range [L, R]`` int64,
``begin << 32 | count`` per source rank) and records each row's token index in the source rank (``handle[0]``,
``src_info [L, S]`` int32); within one source rank's block the order is whatever slot the sending warp claimed, so
nothing here relies on it: combine always goes through the handle. The ``torch`` backend uses (source rank, token
index) order.

Gate weights: ``low_latency_combine`` applies them (DeepEP's LL combine "reduce **with weights**", unlike its
normal-mode combine), as an fp32 sum over the K slots; slots with id -1 contribute nothing.

Backends (explicit, never a silent fallback):

``"torch"``: a reference on ``torch.distributed`` (gloo or NCCL) with DeepEP's buffer shapes: each rank sends a fixed
    ``[R, L, M, H]`` buffer (per destination rank and local expert, the tokens that chose that expert, packed in token
    order) and a ``[R, L]`` count table through ``all_to_all_single`` with equal splits, so the collective's shapes do
    not depend on the routing (the point of LL mode). Cost: ``E * M * H`` elements each way per rank whatever the
    routing, i.e. it moves padding; it is for CPU tests and small decode batches, not a fast path. Padding rows of
    ``recv`` are zero (DeepEP leaves garbage).
``"deep_ep"``: ``Buffer.low_latency_dispatch`` / ``low_latency_combine`` on the caller's buffer, made once per EP
    group with :func:`make_low_latency_buffer` (``Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
    low_latency_mode=True, num_qps_per_rank=E // R)``, DeepEP ``tests/legacy/test_low_latency.py``) and passed to
    every call as ``buffer=``; this module keeps no buffer. Real DeepEP needs CUDA, bf16
    ``x``, int64 ``topk_idx``, fp32 weights, hidden sizes it was compiled for, and IBGDA/NVLink; it holds at most two
    LL result sets alive at once (double buffer): consume ``recv`` of a dispatch before the dispatch after next.
    The LL buffer is separate from the normal-mode ``ElasticBuffer`` (:func:`moe_rl.moe.ep.make_deepep_buffer`).

FP8 (``use_fp8=True``, DeepSeek-V3 §3.3: dispatch in FP8, combine in BF16): ``recv`` is ``(codes [L, S, H] e4m3,
scales [L, S, G] fp32)`` with the scales' last two dims column-major (strides ``(S*G, 1, S)``), as DeepEP returns
them for DeepGEMM's TMA loads. The ``torch`` backend quantizes with :func:`moe_rl.fp8.quant.quantize_1x128` (the same
numerics as the normal-mode FP8 payload); DeepEP quantizes inside its kernel (amax floor 1e-4, fp32 scales by
default), so codes can differ in the last bit from ours; :func:`dequantize_masked` turns either into ``[L, S, H]``.

No autograd: these functions are for decode (run them under ``torch.no_grad()`` / ``torch.inference_mode()``); an
input that requires grad while grad mode is on raises. Training uses :func:`moe_rl.moe.ep.dispatch` / ``combine``.

Validation is local by default (no extra collective on the decode path): argument errors that are the same on every
rank (``num_experts``, ``max_tokens_per_rank``, ``R``) raise everywhere, but data errors (T > M, an id out of range)
raise only on the rank that has them. ``check_across_ranks=True`` adds one ``all_reduce`` of a flag so every rank
raises (use it when debugging; a lone raise leaves the other ranks waiting in the collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moe_rl.moe.ep._checks import routing_problem

__all__ = [
    "LL_MAX_TOKENS_PER_RANK",
    "LowLatencyHandle",
    "dequantize_masked",
    "low_latency_combine",
    "low_latency_dispatch",
    "make_low_latency_buffer",
    "masked_experts_forward",
]

LL_MAX_TOKENS_PER_RANK = 256
"""Largest ``max_tokens_per_rank`` accepted (DeepEP V1 low-latency limit,
"keep ``num_max_dispatch_tokens_per_rank`` <= 256"; newer DeepEP builds accept up to 1024, the kernels'
``FINISHED_SUM_TAG``, as SGLang's DeepEP dispatcher asserts)."""

LLBackend = Literal["torch", "deep_ep"]


@dataclass(slots=True)
class LowLatencyHandle:
    """What :func:`low_latency_combine` needs from a :func:`low_latency_dispatch` (one decode step)."""

    backend: str
    group: dist.ProcessGroup | None
    num_experts: int
    world_size: int
    max_tokens_per_rank: int
    num_tokens: int
    hidden: int
    topk_ids_TK: Tensor
    """``[T, K]`` int64 routing of this rank's tokens (-1 = no expert)."""
    send_pos_TK: Tensor | None = None
    """torch backend: ``[T, K]`` int64 position of slot (t, k) among the tokens this rank sent to expert
    ``topk_ids[t, k]`` (its row in the ``[M]`` block of the returned buffer), -1 for id -1."""
    recv_counts_RL: Tensor | None = None
    """torch backend: ``[R, L]`` int64 rows received from each source rank for each local expert."""
    slab_from_recv: Tensor | None = None
    """torch backend: ``[L * S]`` int64 row of the flattened received ``[R * L * M]`` buffer held by each slab row
    (``R * L * M`` = the zero row, for padding)."""
    recv_from_slab: Tensor | None = None
    """torch backend: ``[R * L * M]`` int64 slab row (flattened ``[L * S]``) each returned row is read from
    (``L * S`` = the zero row), the inverse of ``slab_from_recv``."""
    buffer: Any = None
    """deep_ep backend: the caller's low-latency ``deep_ep.Buffer``."""
    deep_handle: Any = None
    """deep_ep backend: DeepEP's handle ``(src_info [L, S] int32, layout_range [L, R] int64, M, H, E)``."""

    @property
    def num_local_experts(self) -> int:
        """L."""
        return self.num_experts // self.world_size

    @property
    def num_slots(self) -> int:
        """S = M * R."""
        return self.max_tokens_per_rank * self.world_size


def _deep_ep():
    from moe_rl.moe.ep._checks import DEEP_EP_INSTALL

    try:
        import deep_ep
    except ImportError as err:
        raise ImportError(DEEP_EP_INSTALL) from err
    return deep_ep


def make_low_latency_buffer(
    group: dist.ProcessGroup | None, *, max_tokens_per_rank: int, hidden: int, num_experts: int
) -> Any:
    """Create the low-latency ``deep_ep.Buffer`` for ``group``; the caller owns it and passes it as ``buffer=``.

    Collective (DeepEP sets up NVSHMEM on every rank of ``group``). One buffer per EP group serves every layer's
    decode step with these ``(M, H, E)`` or smaller.

    Args:
        group: the EP process group (``None`` = default group).
        max_tokens_per_rank: M (DeepEP ``num_max_dispatch_tokens_per_rank``; the same on every rank), 1..256.
        hidden: H.
        num_experts: E, a multiple of the group size.

    Returns:
        ``deep_ep.Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
        num_qps_per_rank=E // R)`` (DeepEP ``tests/legacy/test_low_latency.py``).

    Raises:
        ValueError: ``max_tokens_per_rank`` outside 1..256, ``hidden`` < 1, or ``num_experts`` not a positive
            multiple of the group size.
        ImportError: DeepEP is not installed (the message says how to install it).
    """
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if not 1 <= max_tokens_per_rank <= LL_MAX_TOKENS_PER_RANK:
        raise ValueError(
            f"max_tokens_per_rank={max_tokens_per_rank} must be in [1, {LL_MAX_TOKENS_PER_RANK}] (DeepEP "
            "low-latency limit)"
        )
    if hidden < 1:
        raise ValueError(f"hidden={hidden} must be >= 1")
    if num_experts < 1 or num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the EP group size R={world}"
        )
    deep_ep = _deep_ep()
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, world, num_experts)
    return deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world)


def _no_grad(t: Tensor, name: str) -> None:
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad: low-latency dispatch/combine are inference-only (no autograd). Run the decode "
            "step under torch.no_grad() / torch.inference_mode(), or use moe_rl.moe.ep.dispatch/combine to train"
        )


def _local_problem(
    x_TH: Tensor, topk_ids_TK: Tensor, num_experts: int, max_tokens_per_rank: int, use_fp8: bool
) -> str | None:
    """Data-dependent checks (may differ between ranks)."""
    if problem := routing_problem(x_TH, "x_TH", topk_ids_TK):
        return problem
    if not x_TH.dtype.is_floating_point or x_TH.dtype.itemsize == 1:
        return f"x_TH must be a float32/bfloat16/float16 tensor, got {x_TH.dtype}"
    num_tokens, hidden = x_TH.shape
    if num_tokens > max_tokens_per_rank:
        return (
            f"x_TH has T={num_tokens} tokens but max_tokens_per_rank={max_tokens_per_rank}: each rank may dispatch "
            "at most max_tokens_per_rank tokens per low-latency call; raise max_tokens_per_rank (<= "
            f"{LL_MAX_TOKENS_PER_RANK}) or split the batch"
        )
    if use_fp8 and hidden % 128:
        return f"use_fp8=True needs the hidden size H={hidden} to be a multiple of 128 (1x128 scale groups)"
    if use_fp8 and not bool(torch.isfinite(x_TH).all()):
        n_bad = int((~torch.isfinite(x_TH)).sum())
        return f"use_fp8=True: x_TH has {n_bad} non-finite values (inf/NaN cannot be quantized to e4m3 faithfully)"
    if topk_ids_TK.numel():
        bad = (topk_ids_TK < -1) | (topk_ids_TK >= num_experts)
        if bool(bad.any()):
            vals = topk_ids_TK[bad].unique()[:8].tolist()
            return (
                f"topk_ids_TK has ids {vals} outside [-1, num_experts={num_experts}); ids are global expert ids "
                "(-1 = no expert)"
            )
        ids = topk_ids_TK.to(torch.int64)
        srt = ids.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            row = int(dup.any(1).nonzero()[0, 0])
            return (
                f"topk_ids_TK row {row} = {ids[row].tolist()} names an expert twice; each token may choose an expert "
                "at most once (an expert's slab holds one row per (source rank, token))"
            )
    return None


def _validate(
    x_TH: Tensor,
    topk_ids_TK: Tensor,
    group: dist.ProcessGroup | None,
    num_experts: int,
    max_tokens_per_rank: int,
    use_fp8: bool,
    check_across_ranks: bool,
) -> int:
    _no_grad(x_TH, "x_TH")
    world = dist.get_world_size(group)
    if not 1 <= max_tokens_per_rank <= LL_MAX_TOKENS_PER_RANK:
        raise ValueError(
            f"max_tokens_per_rank={max_tokens_per_rank} must be in [1, {LL_MAX_TOKENS_PER_RANK}] (DeepEP "
            "low-latency limit); use the normal-mode moe_rl.moe.ep.dispatch for larger batches (prefill)"
        )
    if num_experts < 1 or num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the EP group size R={world} "
            "(each rank holds E / R experts)"
        )
    problem = _local_problem(x_TH, topk_ids_TK, num_experts, max_tokens_per_rank, use_fp8)
    if check_across_ranks:
        # one element per rank (a ``1 << rank`` bit mask overflows int64 from rank 63 on: wide-EP decode groups), on
        # the inputs' device (an NCCL-only group has no CPU backend)
        flag = torch.zeros(world, dtype=torch.int32, device=x_TH.device)
        if problem is not None:
            flag[dist.get_rank(group)] = 1
        dist.all_reduce(flag, group=group)
        bad_ranks = flag.nonzero().flatten().tolist()
        if bad_ranks:
            raise ValueError(
                f"low_latency_dispatch: bad input on rank(s) {bad_ranks}"
                + (f"; this rank: {problem}" if problem else "")
            )
    elif problem is not None:
        raise ValueError(f"low_latency_dispatch: {problem}")
    return world


def _a2a_equal(t: Tensor, group) -> Tensor:
    """``all_to_all_single`` with equal splits along dim 0 (fp8 moved as bytes: gloo has no float8)."""
    is_f8 = t.dtype.itemsize == 1 and t.dtype.is_floating_point
    src = (t.view(torch.uint8) if is_f8 else t).contiguous()
    out = torch.empty_like(src)
    dist.all_to_all_single(out, src, group=group)
    return out.view(t.dtype) if is_f8 else out


def _with_zero_row(x: Tensor) -> Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _torch_dispatch(x_TH, ids_TK, group, world, num_experts, max_tok, use_fp8):
    num_tokens, hidden = x_TH.shape
    local = num_experts // world
    dev = x_TH.device
    # position of each valid slot among the tokens that chose the same expert (token order), one stable sort
    flat = ids_TK.reshape(-1)
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    counts_E = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    start_E = torch.cumsum(counts_E, 0) - counts_E
    n_valid = int(
        counts_E.sum()
    )  # host sync of the reference backend only; the collectives' shapes stay fixed
    slots = order[:n_valid]
    e_sorted = flat[slots]
    pos = torch.arange(n_valid, device=dev) - start_E[e_sorted]
    send_pos = torch.full_like(flat, -1)
    send_pos[slots] = pos
    # send buffer [R, L, M] rows: row (e // L, e % L, pos) = token of slot; flattened index e * M + pos
    send_index = torch.full((num_experts * max_tok,), num_tokens, dtype=torch.int64, device=dev)
    send_index[e_sorted * max_tok + pos] = torch.div(slots, ids_TK.shape[1], rounding_mode="floor")
    if use_fp8:
        from moe_rl.fp8.quant import quantize_1x128

        codes, scales = (
            quantize_1x128(x_TH, name="x_TH")
            if num_tokens
            else (
                x_TH.new_zeros(0, hidden).to(torch.float8_e4m3fn),
                x_TH.new_zeros(0, hidden // 128, dtype=torch.float32),
            )
        )
        payload = [_with_zero_row(codes.view(torch.uint8))[send_index], _with_zero_row(scales)[send_index]]
    else:
        payload = [_with_zero_row(x_TH)[send_index]]
    recv = [
        _a2a_equal(p.view(world, local * max_tok, -1), group).view(world * local * max_tok, -1)
        for p in payload
    ]
    recv_counts = _a2a_equal(counts_E.view(world, local), group)  # [R src, L]
    # slab l: blocks of source ranks in rank order, each block's rows packed to the front of the slab
    c_LR = recv_counts.t()  # [L, R]
    begin_LR = torch.cumsum(c_LR, 1) - c_LR
    slots_S = world * max_tok
    i = torch.arange(max_tok, device=dev)
    in_block = i[None, None, :] < c_LR[:, :, None]  # [L, R, M]
    slab_row = (
        torch.arange(local, device=dev)[:, None, None] * slots_S + begin_LR[:, :, None] + i
    ).masked_select(in_block)
    recv_row = (
        torch.arange(world, device=dev)[None, :, None] * (local * max_tok)
        + torch.arange(local, device=dev)[:, None, None] * max_tok
        + i
    ).masked_select(in_block)
    n_recv_rows = world * local * max_tok
    slab_from_recv = torch.full((local * slots_S,), n_recv_rows, dtype=torch.int64, device=dev)
    slab_from_recv[slab_row] = recv_row
    recv_from_slab = torch.full((n_recv_rows,), local * slots_S, dtype=torch.int64, device=dev)
    recv_from_slab[recv_row] = slab_row
    slabs = [_with_zero_row(r)[slab_from_recv].view(local, slots_S, -1) for r in recv]
    if use_fp8:
        codes_LSH = slabs[0].view(torch.float8_e4m3fn)
        scales_LSG = slabs[1].transpose(1, 2).contiguous().transpose(1, 2)  # column-major, as DeepEP returns
        out = (codes_LSH, scales_LSG)
    else:
        out = slabs[0]
    extra = dict(
        send_pos_TK=send_pos.view_as(ids_TK),
        recv_counts_RL=recv_counts,
        slab_from_recv=slab_from_recv,
        recv_from_slab=recv_from_slab,
    )
    return out, c_LR.sum(1).to(torch.int32), extra


def low_latency_dispatch(
    x_TH: Tensor,
    topk_ids_TK: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    backend: LLBackend = "torch",
    buffer: Any = None,
    use_fp8: bool = False,
    check_across_ranks: bool = False,
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor, LowLatencyHandle]:
    """Send each token to the ranks of its experts into fixed-size per-expert slabs (DeepEP low-latency dispatch).

    Args:
        x_TH: ``[T, H]`` tokens of this rank, ``T <= max_tokens_per_rank`` (bf16 for real DeepEP; any float dtype
            with the ``torch`` backend).
        topk_ids_TK: ``[T, K]`` integer global expert ids, -1 = no expert; each expert at most once per row.
        group: the EP process group (``None`` = default group), R ranks.
        num_experts: E, a multiple of R.
        max_tokens_per_rank: M (DeepEP ``num_max_dispatch_tokens_per_rank``), the same on every rank, 1..256.
        backend: ``"torch"`` (collectives, reference) or ``"deep_ep"`` (``Buffer.low_latency_dispatch``).
        buffer: ``backend="deep_ep"`` only, and required there: the caller's buffer from
            :func:`make_low_latency_buffer` (sized for at least this call's M, H and E).
        use_fp8: send e4m3 codes with 1x128 fp32 scales (H must be a multiple of 128).
        check_across_ranks: one extra ``all_reduce`` so data errors raise on every rank (see module docstring).

    Returns:
        ``(recv, recv_count_L, handle)``: ``recv`` is ``[L, S=M*R, H]`` in ``x_TH``'s dtype, or with ``use_fp8``
        ``(codes [L, S, H] e4m3, scales [L, S, H/128] fp32, column-major last two dims)``; ``recv_count_L`` ``[L]``
        int32 valid leading rows of each slab (DeepGEMM ``masked_m``); rows at and beyond ``recv_count_L[l]`` are
        padding and must not be used. ``handle`` is for :func:`low_latency_combine`.

    Raises:
        ValueError: ``max_tokens_per_rank`` outside 1..256, ``num_experts`` not a multiple of R, T > M, ids outside
            [-1, E) or repeated within a row, ``x_TH`` not a float tensor, H not a multiple of 128 or a non-finite
            ``x_TH`` with ``use_fp8``, unknown ``backend``, or ``x_TH`` requires grad under grad mode (inference
            only), a missing ``buffer`` with ``"deep_ep"`` or one given with ``"torch"``.
        ImportError: ``backend="deep_ep"`` without DeepEP installed.
    """
    if backend not in ("torch", "deep_ep"):
        raise ValueError(f"backend={backend!r} is not supported; use 'torch' or 'deep_ep'")
    if backend == "deep_ep":
        _deep_ep()
        if buffer is None:
            raise ValueError(
                "low_latency_dispatch(backend='deep_ep') needs buffer=: create the low-latency buffer once per EP "
                "group with make_low_latency_buffer(group, max_tokens_per_rank=M, hidden=H, num_experts=E) and pass "
                "it to every call"
            )
    elif buffer is not None:
        raise ValueError("buffer= is only used by backend='deep_ep'; pass buffer=None with backend='torch'")
    world = _validate(x_TH, topk_ids_TK, group, num_experts, max_tokens_per_rank, use_fp8, check_across_ranks)
    ids = topk_ids_TK.to(torch.int64)
    h = LowLatencyHandle(
        backend=backend,
        group=group,
        num_experts=num_experts,
        world_size=world,
        max_tokens_per_rank=max_tokens_per_rank,
        num_tokens=x_TH.shape[0],
        hidden=x_TH.shape[1],
        topk_ids_TK=ids,
    )
    if backend == "torch":
        recv, count, extra = _torch_dispatch(
            x_TH, ids, group, world, num_experts, max_tokens_per_rank, use_fp8
        )
        for k, v in extra.items():
            setattr(h, k, v)
        return recv, count, h
    recv, count, deep_handle, _event, _hook = buffer.low_latency_dispatch(
        x_TH.contiguous(),
        ids,
        max_tokens_per_rank,
        num_experts,
        use_fp8=use_fp8,
        async_finish=False,
        return_recv_hook=False,
    )
    h.buffer, h.deep_handle = buffer, deep_handle
    if use_fp8:
        recv = (recv[0], recv[1])
    return recv, count.to(torch.int32), h


def low_latency_combine(y_LSH: Tensor, topk_weights_TK: Tensor, handle: LowLatencyHandle) -> Tensor:
    """Return each slab row to its token and sum the K expert outputs weighted by the gates, in fp32.

    Only the first ``recv_count[l]`` rows of slab l are read; padding rows may hold anything (NaN included).

    Args:
        y_LSH: ``[L, S, H]`` expert outputs in the layout :func:`low_latency_dispatch` returned (bf16 for DeepEP).
        topk_weights_TK: ``[T, K]`` gate weights of this rank's tokens (cast to fp32); ignored at id -1 slots.
        handle: the handle of the matching :func:`low_latency_dispatch`.

    Returns:
        ``[T, H]`` in ``y_LSH``'s dtype: ``out[t] = sum_{k: id != -1} w[t, k] * expert_{id[t,k]}(x[t])`` (fp32 sum).

    Raises:
        ValueError: shapes do not match the handle, or an input requires grad under grad mode.
    """
    h = handle
    _no_grad(y_LSH, "y_LSH")
    _no_grad(topk_weights_TK, "topk_weights_TK")
    want = (h.num_local_experts, h.num_slots, h.hidden)
    if tuple(y_LSH.shape) != want:
        raise ValueError(
            f"y_LSH has shape {tuple(y_LSH.shape)}; the dispatch returned slabs of shape {want} [L, S, H]"
        )
    if tuple(topk_weights_TK.shape) != tuple(h.topk_ids_TK.shape):
        raise ValueError(
            f"topk_weights_TK has shape {tuple(topk_weights_TK.shape)}; the dispatch routed "
            f"{tuple(h.topk_ids_TK.shape)} [T, K]"
        )
    w_TK = topk_weights_TK.float()
    if h.backend == "deep_ep":
        out, _event, _hook = h.buffer.low_latency_combine(
            y_LSH.contiguous(),
            h.topk_ids_TK,
            w_TK.contiguous(),
            h.deep_handle,
            zero_copy=False,
            async_finish=False,
            return_recv_hook=False,
        )
        return out.to(y_LSH.dtype)
    world, local, max_tok = h.world_size, h.num_local_experts, h.max_tokens_per_rank
    y_flat = _with_zero_row(y_LSH.reshape(local * h.num_slots, h.hidden))
    back = y_flat[
        h.recv_from_slab
    ]  # [R dst-of-tokens, L, M] rows; padding -> the zero row, never a slab pad row
    ret = _a2a_equal(back.view(world, local * max_tok, h.hidden), h.group).view(
        world * local * max_tok, h.hidden
    )
    ids, pos = h.topk_ids_TK, h.send_pos_TK
    valid = ids >= 0
    row = torch.where(
        valid, ids * max_tok + pos, torch.full_like(ids, world * local * max_tok)
    )  # e * M + pos
    y_TKH = _with_zero_row(ret)[row.reshape(-1)].view(*ids.shape, h.hidden).float()
    w_T1K = torch.where(valid, w_TK, torch.zeros((), dtype=torch.float32)).unsqueeze(1)
    return torch.bmm(w_T1K, y_TKH).squeeze(1).to(y_LSH.dtype)


def dequantize_masked(codes_LSH: Tensor, scales_LSG: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``[L, S, H]`` e4m3 codes x 1x128 fp32 scales (any strides) -> ``[L, S, H]`` in ``dtype``.

    Padding rows dequantize to whatever they hold (DeepEP: garbage); :func:`masked_experts_forward` ignores them.
    """
    from moe_rl.fp8.quant import dequantize

    local, slots, hidden = codes_LSH.shape
    x = dequantize(
        codes_LSH.reshape(local * slots, hidden),
        scales_LSG.reshape(local * slots, -1),
        (1, 128),
        out_dtype=dtype,
    )
    return x.view(local, slots, hidden)


def masked_experts_forward(
    x_LSH: Tensor,
    masked_m_L: Tensor,
    gate_up_L2FH: Tensor,
    down_LHF: Tensor,
    *,
    backend: Literal["loop", "bmm"] = "loop",
) -> Tensor:
    """SwiGLU experts on DeepGEMM's masked layout: slab l's first ``masked_m[l]`` rows through local expert l.

    Torch reference of two ``m_grouped_*_gemm_nt_masked(a [L, S, K], b [L, N, K], d [L, S, N], masked_m, expected_m)``
    calls (DeepGEMM) with SwiGLU in between: ``y = down_l(silu(gate_l(x)) * up_l(x))`` (``nn.Linear`` convention).

    Args:
        x_LSH: ``[L, S, H]`` slabs (as :func:`low_latency_dispatch` returns them, dequantized if FP8).
        masked_m_L: ``[L]`` integer valid rows per slab (``recv_count``).
        gate_up_L2FH: ``[L, 2F, H]`` local experts' stacked gate/up weights (gate rows first).
        down_LHF: ``[L, H, F]`` local experts' down weights.
        backend: ``"loop"`` slices the valid rows of each slab (one host sync; padding rows are never read) or
            ``"bmm"`` computes every row with batched matmuls and keeps only valid rows with ``torch.where`` (static
            shapes, no host sync, CUDA-graph friendly; padding values, NaN included, cannot reach the output).

    Returns:
        ``[L, S, H]`` in ``x_LSH``'s dtype; rows >= ``masked_m[l]`` are zero (DeepGEMM leaves them undefined).

    Raises:
        ValueError: shapes disagree, ``masked_m`` outside [0, S], or unknown ``backend``.
    """
    local, slots, hidden = x_LSH.shape
    if gate_up_L2FH.shape[0] != local or down_LHF.shape[0] != local or gate_up_L2FH.shape[2] != hidden:
        raise ValueError(
            f"weights gate_up {tuple(gate_up_L2FH.shape)} / down {tuple(down_LHF.shape)} do not fit x_LSH "
            f"{tuple(x_LSH.shape)}: expected [L={local}, 2F, H={hidden}] and [L, H, F]"
        )
    if tuple(masked_m_L.shape) != (local,):
        raise ValueError(f"masked_m_L has shape {tuple(masked_m_L.shape)}, expected [L={local}]")
    if bool(((masked_m_L < 0) | (masked_m_L > slots)).any()):
        raise ValueError(f"masked_m_L={masked_m_L.tolist()} must lie in [0, S={slots}]")
    if backend == "loop":
        out = x_LSH.new_zeros(local, slots, down_LHF.shape[1])
        for e, m in enumerate(masked_m_L.tolist()):
            if m:
                gate, up = F.linear(x_LSH[e, :m], gate_up_L2FH[e]).chunk(2, dim=-1)
                out[e, :m] = F.linear(F.silu(gate) * up, down_LHF[e])
        return out
    if backend != "bmm":
        raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'bmm'")
    rows = (
        torch.arange(slots, device=x_LSH.device)[None, :, None] < masked_m_L.to(x_LSH.device)[:, None, None]
    )
    x = torch.where(rows, x_LSH, torch.zeros((), dtype=x_LSH.dtype, device=x_LSH.device))
    gate, up = torch.bmm(x, gate_up_L2FH.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down_LHF.transpose(1, 2))
    return torch.where(rows, y, torch.zeros((), dtype=y.dtype, device=y.device))
