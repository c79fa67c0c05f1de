"""Replay of inference-side per-token indices in the trainer: routed experts (R3) and DSA indexer top-k.

- :mod:`moe_rl.replay.indices`: ``TokenIndices`` container ``[S, L, K]`` (``RoutedExperts``, ``DsaIndices``),
  storage dtype by id count, raw or bit-packed pickle-free bytes.
- :mod:`moe_rl.replay.stitch`: the engine's ``S-1`` rows and multi-turn deltas (prime-rl PR #1807).
- :mod:`moe_rl.replay.layout`: rows for every token of a batch-first or packed batch; transport encoding.
- :mod:`moe_rl.replay.fill`: sentinel rows -> dispatchable ids (sgl-project/sglang PR #36404; imports torch).
- :mod:`moe_rl.replay.hf`: replay and a trainer-side recorder for ``transformers`` MoE routers (Qwen3-MoE, Mixtral,
  DeepSeek-V3, GLM-4.5 MoE; imports ``transformers`` only when converting).
- :mod:`moe_rl.replay.torchtitan`: replay in torchtitan's ``TokenChoiceTopKRouter`` (imports torchtitan).

Imports are lazy: ``import moe_rl.replay`` loads numpy only.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

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
    "HfRoutingRecord": "hf",
    "convert_hf_moe_routers": "hf",
    "record_hf_routing": "hf",
    "replay_hf_routing": "hf",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
