"""Optimizer state offload: AdamW moments live in host memory between steps and on the device only for the step.

At GLM-5.1 scale the AdamW moments (2 x fp32 per parameter shard) are the largest per-GPU term of the memory plan
after the activations; moving them to the host between steps frees that memory for the forward/backward peak
(``moe_rl.distributed.memory.plan_memory(optimizer_offload=True)``). This is prime-rl's ``optim_cpu_offload``
(prime-rl PR #1694: "keeps state on CPU and moves it to GPU only for the step"); the mechanism here is our own.

How: after each step every floating-point state tensor (for a DTensor parameter: its local shard) is copied into a
host buffer (pinned when the device is CUDA) and the device storage is released with
``untyped_storage().resize_(0)`` -- the tensor objects, and so the optimizer's references to them, stay valid.
Before the next step the storage is re-allocated and filled from the host. The update is therefore bit-identical to
the plain optimizer's. Scalar ``step`` counters and non-float state are left where the optimizer keeps them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OffloadedOptimizer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's values (a DTensor's local shard; the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class OffloadedOptimizer:
    """Wrap ``optimizer`` so that its state tensors are on ``offload_device`` except during :meth:`step`.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose state tensors are created lazily in ``step`` (AdamW, Adam, SGD
            with momentum...); its parameters may be DTensors (FSDP2 / EP shards).
        offload_device: where the state lives between steps (``"cpu"``).
        pin_memory: pin the host buffers (default: when a parameter is on CUDA), so copies can overlap.

    Attributes:
        offloaded_bytes: bytes of state currently held on ``offload_device`` (0 before the first step).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.

    The wrapper forwards ``zero_grad``, ``param_groups``, ``state``, ``state_dict`` and ``load_state_dict``
    (``state_dict`` restores the states to the device first, so a checkpoint sees ordinary tensors), so LR
    schedulers can take :attr:`optimizer`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, offload_device: str | torch.device = "cpu",
                 pin_memory: bool | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.offload_device = torch.device(offload_device)
        self.pin_memory = pin_memory
        self._host: dict[int, torch.Tensor] = {}  # id(state tensor) -> host copy of its (local) values
        self._offloaded = False
        self.offloaded_bytes = 0

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Restore the state to the parameters' devices, run the optimizer's step, offload the state again."""
        self.restore()
        out = self.optimizer.step(closure)
        self.offload()
        return out

    def _state_tensors(self) -> list[torch.Tensor]:
        return [v for st in self.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]

    @torch.no_grad()
    def offload(self) -> None:
        """Copy every state tensor to ``offload_device`` and free its device storage (idempotent)."""
        if self._offloaded:
            return
        total = 0
        for v in self._state_tensors():
            loc = _local(v)  # copied even when already on offload_device (CPU-only runs): one code path, tested
            host = self._host.get(id(v))
            if host is None or host.shape != loc.shape or host.dtype != loc.dtype:
                pin = loc.device.type == "cuda" if self.pin_memory is None else self.pin_memory
                host = torch.empty(loc.shape, dtype=loc.dtype, device=self.offload_device, pin_memory=pin)
                self._host[id(v)] = host
            host.copy_(loc, non_blocking=True)
            total += host.numel() * host.element_size()
        if any(_local(v).device.type == "cuda" for v in self._state_tensors()):
            torch.cuda.synchronize()  # the copies must land before the storage is released
        for v in self._state_tensors():
            if id(v) in self._host:
                _local(v).untyped_storage().resize_(0)
        self._offloaded = True
        self.offloaded_bytes = total

    @torch.no_grad()
    def restore(self) -> None:
        """Re-allocate the device storage of every offloaded state tensor and fill it from the host (idempotent)."""
        if not self._offloaded:
            return
        for v in self._state_tensors():
            host = self._host.get(id(v))
            if host is None:
                continue
            loc = _local(v)
            loc.untyped_storage().resize_(loc.numel() * loc.element_size())
            loc.copy_(host, non_blocking=True)
        self._offloaded = False
        self.offloaded_bytes = 0

    # -- forwarding ---------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict`` with the state on the device (restored first; offloaded again after)."""
        was = self._offloaded
        self.restore()
        sd = self.optimizer.state_dict()
        sd = {"state": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in s.items()}
                        for k, s in sd["state"].items()},
              "param_groups": sd["param_groups"]}
        if was:
            self.offload()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer (on the device), then offload."""
        self.restore()
        self.optimizer.load_state_dict(state_dict)
        self._host.clear()
        if self.optimizer.state:
            self.offload()
