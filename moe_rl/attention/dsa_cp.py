"""DSA context parallelism: local queries, all-gathered latent KV and indexer keys, top-k in global coordinates.

Shape legend:
    Tl   tokens per rank; Tp = cp * Tl tokens of the (padded) packed stream
    H    query heads; Dk latent key dim (kv_lora_rank + qk_rope_head_dim); Dv = kv_lora_rank
    HI, DI  indexer heads / head dim; K = index_topk

Why not Ulysses or ring: MLA in MQA mode has a single shared latent KV head (nothing to
split over heads), and the top-k needs every key's indexer score before any attention (a ring would need two
passes). The latent is small (576 values per token per layer), so each rank all-gathers it:

1. all-gather the token indices (ints), the latent ``kv [Tl, Dk]`` and the indexer keys ``index_k [Tl, DI]``
   (autograd-aware: the backward reduce-scatters, so every rank's gradient for a key row is summed at the row's
   owner); reorder the gathered rows by token index so that **row s = token index s** for the whole padded stream;
2. run the lightning indexer for the local queries against all keys with their absolute key windows and take
   the top-k; the indices are token indices (global coordinates), independent of the layout, so they can be
   recorded and replayed (``topk_indices=``) under any CP size or layout;
3. sparse latent attention of the local queries over the selected rows.

This is the all-gather scheme of prime-rl v0.6.0 (``gather_for_cp``) and slime's ``--allgather-cp`` for GLM-5;
the code here is our own. Memory per rank: O(Tp * (Dk + DI)) for the gathered keys; with ``backend="torch"``
(:mod:`moe_rl.attention.dsa_chunked`) everything else is O(Tl * K) plus per-tile temporaries set by the chunk
sizes, while ``backend="dense"`` holds ``[Tl, Tp]`` indexer scores and the ``[Tl, K, Dk]`` gathered rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.attention.comm import all_gather_rows, check_same_across_ranks
from moe_rl.attention.dsa import DSAOutput, IndexerBackend, dsa_attention
from moe_rl.attention.dsa_chunked import (
    DEFAULT_ATTN_CHUNK,
    DEFAULT_K_CHUNK,
    DEFAULT_Q_CHUNK,
    DSABackend,
    check_chunk_size,
    check_dsa_backend,
)

__all__ = ["dsa_cp_attention"]


def dsa_cp_attention(
    q: Tensor,
    kv: Tensor,
    *,
    v_head_dim: int,
    token_idx: Tensor,
    cu_seqlens: Tensor,
    scale: float | None = None,
    topk_indices: Tensor | None = None,
    index_q: Tensor | None = None,
    index_weights: Tensor | None = None,
    index_k: Tensor | None = None,
    index_topk: int | None = None,
    causal: bool = True,
    return_index_scores: bool = False,
    check_indices: bool = True,
    indexer_backend: IndexerBackend = "torch",
    group: dist.ProcessGroup | None = None,
    backend: DSABackend = "dense",
    q_chunk_size: int = DEFAULT_Q_CHUNK,
    k_chunk_size: int = DEFAULT_K_CHUNK,
    attn_chunk_size: int = DEFAULT_ATTN_CHUNK,
) -> DSAOutput:
    """DSA for this rank's queries under context parallelism (same semantics as :func:`dsa_attention`).

    Args:
        q: ``[Tl, H, Dk]`` this rank's absorbed queries.
        kv: ``[Tl, Dk]`` this rank's latent rows (value = first ``v_head_dim`` dims).
        v_head_dim: Dv.
        token_idx: ``[Tl]`` token indices of this rank's rows; over all ranks they must be a permutation of
            ``[0, cp*Tl)`` (any :class:`moe_rl.attention.ShardPlan` layout is).
        cu_seqlens: ``[N + 1]`` global packed-sequence boundaries (``cu_seqlens[-1] <= cp*Tl``; the rest is
            padding).
        scale: softmax scale (default ``Dk ** -0.5``; MLA passes ``qk_head_dim ** -0.5``).
        topk_indices: ``[Tl, K]`` replayed selection in token-index coordinates (``-1`` = none); the indexer
            then does not run. Otherwise pass ``index_q [Tl, HI, DI]``, ``index_weights [Tl, HI]``,
            ``index_k [Tl, DI]`` and ``index_topk``.
        causal, return_index_scores, check_indices, indexer_backend: as in :func:`dsa_attention`
            (``index_scores`` are ``[Tl, Tp]`` over the gathered keys, differentiable into every rank's
            ``index_k`` through the all-gather).
        group: CP process group.
        backend, q_chunk_size, k_chunk_size, attn_chunk_size: as in :func:`dsa_attention`; ``"torch"`` keeps
            this rank's DSA memory at O(Tl * K) beyond the gathered ``[Tp, Dk + DI]`` keys (no ``[Tl, Tp]``
            tensor).

    Returns:
        :class:`DSAOutput` for the local queries; ``topk_indices`` in token-index coordinates.

    Raises:
        ValueError: bad shapes, sizes that differ across ranks, or token indices that are not a permutation
            (raised identically on every rank); an unknown ``backend`` or a chunk size < 1 (before any
            communication, so on every rank alike).
    """
    check_dsa_backend(backend)
    for name, val in (("q_chunk_size", q_chunk_size), ("k_chunk_size", k_chunk_size),
                      ("attn_chunk_size", attn_chunk_size)):
        check_chunk_size(name, val)  # every backend (before any communication)
    if q.dim() != 3 or kv.dim() != 2 or q.shape[0] != kv.shape[0] or q.shape[0] != token_idx.shape[0]:
        raise ValueError(f"dsa_cp_attention expects q [Tl, H, Dk], kv [Tl, Dk], token_idx [Tl]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(token_idx.shape)}")
    has_ik = index_k is not None
    check_same_across_ranks(
        [q.shape[0], q.shape[1], kv.shape[1], int(has_ik), index_k.shape[1] if has_ik else 0],
        ["Tl", "H", "Dk", "has_index_k", "DI"], "dsa_cp_attention", group)
    cp = dist.get_world_size(group)
    idx_all = all_gather_rows(token_idx.to(torch.int64).contiguous(), group)  # [Tp] rank order
    Tp = idx_all.numel()
    order = torch.argsort(idx_all)
    if not torch.equal(idx_all[order], torch.arange(Tp, device=idx_all.device)):
        raise ValueError(f"token_idx over the {cp} CP ranks must be a permutation of [0, {Tp}); build them with "
                         "make_shard_plan(...).local_token_idx(rank)")
    if int(cu_seqlens[-1]) > Tp:
        raise ValueError(f"cu_seqlens[-1]={int(cu_seqlens[-1])} exceeds the {Tp} tokens held by the CP group")
    kv_full = all_gather_rows(kv, group).index_select(0, order)  # row s = token s
    index_k_full = all_gather_rows(index_k, group).index_select(0, order) if has_ik else None
    return dsa_attention(
        q, kv_full, v_head_dim=v_head_dim, scale=scale, topk_indices=topk_indices, index_q=index_q,
        index_weights=index_weights, index_k=index_k_full, index_topk=index_topk, causal=causal,
        cu_seqlens=cu_seqlens, q_token_idx=token_idx, return_index_scores=return_index_scores,
        check_indices=check_indices, indexer_backend=indexer_backend, backend=backend,
        q_chunk_size=q_chunk_size, k_chunk_size=k_chunk_size, attn_chunk_size=attn_chunk_size,
    )
