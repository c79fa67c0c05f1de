"""Replay of inference-side per-token indices in the trainer: routed experts (R3) and DSA indexer top-k.

- :mod:`moe_rl.replay.indices`: ``TokenIndices`` container ``[S, L, K]`` (``RoutedExperts``, ``DsaIndices``),
  storage dtype by id count, raw or bit-packed pickle-free bytes.
- :mod:`moe_rl.replay.stitch`: the engine's ``S-1`` rows and multi-turn deltas (prime-rl PR #1807).
- :mod:`moe_rl.replay.layout`: rows for every token of a batch-first or packed batch; transport encoding.
- :mod:`moe_rl.replay.fill`: sentinel rows -> dispatchable ids (sgl-project/sglang PR #36404; imports torch).

Imports are lazy: ``import moe_rl.replay`` loads numpy only.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TokenIndices": "indices",
    "RoutedExperts": "indices",
    "DsaIndices": "indices",
    "storage_dtype": "indices",
    "bits_per_id": "indices",
    "StitchResult": "stitch",
    "complete_engine_rows": "stitch",
    "delta_start": "stitch",
    "stitch_records": "stitch",
    "FILL_ROW": "layout",
    "OWN_ROW": "layout",
    "LayoutStats": "layout",
    "batch_rows": "layout",
    "batch_transport": "layout",
    "encode_rows": "layout",
    "decode_rows": "layout",
    "fill_ids": "fill",
    "resolve_replay_ids": "fill",
    "model_replay_ids": "fill",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moe_rl.replay.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moe_rl.replay' has no attribute {name!r}")
