"""Mixture-of-Experts building blocks: top-k router (noaux_tc, group limit, replay), stacked experts, MoE block,
expert-parallel dispatch/combine and the expert-parallel MoE block.

Importing this package imports torch only (no transformers, no vLLM).
"""

from moe_rl.moe.ep import DispatchHandle, EPBackend, combine, dispatch
from moe_rl.moe.ep_moe import ExpertParallelMoE, local_experts_forward
from moe_rl.moe.experts import ExpertsBackend, GroupedExperts, grouped_experts_forward
from moe_rl.moe.moe import MoE, SwiGLUMLP
from moe_rl.moe.router import ScoreFunc, TopKRouter, topk_route

__all__ = [
    "DispatchHandle",
    "EPBackend",
    "ExpertParallelMoE",
    "ExpertsBackend",
    "GroupedExperts",
    "MoE",
    "ScoreFunc",
    "SwiGLUMLP",
    "TopKRouter",
    "combine",
    "dispatch",
    "grouped_experts_forward",
    "local_experts_forward",
    "topk_route",
]
