"""Random inputs of the Mamba-2 SSD scan, shared by the single-process tests (``tests/ssm/test_ssd.py``) and the
context-parallel rank worker (``tests/ssm/_cp_worker.py``), so both exercise the same value ranges."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_inputs(b: int = 2, T: int = 37, H: int = 4, P: int = 8, G: int = 2, N: int = 16, seed: int = 0):
    """Seeded fp32 inputs of :func:`moe_rl.ssm.ssd_scan` and cotangents for its two outputs.

    Values are of unit scale: ``x, D, h0`` standard normal; ``dt = softplus(n - 2)`` (Mamba-2's range, ~0.01 ..
    0.5); ``A = -exp(n)`` (negative, so every decay is < 1); ``B, C`` normal times ``N ** -0.5`` (a normalized
    projection, ``|C . B| ~ 1``).

    Returns:
        ``(x [b, T, H, P], dt [b, T, H], A [H], B [b, T, G, N], C [b, T, G, N], D [H], h0 [b, H, P, N],
        gy [b, T, H, P], gh [b, H, P, N])``: the scan's arguments in call order, then the cotangents of ``y`` and
        of the final state. The same ``seed`` gives the same tensors on every process.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, H, P, generator=g)
    dt = F.softplus(torch.randn(b, T, H, generator=g) - 2.0)
    A = -torch.exp(torch.randn(H, generator=g))
    B = torch.randn(b, T, G, N, generator=g) * N ** -0.5
    C = torch.randn(b, T, G, N, generator=g) * N ** -0.5
    D = torch.randn(H, generator=g)
    h0 = torch.randn(b, H, P, N, generator=g)
    gy = torch.randn(b, T, H, P, generator=g)
    gh = torch.randn(b, H, P, N, generator=g)
    return x, dt, A, B, C, D, h0, gy, gh
