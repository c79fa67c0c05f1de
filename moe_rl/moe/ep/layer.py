"""Expert-parallel MoE block: the router and shared experts of :class:`moe_rl.moe.MoE` on every rank, and only
this rank's slice of the routed experts.

Shape legend:
    T  tokens on this rank (may be 0)
    D  hidden size
    F  routed expert intermediate size
    E  routed experts in total
    R  ranks in the expert-parallel group
    L  local experts, L = E / R; rank r holds experts ``[r * L, (r + 1) * L)``
    K  experts per token
    P  rows received for the local experts (see :func:`moe_rl.moe.ep.dispatch`)

Computation (same math as :class:`moe_rl.moe.MoE`, with the routed part spread over ranks)::

    ids_TK, w_TK, _ = router(x_TD, replay_ids_TK)          # replicated router, w_TK fp32
    recv_PD, counts_L, handle = dispatch(x_TD, ids_TK, w_TK, group)  # backend "torch" or "deep_ep"
    y_PD   = local_experts(recv_PD, counts_L)              # unweighted, x dtype
    out_TD = combine(y_PD, handle)                         # fp32 weighted sum over K, cast to x dtype
    out_TD += shared_experts(x_TD)

Gradients of the replicated parts (router, shared experts) are this rank's partial sums over its own tokens;
summing them over the ranks (data-parallel reduction, done by the trainer) gives the full-batch gradient. The
local experts' gradients are complete: every token routed to them arrives here.
"""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe_rl.moe.ep.api import EPBackend, combine, dispatch
from moe_rl.moe.ep.torch_backend import DispatchHandle
from moe_rl.moe.experts import GroupedExperts
from moe_rl.moe.moe import MoE, SwiGLUMLP
from moe_rl.moe.router import TopKRouter, flat_replay_ids

if TYPE_CHECKING:
    from moe_rl.moe.ep.deepep import DeepEPHandle

__all__ = ["ExpertParallelMoE", "LocalExperts", "local_experts_forward"]


def _swiglu_expert(x_nD: Tensor, gate_up_2FD: Tensor, down_DF: Tensor) -> Tensor:
    gate_nF, up_nF = F.linear(x_nD, gate_up_2FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate_nF) * up_nF, down_DF)


def _local(w: Tensor) -> Tensor:
    """This rank's ``[L, ...]`` slice of an expert weight. Under :func:`moe_rl.distributed.parallelize.
    parallelize_model` the weights are DTensors sharded ``Shard(0)`` over the EP mesh (global ``[E, ...]``, so
    checkpoints reshard across layouts); ``to_local`` is differentiable and returns the gradient as a DTensor."""
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


def local_experts_forward(x_PD: Tensor, counts_L: Tensor, experts: GroupedExperts) -> Tensor:
    """Run expert-major rows through the local experts.

    Every local expert takes part in the autograd graph even when it received no rows, so its weight gradient
    is a zero tensor rather than ``None`` (prime-rl PR #3411: optimizer and grad-norm code must see the same
    parameters with gradients on every rank).

    Args:
        x_PD: ``[P, D]`` rows sorted by local expert (as :func:`moe_rl.moe.ep.dispatch` returns them).
        counts_L: ``[L]`` int64 rows per local expert, summing to P.
        experts: the local :class:`GroupedExperts` (``num_experts == L``); its ``backend`` picks the kernel, or,
            when its ``fp8_backend`` attribute is set (:class:`LocalExperts` made by :meth:`ExpertParallelMoE.
            from_full` from FP8 experts), both projections run as :func:`moe_rl.fp8.grouped.fp8_grouped_linear`
            (the math of :func:`moe_rl.fp8.grouped.fp8_experts_forward` on rows already sorted by expert).

    Returns:
        ``[P, D]`` unweighted expert outputs in ``x_PD``'s dtype.
    """
    gate_up_L2FD, down_LDF = _local(experts.gate_up_proj), _local(experts.down_proj)
    fp8_backend = getattr(experts, "fp8_backend", None)
    if fp8_backend is not None:  # FP8 grouped GEMMs (moe_rl.fp8.grouped), 128-row padded contiguous layout
        from moe_rl.fp8.grouped import contiguous_layout, fp8_grouped_linear

        layout = contiguous_layout(counts_L)
        x_MD = x_PD.new_zeros(layout.num_rows, x_PD.shape[1]).index_copy(0, layout.rows, x_PD)
        gate_MF, up_MF = fp8_grouped_linear(x_MD, gate_up_L2FD, layout, fp8_backend).chunk(2, dim=-1)
        return fp8_grouped_linear(F.silu(gate_MF) * up_MF, down_LDF, layout, fp8_backend)[layout.rows]
    if experts.backend == "grouped_mm":
        offs_L = torch.cumsum(counts_L, dim=0, dtype=torch.int32)
        h_P2F = torch._grouped_mm(x_PD, gate_up_L2FD.transpose(-2, -1), offs=offs_L)
        gate_PF, up_PF = h_P2F.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate_PF) * up_PF, down_LDF.transpose(-2, -1), offs=offs_L)
    outs = []
    start = 0
    for e, count in enumerate(counts_L.tolist()):
        outs.append(_swiglu_expert(x_PD[start : start + count], gate_up_L2FD[e], down_LDF[e]))
        start += count
    return torch.cat(outs)


