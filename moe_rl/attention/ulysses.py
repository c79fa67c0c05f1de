"""Ulysses (DeepSpeed-Ulysses, arXiv 2309.14509): all-to-all from sequence shards to head shards and back.

Shape legend:
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
from moe_rl.attention.core import AttentionOutput, check_qkv, key_windows, windowed_attention

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
    """[Tl, Hx, Dx] -> [cp*Tl, Hx/cp, Dx]: block r (heads [r*Hx/cp, ...)) goes to rank r."""
    Tl, Hx, Dx = x.shape
    x = x.view(Tl, cp, Hx // cp, Dx).transpose(0, 1).reshape(cp * Tl, Hx // cp, Dx)
    return all_to_all_rows(x, group)


def _heads_to_seq(x: Tensor, cp: int, group) -> Tensor:
    """[cp*Tl, h, Dx] -> [Tl, cp*h, Dx] (inverse of :func:`_seq_to_heads`)."""
    Tp, h, Dx = x.shape
    y = all_to_all_rows(x.contiguous(), group)  # block r = my tokens, heads of rank r
    return y.view(cp, Tp // cp, h, Dx).transpose(0, 1).reshape(Tp // cp, cp * h, Dx)


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
        q: ``[Tl, H, D]`` this rank's queries; k: ``[Tl, Hkv, D]``; v: ``[Tl, Hkv, Dv]`` (same tokens).
        token_idx: ``[Tl]`` token indices of this rank's rows (any layout).
        cu_seqlens: ``[N + 1]`` global packed-sequence boundaries.
        causal, scale: as in :func:`moe_rl.attention.attention_reference`.
        group: CP process group.

    Returns:
        :class:`AttentionOutput` for this rank's tokens: ``out [Tl, H, Dv]`` (differentiable w.r.t. q, k, v),
        ``lse [Tl, H]`` fp32 (no gradient).

    Raises:
        ValueError: bad shapes or sizes that differ across ranks (on every rank, before the payload exchange).
    """
    H, Hkv = check_qkv(q, k, v)
    if not (q.shape[0] == k.shape[0] == token_idx.shape[0]):
        raise ValueError(f"ulysses_attention is self-attention: q {q.shape[0]}, k {k.shape[0]} and token_idx "
                         f"{token_idx.shape[0]} rows must be equal")
    check_same_across_ranks([q.shape[0], H, Hkv, q.shape[2], v.shape[2]], ["Tl", "H", "Hkv", "D", "Dv"],
                            "ulysses_attention", group)
    cp = dist.get_world_size(group)
    plan = ulysses_head_plan(H, Hkv, cp)
    G = H // Hkv
    Tl = q.shape[0]
    if plan.kv_replicas > 1:
        k = k.repeat_interleave(plan.kv_replicas, dim=1)
        v = v.repeat_interleave(plan.kv_replicas, dim=1)
    elif plan.kv_heads_padded != Hkv:
        extra = plan.kv_heads_padded - Hkv
        k = torch.cat([k, k.new_zeros(Tl, extra, k.shape[2])], dim=1)
        v = torch.cat([v, v.new_zeros(Tl, extra, v.shape[2])], dim=1)
        q = torch.cat([q.view(Tl, Hkv, G, -1), q.new_zeros(Tl, extra, G, q.shape[2])], dim=1).view(Tl, -1, q.shape[2])
    qh = _seq_to_heads(q, cp, group)
    kh = _seq_to_heads(k, cp, group)
    vh = _seq_to_heads(v, cp, group)
    idx_all = all_gather_rows(token_idx.to(torch.int64).contiguous(), group)  # [cp*Tl], rank order
    ks, ke = key_windows(idx_all, cu_seqlens, causal=causal)
    res = windowed_attention(qh, kh, vh, ks=ks, ke=ke, k_idx=idx_all, scale=scale)
    out = _heads_to_seq(res.out, cp, group)  # [Tl, Hp, Dv]
    with torch.no_grad():
        lse = _heads_to_seq(res.lse[..., None].contiguous(), cp, group)[..., 0]
    if plan.q_heads_padded != H:
        Hkvp = plan.kv_heads_padded
        out = out.view(Tl, Hkvp, G, -1)[:, :Hkv].reshape(Tl, H, -1)
        lse = lse.view(Tl, Hkvp, G)[:, :Hkv].reshape(Tl, H)
    return AttentionOutput(out, lse)


class UlyssesAttention(torch.nn.Module):
    """``nn.Module`` wrapper of :func:`ulysses_attention` (no parameters; head counts come from each call's
    tensors). ``forward(q, k, v, token_idx, cu_seqlens) -> out [Tl, H, Dv]``."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, causal: bool = True,
                 scale: float | None = None) -> None:
        super().__init__()
        self.group, self.causal, self.scale = group, causal, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, token_idx: Tensor, cu_seqlens: Tensor) -> Tensor:
        return ulysses_attention(q, k, v, token_idx=token_idx, cu_seqlens=cu_seqlens, causal=self.causal,
                                 scale=self.scale, group=self.group).out
