"""Reference attention on packed sequences: per-query key windows, GQA, log-sum-exp, the stable LSE merge.

Shape legend:
    T   tokens of the packed stream (all sequences concatenated, plus any CP padding at the end)
    Tq  query tokens held by this call (a CP shard or the whole stream)
    Tk  key tokens held by this call
    H   query heads
    Hkv key/value heads (H = Hkv * G, G query heads per KV head; query head h reads KV head h // G)
    D   query/key head dim
    Dv  value head dim
    N   packed sequences
    B   rows: independent packed streams of one batch (optional leading dim; every row has the same ``T``,
        ``cu_seqlens`` and sharding, so masks are built once per call and broadcast over the rows)

Every token carries its **token index**: its absolute position in the packed stream ``[0, T)``. Sequence ``n``
occupies token indices ``[cu_seqlens[n], cu_seqlens[n+1])``. Masks are built from token indices, never from
row numbers, so they stay right under any sharding (contiguous, zigzag, a later ring hop, a query block that is
not at offset 0; onnx/onnx issue #8054). Query ``t`` sees the keys whose token index ``s`` lies in its **key window**
``ks[t] <= s < ke[t]``::

    causal=True : ks = start of t's sequence, ke = t + 1       (bottom-right aligned on absolute positions)
    causal=False: ks = start of t's sequence, ke = end of it

    two packed sequences [0,3) and [3,5), causal        token indices beyond cu_seqlens[-1] (CP padding)
        s: 0 1 2 3 4                                        have the empty window ks = ke = 0: they see no
    t=0    x . . . .                                        key, and no real query sees them.
    t=1    x x . . .
    t=2    x x x . .
    t=3    . . . x .
    t=4    . . . x x

A query row with no visible key returns output 0 and LSE ``-inf`` (never NaN), so it merges as a no-op.

Batched rows: :func:`windowed_attention` (and the CP functions built on it) also take ``q [B, Tq, H, D]``,
``k``/``v [B, Tk, Hkv, D]``: B rows, each its own packed stream of token indices ``[0, T)`` with the same
``cu_seqlens``. Windows ``[Tq]`` and key indices ``[Tk]`` then apply to every row (one ``[Tq, Tk]`` mask
broadcast over B), or ``[B, Tq]`` / ``[B, Tk]`` give each row its own. This costs ``B * Tq * Tk``, where
flattening the rows into one packed stream of ``B * T`` tokens would cost ``(B * Tq) * (B * Tk)``.

Sources: the masking convention is flash-attn's varlen ``cu_seqlens`` with bottom-right causal alignment
(Dao-AILab/flash-attention ``flash_attn_interface.py``); the LSE merge is the one of ring attention
(Liu et al., arXiv 2310.01889) and ring-flash-attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "AttentionOutput",
    "ContextParallelAttention",
    "attention_reference",
    "check_qkv",
    "check_token_idx",
    "key_windows",
    "merge_attention",
    "visible_mask",
    "windowed_attention",
]


class AttentionOutput(NamedTuple):
    """``out``: ``[(B,) Tq, H, Dv]`` in the query dtype; ``lse``: ``[(B,) Tq, H]`` fp32 (fp64 for fp64 inputs)
    natural-log sum of ``exp(scale * q.k)`` over the visible keys (``-inf`` for a row with no visible key)."""

    out: Tensor
    lse: Tensor


class ContextParallelAttention(torch.nn.Module):
    """Base of the ``nn.Module`` wrappers of the context-parallel attention functions (``RingAttention``,
    ``UlyssesAttention``): it holds the process group, the causal flag and the scale (no parameters) and calls the
    subclass's ``attention`` function.

    Args:
        group: the context-parallel process group (None: the default group).
        causal: causal masking within each packed sequence.
        scale: softmax scale; None: ``head_dim ** -0.5``.

    ``forward(q, k, v, token_idx, cu_seqlens) -> out [(B,) Tl, H, Dv]``: this rank's query rows, as the function's
    ``AttentionOutput.out`` (shapes, dtypes and errors: the function's docstring).
    """

    attention: Callable[..., AttentionOutput]  # set by each subclass, as a staticmethod

    def __init__(self, group: dist.ProcessGroup | None = None, *, causal: bool = True,
                 scale: float | None = None) -> None:
        super().__init__()
        self.group, self.causal, self.scale = group, causal, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, token_idx: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.attention(q, k, v, token_idx=token_idx, cu_seqlens=cu_seqlens, causal=self.causal,
                              scale=self.scale, group=self.group).out


def _check_int_vector(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a 1-D integer tensor, got {got}")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 (so fp64 references stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def default_cu_seqlens(total: int, device: torch.device | None = None) -> Tensor:
    """``[0, total]`` as int64: the whole stream is one sequence."""
    return torch.tensor([0, total], dtype=torch.int64, device=device)


def key_windows(token_idx: Tensor, cu_seqlens: Tensor, *, causal: bool) -> tuple[Tensor, Tensor]:
    """Per-query key window ``[ks, ke)`` in token-index coordinates.

    Args:
        token_idx: ``[Tq]`` integer token index of each query in the packed stream.
        cu_seqlens: ``[N + 1]`` integer, non-decreasing, ``cu_seqlens[0] == 0``; the real stream length is
            ``cu_seqlens[-1]``. Tokens at or beyond it are padding.
        causal: bottom-right causal window (``ke = t + 1``) or the whole sequence.

    Returns:
        ``(ks, ke)``, each ``[Tq]`` int64. Padding queries (and any index outside ``[0, cu_seqlens[-1])``)
        get the empty window ``(0, 0)``.

    Raises:
        TypeError: non-integer inputs. ValueError: ``cu_seqlens`` empty, not starting at 0, or decreasing.
    """
    _check_int_vector("token_idx", token_idx)
    _check_int_vector("cu_seqlens", cu_seqlens)
    if cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and hold at least 2 entries, got {cu_seqlens.tolist()}"
        )
    cu = cu_seqlens.to(device=token_idx.device, dtype=torch.int64)
    t = token_idx.to(torch.int64)
    n = cu.numel() - 1
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, n - 1)
    valid = (t >= 0) & (t < cu[-1])
    ks = cu[seq]
    ke = t + 1 if causal else cu[seq + 1]
    zero = torch.zeros_like(t)
    return torch.where(valid, ks, zero), torch.where(valid, ke, zero)


def visible_mask(ks: Tensor, ke: Tensor, k_idx: Tensor) -> Tensor:
    """``[Tq, Tk]`` bool: key ``j`` (token index ``k_idx[j]``) is visible to query ``i``.

    Leading batch dims broadcast: ``ks``/``ke [..., Tq]`` and ``k_idx [..., Tk]`` give ``[..., Tq, Tk]``."""
    k = k_idx.to(torch.int64).unsqueeze(-2)
    return (k >= ks.unsqueeze(-1)) & (k < ke.unsqueeze(-1))


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """Validate ``q [(B,) Tq, H, D]``, ``k [(B,) Tk, Hkv, D]``, ``v [(B,) Tk, Hkv, Dv]``; return ``(H, Hkv)``.

    Raises:
        ValueError: wrong ranks (3-D packed or 4-D batched, the same for q, k, v), different row counts B,
            mismatched token counts / head dims / dtypes, or H not a multiple of Hkv.
    """
    if q.dim() not in (3, 4) or not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            "q, k, v must all be [tokens, heads, head_dim] or all [rows, tokens, heads, head_dim]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.dim() == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k, v must have the same number of rows B (dim 0); got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [tokens, kv_heads]")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} != k head_dim {k.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    H, Hkv = q.shape[-2], k.shape[-2]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"query heads H={H} must be a positive multiple of kv heads Hkv={Hkv} (GQA)")
    return H, Hkv


def check_token_idx(fn: str, token_idx: Tensor, q: Tensor, k: Tensor) -> None:
    """Validate the token indices of a CP self-attention call: ``[Tl]`` (packed ``q [Tl, H, D]``, or shared by
    every row of a batched ``q [B, Tl, H, D]``) or ``[B, Tl]`` (batched only), with ``Tl`` equal to q's and k's
    token counts.

    Raises:
        TypeError: ``token_idx`` is not an integer tensor. ValueError: wrong rank or sizes.
    """
    if not isinstance(token_idx, Tensor) or token_idx.dtype.is_floating_point or token_idx.dtype == torch.bool:
        got = f"{tuple(token_idx.shape)} {token_idx.dtype}" if isinstance(token_idx, Tensor) else type(token_idx).__name__
        raise TypeError(f"{fn}: token_idx must be an integer tensor, got {got}")
    ok_dims = (1, 2) if q.dim() == 4 else (1,)
    if token_idx.dim() not in ok_dims or (token_idx.dim() == 2 and token_idx.shape[0] != q.shape[0]):
        raise ValueError(
            f"{fn}: token_idx {tuple(token_idx.shape)} must be [Tl]"
            + (f" or [B={q.shape[0]}, Tl] (one row of indices per batch row)" if q.dim() == 4 else "")
            + f" for q {tuple(q.shape)}"
        )
    if not (q.shape[-3] == k.shape[-3] == token_idx.shape[-1]):
        raise ValueError(f"{fn} is self-attention: q {q.shape[-3]}, k {k.shape[-3]} and token_idx "
                         f"{token_idx.shape[-1]} token counts must be equal")


def _softmax_stats(scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For masked (``-inf``) fp32 scores ``[..., Tk]``: probabilities, lse, and whether the row has any key.
    Empty rows give probabilities 0 and lse -inf with finite gradients."""
    m = scores.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    s = e.sum(dim=-1, keepdim=True)
    has = s > 0
    s_safe = torch.where(has, s, torch.ones_like(s))
    lse = torch.where(has, m + torch.log(s_safe), torch.full_like(s, -math.inf)).squeeze(-1)
    return e / s_safe, lse, has.squeeze(-1)


def windowed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ks: Tensor,
    ke: Tensor,
    k_idx: Tensor,
    scale: float | None = None,
) -> AttentionOutput:
    """Dense masked attention with explicit key windows (differentiable with plain autograd).

    Args:
        q: ``[Tq, H, D]`` or batched ``[B, Tq, H, D]``. k: ``[(B,) Tk, Hkv, D]``. v: ``[(B,) Tk, Hkv, Dv]``
            (same dtype; math in fp32).
        ks, ke: ``[Tq]`` int64 key windows from :func:`key_windows` (shared by every row), or ``[B, Tq]``.
        k_idx: ``[Tk]`` token index of each key row (shared by every row), or ``[B, Tk]``.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        :class:`AttentionOutput` (``out [(B,) Tq, H, Dv]`` in q's dtype, ``lse [(B,) Tq, H]`` fp32). Each row
        is computed independently (cost ``B * Tq * Tk``); the mask is built once and broadcast over B.
    """
    H, Hkv = check_qkv(q, k, v)
    G = H // Hkv
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    vis = visible_mask(ks, ke, k_idx)  # [(B,) Tq, Tk]
    acc = acc_dtype(q.dtype)
    kf = k.to(acc).repeat_interleave(G, dim=-2)  # [(B,) Tk, H, D]
    vf = v.to(acc).repeat_interleave(G, dim=-2)
    scores = torch.einsum("...thd,...shd->...hts", q.to(acc), kf) * scale  # [(B,) H, Tq, Tk]
    scores = scores.masked_fill(~vis.unsqueeze(-3), -math.inf)
    p, lse, _ = _softmax_stats(scores)
    out = torch.einsum("...hts,...shd->...thd", p, vf)
    return AttentionOutput(out.to(q.dtype), lse.transpose(-1, -2).contiguous())


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    q_token_idx: Tensor | None = None,
    k_token_idx: Tensor | None = None,
    scale: float | None = None,
) -> AttentionOutput:
    """Single-process attention over packed sequences with GQA (the oracle for every CP method here).

    Args:
        q: ``[Tq, H, D]`` fp32/bf16/fp64. k: ``[Tk, Hkv, D]``. v: ``[Tk, Hkv, Dv]``; H a multiple of Hkv. Or
            batched ``[B, Tq, H, D]`` etc.: B rows with the same boundaries and token indices (module docstring).
        causal: bottom-right causal mask on absolute token indices.
        cu_seqlens: ``[N + 1]`` packed-sequence boundaries; default one sequence of ``Tk`` tokens.
        q_token_idx: ``[Tq]`` token indices of the queries; default ``arange(Tq) + (Tk - Tq)`` (the query
            block is the *last* Tq tokens, as in chunked prefill: onnx/onnx issue #8054).
        k_token_idx: ``[Tk]`` token indices of the keys; default ``arange(Tk)``.
        scale: default ``D ** -0.5``.

    Returns:
        :class:`AttentionOutput`; rows with no visible key give ``out = 0`` and ``lse = -inf``.
    """
    Tq, Tk = q.shape[-3], k.shape[-3]
    dev = q.device
    if k_token_idx is None:
        k_token_idx = torch.arange(Tk, device=dev)
    if q_token_idx is None:
        q_token_idx = torch.arange(Tq, device=dev) + (Tk - Tq)
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(Tk, dev)
    ks, ke = key_windows(q_token_idx, cu_seqlens, causal=causal)
    return windowed_attention(q, k, v, ks=ks, ke=ke, k_idx=k_token_idx, scale=scale)


def merge_attention(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets (numerically stable, ``-inf``-safe).

    ``lse = m + log(e^{lse1-m} + e^{lse2-m})`` with ``m = max(lse1, lse2)``, and
    ``out = (e^{lse1-m} out1 + e^{lse2-m} out2) / (e^{lse1-m} + e^{lse2-m})``; equal to the sigmoid form
    ``out1 - sigmoid(lse2 - lse1) (out1 - out2)`` where both are finite. A side with ``lse = -inf`` contributes
    nothing; two empty sides give ``out = 0``, ``lse = -inf``.

    Args:
        out1, out2: ``[(B,) Tq, H, Dv]`` fp32. lse1, lse2: ``[(B,) Tq, H]`` fp32.

    Returns:
        ``(out [(B,) Tq, H, Dv] fp32, lse [(B,) Tq, H] fp32)``.
    """
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e1, e2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    s = e1 + e2
    has = s > 0
    s_safe = torch.where(has, s, torch.ones_like(s))
    out = (out1 * e1[..., None] + out2 * e2[..., None]) / s_safe[..., None]
    lse = torch.where(has, m + torch.log(s_safe), torch.full_like(s, -math.inf))
    return out, lse
