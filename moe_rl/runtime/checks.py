"""Run-config checks shared by the trainer process and the cluster entry points (no process, no I/O)."""

from __future__ import annotations

__all__ = ["UsageError", "check_supported", "check_trainer_supported", "grouped_experts_problem", "unsupported_weights_kind"]


class UsageError(ValueError):
    """Bad arguments or config (exit status 2)."""


def unsupported_weights_kind(cfg) -> str | None:
    """Why ``weights`` cannot run in the cluster entry points (both refuse it), or None."""
    if cfg.weights.kind in ("broadcast", "p2p") and cfg.weights.quantize_fp8:
        return (f"weights.kind={cfg.weights.kind!r} with weights.quantize_fp8=true: FP8 128x128 blocks are quantized "
                f"from whole tensors, and {cfg.weights.kind} ships each trainer rank's shards; set "
                "weights.quantize_fp8=false (bf16 on the wire) or weights.kind='filesystem' (rank 0 streams an FP8 "
                "folder)")
    return None


def grouped_experts_problem(model_cfg, dtype: str, device_type: str = "cuda") -> str | None:
    """Why the cluster trainer's routed experts (``torch._grouped_mm``, no config switch) cannot run ``model_cfg``
    in ``dtype`` on ``device_type``, or None.

    The rule of :func:`moe_rl.runtime.trainer.step.resolve_experts_backend`: fp32 on CUDA runs the per-expert loop
    (no size rule); otherwise ``hidden_size`` and ``moe_intermediate_size`` need 16-byte rows
    (:func:`moe_rl.moe.experts.grouped_mm_problem`: multiples of 8 in bf16, of 4 in fp32).

    Args:
        model_cfg: the model config the trainer builds (``hidden_size``, ``moe_intermediate_size``).
        dtype: ``trainer.dtype``, ``"float32"`` or ``"bfloat16"``.
        device_type: ``"cuda"`` or ``"cpu"``.

    Returns:
        A sentence naming the rule, the sizes and the fields to change, or None when the sizes run.
    """
    if device_type == "cuda" and dtype != "bfloat16":
        return None
    import torch

    from moe_rl.moe.experts import grouped_mm_problem

    problem = grouped_mm_problem(model_cfg.hidden_size, model_cfg.moe_intermediate_size, getattr(torch, dtype))
    if problem is None:
        return None
    return (f"its routed experts run torch._grouped_mm (trainer.dtype={dtype!r} on {device_type}; the cluster trainer "
            f"has no switch to the per-expert loop) and {problem}; change model.config.hidden_size / "
            "model.config.moe_intermediate_size")


def check_trainer_supported(cfg, device_type: str = "cuda") -> None:
    """Reject a cluster config the cluster trainer cannot run (it calls this at start-up; so does the dry run).

    Args:
        cfg: the resolved cluster config.
        device_type: where the trainer runs: ``"cuda"`` (the cluster, and the dry run's assumption) or ``"cpu"``.

    Raises:
        ValueError: the recipe's model is described by published figures only (the trainer builds ``glm_moe_dsa``
            and ``glm4_moe`` models), ``weights`` asks for FP8 over the broadcast or p2p transport, or the model's expert
            sizes cannot run the trainer's grouped experts (:func:`grouped_experts_problem`).
    """
    if not cfg.model.modelled:
        raise ValueError(f"model.architecture={cfg.model.architecture!r} is described by published figures only; the "
                         "trainer builds glm_moe_dsa (GLM-5/5.1) and glm4_moe (GLM-4.5) models")
    problem = unsupported_weights_kind(cfg)
    if problem is not None:
        raise ValueError(problem)
    problem = grouped_experts_problem(cfg.model.model_config_obj(), cfg.trainer.dtype, device_type)
    if problem is not None:
        raise ValueError(problem)


def check_supported(cfg) -> None:
    """Reject settings this entry point cannot run.

    Raises:
        UsageError: ``weights.kind = "broadcast"`` or ``"p2p"`` with ``weights.quantize_fp8`` (FP8 blocks need whole
            tensors);
            disaggregated mode with ``orchestrator.off_policy_policy = "mask"`` (needs per-token versions) or with
            ``trainer.router_replay = true`` (needs routing captured by the serving engine); behind the P/D proxy
            the client does not know which replica served a request.
    """
    problems = []
    weights_problem = unsupported_weights_kind(cfg)
    if weights_problem is not None:
        problems.append(weights_problem)
    if cfg.inference.mode == "disaggregated":
        if cfg.orchestrator.off_policy_policy == "mask":
            problems.append(
                "orchestrator.off_policy_policy='mask' with inference.mode='disaggregated': masking by token age "
                "needs per-token policy versions, which cannot be tracked behind the P/D proxy (the client does "
                "not know which decode replica served a request); use off_policy_policy='drop' or 'withhold', or "
                "inference.mode='colocated'")
        if cfg.trainer.router_replay:
            problems.append(
                "trainer.router_replay=true with inference.mode='disaggregated': routed experts are captured by the "
                "serving engine, which is unknown behind the P/D proxy; set trainer.router_replay=false or use "
                "inference.mode='colocated'")
    if problems:
        raise UsageError("; ".join(problems))

