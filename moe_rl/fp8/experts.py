"""FP8 routed experts: a :class:`moe_rl.moe.GroupedExperts` whose grouped GEMMs run in FP8 block scaling.

Same parameters (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``), names and state dict as
:class:`moe_rl.moe.experts.GroupedExperts`; only ``forward`` differs (:func:`moe_rl.fp8.grouped.fp8_experts_forward`:
DeepGEMM contiguous layout, 1x128 activations, 128x128 per-expert weights, Wgrad 128x1 along tokens).
"""

from __future__ import annotations

from torch import Tensor, nn

from moe_rl.fp8.grouped import GroupedBackend, fp8_experts_forward
from moe_rl.moe.experts import GroupedExperts

__all__ = ["Fp8GroupedExperts"]


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
