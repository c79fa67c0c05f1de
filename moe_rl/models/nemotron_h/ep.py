"""Expert parallelism for the Nemotron-H latent MoE: the router, latent projections and shared expert on every rank,
only this rank's slice of the ungated squared-ReLU routed experts.

Shape legend:
    T   tokens on this rank (may be 0)
    D   hidden size
    L   expert width: ``moe_latent_size`` when set (LatentMoE), else D
    F   routed expert intermediate size
    E   routed experts in total; R ranks in the EP group; El = E / R local experts (rank r holds ``[r El, (r+1) El)``)
    K   experts per token
    P   rows received for the local experts (expert-major, :func:`moe_rl.moe.ep.dispatch`)

Computation (the math of :class:`moe_rl.models.nemotron_h.moe.NemotronHMoE`, with the routed part spread over the
ranks; the token-slots move in the latent width L, which is why LatentMoE makes EP cheaper)::

    ids_TK, w_TK  = gate(x_TD)                              # replicated router, w_TK fp32
    z_TL          = fc1_latent_proj(x_TD)                   # replicated, identity without a latent
    recv_PL, counts_El, handle = dispatch(z_TL, ids_TK, w_TK, group)   # backend "torch" (all_to_all_single)
    y_PL          = local_experts(recv_PL, counts_El)       # down_e(relu(up_e(z))^2), unweighted
    out_TL        = combine(y_PL, handle)                   # fp32 weighted sum over K, cast to x dtype
    out_TD        = fc2_latent_proj(out_TL) + shared_experts(x_TD)

The generic :class:`moe_rl.moe.ep.ExpertParallelMoE` holds SwiGLU experts (``gate_up_proj``) under a ``router``;
this block keeps :class:`NemotronHMoE`'s parameter names (``gate``, ``experts.up_proj`` / ``experts.down_proj``
with their global ``[E, ...]`` shapes as DTensors, ``shared_experts``, ``fc1_latent_proj``, ``fc2_latent_proj``),
so a state dict of one layout loads into another.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_rl.models.nemotron_h.moe import NemotronHMoE, ReluSquaredExperts, relu2_rows_forward
from moe_rl.moe.router import flat_replay_ids

__all__ = ["LocalReluSquaredExperts", "NemotronHExpertParallelMoE", "local_relu2_experts_forward"]


def _local(w: Tensor) -> Tensor:
    """This rank's ``[El, ...]`` slice of an expert stack (a DTensor ``Shard(0)`` on the EP mesh after
    :func:`moe_rl.models.nemotron_h.parallelize.parallelize_nemotron_h`; ``to_local`` is differentiable)."""
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


def local_relu2_experts_forward(x_PL: Tensor, counts_El: Tensor, up_proj: Tensor, down_proj: Tensor, *,
                                backend: str, fp8_backend: str | None = None) -> Tensor:
    """Run expert-major rows through the local squared-ReLU experts (unweighted):
    :func:`moe_rl.models.nemotron_h.moe.relu2_rows_forward` of this rank's ``El`` experts.

    Args:
        x_PL: ``[P, L]`` rows sorted by local expert (as :func:`moe_rl.moe.ep.dispatch` returns them).
        counts_El: ``[El]`` int64 rows per local expert, summing to P.
        up_proj: ``[El, F, L]``; down_proj: ``[El, L, F]`` (``y = x @ W^T``).
        backend, fp8_backend: the kernel, as ``relu2_rows_forward`` takes them (every local expert is in the
            autograd graph, so its weight gradient is a zero tensor rather than None even with no rows).

    Returns:
        ``[P, L]`` in ``x_PL``'s dtype.

    Raises:
        ValueError: an unknown backend, or a ``grouped_mm`` dtype/alignment rule is not met.
    """
    return relu2_rows_forward(x_PL, counts_El, up_proj, down_proj, backend=backend, fp8_backend=fp8_backend)


class LocalReluSquaredExperts(ReluSquaredExperts):
    """This EP rank's El experts (``up_proj [El, F, L]``, ``down_proj [El, L, F]``, or DTensors of the global
    ``[E, ...]`` stacks), called on expert-major rows: ``forward(x_PL, counts_El) -> [P, L]``
    (:func:`local_relu2_experts_forward`). Being called as a module lets FSDP2's hooks on it run. ``fp8_backend``
    is copied from the full block's experts by :meth:`NemotronHExpertParallelMoE.from_full`, so FP8 experts stay
    FP8 under expert parallelism."""

    def forward(self, x_PL: Tensor, counts_El: Tensor) -> Tensor:  # type: ignore[override]
        return local_relu2_experts_forward(x_PL, counts_El, _local(self.up_proj), _local(self.down_proj),
                                           backend=self.backend, fp8_backend=self.fp8_backend)


class NemotronHExpertParallelMoE(nn.Module):
    """A :class:`NemotronHMoE` with expert parallelism over ``group`` (module docstring); build it with
    :meth:`from_full`. ``forward(x [..., D], replay_ids [..., K] | None) -> [..., D]`` in ``x``'s dtype; collective
    (every rank of ``group`` calls it, possibly with 0 tokens).

    Gradients of the replicated parts (gate, latent projections, shared expert) are this rank's partial sums over
    its tokens (the data-parallel reduction completes them); the local experts' gradients are complete.
    """

    def __init__(self, gate: nn.Module, experts: LocalReluSquaredExperts, shared_experts: nn.Module,
                 fc1_latent_proj: nn.Module | None, fc2_latent_proj: nn.Module | None, top_k: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts
        self.fc1_latent_proj, self.fc2_latent_proj = fc1_latent_proj, fc2_latent_proj
        self.top_k, self.group = top_k, group
        self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = gate.num_experts

    @classmethod
    def from_full(cls, moe: NemotronHMoE, group: dist.ProcessGroup | None = None) -> NemotronHExpertParallelMoE:
        """Copy the gate, latent projections and shared expert of a full :class:`NemotronHMoE` and slice this
        rank's experts out of it (``moe`` is left unchanged).

        Raises:
            TypeError: ``moe`` is not a ``NemotronHMoE``.
            ValueError: E is not a multiple of the group size.
        """
        if not isinstance(moe, NemotronHMoE):
            raise TypeError(f"moe must be a NemotronHMoE, got {type(moe).__name__}")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        full = moe.experts
        num_experts, inter, width = full.up_proj.shape
        if num_experts % world:
            raise ValueError(f"n_routed_experts={num_experts} must be a multiple of the EP group size {world} (each "
                             "EP rank holds n_routed_experts / ep experts); change ep")
        local = num_experts // world
        with torch.device(full.up_proj.device):
            experts = LocalReluSquaredExperts(local, width, inter, backend=full.backend).to(full.up_proj.dtype)
        experts.fp8_backend = full.fp8_backend  # FP8 experts (ReluSquaredExperts.enable_fp8) stay FP8
        with torch.no_grad():
            experts.up_proj.copy_(full.up_proj[rank * local:(rank + 1) * local])
            experts.down_proj.copy_(full.down_proj[rank * local:(rank + 1) * local])
        return cls(copy.deepcopy(moe.gate), experts, copy.deepcopy(moe.shared_experts),
                   copy.deepcopy(moe.fc1_latent_proj), copy.deepcopy(moe.fc2_latent_proj), moe.top_k, group)

    def forward(self, x: Tensor, replay_ids: Tensor | None = None) -> Tensor:
        """Args: ``x [..., D]``; ``replay_ids`` optional ``[..., K]`` integer expert ids to replay (R3; sentinel
        rows as in :func:`moe_rl.moe.router.topk_route`). Raises ValueError when ``replay_ids`` does not match."""
        from moe_rl.moe.ep import combine, dispatch

        x_TD = x.reshape(-1, x.shape[-1])
        replay_TK = flat_replay_ids(replay_ids, x, self.top_k)
        ids_TK, w_TK, _ = self.gate(x_TD, replay_TK)
        z_TL = x_TD if self.fc1_latent_proj is None else self.fc1_latent_proj(x_TD)
        recv_PL, counts_El, handle = dispatch(z_TL, ids_TK, w_TK, self.group, num_experts=self.num_experts)
        out_TL = combine(self.experts(recv_PL, counts_El), handle).to(x.dtype)
        out_TD = out_TL if self.fc2_latent_proj is None else self.fc2_latent_proj(out_TL)
        return (out_TD + self.shared_experts(x_TD)).view(x.shape)

    def extra_repr(self) -> str:
        return f"ep_rank={self.ep_rank}, ep_size={self.ep_size}, num_experts={self.num_experts}"
