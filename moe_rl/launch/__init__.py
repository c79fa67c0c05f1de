"""Cluster launch: config models of a Slurm GPU deployment (trainer layout, P/D-disaggregated wide-EP vLLM engines,
Mooncake KV offload, router, orchestrator), the exact command of every process (:func:`build_plan`), the sbatch
script (:func:`render_sbatch`) and ``moe-rl cluster ... --dry-run`` (:func:`dry_run`).

Submodules: ``model`` (which model, modelled or published-only), ``engines`` (vLLM groups, KV connectors, router),
``mooncake`` (Mooncake Store offload), ``config`` (:class:`ClusterConfig`), ``plan``, ``slurm``, ``dry_run``.
Names are imported lazily (``ClusterConfig`` composes ``OrchestratorConfig``, whose module imports torch).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "ClusterConfig": "config",
    "EngineGroup": "engines",
    "InferenceDeployment": "engines",
    "LaunchPlan": "plan",
    "ModelSpec": "model",
    "MooncakeOffloadConfig": "mooncake",
    "Process": "plan",
    "TrainerLayout": "config",
    "build_plan": "plan",
    "dry_run": "dry_run",
    "kv_transfer_config": "engines",
    "render_sbatch": "slurm",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
