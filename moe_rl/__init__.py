"""moe_rl: composable building blocks for asynchronous RL post-training of very large Mixture-of-Experts LLMs.

Importing this package is cheap and quiet: it imports no torch, no optional backend and does no work.
Subpackages (``moe_rl.models``, ``moe_rl.moe``, ``moe_rl.rl``, ``moe_rl.inference``, ``moe_rl.envs``,
``moe_rl.runtime``, ...) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = (
    "attention",
    "config",
    "distributed",
    "entrypoints",
    "envs",
    "fp8",
    "inference",
    "launch",
    "models",
    "moe",
    "replay",
    "rl",
    "runtime",
)

__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"moe_rl.{name}")
    raise AttributeError(f"module 'moe_rl' has no attribute {name!r}")
