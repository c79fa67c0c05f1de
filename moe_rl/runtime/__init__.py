"""The run-time: the two processes of an RL run and what wires them together.

- :mod:`moe_rl.runtime.config`: ``RLConfig``, the composed run configuration.
- :mod:`moe_rl.runtime.run_dir`: ``RunPaths``, the run directory (the file protocol between the processes).
- :mod:`moe_rl.runtime.checks`: run-config checks shared by the trainer and the cluster entry points.
- :mod:`moe_rl.runtime.orchestrator`: the orchestrator process (rollouts, buffer, batches, weight watching).
- :mod:`moe_rl.runtime.trainer`: the trainer process (torchrun), its train step and SFT warm-up (weights are published
  through :mod:`moe_rl.weights`).
- :mod:`moe_rl.runtime.fp8_validate`: the FP8-vs-BF16 training experiment.
- :mod:`moe_rl.runtime.plots`: the run's learning curves.
- :mod:`moe_rl.runtime.sinks`: optional metric sinks (TensorBoard, Weights & Biases offline; off by default).
- :mod:`moe_rl.runtime.checkpoint`: resumable checkpoints of a run and ``moe-rl rl --resume``.
- :mod:`moe_rl.runtime.engine_pool`: several vLLM engines of one run; a dead one is restarted and rejoins at the
  current weight version (``inference.num_engines``, ``inference.max_engine_restarts``).

The runtime sits above every library block (``rl``, ``inference``, ``envs``, ``models``, ...) and below
``launch``, ``entrypoints`` and ``cli``; nothing in the library imports it. Imports are lazy.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "EngineClient": "orchestrator",
    "Orchestrator": "orchestrator",
    "OrchestratorConfig": "orchestrator",
    "RLConfig": "config",
    "RunPaths": "run_dir",
    "UsageError": "checks",
    "check_supported": "checks",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
