"""Ring attention: queries stay, KV blocks rotate around the CP ring with isend/irecv; causal + zigzag balanced.

Shape legend:
    B    rows (optional leading dim): independent packed streams with the same sharding, computed together
    Tl   tokens per rank (queries and keys of this rank; equal on every rank)
    H    query heads, Hkv key/value heads (GQA, H = Hkv * G)
    D    head dim, Dv value head dim
    cp   ranks in the ring

Forward (Liu et al., "Ring Attention with Blockwise Transformers", arXiv 2310.01889): at hop ``s`` rank ``r``
holds the KV block of rank ``(r - s) mod cp`` and starts sending it to ``r + 1`` (``batch_isend_irecv``) before
computing on it, so the transfer overlaps the block's attention. Each hop's partial output and LSE are merged
with :func:`moe_rl.attention.core.merge_attention`. Masks come from the *token indices* of the queries and of the
visiting block (onnx/onnx issue #8054): a block wholly before the query's window start or after its causal end has no visible
key and is skipped (LSE ``-inf``); the diagonal block gets the causal triangle on absolute positions; a row with
no visible key anywhere returns 0 / ``-inf``. With the zigzag layout (:mod:`moe_rl.attention.layout`) every rank
does the same causal work.

Backward (a custom ``autograd.Function``; the flash-attention gradient with the saved global LSE,
``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O))``): the KV blocks rotate again; at each hop the rank adds
its dQ contribution locally and adds dK/dV for the visiting block into fp32 accumulators that travel *with*
the block; after ``cp`` hops each accumulator has visited every rank and the last send returns it to the
block's owner. The LSE output carries no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.attention.comm import all_gather_rows, check_same_across_ranks, ring_exchange
from moe_rl.attention.core import (
    AttentionOutput,
    ContextParallelAttention,
    acc_dtype,
    check_qkv,
    check_token_idx,
    key_windows,
    merge_attention,
    visible_mask,
)

__all__ = ["RingAttention", "ring_attention"]


def _scores(q: Tensor, k: Tensor, vis: Tensor, scale: float, G: int) -> Tensor:
    """``[(B,) H, Tq, Tk]`` masked fp32 scores; ``vis [(B,) Tq, Tk]`` broadcasts over the heads (and rows)."""
    acc = acc_dtype(q.dtype)
    kf = k.to(acc).repeat_interleave(G, dim=-2)
    s = torch.einsum("...thd,...shd->...hts", q.to(acc), kf) * scale
    return s.masked_fill(~vis.unsqueeze(-3), -math.inf)


def _block_fwd(q: Tensor, k: Tensor, v: Tensor, vis: Tensor, scale: float, G: int) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, vis, scale, G)  # [(B,) H, Tq, Tk]
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    tot = e.sum(-1, keepdim=True)
    has = tot > 0
    tot_safe = torch.where(has, tot, torch.ones_like(tot))
    lse = torch.where(has, m + torch.log(tot_safe), torch.full_like(tot, -math.inf)).squeeze(-1)
    out = torch.einsum("...hts,...shd->...thd", e / tot_safe, v.to(s.dtype).repeat_interleave(G, dim=-2))
    return out, lse.transpose(-1, -2)


def _block_bwd(q, k, v, vis, scale, G, lse, dout, delta):
    """Gradients of one (query block, KV block) pair given the *global* lse [(B,) Tq, H] and delta [(B,) Tq, H]."""
    s = _scores(q, k, vis, scale, G)  # [(B,) H, Tq, Tk]
    lse_h = lse.transpose(-1, -2)[..., None]
    p = torch.exp(s - torch.where(torch.isfinite(lse_h), lse_h, torch.zeros_like(lse_h)))
    vf = v.to(s.dtype).repeat_interleave(G, dim=-2)
    kf = k.to(s.dtype).repeat_interleave(G, dim=-2)
    dv = torch.einsum("...hts,...thd->...shd", p, dout)
    dp = torch.einsum("...thd,...shd->...hts", dout, vf)
    ds = p * (dp - delta.transpose(-1, -2)[..., None])
    dq = torch.einsum("...hts,...shd->...thd", ds, kf) * scale
    dk = torch.einsum("...hts,...thd->...shd", ds, q.to(s.dtype)) * scale
    H = q.shape[-2]
    return dq, dk.unflatten(-2, (H // G, G)).sum(-2), dv.unflatten(-2, (H // G, G)).sum(-2)


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[Tensor, Tensor]:
    nk = k_shape.numel()
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ks, ke, k_idx_all, scale, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        G = q.shape[-2] // k.shape[-2]
        acc = acc_dtype(q.dtype)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)  # [(B,) Tl, H, Dv]
        lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)  # [(B,) Tl, H]
        cur = _pack(k, v)  # one message per hop
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                recv, works = ring_exchange([cur], group)  # overlaps the block's attention below
            vis = visible_mask(ks, ke, k_idx_all[src])
            if bool(vis.any()):  # blocks with no visible key (causal future, other sequences) are skipped
                kb, vb = _unpack(cur, k.shape, v.shape)
                o_b, l_b = _block_fwd(q, kb, vb, vis, scale, G)
                out, lse = merge_attention(out, lse, o_b, l_b)
            if step < cp - 1:
                for w in works:
                    w.wait()
                cur = recv[0]
        ctx.save_for_backward(q, k, v, ks, ke, k_idx_all, out, lse)
        ctx.scale, ctx.group = scale, group
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, ks, ke, k_idx_all, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        G = q.shape[-2] // k.shape[-2]
        dout = dout.to(out.dtype).contiguous()  # an expanded (stride-0) gradient sends bmm to a slow path
        delta = (dout * out).sum(-1)  # [(B,) Tq, H]
        acc = out.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        cur = _pack(k, v)
        dkv_acc = torch.zeros(k.numel() + v.numel(), dtype=acc, device=k.device)  # [dk | dv] fp32, travels
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                kv_recv, kv_works = ring_exchange([cur], group)
            vis = visible_mask(ks, ke, k_idx_all[src])
            if bool(vis.any()):
                kb, vb = _unpack(cur, k.shape, v.shape)
                dq_b, dk_b, dv_b = _block_bwd(q, kb, vb, vis, scale, G, lse, dout, delta)
                dq += dq_b
                dkv_acc += torch.cat([dk_b.reshape(-1), dv_b.reshape(-1)])
            if cp > 1:  # the accumulator travels with its block; the last hop returns it to the owner
                (dkv_acc,), d_works = ring_exchange([dkv_acc], group)
                for w in d_works:
                    w.wait()
            if step < cp - 1:
                for w in kv_works:
                    w.wait()
                cur = kv_recv[0]
        dk, dv = _unpack(dkv_acc, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    token_idx: Tensor,
    cu_seqlens: Tensor,
    causal: bool = True,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
) -> AttentionOutput:
    """Context-parallel self-attention over a ring of P2P transfers (KV rotates, queries stay).

    Args:
        q: ``[Tl, H, D]`` this rank's queries (fp32/bf16; math and accumulators in fp32), or batched
            ``[B, Tl, H, D]``: B rows, each its own packed stream (token indices ``[0, T)`` per row, the same
            ``cu_seqlens`` and sharding); cost ``B * Tl * cp * Tl`` per rank, one message per hop for all rows.
        k: ``[(B,) Tl, Hkv, D]``, v: ``[(B,) Tl, Hkv, Dv]`` this rank's keys/values (the same tokens as ``q``).
        token_idx: ``[Tl]`` int64 token indices of this rank's tokens (:meth:`ShardPlan.local_token_idx`), the
            same for every row; or ``[B, Tl]`` per row (batched q only). Any layout works, zigzag balances
            causal work.
        cu_seqlens: ``[N + 1]`` global packed-sequence boundaries of one row (identical on every rank).
        causal: bottom-right causal on absolute token indices.
        scale: default ``D ** -0.5``.
        group: CP process group (``None`` = default group).

    Returns:
        :class:`AttentionOutput` for this rank's queries: ``out [(B,) Tl, H, Dv]`` (q's dtype, differentiable
        w.r.t. q, k, v; dK/dV reach the owning ranks) and ``lse [(B,) Tl, H]`` fp32 (no gradient).

    Raises:
        TypeError: ``token_idx`` is not an integer tensor.
        ValueError: bad local shapes, or sizes that differ across ranks (raised on every rank after one small
            all-gather, before any payload is exchanged).
    """
    H, Hkv = check_qkv(q, k, v)
    check_token_idx("ring_attention", token_idx, q, k)
    rows = q.shape[0] if q.dim() == 4 else 0  # 0: packed (unbatched) call
    check_same_across_ranks([q.shape[-3], H, Hkv, q.shape[-1], v.shape[-1], rows, token_idx.dim()],
                            ["Tl", "H", "Hkv", "D", "Dv", "B", "token_idx dims"], "ring_attention", group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ks, ke = (w.view(token_idx.shape) for w in key_windows(token_idx.reshape(-1), cu_seqlens, causal=causal))
    cp = dist.get_world_size(group)
    # [cp, Tl] or [cp, B, Tl]: the token indices of every rank's block (masks per hop are [(B,) Tl, Tl])
    k_idx_all = all_gather_rows(token_idx.to(torch.int64).contiguous(), group).view(cp, *token_idx.shape)
    return AttentionOutput(*_RingAttentionFn.apply(q, k, v, ks, ke, k_idx_all, scale, group))


class RingAttention(ContextParallelAttention):
    """``nn.Module`` wrapper of :func:`ring_attention` holding the process group and the causal flag (no
    parameters). ``forward(q, k, v, token_idx, cu_seqlens) -> out [Tl, H, Dv]``."""

    attention = staticmethod(ring_attention)
