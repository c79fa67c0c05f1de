"""Prefix-cache block hashes, computed exactly as vLLM's engine computes them (default ``sha256`` algorithm).

vLLM (V1 engine, ``vllm/v1/core/kv_cache_utils.py``) keys its prefix cache by a hash chain over *full* blocks of
``block_size`` tokens::

    h[0] = sha256(pickle((NONE_HASH, tuple(tokens[0:bs]),      (("cache_salt", salt),) or None)))
    h[i] = sha256(pickle((h[i-1],    tuple(tokens[i*bs:(i+1)*bs]), None)))          for i >= 1
    NONE_HASH = sha256(pickle("vllm-none-hash"))      (or the PYTHONHASHSEED value when that is set)

- The ``cache_salt`` enters the extra keys of **block 0 only**; later blocks inherit it through the parent
  chain, so two requests share a block iff their salts are equal and all tokens up to that block's end are equal
  (vLLM PR #17045). An empty salt counts as no salt (vLLM tests ``request.cache_salt`` for truth).
- Only full blocks are hashed; a trailing partial block is never cached.
- A request can hit at most ``num_tokens - 1`` tokens (the last prompt token is always computed to get its
  logits; ``KVCacheManager.get_computed_blocks``), so at most ``(prompt_len - 1) // block_size`` blocks.
- After a request finishes, the KV of all its tokens but the last sampled one has been computed, so the engine
  holds ``(prompt_len + output_len - 1) // block_size`` full blocks of it.

The bytes equal vLLM's (``tests/inference/test_router.py`` compares them with vLLM's own hasher), so a router
could also consume the block hashes vLLM publishes in its KV events. pickle output depends on the protocol; like
vLLM we use ``pickle.HIGHEST_PROTOCOL`` of the running Python, so router and engine must run the same Python
minor version for the bytes (not the semantics) to agree.

LoRA adapters, multimodal inputs and prompt embeddings also add extra keys in vLLM; this module handles plain
token prompts only (what the RL orchestrator sends).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence

__all__ = [
    "NONE_HASH_SEED",
    "none_hash",
    "prefix_block_hashes",
    "extend_block_hashes",
    "hittable_blocks",
    "cached_blocks_after",
]

NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's fixed seed of the root parent hash for cryptographic hash algorithms (``DEFAULT_NONE_HASH_SEED``)."""


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent hash of block 0: ``sha256(pickle(seed))`` with seed ``$PYTHONHASHSEED`` if set, else
    ``"vllm-none-hash"`` (vLLM ``resolve_none_hash_seed`` for ``sha256``). Read at each call, like vLLM reads it
    at engine start; router and engines must see the same ``PYTHONHASHSEED``."""
    return _sha256(os.environ.get("PYTHONHASHSEED", NONE_HASH_SEED))


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, max_blocks: int | None = None
) -> list[bytes]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``, bit-identical to vLLM's.

    Args:
        token_ids: ``[num_tokens]`` int token ids (prompt, or prompt + output).
        block_size: tokens per KV block (the engine's ``--block-size``), >= 1.
        cache_salt: the request's ``cache_salt``; None or "" for the unsalted namespace.
        max_blocks: hash at most this many leading blocks (None: all full blocks).

    Returns:
        ``[num_full_blocks]`` 32-byte sha256 digests; ``h[i]`` identifies tokens ``[0, (i+1)*block_size)`` under
        this salt.

    Raises:
        ValueError: ``block_size < 1`` or ``max_blocks < 0``.
        TypeError: ``cache_salt`` is neither None nor a str.
    """
    return extend_block_hashes([], token_ids, block_size, cache_salt, max_blocks)


def extend_block_hashes(
    known: Sequence[bytes],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> list[bytes]:
    """``prefix_block_hashes`` of ``token_ids`` when the hashes of its first ``len(known)`` blocks are already
    known (e.g. a prompt's, extended over prompt + output): only the later blocks are hashed.

    Args:
        known: ``prefix_block_hashes(token_ids[:len(known) * block_size], block_size, cache_salt)``; not checked.
        token_ids, block_size, cache_salt, max_blocks: as for ``prefix_block_hashes``.

    Returns:
        ``[num_full_blocks]`` digests (``known`` included, truncated to ``max_blocks``).

    Raises:
        ValueError: ``block_size < 1``, ``max_blocks < 0``, or ``known`` has more blocks than ``token_ids``.
        TypeError: ``cache_salt`` is neither None nor a str.
    """
    if block_size < 1:
        raise ValueError(
            f"prefix_block_hashes: block_size={block_size} must be >= 1 (the engine's --block-size)"
        )
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(
            f"prefix_block_hashes: cache_salt must be a str or None, got {type(cache_salt).__name__}"
        )
    n = len(token_ids) // block_size
    if len(known) > n:
        raise ValueError(
            f"extend_block_hashes: {len(known)} known block hashes but token_ids has only {n} full blocks of "
            f"{block_size}; pass the hashes of a prefix of token_ids"
        )
    if max_blocks is not None:
        if max_blocks < 0:
            raise ValueError(f"prefix_block_hashes: max_blocks={max_blocks} must be >= 0 (or None for all)")
        n = min(n, max_blocks)
    out = list(known[:n])
    parent = out[-1] if out else none_hash()
    salt_keys = (("cache_salt", cache_salt),) if cache_salt else None
    ids = list(
        map(int, token_ids[len(out) * block_size : n * block_size])
    )  # plain ints: pickle bytes as vLLM's
    for j, i in enumerate(range(len(out), n)):
        block = tuple(ids[j * block_size : (j + 1) * block_size])
        parent = _sha256((parent, block, salt_keys if i == 0 else None))
        out.append(parent)
    return out


def hittable_blocks(prompt_len: int, block_size: int) -> int:
    """Most prefix-cache blocks a prompt of ``prompt_len`` tokens can hit: ``(prompt_len - 1) // block_size``
    (vLLM always computes the last prompt token), 0 for an empty prompt."""
    return max(prompt_len - 1, 0) // block_size


def cached_blocks_after(num_tokens: int, block_size: int) -> int:
    """Full blocks an engine has computed (and so can cache) for a sequence of ``num_tokens`` tokens
    (prompt + output) once it finished: ``(num_tokens - 1) // block_size`` (the last sampled token's KV is never
    computed)."""
    return max(num_tokens - 1, 0) // block_size
