"""Expert parallelism: token dispatch/combine with two backends, the expert-parallel MoE block, and the decode
(low-latency) path.

Modules: ``api`` (:func:`dispatch` / :func:`combine`, the entry points), ``torch_backend`` (``all_to_all_single``,
gloo or NCCL), ``deepep`` (DeepEP >= 2.0 ``ElasticBuffer`` on a caller-owned buffer, :func:`make_deepep_buffer`),
``_checks`` (argument and cross-rank checks shared by both), ``layer`` (:class:`ExpertParallelMoE`),
``low_latency`` (decode dispatch/combine in DeepGEMM's masked layout), ``traffic`` (analytical EP-vs-FSDP bytes,
``python -m moe_rl.moe.ep.traffic``).

Imports are lazy: ``import moe_rl.moe.ep`` loads no torch; a name loads its module, and DeepEP is imported only
when the ``"deep_ep"`` backend is used. Nothing here creates global state: DeepEP buffers belong to the caller.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "DeepEPHandle": "deepep",
    "DispatchHandle": "torch_backend",
    "EPBackend": "api",
    "ExpertParallelMoE": "layer",
    "LocalExperts": "layer",
    "LowLatencyHandle": "low_latency",
    "combine": "api",
    "dispatch": "api",
    "local_experts_forward": "layer",
    "low_latency_combine": "low_latency",
    "low_latency_dispatch": "low_latency",
    "make_deepep_buffer": "deepep",
    "make_low_latency_buffer": "low_latency",
    "masked_experts_forward": "low_latency",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
