"""Attention for long-context MoE RL: MLA, DeepSeek Sparse Attention (DSA), sequence sharding layouts, and three
context-parallel methods (Ulysses, ring, DSA all-gather). See ``docs/attention.md``.

Every function works on packed token-major tensors (``[tokens, heads, head_dim]``) and builds its masks from
absolute token indices and ``cu_seqlens``; the dense reference core, ring and Ulysses also take batched rows
(``[rows, tokens, heads, head_dim]``, each row its own packed stream; see :mod:`moe_rl.attention.core`); CP
functions take an explicit process group and keep no global state. Importing this package imports torch and pydantic only (Triton is imported inside the triton backend).
"""

from moe_rl.attention.core import (
    AttentionOutput,
    attention_reference,
    key_windows,
    merge_attention,
    windowed_attention,
)
from moe_rl.attention.dsa import (
    DSAOutput,
    IndexerOutput,
    dsa_attention,
    indexer_kl_loss,
    indexer_kl_target,
    lightning_indexer,
    select_topk,
    sparse_latent_attention,
)
from moe_rl.attention.dsa_chunked import chunked_indexer_topk, sparse_latent_attention_chunked
from moe_rl.attention.dsa_cp import dsa_cp_attention
from moe_rl.attention.layout import Layout, ShardPlan, make_shard_plan
from moe_rl.attention.mla import DSAIndexer, MLAConfig, MLAOutput, MultiheadLatentAttention, rope_positions
from moe_rl.attention.ring import RingAttention, ring_attention
from moe_rl.attention.ulysses import UlyssesAttention, UlyssesHeadPlan, ulysses_attention, ulysses_head_plan

__all__ = [
    "AttentionOutput",
    "DSAIndexer",
    "DSAOutput",
    "IndexerOutput",
    "Layout",
    "MLAConfig",
    "MLAOutput",
    "MultiheadLatentAttention",
    "RingAttention",
    "ShardPlan",
    "UlyssesAttention",
    "UlyssesHeadPlan",
    "attention_reference",
    "chunked_indexer_topk",
    "dsa_attention",
    "dsa_cp_attention",
    "indexer_kl_loss",
    "indexer_kl_target",
    "key_windows",
    "lightning_indexer",
    "make_shard_plan",
    "merge_attention",
    "ring_attention",
    "rope_positions",
    "select_topk",
    "sparse_latent_attention",
    "sparse_latent_attention_chunked",
    "ulysses_attention",
    "ulysses_head_plan",
    "windowed_attention",
]
