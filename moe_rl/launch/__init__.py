"""Cluster launch: config models of a Slurm GPU deployment (trainer layout, P/D-disaggregated wide-EP vLLM engines,
Mooncake KV offload, router, orchestrator), the exact command of every process (:func:`build_plan`), the sbatch
script (:func:`render_sbatch`) and ``moe-rl cluster ... --dry-run`` (:func:`dry_run`).

Submodules: ``model`` (which model, modelled or published-only), ``engines`` (vLLM groups, KV connectors, router),
``mooncake`` (Mooncake Store offload), ``config`` (:class:`ClusterConfig`), ``plan``, ``slurm``, ``dry_run``.
Names are imported lazily (``ClusterConfig`` composes ``OrchestratorConfig``, whose module imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moe_rl.launch.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moe_rl.launch' has no attribute {name!r}")
