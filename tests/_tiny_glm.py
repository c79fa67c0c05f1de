"""Tiny model configs shared by the multi-rank tests (workers put ``tests/`` on ``sys.path`` and import it)."""

from __future__ import annotations

from typing import Any


def glm4_micro(**overrides: Any):
    """:meth:`GlmMoeConfig.tiny_debug` shrunk for multi-rank tests: hidden 32, 4 query heads x 8 and 2 KV heads,
    dense intermediate 64, routed experts of width 16 (top-2 of 8, 2 layers, vocab 32 unless ``overrides`` say
    otherwise). ``overrides`` replace any field."""
    from moe_rl.models.glm4_moe import GlmMoeConfig

    micro = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, head_dim=8, num_attention_heads=4,
                 num_key_value_heads=2)
    return GlmMoeConfig.tiny_debug(**{**micro, **overrides})
