"""FP8 routed experts: a :class:`moe_rl.moe.GroupedExperts` whose grouped GEMMs run in FP8 block scaling.

The MoE side of FP8 training; the numerics (quantizers, grouped GEMM, contiguous layout) live in ``moe_rl.fp8``.

Same parameters (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``), names and state dict as
:class:`moe_rl.moe.experts.GroupedExperts`; only ``forward`` differs (:func:`fp8_experts_forward`:
DeepGEMM contiguous layout, 1x128 activations, 128x128 per-expert weights, Wgrad 128x1 along tokens).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from moe_rl.fp8.gemm import check_backend
from moe_rl.fp8.grouped import GroupedBackend, contiguous_layout, fp8_grouped_linear
from moe_rl.moe.experts import GroupedExperts, expert_slots_forward

__all__ = ["Fp8GroupedExperts", "fp8_experts_forward"]


class Fp8GroupedExperts(GroupedExperts):
    """Routed SwiGLU experts computed with FP8 grouped GEMMs; master weights stay in their own dtype.

    Build with :meth:`from_experts` (shares the parameters, so FSDP2 / optimizers / checkpoints see the same
    tensors). ``backend`` selects the grouped GEMM (``"torch"`` | ``"triton"`` | ``"deep_gemm"`` | ``"auto"``).
    """

    fp8_backend: GroupedBackend

    @classmethod
    def from_experts(cls, experts: GroupedExperts, *, backend: GroupedBackend = "torch") -> Fp8GroupedExperts:
        """Return an FP8 module sharing ``experts``' parameters (no copy).

        Raises:
            TypeError: ``experts`` is not a :class:`GroupedExperts`.
            ValueError: unknown ``backend`` (checked here, not at the first forward).
        """
        from moe_rl.fp8.gemm import check_backend

        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"experts: expected a GroupedExperts, got {type(experts).__name__}")
        check_backend(backend)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts = experts.num_experts
        new.hidden_size = experts.hidden_size
        new.intermediate_size = experts.intermediate_size
        new.backend = experts.backend  # the high-precision backend, kept for switching back
        new.gate_up_proj = experts.gate_up_proj
        new.down_proj = experts.down_proj
        new.fp8_backend = backend
        return new

    def forward(self, x_TD: Tensor, topk_ids_TK: Tensor) -> Tensor:
        """``[T, D]`` tokens and ``[T, K]`` int64 ids -> ``[T, K, D]`` unweighted expert outputs (FP8 GEMMs)."""
        return fp8_experts_forward(x_TD, topk_ids_TK, self.gate_up_proj, self.down_proj, backend=self.fp8_backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_backend={self.fp8_backend!r}"


def fp8_experts_forward(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    *,
    backend: GroupedBackend = "torch",
) -> Tensor:
    """FP8 twin of :func:`moe_rl.moe.experts.grouped_experts_forward` (same contract, unweighted outputs).

    Rows are sorted by expert (stable), laid out contiguously with 128-row padding, run through
    ``down(silu(gate(x)) * up(x))`` with both projections as :func:`moe_rl.fp8.grouped.fp8_grouped_linear` (SwiGLU in the input
    dtype), gathered back from the padded buffer and scattered to token order with ``index_copy``.

    Args:
        x_TD: ``[T, D]`` tokens.
        topk_ids_TK: ``[T, K]`` int64 expert ids in ``[0, E)``.
        gate_up_proj: ``[E, 2F, D]``; down_proj: ``[E, D, F]``.
        backend: grouped GEMM backend.

    Returns:
        ``[T, K, D]`` in ``x_TD``'s dtype.

    Raises:
        ValueError: an unknown ``backend`` (checked on entry), or as :func:`moe_rl.fp8.fp8_grouped_linear`.
    """
    check_backend(backend)

    def rows_forward(x_ND: Tensor, counts_E: Tensor) -> Tensor:
        layout = contiguous_layout(counts_E)
        x_MD = x_ND.new_zeros(layout.num_rows, x_ND.shape[1]).index_copy(0, layout.rows, x_ND)
        h_M2F = fp8_grouped_linear(x_MD, gate_up_proj, layout, backend)
        gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
        y_MD = fp8_grouped_linear(F.silu(gate_MF) * up_MF, down_proj, layout, backend)
        return y_MD[layout.rows]

    return expert_slots_forward(x_TD, topk_ids_TK, gate_up_proj.shape[0], rows_forward)
