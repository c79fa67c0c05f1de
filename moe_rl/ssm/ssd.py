"""The Mamba-2 selective state-space scan: the chunked SSD algorithm and its sequential float64 reference.

Shape legend (token-major, one sequence per row):
    b   rows (each row its own sequence; the state starts at ``initial_state`` or zero at token 0)
    T   tokens per row
    H   SSM heads
    P   head dim (channels per head)
    G   B/C groups (``n_groups``); head ``h`` reads group ``h // (H // G)``, so ``H % G == 0``
    N   state size per channel (``ssm_state_size``)
    L   chunk size; ``c = ceil(T / L)`` chunks

The recurrence (Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", ICML 2024, eq. for the selective SSM with scalar ``A`` per head), for every row, head and
channel ``p``::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t * B_t        h: [P, N] per head, h_{-1} = initial_state (or 0)
    y_t = h_t @ C_t + D * x_t

:func:`ssd_scan` computes it with the paper's state-space-duality (SSD) chunked algorithm: inside each chunk of
``L`` tokens the output is a masked quadratic form (``y = (C B^T o Lmask) (dt x)``, the "attention-like" diagonal
blocks); each chunk's end state (with a zero start) is a sum over its tokens; the start state of every chunk comes
from the inter-chunk recurrence written as a second segment-sum matrix over chunks; the off-diagonal blocks add
``exp(cumsum a) * C_t . h_start``. Decay products are ``exp`` of *segment sums* (``sum_{s < i <= l} a_i``), each a
masked cumulative sum of the per-token log-decays (never a difference of two long prefix sums, which would lose
the small segments to cancellation).

Cost: ``O(b c L^2 H (N + P))`` for the diagonal blocks and ``O(b c^2 H P N)`` for the inter-chunk segment-sum
product (the state recurrence as one matmul over chunks), memory ``O(b c L^2 H + b c H P N)``. A plain PyTorch
reference implementation: no fused kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SSDOutput", "segment_sum", "ssd_scan", "ssd_sequential"]


class SSDOutput(NamedTuple):
    """``y``: ``[b, T, H, P]`` scan output (``D`` skip included). ``final_state``: ``[b, H, P, N]`` the state after
    the last token (for a CP rank: after its last token). Both in the compute dtype (fp32 for fp32/bf16/fp16
    inputs, fp64 for fp64 inputs)."""

    y: Tensor
    final_state: Tensor


def segment_sum(a: Tensor) -> Tensor:
    """``a [..., L] -> [..., L, L]``: ``out[..., l, s] = sum_{s < i <= l} a_i`` for ``s <= l`` (0 on the diagonal)
    and ``-inf`` above it, so ``exp(out)`` is the causal decay matrix from position ``s`` to position ``l``.

    Each entry is a masked cumulative sum over the segment itself (Dao & Gu 2024, ``segsum``), not
    ``cumsum[l] - cumsum[s]``: the difference of two long prefix sums loses a short segment's value to
    cancellation in fp32.
    """
    n = a.shape[-1]
    x = a.unsqueeze(-1).expand(*a.shape, n)  # x[..., i, s] = a_i
    keep = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)  # i > s
    seg = torch.cumsum(x.masked_fill(~keep, 0.0), dim=-2)  # seg[..., l, s] = sum_{s < i <= l} a_i
    causal = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(0)
    return seg.masked_fill(~causal, float("-inf"))


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
           initial_state: Tensor | None) -> tuple[int, int, int, int, int, int]:
    """Validate the scan's inputs; return ``(b, T, H, P, G, N)``."""
    if x.dim() != 4:
        raise ValueError(f"x has shape {tuple(x.shape)}: it must be [b, T, H, P] (rows, tokens, heads, head dim)")
    b, T, H, P = x.shape
    if tuple(dt.shape) != (b, T, H):
        raise ValueError(f"dt has shape {tuple(dt.shape)}: it must be [b, T, H] = {(b, T, H)} (one step per token "
                         "and head, after softplus)")
    if tuple(A.shape) != (H,):
        raise ValueError(f"A has shape {tuple(A.shape)}: it must be [H] = ({H},) (one scalar per head)")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, T):
        raise ValueError(f"B has shape {tuple(B.shape)}: it must be [b, T, G, N] with b, T = {(b, T)}")
    if tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"C has shape {tuple(C.shape)}: it must equal B's shape {tuple(B.shape)}")
    G, N = B.shape[2], B.shape[3]
    if G < 1 or H % G:
        raise ValueError(f"B/C have G={G} groups and x has H={H} heads: H must be a multiple of G (head h reads "
                         "group h // (H // G)); fix n_groups")
    if D is not None and tuple(D.shape) != (H,):
        raise ValueError(f"D has shape {tuple(D.shape)}: it must be [H] = ({H},) or None")
    if initial_state is not None and tuple(initial_state.shape) != (b, H, P, N):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}: it must be [b, H, P, N] = "
                         f"{(b, H, P, N)} or None")
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}: the scan needs floating-point inputs")
    return b, T, H, P, G, N


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, chunk_size: int,
             D: Tensor | None = None, initial_state: Tensor | None = None) -> SSDOutput:
    """The Mamba-2 selective scan by the chunked SSD algorithm (Dao & Gu 2024, section 6 / ``ssd_minimal``).

    Args:
        x: ``[b, T, H, P]`` scan input (the conv output's ``x`` part, split into heads).
        dt: ``[b, T, H]`` time steps, already discretized (``softplus(dt_raw + dt_bias)``, clamped); > 0.
        A: ``[H]`` the per-head decay rate (``-exp(A_log)``; < 0).
        B, C: ``[b, T, G, N]`` input and output projections of the state, ``G`` groups shared by ``H // G``
            consecutive heads each.
        chunk_size: ``L``, tokens per chunk (any ``T``: the last chunk is padded with ``dt = 0``, which neither
            decays nor feeds the state, and the padding is cut from ``y``).
        D: ``[H]`` skip weight (``y += D[h] * x``), or None.
        initial_state: ``[b, H, P, N]`` the state before token 0, or None (zero).

    Returns:
        :class:`SSDOutput` ``(y [b, T, H, P], final_state [b, H, P, N])`` in fp32 (fp64 for fp64 ``x``); inputs
        of other dtypes are promoted, as Hugging Face's and the reference kernels' scans do.

    Raises:
        ValueError: a shape that does not fit the legend, ``H % G != 0``, or ``chunk_size < 1``.
        TypeError: integer inputs.
    """
    b, T, H, P, G, N = _check(x, dt, A, B, C, D, initial_state)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: it must be an int >= 1 (tokens per chunk; Nemotron-H uses 128)")
    f = _compute_dtype(x)
    R, L = H // G, chunk_size
    pad = (-T) % L
    c = (T + pad) // L

    x, dt, A, B, C = x.to(f), dt.to(f), A.to(f), B.to(f), C.to(f)
    a = dt * A  # [b, T, H] per-token log-decay (<= 0)
    xd = x * dt.unsqueeze(-1)  # [b, T, H, P] discretized input
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
        xd = F.pad(xd, (0, 0, 0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))

    a = a.view(b, c, L, G, R).permute(0, 3, 4, 1, 2)  # [b, G, R, c, L]
    xc = xd.view(b, c, L, G, R, P)
    Bc, Cc = B.view(b, c, L, G, N), C.view(b, c, L, G, N)

    decay = torch.exp(segment_sum(a))  # [b, G, R, c, L, L]: decay from s to l inside a chunk
    a_cum = torch.cumsum(a, dim=-1)  # [b, G, R, c, L]: log-decay from the chunk start to l (inclusive)

    # 1. diagonal blocks: y_l = sum_{s <= l} (C_l . B_s) decay[l, s] dt_s x_s
    cb = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # [b, G, c, L, L]
    y_diag = torch.einsum("bgcls,bgrcls,bcsgrp->bclgrp", cb, decay, xc)

    # 2. each chunk's end state from a zero start: sum_s decay[L-1, s] dt_s x_s B_s^T
    states = torch.einsum("bcsgn,bgrcs,bcsgrp->bcgrpn", Bc, decay[..., -1, :], xc)  # [b, c, G, R, P, N]

    # 3. inter-chunk recurrence as a segment-sum matrix over chunks: start state of chunk j (j = c: the final state)
    h0 = (initial_state.to(f).view(b, 1, G, R, P, N) if initial_state is not None
          else states.new_zeros(b, 1, G, R, P, N))
    states = torch.cat([h0, states], dim=1)  # [b, c + 1, G, R, P, N]; entry z >= 1: end of chunk z - 1
    chunk_decay = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [b, G, R, c + 1, c + 1]
    starts = torch.einsum("bgrjz,bzgrpn->bjgrpn", chunk_decay, states)  # [b, c + 1, G, R, P, N]

    # 4. off-diagonal blocks: y_l += exp(a_cum[l]) C_l . h_start
    y_off = torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, starts[:, :c], torch.exp(a_cum))

    y = (y_diag + y_off).reshape(b, c * L, H, P)[:, :T]
    if D is not None:
        y = y + D.to(f).view(1, 1, H, 1) * x
    return SSDOutput(y, starts[:, c].reshape(b, H, P, N))


def ssd_sequential(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
                   initial_state: Tensor | None = None) -> SSDOutput:
    """The same scan as :func:`ssd_scan`, token by token (the recurrence in this module's docstring).

    The reference for tests (run it in float64) and the decode step's semantics: ``T`` steps of
    ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``. Same arguments, shapes, dtypes and errors as
    :func:`ssd_scan` (no ``chunk_size``). Cost ``O(b T H P N)`` in ``T`` sequential steps.
    """
    b, T, H, P, G, N = _check(x, dt, A, B, C, D, initial_state)
    f = _compute_dtype(x)
    R = H // G
    x, dt, A = x.to(f), dt.to(f), A.to(f)
    Bh = B.to(f).repeat_interleave(R, dim=2)  # [b, T, H, N]
    Ch = C.to(f).repeat_interleave(R, dim=2)
    h = initial_state.to(f) if initial_state is not None else x.new_zeros(b, H, P, N)
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)  # [b, H]
        h = decay[:, :, None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)
    if D is not None:
        y = y + D.to(f).view(1, 1, H, 1) * x
    return SSDOutput(y, h)
