"""Attention for long-context MoE RL: MLA, DeepSeek Sparse Attention (DSA), sequence sharding layouts, and three
context-parallel methods (Ulysses, ring, DSA all-gather). See ``docs/attention.md``.

Every function works on packed token-major tensors (``[tokens, heads, head_dim]``) and builds its masks from
absolute token indices and ``cu_seqlens``; the dense reference core, ring and Ulysses also take batched rows
(``[rows, tokens, heads, head_dim]``, each row its own packed stream; see :mod:`moe_rl.attention.core`); CP
functions take an explicit process group and keep no global state.

Imports are lazy: ``import moe_rl.attention`` loads no torch; a name loads its submodule (torch and pydantic;
Triton is imported inside the triton backend only).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "AttentionOutput": "core",
    "ContextParallelAttention": "core",
    "DSAIndexer": "mla",
    "DSAOutput": "dsa",
    "IndexerOutput": "dsa",
    "Layout": "layout",
    "MLAConfig": "mla",
    "MLAOutput": "mla",
    "MultiheadLatentAttention": "mla",
    "YarnRope": "yarn",
    "RingAttention": "ring",
    "ShardPlan": "layout",
    "UlyssesAttention": "ulysses",
    "UlyssesHeadPlan": "ulysses",
    "attention_reference": "core",
    "chunked_indexer_topk": "dsa_chunked",
    "dsa_attention": "dsa",
    "dsa_cp_attention": "dsa_cp",
    "indexer_kl_loss": "dsa",
    "indexer_kl_target": "dsa",
    "key_windows": "core",
    "lightning_indexer": "dsa",
    "make_shard_plan": "layout",
    "merge_attention": "core",
    "ring_attention": "ring",
    "rope_positions": "mla",
    "select_topk": "dsa_chunked",
    "sparse_latent_attention": "dsa",
    "sparse_latent_attention_chunked": "dsa_chunked",
    "ulysses_attention": "ulysses",
    "ulysses_head_plan": "ulysses",
    "windowed_attention": "core",
    "yarn_inv_freq": "yarn",
    "yarn_softmax_mscale": "yarn",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
