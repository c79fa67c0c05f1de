"""Run-config checks shared by the trainer process and the cluster entry points (no process, no I/O)."""

from __future__ import annotations

__all__ = ["UsageError", "check_supported", "check_trainer_supported", "checkpoint_quantization",
           "engine_format_problem", "grouped_experts_problem", "unsupported_weights_kind"]


class UsageError(ValueError):
    """Bad arguments or config (exit status 2)."""


def unsupported_weights_kind(cfg) -> str | None:
    """Why ``weights`` cannot run in the cluster entry points (both refuse it), or None."""
    if cfg.weights.kind in ("broadcast", "p2p") and cfg.weights.quantize_fp8:
        return (f"weights.kind={cfg.weights.kind!r} with weights.quantize_fp8=true: FP8 128x128 blocks are quantized "
                f"from whole tensors, and {cfg.weights.kind} ships each trainer rank's shards; set "
                "weights.quantize_fp8=false (bf16 on the wire) or weights.kind='filesystem' (rank 0 streams an FP8 "
                "folder)")
    delta = getattr(cfg.weights, "delta", None)
    if delta is not None and delta.enabled and cfg.weights.quantize_fp8:
        return (f"weights.delta.enabled=true with weights.kind={cfg.weights.kind!r} and weights.quantize_fp8=true: "
                "delta encoding works on each trainer rank's bf16 pieces, and the FP8 folder is streamed whole by "
                "rank 0; set weights.quantize_fp8=false, or weights.delta.enabled=false")
    return None


def checkpoint_quantization(ref: str) -> str | None:
    """The weight format of a local checkpoint folder from its ``config.json`` ``quantization_config``: ``"int4"``
    (``quant_method`` ``compressed-tensors`` with a 4-bit weight group), ``"fp8"`` (``quant_method`` ``fp8``, or
    compressed-tensors with 8-bit float weights), ``"none"`` (no ``quantization_config``), or None when ``ref`` is
    not a local folder with a readable ``config.json`` (a hub id: nothing is downloaded) or the method is another
    one."""
    import json
    from pathlib import Path

    path = Path(ref).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q is None:
        return "none"
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        if any(w.get("num_bits") == 4 for w in weights):
            return "int4"
        if any(w.get("num_bits") == 8 and w.get("type") == "float" for w in weights):
            return "fp8"
    return None


def engine_format_problem(cfg) -> str | None:
    """Why the engines cannot load the weights the trainer publishes, or None.

    The trainer publishes ``weights.dtype`` tensors or 128 x 128 block FP8 (``weights.quantize_fp8``); an engine keeps
    the weight format of the checkpoint it started from (``model.inference_quantization``, else read from a local
    ``model.inference_checkpoint``'s ``config.json``: :func:`checkpoint_quantization`). An INT4 engine
    (compressed-tensors, e.g. Kimi-K2-Thinking's routed experts in INT4 with group size 32) has packed INT4
    parameters and no loader for bf16 or FP8 tensors, and no INT4 publisher exists here.

    Returns:
        A sentence naming the fields and what to set, or None.
    """
    declared = getattr(cfg.model, "inference_quantization", None)
    found = checkpoint_quantization(cfg.model.inference_checkpoint)
    fmt = declared if declared is not None else found
    published = "128x128 block FP8 (weights.quantize_fp8=true)" if cfg.weights.quantize_fp8 else \
        f"{cfg.weights.dtype} (weights.quantize_fp8=false)"
    if declared is not None and found is not None and declared != found:
        return (f"model.inference_quantization={declared!r} but the config.json of model.inference_checkpoint="
                f"{cfg.model.inference_checkpoint!r} declares {found!r} weights; make them agree")
    if fmt == "int4":
        return (f"the engines serve an INT4 checkpoint (model.inference_quantization='int4', compressed-tensors INT4 "
                f"experts, group size 32: model.inference_checkpoint={cfg.model.inference_checkpoint!r}) but the "
                f"trainer publishes {published}, and this library has no INT4 publisher: an INT4 engine cannot load "
                "the updates. Serve the bf16 or FP8 release instead: set model.inference_checkpoint to it and "
                "model.inference_quantization='fp8' with weights.quantize_fp8=true (or 'none' with "
                "weights.quantize_fp8=false)")
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
        ValueError: the recipe's model is described by published figures only (the trainer builds ``glm_moe_dsa``,
            ``glm4_moe``, ``deepseek_v3`` and ``nemotron_h`` models), ``weights`` asks for FP8 over the broadcast or p2p transport, or the model's expert
            sizes cannot run the trainer's grouped experts (:func:`grouped_experts_problem`).
    """
    if not cfg.model.modelled:
        raise ValueError(f"model.architecture={cfg.model.architecture!r} is described by published figures only; the "
                         "trainer builds glm_moe_dsa (GLM-5/5.1), glm4_moe (GLM-4.5), deepseek_v3 (DeepSeek-V3, Kimi-K2) and "
                         "nemotron_h (Nemotron-3) models")
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
            tensors); an INT4 engine checkpoint (:func:`engine_format_problem`);
            disaggregated mode with ``orchestrator.off_policy_policy = "mask"`` (needs per-token versions) or with
            ``trainer.router_replay = true`` (needs routing captured by the serving engine); behind the P/D proxy
            the client does not know which replica served a request.
    """
    problems = []
    weights_problem = unsupported_weights_kind(cfg)
    if weights_problem is not None:
        problems.append(weights_problem)
    engine_problem = engine_format_problem(cfg)
    if engine_problem is not None:
        problems.append(engine_problem)
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