class LocalExperts(GroupedExperts):
    """This EP rank's L experts (weights as in :class:`GroupedExperts`), called on expert-major rows:
    ``forward(x_PD, counts_L) -> [P, D]`` = :func:`local_experts_forward`.

    Calling the experts as a module (rather than reading their weights from the parent) lets module hooks run
    around the expert computation: FSDP2 on the experts (``fully_shard(experts, mesh=efsdp)``) all-gathers the
    weights in its forward pre-hook and reduce-scatters their gradients after backward.

    ``fp8_backend``: ``None`` (high precision, ``backend`` picks the kernel) or the FP8 grouped GEMM backend
    (``"torch"`` | ``"triton"`` | ``"deep_gemm"`` | ``"auto"``, :mod:`moe_rl.fp8.grouped`); set by
    :meth:`ExpertParallelMoE.from_full` when the full block's experts are FP8
    (:class:`moe_rl.moe.fp8_experts.Fp8GroupedExperts`), so FP8 experts stay FP8 under expert parallelism.
    """

    fp8_backend: str | None = None

    def forward(self, x_PD: Tensor, counts_L: Tensor) -> Tensor:  # type: ignore[override]
        return local_experts_forward(x_PD, counts_L, self)


def _check_ep_backend(backend: object, deepep_buffer: Any) -> None:
    """Refuse an unknown dispatch backend name, or a buffer that does not fit it, when the module is built (not
    at the first forward)."""
    if backend not in ("torch", "deep_ep"):
        raise ValueError(
            f"backend={backend!r} is not an expert-parallel dispatch backend; use 'torch' (all_to_all_single, "
            "gloo or NCCL) or 'deep_ep' (DeepEP kernels)"
        )
    if backend == "deep_ep" and deepep_buffer is None:
        raise ValueError(
            "backend='deep_ep' needs deepep_buffer=: create DeepEP's buffer once per EP group with "
            "moe_rl.moe.ep.make_deepep_buffer(group, hidden=D, top_k=K, max_tokens_per_rank=T_max) and pass it "
            "to every ExpertParallelMoE of that group"
        )
    if backend == "torch" and deepep_buffer is not None:
        raise ValueError(
            "deepep_buffer= is only used by backend='deep_ep'; pass deepep_buffer=None with 'torch'"
        )


