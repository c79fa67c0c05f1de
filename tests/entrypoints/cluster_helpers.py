"""Helpers for local (CPU) runs of the cluster entry points: a tiny GLM-4.5-architecture checkpoint with the char
tokenizer, and a ``ClusterConfig`` JSON describing 1 trainer node + 1 colocated inference node that serve it.

Used by ``test_cluster_orchestrator.py`` and meant for a full local smoke test (trainer via torchrun + the
orchestrator + a vLLM CPU server)::

    ckpt = write_tiny_checkpoint(tmp / "ckpt")
    cfg_path = write_cluster_config(tmp / "cluster.json", ckpt, max_steps=3)
    python -m moe_rl.entrypoints.cluster_orchestrator --config cfg_path --run-dir RUN \\
        --inference-url URL --engine-url engine=URL

The model is ``GlmMoeConfig.tiny_debug()`` (the debug_cpu recipe's: vocab 32 = the char tokenizer over the default
29-character alphabet, head_dim 32 and moe_intermediate_size 64 as vLLM's CPU kernels need); the config gives it to
``ClusterConfig`` as ``model.config`` overrides of ``glm4_moe``, so ``ModelSpec.model_config_obj()`` rebuilds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["tiny_model_overrides", "write_tiny_checkpoint", "cluster_config_dict", "write_cluster_config"]


def tiny_model_overrides() -> dict[str, Any]:
    """Every field of ``GlmMoeConfig.tiny_debug()`` (``model.config`` of the cluster config)."""
    from moe_rl.models import GlmMoeConfig

    return GlmMoeConfig.tiny_debug().model_dump(mode="json")


def write_tiny_checkpoint(out_dir: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random-init tiny ``glm4_moe`` HF checkpoint + the char tokenizer to ``out_dir`` (moe_rl's own
    ``save_hf_checkpoint``, as ``moe-rl rl`` writes version 0). Returns ``out_dir``."""
    import torch

    from moe_rl.envs import CharTokenizer
    from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM
    from moe_rl.models.glm4_moe import save_hf_checkpoint

    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model, cfg, out_dir, dtype=getattr(torch, dtype))
    CharTokenizer().save_pretrained(out_dir)
    return out_dir


def cluster_config_dict(checkpoint: Path | str, *, max_steps: int = 3, batch_size: int = 4, group_size: int = 2,
                        max_model_len: int = 128, seq_len: int = 128, gpus_per_node: int = 1, **overrides: Any) -> dict:
    """A ``ClusterConfig`` dict for a CPU smoke run on ``checkpoint`` (trainer and engines both load it).

    Layout: ``cluster.num_nodes = 2`` (trainer node 0, colocated engine node 1), ``gpus_per_node`` GPUs (ranks) each;
    ``task.tokenizer = "char"`` with the default alphabet; addition with 2-digit operands; ``weights``: filesystem,
    fp32, no FP8 quantization (what a vLLM CPU engine serving the fp32 checkpoint loads); ``max_inflight = batch_size`` groups (``ClusterConfig`` requires max_inflight * group_size >= batch_size).
    ``overrides`` replace top-level sections (shallow: ``orchestrator={...}`` replaces the whole section).
    """
    ckpt = str(Path(checkpoint).resolve())
    d: dict[str, Any] = {
        "name": "cpu-smoke",
        "max_steps": max_steps,
        "seed": 0,
        "task": {"env": {"num_digits": 2, "max_new_tokens": 4}, "tokenizer": "char"},
        "cluster": {"num_nodes": 2, "gpus_per_node": gpus_per_node, "gpu_name": "cpu"},
        "model": {"architecture": "glm4_moe", "trainer_checkpoint": ckpt, "inference_checkpoint": ckpt,
                  "config": tiny_model_overrides()},
        "trainer": {"num_nodes": 1, "seq_len": seq_len, "activation_checkpointing": "none", "env": {},
                    "dtype": "float32",  # = the fp32 CPU engine's numerics
                    "optim": {"lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 0}},
        "inference": {"mode": "colocated", "max_model_len": max_model_len,
                      "engine": {"nodes_per_replica": 1, "replicas": 1, "enable_expert_parallel": False}},
        "orchestrator": {"batch_size": batch_size, "group_size": group_size, "max_inflight": batch_size,
                         "max_off_policy_steps": 1, "temperature": 1.0, "request_timeout_s": 60.0,
                         "stall_timeout_s": 120.0},
        # the CPU engine serves the fp32 checkpoint: publish fp32, no FP8 block quantization
        "weights": {"kind": "filesystem", "quantize_fp8": False, "dtype": "float32"},
    }
    d.update(overrides)
    return d


def write_cluster_config(path: Path, checkpoint: Path | str, **kwargs: Any) -> Path:
    """Validate ``cluster_config_dict(checkpoint, **kwargs)`` as a ``ClusterConfig`` and write its JSON (the form
    ``moe-rl cluster`` writes to ``configs/cluster.json``) to ``path``. Returns ``path``.

    Raises:
        ValueError: ``ClusterConfig`` rejects the config (pydantic ``ValidationError``).
    """
    from moe_rl.launch.config import ClusterConfig

    cfg = ClusterConfig.model_validate(cluster_config_dict(checkpoint, **kwargs))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cfg.model_dump_json(indent=2))
    json.loads(path.read_text())
    return path
