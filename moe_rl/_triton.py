"""Lazy Triton import and device checks shared by the Triton kernels (``moe_rl.fp8.triton_kernels``,
``moe_rl.attention.triton_indexer``).

Triton is never imported at module import time, so every kernel module imports on a machine without it; the
entry points call :func:`import_triton`, which raises ``ImportError`` with the caller's install hint.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["import_triton", "triton_available", "interpreting", "check_kernel_device"]


def import_triton(install_hint: str) -> tuple[Any, Any]:
    """Return ``(triton, triton.language)``.

    Raises:
        ImportError: Triton cannot be imported; the message starts with ``install_hint``.
    """
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(f"{install_hint} (import failed: {e})") from e
    return triton, tl


def triton_available() -> bool:
    """True when ``import triton`` succeeds (does not check for a GPU)."""
    try:
        import_triton("")
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a non-zero value (kernels run in Triton's CPU interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_kernel_device(caller: str, *tensors: torch.Tensor) -> None:
    """Require every tensor on one device, and that device CUDA unless Triton is interpreting.

    Raises:
        ValueError: tensors on several devices, or on CPU without ``TRITON_INTERPRET=1``; the message names
            ``caller`` and the fix.
    """
    dev = {t.device for t in tensors}
    if len(dev) != 1:
        raise ValueError(f"{caller}: all tensors must be on one device, got {sorted(map(str, dev))}")
    (d,) = dev
    if d.type != "cuda" and not interpreting():
        raise ValueError(
            f"{caller} needs CUDA tensors, got {d}; on CPU use backend='torch', or (tests only) set "
            "TRITON_INTERPRET=1 before triton is first imported to run the kernels in Triton's interpreter"
        )
