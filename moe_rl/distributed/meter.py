"""Measured memory of a CPU (or any-device) run: live tensor-storage bytes and their peak, per device.

:class:`LiveBytesMeter` is a ``TorchDispatchMode`` that records the storage of every tensor an ATen op returns
and forgets it when the storage is freed (checked through ``StorageWeakRef``, as
``torch.distributed._tools.mem_tracker`` does), so its ``peak_bytes`` is the high-water mark of bytes held by
live tensors, the quantity a GPU caching allocator's ``max_memory_allocated`` reports minus fragmentation. It
works on CPU, where no allocator statistics exist, and is what :mod:`moe_rl.distributed.memory` is checked against.

Tensors created before the mode is entered (parameters, an existing optimizer state) must be added with
:meth:`LiveBytesMeter.track` *before* running ops on them: otherwise the first view of such a tensor taken
inside the mode (a ``.t()`` of a weight, a ``reshape``) is counted as new storage. Tensor subclasses (DTensor) are
counted through their inner tensors (``__tensor_flatten__``). Overhead: O(live storages) per op, fine for the small models
it is meant for. ``UntypedStorage.resize_`` (how FSDP2 frees and refills its all-gather buffers without freeing
the storage object) does not go through the dispatcher, so it is patched while the mode is active, as
``torch.distributed._tools.mem_tracker`` does.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytesMeter"]


class LiveBytesMeter(TorchDispatchMode):
    """Track live tensor-storage bytes and their peak while active.

    Attributes:
        current_bytes: bytes held right now by tracked storages, summed over devices.
        peak_bytes: the maximum of ``current_bytes`` seen after any op (or :meth:`track` call).
        peak_by_device: the same per device (``str(device)`` -> bytes).

    Example::

        meter = LiveBytesMeter()
        meter.track(*model.parameters())
        with meter:
            model(x).sum().backward()
        print(meter.peak_bytes)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._dev_current: dict[str, int] = defaultdict(int)
        self.peak_by_device: dict[str, int] = defaultdict(int)

    def _purge(self) -> None:
        dead = [k for k, (ref, _, _) in self._live.items() if ref.expired()]
        for k in dead:
            _, n, dev = self._live.pop(k)
            self.current_bytes -= n
            self._dev_current[dev] -= n

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            # a wrapper subclass (DTensor, ...): its inner tensors hold the memory; the ops that made them ran
            # inside the subclass's own dispatch, below this mode, so they are counted here
            flatten = getattr(t, "__tensor_flatten__", None)
            if flatten is not None:
                for name in flatten()[0]:
                    self._add(getattr(t, name))
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        n, dev = st.nbytes(), str(t.device)
        self._live[key] = (StorageWeakRef(st), n, dev)
        self.current_bytes += n
        self._dev_current[dev] += n

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        for dev, n in self._dev_current.items():
            self.peak_by_device[dev] = max(self.peak_by_device[dev], n)

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors created outside the mode (parameters, buffers, optimizer state)."""
        self._purge()
        for t in tensors:
            self._add(t)
        self._update_peak()

    def _resized(self, st: torch.UntypedStorage) -> None:
        """Account a ``UntypedStorage.resize_`` (FSDP2 frees and refills its all-gather buffers this way)."""
        key = st._cdata
        if key in self._live:
            ref, old, dev = self._live[key]
            new = st.nbytes()
            self._live[key] = (ref, new, dev)
            self.current_bytes += new - old
            self._dev_current[dev] += new - old
        elif st.device.type != "meta":
            n, dev = st.nbytes(), str(st.device)
            self._live[key] = (StorageWeakRef(st), n, dev)
            self.current_bytes += n
            self._dev_current[dev] += n
        self._update_peak()

    def __enter__(self):
        orig = torch.UntypedStorage.resize_
        meter = self

        def resize_(st, size):
            out = orig(st, size)
            meter._resized(st)
            return out

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_  # ``resize_`` does not go through the dispatcher
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        """Set ``peak_bytes`` (and per device) to the bytes live now."""
        self._purge()
        self.peak_bytes = self.current_bytes
        self.peak_by_device = defaultdict(int, self._dev_current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._purge()
        for t in tree_flatten(out)[0]:
            self._add(t)
        self._update_peak()
        return out
