"""Ulysses (DeepSpeed-Ulysses, arXiv 2309.14509): all-to-all from sequence shards to head shards and back.

Shape legend:
    B    rows (optional leading dim): independent packed streams with the same sharding, exchanged and computed
         together (one all-to-all per tensor for all rows)
    Tl   tokens per rank; T' = cp * Tl tokens after the exchange (every rank's tokens, in rank order)
    H    query heads, Hkv key/value heads (GQA: query head h reads KV head h // G, G = H / Hkv)
    Hp, Hkvp  head counts after replication / padding (both divisible by cp)
    D, Dv head dims

Each rank turns ``q [Tl, H, D]`` into ``[T', Hp/cp, D]`` (every token, a slice of heads), runs full attention
on its heads with the token-index masks (:mod:`moe_rl.attention.core`; the layout only permutes rows), and the
inverse all-to-all returns ``[Tl, H, Dv]``. Both exchanges are differentiable (:func:`all_to_all_rows`).

Head plan (:func:`ulysses_head_plan`, computed per call from the tensors' shapes, never from global state:
case B07a; rule from verl #1226 / DeepSpeed #8316):

* ``Hkv % cp == 0``: no change; rank r gets query heads ``[r*H/cp, (r+1)*H/cp)`` and their KV heads.
* ``cp % Hkv == 0`` and ``G % (cp/Hkv) == 0`` (fewer KV heads than ranks): every KV head is replicated
  ``cp/Hkv`` times with ``repeat_interleave`` on the **head** axis (case B07c); rank r gets KV replica r, whose
  query heads are exactly the ones it holds; the gradients of the replicas sum back into the original head.
* otherwise: KV heads are zero-padded to ``Hkvp = ceil(Hkv/cp)*cp`` and the query heads are padded *per KV
  group* to ``Hp = Hkvp * G`` (case B07b: 28Q/7KV at cp=2 -> 32Q/8KV, 16Q/4KV per rank), so the Q->KV grouping is
  preserved; the padded heads are dropped after the inverse exchange (they receive no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.attention.comm import all_gather_rows, all_to_all_rows, check_same_across_ranks
from moe_rl.attention.core import (
    AttentionOutput,
    ContextParallelAttention,
    check_qkv,
    check_token_idx,
    key_windows,
    windowed_attention,
)

__all__ = ["UlyssesAttention", "UlyssesHeadPlan", "ulysses_attention", "ulysses_head_plan"]


@dataclass(frozen=True)
class UlyssesHeadPlan:
    """How H query / Hkv KV heads are spread over cp ranks (see the module docstring).

    Attributes:
        num_heads, num_kv_heads, cp: the inputs.
        kv_replicas: copies of each KV head (1 unless KV heads are replicated).
        kv_heads_padded: Hkvp, KV heads after replication/padding (divisible by cp).
        q_heads_padded: Hp = Hkvp * G / kv_replicas (divisible by cp).
    """

    num_heads: int
    num_kv_heads: int
    cp: int
    kv_replicas: int
    kv_heads_padded: int
    q_heads_padded: int

    @property
    def q_heads_per_rank(self) -> int:
        return self.q_heads_padded // self.cp

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads_padded // self.cp

    def q_head_ranges(self) -> list[tuple[int, int]]:
        """Per rank, the half-open range of *original* query heads it computes (padding excluded)."""
        n = self.q_heads_per_rank
        G = self.num_heads // self.num_kv_heads
        Gp = self.q_heads_padded // (self.kv_heads_padded // self.kv_replicas)  # padded group size (= G)
        out = []
        for r in range(self.cp):
            real = [h for h in range(r * n, (r + 1) * n) if h // Gp < self.num_kv_heads]
            ids = [(h // Gp) * G + h % Gp for h in real]
            out.append((ids[0], ids[-1] + 1) if ids else (0, 0))
        return out


def ulysses_head_plan(num_heads: int, num_kv_heads: int, cp: int) -> UlyssesHeadPlan:
    """Head plan for one attention call (pure function of its arguments).

    Raises:
        ValueError: non-positive counts or ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    if num_heads < 1 or num_kv_heads < 1 or cp < 1:
        raise ValueError(f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, cp={cp} must all be >= 1")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)")
    G = num_heads // num_kv_heads
    if num_kv_heads % cp == 0:
        return UlyssesHeadPlan(num_heads, num_kv_heads, cp, 1, num_kv_heads, num_heads)
    if cp % num_kv_heads == 0 and G % (cp // num_kv_heads) == 0:
        return UlyssesHeadPlan(num_heads, num_kv_heads, cp, cp // num_kv_heads, cp, num_heads)
    kvp = -(-num_kv_heads // cp) * cp
    return UlyssesHeadPlan(num_heads, num_kv_heads, cp, 1, kvp, kvp * G)


def _seq_to_heads(x: Tensor, cp: int, group) -> Tensor:
    """[B, Tl, Hx, Dx] -> [B, cp*Tl, Hx/cp, Dx]: heads [r*Hx/cp, ...) of every row go to rank r (one message);
    the received tokens are in rank order within each row."""
    B, Tl, Hx, Dx = x.shape
    x = x.reshape(B, Tl, cp, Hx // cp, Dx).permute(2, 0, 1, 3, 4).reshape(cp * B * Tl, Hx // cp, Dx)
    y = all_to_all_rows(x, group)  # block r = rank r's tokens of every row, my heads
    return y.view(cp, B, Tl, Hx // cp, Dx).transpose(0, 1).reshape(B, cp * Tl, Hx // cp, Dx)


def _heads_to_seq(x: Tensor, cp: int, group) -> Tensor:
    """[B, cp*Tl, h, Dx] -> [B, Tl, cp*h, Dx] (inverse of :func:`_seq_to_heads`)."""
    B, Tp, h, Dx = x.shape
    Tl = Tp // cp
    x = x.reshape(B, cp, Tl, h, Dx).transpose(0, 1).reshape(cp * B * Tl, h, Dx)
    y = all_to_all_rows(x, group)  # block r = my tokens of every row, heads of rank r
    return y.view(cp, B, Tl, h, Dx).permute(1, 2, 0, 3, 4).reshape(B, Tl, cp * h, Dx)


def ulysses_attention(
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
    """Context-parallel attention via two all-to-alls (sequence -> heads, heads -> sequence).

    Args:
        q: ``[Tl, H, D]`` this rank's queries; k: ``[Tl, Hkv, D]``; v: ``[Tl, Hkv, Dv]`` (same tokens). Or
            batched ``[B, Tl, H, D]`` etc.: B rows, each its own packed stream (token indices ``[0, T)`` per row,
            the same ``cu_seqlens`` and sharding); cost ``B * (cp * Tl)^2 * H / cp`` per rank, one all-to-all
            per tensor for all rows.
        token_idx: ``[Tl]`` token indices of this rank's tokens (any layout), the same for every row; or
            ``[B, Tl]`` per row (batched q only).
        cu_seqlens: ``[N + 1]`` global packed-sequence boundaries of one row.
        causal, scale: as in :func:`moe_rl.attention.attention_reference`.
        group: CP process group.

    Returns:
        :class:`AttentionOutput` for this rank's tokens: ``out [(B,) Tl, H, Dv]`` (differentiable w.r.t. q,
        k, v), ``lse [(B,) Tl, H]`` fp32 (no gradient).

    Raises:
        TypeError: ``token_idx`` is not an integer tensor.
        ValueError: bad shapes or sizes that differ across ranks (on every rank, before the payload exchange).
    """
    H, Hkv = check_qkv(q, k, v)
    check_token_idx("ulysses_attention", token_idx, q, k)
    packed = q.dim() == 3
    rows = 0 if packed else q.shape[0]  # 0: packed (unbatched) call
    check_same_across_ranks([q.shape[-3], H, Hkv, q.shape[-1], v.shape[-1], rows, token_idx.dim()],
                            ["Tl", "H", "Hkv", "D", "Dv", "B", "token_idx dims"], "ulysses_attention", group)
    if packed:
        q, k, v = q[None], k[None], v[None]  # one row
    cp = dist.get_world_size(group)
    plan = ulysses_head_plan(H, Hkv, cp)
    G = H // Hkv
    B, Tl = q.shape[0], q.shape[1]
    if plan.kv_replicas > 1:
        k = k.repeat_interleave(plan.kv_replicas, dim=2)
        v = v.repeat_interleave(plan.kv_replicas, dim=2)
    elif plan.kv_heads_padded != Hkv:
        extra = plan.kv_heads_padded - Hkv
        k = torch.cat([k, k.new_zeros(B, Tl, extra, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(B, Tl, extra, v.shape[-1])], dim=2)
        q = torch.cat([q.view(B, Tl, Hkv, G, -1), q.new_zeros(B, Tl, extra, G, q.shape[-1])], dim=2)
        q = q.view(B, Tl, -1, q.shape[-1])
    qh = _seq_to_heads(q, cp, group)  # [B, cp*Tl, Hp/cp, D]
    kh = _seq_to_heads(k, cp, group)
    vh = _seq_to_heads(v, cp, group)
    idx_all = all_gather_rows(token_idx.to(torch.int64).contiguous(), group)  # [cp*Tl] or [cp*B, Tl]
    if idx_all.dim() == 2:  # per-row indices -> [B, cp*Tl], rank order within each row
        idx_all = idx_all.view(cp, B, Tl).transpose(0, 1).reshape(B, cp * Tl)
    ks, ke = (w.view(idx_all.shape) for w in key_windows(idx_all.reshape(-1), cu_seqlens, causal=causal))
    res = windowed_attention(qh, kh, vh, ks=ks, ke=ke, k_idx=idx_all, scale=scale)  # one mask for all rows
    out = _heads_to_seq(res.out, cp, group)  # [B, Tl, Hp, Dv]
    with torch.no_grad():
        lse = _heads_to_seq(res.lse[..., None].contiguous(), cp, group)[..., 0]
    if plan.q_heads_padded != H:
        Hkvp = plan.kv_heads_padded
        out = out.view(B, Tl, Hkvp, G, -1)[:, :, :Hkv].reshape(B, Tl, H, -1)
        lse = lse.view(B, Tl, Hkvp, G)[:, :, :Hkv].reshape(B, Tl, H)
    if packed:
        out, lse = out[0], lse[0]
    return AttentionOutput(out, lse)


class UlyssesAttention(ContextParallelAttention):
    """``nn.Module`` wrapper of :func:`ulysses_attention` (no parameters; head counts come from each call's
    tensors). ``forward(q, k, v, token_idx, cu_seqlens) -> out [Tl, H, Dv]``."""

    attention = staticmethod(ulysses_attention)
