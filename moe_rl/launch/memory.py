"""Command line of the trainer memory planner: ``python -m moe_rl.launch.memory --model glm5_1 --nodes 16 ...``.

It builds a named model config (``glm5_1``: ``GlmMoeDsaConfig.glm5_1``; ``glm45_air``: ``GlmMoeConfig.glm45_air``;
``deepseek_v3`` / ``kimi_k2``: ``DeepseekV3Config.deepseek_v3`` / ``.kimi_k2``; ``nemotron_3_ultra``:
``NemotronHConfig.ultra_550b_a55b``; ``tiny``: ``GlmMoeConfig.tiny_debug``), the :class:`moe_rl.distributed.ParallelDims` of each node count, and prints
:func:`moe_rl.distributed.memory.plan_memory`'s report (the planner itself imports no model family). The tables of
``docs/memory.md`` are this command's output.
"""

from __future__ import annotations

from moe_rl.distributed.memory import _MODEL_ATTN_KERNEL, GiB, arch_spec, plan_memory
from moe_rl.distributed.parallel_dims import ParallelDims

__all__ = ["MODELS", "main"]

_CONFIGS = {"deepseek_v3": ("deepseek_v3", "deepseek_v3"), "glm45_air": ("glm4_moe", "glm45_air"),
            "glm5_1": ("glm_moe_dsa", "glm5_1"), "kimi_k2": ("deepseek_v3", "kimi_k2"),
            "nemotron_3_ultra": ("nemotron_h", "ultra_550b_a55b"), "tiny": ("glm4_moe", "tiny_debug")}
"""``--model`` choice -> (model family, the constructor of its config class)."""
MODELS = tuple(_CONFIGS)
"""The ``--model`` choices."""


def _model_config(name: str):
    """The config of a ``--model`` choice."""
    if name not in _CONFIGS:
        raise ValueError(f"model={name!r} is not one of {list(MODELS)}")
    from moe_rl.models.families import config_class

    family, make = _CONFIGS[name]
    return getattr(config_class(family), make)()


def main(argv: list[str] | None = None) -> int:
    """Print the plan of each ``--nodes`` value (markdown, the tables of ``docs/memory.md``); ``--help`` lists the
    options.

    Returns:
        0; bad arguments exit through ``argparse`` with status 2 and a message naming the option and the rule.
    """
    import argparse

    p = argparse.ArgumentParser(description="Per-GPU memory plan of a training step (moe_rl.launch.memory, "
                                "planned by moe_rl.distributed.memory.plan_memory)")
    p.add_argument("--model", choices=sorted(MODELS), default="glm5_1")
    p.add_argument("--nodes", type=int, nargs="+", default=[28], help="trainer nodes (one plan per value)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-gb", type=float, default=141.0, help="GPU memory in GB (1e9 bytes); H200: 141")
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="usable GPU memory in GiB (2**30 bytes), replaces --gpu-gb; an H200 reports 140.4")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--ac", choices=["full", "none"], default="full")
    p.add_argument("--loss-chunk-tokens", type=int, default=None)
    p.add_argument("--optimizer-offload", action="store_true")
    p.add_argument("--attn-kernel", choices=["dense", "chunked"], default=None,
                   help="glm5_1: DSA attention (dense: the [T, T] reference; chunked: the memory-bounded path); "
                   "default: the model config's attn_backend (GLM-5.1: 'torch' = chunked)")
    p.add_argument("--fp8", action="store_true", help="FP8 linears and routed experts")
    a = p.parse_args(argv)
    if a.gpu_gb <= 0:
        p.error(f"--gpu-gb {a.gpu_gb} must be > 0 (GPU memory in GB, e.g. 141 for an H200)")
    if a.gpu_gib is not None and a.gpu_gib <= 0:
        p.error(f"--gpu-gib {a.gpu_gib} must be > 0 (usable GPU memory in GiB, e.g. 140.4 for an H200)")
    if a.loss_chunk_tokens is not None and a.loss_chunk_tokens < 1:
        p.error(f"--loss-chunk-tokens {a.loss_chunk_tokens} must be >= 1 (tokens per head/loss chunk)")
    gpu_bytes = a.gpu_gib * GiB if a.gpu_gib is not None else a.gpu_gb * 1e9
    for name in ("gpus_per_node", "seq_len", "micro_batch", "cp", "ep", "dp_replicate"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if min(a.nodes) < 1:
        p.error(f"--nodes {a.nodes}: every value must be >= 1")
    cfg = _model_config(a.model)
    if a.attn_kernel is None:  # what the trainer runs for this config (trainer_plan_inputs' mapping)
        a.attn_kernel = _MODEL_ATTN_KERNEL.get(getattr(cfg, "attn_backend", "dense"), "dense")
    spec = arch_spec(cfg)
    print(f"# {a.model}: {spec.total_params / 1e9:.3g}B parameters ({spec.active_params / 1e9:.3g}B active, "
          "embedding and head excluded)\n")
    for nodes in a.nodes:
        world = nodes * a.gpus_per_node
        if world % (a.dp_replicate * a.cp):
            p.error(f"{world} GPUs are not divisible by dp_replicate*cp = {a.dp_replicate * a.cp}")
        try:
            dims = ParallelDims(
                dp_replicate=a.dp_replicate, dp_shard=world // (a.dp_replicate * a.cp), cp=a.cp, ep=a.ep
            )
            plan = plan_memory(cfg, dims, a.seq_len, a.micro_batch, a.precision, a.ac, a.optimizer_offload,
                               loss_chunk_tokens=a.loss_chunk_tokens, attn_kernel=a.attn_kernel, fp8=a.fp8,
                               fp8_experts=a.fp8)
        except ValueError as err:
            p.error(str(err))
        dsa = f", DSA {a.attn_kernel}" if spec.dsa is not None else ""
        print(f"## {nodes} nodes x {a.gpus_per_node} GPUs: dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} "
              f"cp={dims.cp} ep={dims.ep}; seq {a.seq_len} x {a.micro_batch}, {a.precision}{dsa}, AC {a.ac}, "
              f"optimizer offload {'on' if a.optimizer_offload else 'off'}, fp8 {'on' if a.fp8 else 'off'}, "
              f"loss chunk {a.loss_chunk_tokens}; peak in {plan.peak_phase}\n")
        print(plan.report(gpu_bytes))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
