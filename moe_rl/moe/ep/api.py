"""Expert-parallel token dispatch and combine: the backend-independent entry points.

Shape legend:
    T  tokens on this rank (may be 0)       D  hidden size
    K  experts per token (top_k)            E  routed experts; expert e lives on rank ``e // L``
    R  ranks in the EP group                L  local experts per rank, ``E / R``
    P  rows handed to the local experts (expert-major, each expert's segment padded to ``align``)

:func:`dispatch` checks its arguments, then hands over to the chosen backend: ``"torch"``
(:mod:`moe_rl.moe.ep.torch_backend`, ``all_to_all_single`` on gloo or NCCL, one row per token-slot) or
``"deep_ep"`` (:mod:`moe_rl.moe.ep.deepep`, DeepEP's ``ElasticBuffer`` on CUDA, one row per token and destination
rank, on a buffer the caller owns). :func:`combine` follows the handle it is given. Both backends return the same
expert-major layout and the same handle contract, so the expert code does not depend on the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from torch import Tensor

from moe_rl.moe.ep._checks import check_backend
from moe_rl.moe.ep.torch_backend import DispatchHandle, torch_combine, torch_dispatch

if TYPE_CHECKING:
    from moe_rl.moe.ep.deepep import DeepEPHandle

__all__ = ["EPBackend", "combine", "dispatch"]

EPBackend = Literal["torch", "deep_ep"]
"""Expert-parallel dispatch backends."""


def dispatch(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    backend: EPBackend = "torch",
    buffer: Any = None,
    align: int = 1,
    chunk_size: int | None = None,
    handle: DispatchHandle | DeepEPHandle | None = None,
    fp8: bool = False,
    fp8_output: Literal["dequant", "codes"] = "dequant",
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor, DispatchHandle | DeepEPHandle]:
    """Send every token-slot to the rank that owns its expert (DeepEP normal-mode ``dispatch`` semantics).

    Collective: every rank of ``group`` must call it, with the same ``num_experts``, D and ``chunk_size``, and
    either all with ``handle=None`` or all with a handle.

    Collectives per call (``handle=None``): one ``all_gather`` that carries both the validation ints and the
    per-expert counts (plus one ``all_gather`` of per-chunk counts when chunked or ``E > FUSED_MAX_EXPERTS``),
    then one ``all_to_all_single`` of rows per chunk. One host sync (the split sizes) per count collective.
    With ``handle=h``: the row exchanges only.

    Args:
        x_TD: ``[T, D]`` tokens on this rank, any dtype gloo/NCCL can move (float8 is sent as uint8); T may be 0.
        topk_ids_TK: ``[T, K]`` integer expert ids in ``[0, E)``; -1 marks a slot that goes nowhere.
        topk_weights_TK: ``[T, K]`` gate weights (any float dtype; applied in fp32 by :func:`combine`). Kept
            in the handle; gradients reach it through :func:`combine`.
        group: the expert-parallel process group (``None`` = default group). Rank r owns experts
            ``[r * L, (r + 1) * L)``.
        num_experts: E, a multiple of the group size.
        backend: ``"torch"`` (``all_to_all_single``, works on gloo and NCCL) or ``"deep_ep"`` (DeepEP >= 2.0
            ``ElasticBuffer`` kernels through :mod:`moe_rl.moe.ep.deepep`; needs ``buffer``; raises ImportError
            with install instructions when DeepEP is missing or V1-only; never falls back silently).
        buffer: ``backend="deep_ep"`` only, and required there: the caller's ``deep_ep.ElasticBuffer`` (make one
            with :func:`moe_rl.moe.ep.make_deepep_buffer` and keep it for the life of the group). Must be ``None``
            with ``backend="torch"``.
        align: pad each local expert's rows to a multiple of ``align`` with zero rows (128 = DeepGEMM
            contiguous grouped layout); ``handle.layout_P`` then marks padding with -1.
        chunk_size: if set, exchange tokens in chunks of this many tokens; all ranks run the same number of
            chunks, ``max over ranks of ceil(T / chunk_size)``. ``"torch"`` backend only (DeepEP pipelines a
            dispatch internally).
        handle: a :class:`DispatchHandle` (``"deep_ep"``: a :class:`DeepEPHandle`) from an earlier dispatch of the **same** ``topk_ids_TK`` (replayed
            routing, a later micro-step): its layout is reused, so no count collective, no host sync and no
            sort run (DeepEP's cached-handle dispatch). The ids are not re-read (that would cost a sync);
            new ``topk_weights_TK`` are allowed. Shapes, E, ``align``, ``chunk_size`` and the group are checked
            on this rank only: the cross-rank validation ran when the handle was built. A handle works for either
            payload (the layout does not depend on it).
        fp8: send an FP8 payload (DeepSeek-V3): ``x_TD`` (fp32/bf16/fp16, finite) is quantized 1x128 per token
            (:func:`moe_rl.fp8.quant.quantize_1x128`) and each token-slot moves as one packed uint8 row of
            ``D + 4 * ceil(D / 128)`` bytes (e4m3 codes, then fp32 scales), in the same exchanges as without
            ``fp8``. All ranks must pass the same ``fp8``. Backward: straight-through estimator of the quantizer
            (the gradient of the dequantized rows reaches ``x_TD`` unchanged, in ``x_TD``'s dtype).
        fp8_output: with ``fp8``, what the experts get: ``"dequant"`` (default) the rows dequantized to ``x_TD``'s
            dtype, bit-identical to dispatching ``dequantize(*quantize_1x128(x_TD), (1, 128), out_dtype=x.dtype)``;
            or ``"codes"``: ``(codes_PD float8_e4m3fn, scales_PG fp32)`` for an FP8 grouped GEMM (padding rows have
            zero codes and scale 0). ``"codes"`` is not differentiable (no gradient reaches ``x_TD``); its FP8 GEMM
            owns the backward.

    Returns:
        ``(recv_x_PD, recv_counts_L, handle)``: ``recv_x_PD`` ``[P, D]`` in ``x_TD``'s dtype, expert-major
        (all rows of local expert 0, then 1, ...; within an expert, source rank by rank in token order), ``recv_counts_L`` ``[L]`` int64 rows per local expert
        (padded counts when ``align > 1``, as DeepEP's ``num_recv_tokens_per_expert_list``), and the
        :class:`DispatchHandle` (or :class:`DeepEPHandle`) for :func:`combine`. Differentiable w.r.t. ``x_TD``. With
        ``fp8_output="codes"`` the first item is ``(codes_PD, scales_PG)``.

    Raises:
        ValueError: on every rank, before any token moves, if the ranks disagree on ``num_experts``, D or
            ``chunk_size``, if E is not a multiple of the group size, or if any rank passes bad shapes or
            ids out of range, or (``fp8``) a non-float or non-finite ``x_TD``. The message names the values.
            With ``handle=``, on this rank only, if the inputs do not match the handle; with ``handle=`` and
            ``fp8``, a non-finite ``x_TD`` on any rank raises on every rank (one ``all_reduce`` of R ints, the only
            collective besides the row exchanges).
            Also (on this rank, before any collective): unknown ``backend`` or ``fp8_output``, a ``buffer`` with
            ``backend="torch"`` or none with ``"deep_ep"``, ``chunk_size`` with ``"deep_ep"``, a handle of the other
            backend.
        ImportError: ``backend="deep_ep"`` without DeepEP installed, or with a V1-only DeepEP.
    """
    check_backend(backend)
    if fp8_output not in ("dequant", "codes"):
        raise ValueError(f"fp8_output={fp8_output!r} is not supported; use 'dequant' or 'codes'")
    if backend == "torch":
        if buffer is not None:
            raise ValueError(
                f"buffer={type(buffer).__name__} is only used by backend='deep_ep'; pass buffer=None with "
                "backend='torch'"
            )
        return torch_dispatch(
            x_TD,
            topk_ids_TK,
            topk_weights_TK,
            group,
            num_experts=num_experts,
            align=align,
            chunk_size=chunk_size,
            handle=handle,
            fp8=fp8,
            fp8_output=fp8_output,
        )
    from moe_rl.moe.ep.deepep import deepep_dispatch

    if chunk_size is not None:
        raise ValueError(
            f"chunk_size={chunk_size} is not supported with backend='deep_ep' (DeepEP pipelines a dispatch "
            "internally); pass chunk_size=None"
        )
    return deepep_dispatch(
        x_TD,
        topk_ids_TK,
        topk_weights_TK,
        group,
        buffer=buffer,
        num_experts=num_experts,
        align=align,
        handle=handle,
        fp8=fp8,
        fp8_output=fp8_output,
    )


def combine(y_PD: Tensor, handle: DispatchHandle | DeepEPHandle, *, fp8_backward: bool = False) -> Tensor:
    """Return expert outputs to the tokens' ranks and sum them with the gate weights (fp32).

    Collective: every rank of the handle's group must call it.

    Args:
        y_PD: ``[P, D]`` outputs of the local experts, rows in the order :func:`dispatch` returned (padding rows
            are ignored).
        handle: the :class:`DispatchHandle` or :class:`DeepEPHandle` from :func:`dispatch` (it picks the backend).
        fp8_backward: the forward stays in ``y_PD``'s dtype (DeepSeek-V3: combine in BF16), but the backward (a
            dispatch of the per-slot gradients ``w * dout``) sends them as 1x128 FP8 packed bytes like
            ``dispatch(..., fp8=True)`` and hands ``y_PD`` their dequantized values (straight-through). All ranks
            must pass the same value; a non-finite gradient raises ValueError on every rank (one ``all_reduce`` of R
            ints before the exchange).

    Autograd caveat (prime-rl PR #3411): the backward of combine and of dispatch are collectives too, so on
    every rank ``y_PD`` must be computed from the dispatched rows inside the autograd graph, even when this rank
    received no rows (run the experts on the empty tensor, as :func:`moe_rl.moe.ep.local_experts_forward`
    does; do not replace the output by a fresh ``zeros`` tensor), or the other ranks wait forever in backward.

    Returns:
        ``[T, D]`` in ``y_PD``'s dtype: ``sum_k topk_weights_TK[t, k] * y[slot (t, k)]`` computed in fp32, slots
        with id -1 contribute nothing. Differentiable w.r.t. ``y_PD`` and ``topk_weights_TK``.

    Raises:
        ValueError: ``y_PD`` is not ``[P, D]`` with the handle's P.
        TypeError: ``handle`` is neither a :class:`DispatchHandle` nor a :class:`DeepEPHandle`.
    """
    if isinstance(handle, DispatchHandle):
        return torch_combine(y_PD, handle, fp8_backward=fp8_backward)
    from moe_rl.moe.ep.deepep import DeepEPHandle, deepep_combine

    if not isinstance(handle, DeepEPHandle):
        raise TypeError(
            f"combine(handle=...) got a {type(handle).__name__}; pass the handle that dispatch returned "
            "(a DispatchHandle or a DeepEPHandle)"
        )
    return deepep_combine(y_PD, handle, fp8_backward=fp8_backward)