class ExpertParallelMoE(nn.Module):
    """MoE block with expert parallelism over ``group`` (build it with :meth:`from_full`).

    Args:
        router: the (replicated) :class:`TopKRouter` over all E experts.
        experts: this rank's L experts.
        shared_experts: the (replicated) shared experts, or ``None``.
        group: the expert-parallel process group (``None`` = default group).
        backend: dispatch backend, ``"torch"`` or ``"deep_ep"`` (see :func:`moe_rl.moe.ep.dispatch`).
        deepep_buffer: with ``backend="deep_ep"`` (required there): the caller's ``deep_ep.ElasticBuffer`` from
            :func:`moe_rl.moe.ep.make_deepep_buffer`; one buffer serves every MoE layer of the EP group (they run
            one after another). The module holds a reference; it creates no buffer and no global state.
        align: per-expert row padding for the expert kernel (1 = none, 128 = DeepGEMM contiguous layout).
        chunk_size: tokens per dispatch chunk, or ``None``.
        fp8_dispatch: send the dispatch payload as 1x128 FP8 (``dispatch(..., fp8=True)``; DeepSeek-V3): the local
            experts get the dequantized rows in x's dtype, combine stays in x's dtype, and the gradient reaches x
            through a straight-through estimator of the quantizer. The router and shared experts see the
            unquantized x.
        fp8_combine_backward: also send the gradients in combine's backward as FP8 (``combine(...,
            fp8_backward=True)``).

    Attributes:
        last_handle: the :class:`moe_rl.moe.ep.DispatchHandle` (``"deep_ep"``: ``DeepEPHandle``) of the latest
            forward; pass it back as
            ``forward(x, replay_ids, handle=...)`` when the routing is replayed unchanged, to skip the count
            collective and the layout work.

    Raises:
        ValueError: E is not a multiple of the group size, ``experts`` does not hold E / R experts, ``backend``
            is not "torch" or "deep_ep", or ``deepep_buffer`` is missing with "deep_ep" or given with "torch"
            (checked at construction).
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: GroupedExperts,
        shared_experts: SwiGLUMLP | None,
        group: dist.ProcessGroup | None = None,
        *,
        backend: EPBackend = "torch",
        deepep_buffer: Any = None,
        align: int = 1,
        chunk_size: int | None = None,
        fp8_dispatch: bool = False,
        fp8_combine_backward: bool = False,
    ) -> None:
        _check_ep_backend(backend, deepep_buffer)
        super().__init__()
        world = dist.get_world_size(group)
        if router.num_experts % world != 0:
            raise ValueError(
                f"router.num_experts={router.num_experts} must be a multiple of the EP group size {world}"
            )
        if experts.num_experts != router.num_experts // world:
            raise ValueError(
                f"experts holds {experts.num_experts} experts but rank-local experts should be "
                f"num_experts / ep = {router.num_experts} / {world} = {router.num_experts // world}"
            )
        self.router = router
        self.experts = experts
        self.shared_experts = shared_experts
        self.group = group
        self.ep_rank = dist.get_rank(group)
        self.ep_size = world
        self.backend: EPBackend = backend
        self.deepep_buffer = deepep_buffer
        self.align = align
        self.chunk_size = chunk_size
        self.fp8_dispatch = fp8_dispatch
        self.fp8_combine_backward = fp8_combine_backward
        self.last_handle: DispatchHandle | DeepEPHandle | None = None

    @classmethod
    def from_full(cls, moe: MoE, group: dist.ProcessGroup | None = None, **options: Any) -> ExpertParallelMoE:
        """Copy router and shared experts from a full :class:`MoE` and slice this rank's experts out of it
        (FP8 experts, :class:`moe_rl.moe.fp8_experts.Fp8GroupedExperts`, give FP8 local experts: ``fp8_backend``).

        ``moe`` itself is left unchanged (the new module owns copies of the weights). ``options``: the
        constructor's keyword arguments (``backend``, ``deepep_buffer``, ``align``, ``chunk_size``,
        ``fp8_dispatch``, ``fp8_combine_backward``), passed on unchanged.

        Raises:
            ValueError: unknown ``backend`` or a ``deepep_buffer`` that does not fit it (checked here, before any
                weight is copied), or as the constructor.
            TypeError: an option the constructor does not take (checked here, before any weight is copied).
        """
        allowed = {n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"ExpertParallelMoE.from_full: unexpected keyword arguments {unknown}; the constructor's "
                            f"options are {sorted(allowed)}")
        _check_ep_backend(options.get("backend", "torch"), options.get("deepep_buffer"))
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        num_experts = moe.router.num_experts
        if num_experts % world != 0:
            raise ValueError(
                f"n_routed_experts={num_experts} must be a multiple of the EP group size {world}"
            )
        local = num_experts // world
        full = moe.experts
        experts = LocalExperts(local, full.hidden_size, full.intermediate_size, backend=full.backend)
        experts.fp8_backend = getattr(full, "fp8_backend", None)  # FP8 experts stay FP8 (Fp8GroupedExperts)
        experts.to(device=full.gate_up_proj.device, dtype=full.gate_up_proj.dtype)
        with torch.no_grad():
            experts.gate_up_proj.copy_(full.gate_up_proj[rank * local : (rank + 1) * local])
            experts.down_proj.copy_(full.down_proj[rank * local : (rank + 1) * local])
        return cls(copy.deepcopy(moe.router), experts, copy.deepcopy(moe.shared_experts), group, **options)

    def forward(
        self,
        x: Tensor,
        replay_ids: Tensor | None = None,
        *,
        handle: DispatchHandle | DeepEPHandle | None = None,
    ) -> Tensor:
        """Apply the block (collective: every rank of the group must call it, possibly with 0 tokens).

        Args:
            x: ``[..., D]`` hidden states on this rank.
            replay_ids: optional ``[..., K]`` integer expert ids to replay instead of the router's selection
                (passed to the router as ``replay_ids_TK``).
            handle: a dispatch layout to reuse (e.g. ``self.last_handle`` from a forward with the same
                ``replay_ids``): the ids are not re-read, so they must equal the ones the handle was built from;
                the gate weights are recomputed. All ranks must pass a handle or none.

        Returns:
            Tensor shaped like ``x``, same dtype.
        """
        hidden = x.shape[-1]
        x_TD = x.reshape(-1, hidden)
        top_k = self.router.top_k
        replay_ids_TK = flat_replay_ids(replay_ids, x, top_k)
        topk_ids_TK, topk_weights_TK, _ = self.router(x_TD, replay_ids_TK)
        recv_PD, counts_L, handle = dispatch(
            x_TD,
            topk_ids_TK,
            topk_weights_TK,
            self.group,
            num_experts=self.router.num_experts,
            backend=self.backend,
            buffer=self.deepep_buffer,
            align=self.align,
            chunk_size=self.chunk_size,
            handle=handle,
            fp8=self.fp8_dispatch,
        )
        self.last_handle = handle
        if isinstance(self.experts, LocalExperts):
            y_PD = self.experts(recv_PD, counts_L)
        else:
            y_PD = local_experts_forward(recv_PD, counts_L, self.experts)
        out_TD = combine(y_PD, handle, fp8_backward=self.fp8_combine_backward).to(x.dtype)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(x.shape)

    def extra_repr(self) -> str:
        return (
            f"ep_rank={self.ep_rank}, ep_size={self.ep_size}, backend={self.backend}, align={self.align}, "
            f"chunk_size={self.chunk_size}, fp8_dispatch={self.fp8_dispatch}, "
            f"fp8_combine_backward={self.fp8_combine_backward}"
        )
