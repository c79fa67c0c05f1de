"""Mixture-of-Experts building blocks: top-k router (noaux_tc, group limit, replay), stacked experts, MoE block.

Importing this package imports torch only (no transformers, no vLLM).
"""

from moe_rl.moe.experts import ExpertsBackend, GroupedExperts, grouped_experts_forward
from moe_rl.moe.moe import MoE, SwiGLUMLP
from moe_rl.moe.router import ScoreFunc, TopKRouter, topk_route

__all__ = [
    "ExpertsBackend",
    "GroupedExperts",
    "MoE",
    "ScoreFunc",
    "SwiGLUMLP",
    "TopKRouter",
    "grouped_experts_forward",
    "topk_route",
]
