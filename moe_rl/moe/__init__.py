"""Mixture-of-Experts building blocks: top-k router (noaux_tc, group limit, replay), stacked experts, MoE block,
expert-parallel dispatch/combine (``torch`` and DeepEP backends, :mod:`moe_rl.moe.ep`), the expert-parallel MoE block,
and FP8 routed experts.

Imports are lazy: ``import moe_rl.moe`` loads no torch; a name loads its submodule (torch only: no
transformers, no vLLM, no DeepEP until its backend is used).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "DispatchHandle": "ep.torch_backend",
    "EPBackend": "ep.api",
    "ExpertParallelMoE": "ep.layer",
    "ExpertsBackend": "experts",
    "Fp8GroupedExperts": "fp8_experts",
    "GroupedExperts": "experts",
    "MoE": "moe",
    "ScoreFunc": "router",
    "SwiGLUMLP": "moe",
    "TopKRouter": "router",
    "combine": "ep.api",
    "convert_model_to_fp8": "fp8_convert",
    "dispatch": "ep.api",
    "fp8_parameter_fraction": "fp8_convert",
    "grouped_experts_forward": "experts",
    "local_experts_forward": "ep.layer",
    "make_deepep_buffer": "ep.deepep",
    "topk_route": "router",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
