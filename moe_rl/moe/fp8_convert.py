"""Convert a model for FP8 block-scaled training: linears and routed experts, in place, before FSDP2."""

from __future__ import annotations

import logging
import warnings

from torch import nn

from moe_rl.fp8.config import Fp8Config
from moe_rl.fp8.linear import Fp8BlockLinear, convert_to_fp8_block_linear, default_fp8_filter
from moe_rl.moe.experts import GroupedExperts
from moe_rl.moe.fp8_experts import Fp8GroupedExperts

__all__ = ["convert_model_to_fp8", "fp8_parameter_fraction"]

logger = logging.getLogger(__name__)


def convert_model_to_fp8(model: nn.Module, cfg: Fp8Config | None = None) -> dict[str, int]:
    """Swap ``model``'s ``nn.Linear`` and :class:`moe_rl.moe.GroupedExperts` modules for FP8 ones, in place; experts
    of a model family that convert themselves (an ``enable_fp8(backend)`` method and an ``fp8_backend`` attribute,
    e.g. Nemotron-H's squared-ReLU ``ReluSquaredExperts``) are switched to FP8 in place and counted as experts.

    Exclusions (DeepSeek-V3 §3.3): router/gate, ``lm_head`` (see :func:`moe_rl.fp8.linear.default_fp8_filter`)
    and embeddings (not ``nn.Linear``). Dimensions need not be multiples of 128: tail blocks get their own
    scale (vllm-project/compressed-tensors PR #547) and the deep_gemm backend zero-pads K. Parameters are shared, so the state dict is unchanged.

    Args:
        model: e.g. :class:`moe_rl.models.GlmMoeForCausalLM`; call before ``fully_shard``.
        cfg: :class:`Fp8Config` (``enabled`` is not consulted: calling this converts).

    Returns:
        ``{"linear": n, "experts": m, "skipped_linear": k}`` counts of this call (also logged), so nothing is skipped
        silently; a second call on a converted model converts and counts nothing.
        Fused experts of other implementations (e.g. ``transformers``' ``Qwen3MoeExperts``: 3-D
        ``gate_up_proj``/``down_proj``/``up_proj`` parameters) are not converted here; a ``UserWarning`` names each
        one and points to :func:`moe_rl.fp8.hf.convert_hf_moe_to_fp8`.
    """
    cfg = cfg or Fp8Config(enabled=True)
    backend = cfg.backend

    def _filter(fqn: str, mod: nn.Module) -> bool:
        if not default_fp8_filter(fqn, mod):
            return False
        return cfg.shared_experts or not any(p in ("shared_experts", "mlp") for p in fqn.split(".")[:-1])

    n_lin_before = sum(type(m) is nn.Linear for m in model.modules())
    n_fp8_before = sum(isinstance(m, Fp8BlockLinear) for m in model.modules())  # a second call converts nothing
    convert_to_fp8_block_linear(model, filter_fn=_filter, backend=backend)
    n_lin = sum(isinstance(m, Fp8BlockLinear) for m in model.modules()) - n_fp8_before
    n_exp = 0
    if cfg.experts:
        for fqn, mod in list(model.named_modules()):
            if type(mod) is GroupedExperts:
                parent_name, _, child = fqn.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, Fp8GroupedExperts.from_experts(mod, backend=backend))
                n_exp += 1
            elif _own_fp8_experts(mod) and getattr(mod, "fp8_backend", None) is None:
                mod.enable_fp8(backend)  # a model family's own experts (e.g. Nemotron-H's squared-ReLU experts)
                n_exp += 1
    counts = {"linear": n_lin, "experts": n_exp, "skipped_linear": n_lin_before - n_lin}
    _warn_foreign_experts(model)
    logger.info("fp8: converted %d linear(s) and %d expert group(s); %d linear(s) kept high precision "
                "(router/gate/lm_head or filtered), backend=%r", n_lin, n_exp, counts["skipped_linear"], backend)
    return counts


def _own_fp8_experts(mod: nn.Module) -> bool:
    """Experts of a model family that convert themselves: an ``enable_fp8(backend)`` method switching their grouped
    GEMMs to FP8 in place and an ``fp8_backend`` attribute (``None`` while high precision)."""
    return callable(getattr(mod, "enable_fp8", None)) and hasattr(mod, "fp8_backend")


def _warn_foreign_experts(model: nn.Module) -> None:
    from moe_rl.fp8.hf import is_fp8_hf_experts

    def fused(mod: nn.Module) -> bool:
        return any(isinstance(p := getattr(mod, n, None), nn.Parameter) and p.dim() == 3
                   for n in ("gate_up_proj", "down_proj", "up_proj"))

    foreign = [
        f"{fqn or '<model>'} ({type(mod).__name__})"
        for fqn, mod in model.named_modules()
        if fused(mod) and not isinstance(mod, (GroupedExperts, Fp8GroupedExperts)) and not is_fp8_hf_experts(mod)
        and not _own_fp8_experts(mod)
    ]
    if foreign:
        warnings.warn(
            f"convert_model_to_fp8: {len(foreign)} fused experts module(s) of another implementation left in high "
            f"precision: {', '.join(foreign)}; for transformers MoE models use moe_rl.fp8.hf.convert_hf_moe_to_fp8",
            UserWarning,
            stacklevel=3,
        )


def fp8_parameter_fraction(model: nn.Module) -> dict[str, float | int]:
    """How much of ``model`` runs its GEMMs in FP8: the parameters of FP8-converted modules over all parameters.

    FP8 parameters are the weights of :class:`moe_rl.fp8.linear.Fp8BlockLinear` (their bias, if any, is added in
    high precision and counts as not FP8) and the stacked expert weights (``gate_up_proj`` or ``up_proj``, and
    ``down_proj``) of every module with an ``fp8_backend`` (:class:`moe_rl.moe.fp8_experts.Fp8GroupedExperts`, and
    :class:`moe_rl.moe.ep.LocalExperts` made from them under expert parallelism). Each parameter counts once
    (a tied embedding / LM head is one parameter) with its *global* element count: DTensor shards of FSDP2 / EP
    report the full tensor's ``numel()``, so every rank of a parallelized model returns the same figures.

    Args:
        model: any module, before or after :func:`moe_rl.distributed.parallelize.parallelize_model`.

    Returns:
        ``{"fp8_params": n, "total_params": t, "fraction": n / t}`` (element counts; ``fraction`` 0.0 for an
        empty model).
    """
    fp8_ids: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, Fp8BlockLinear):
            fp8_ids.add(id(mod.weight))
        elif getattr(mod, "fp8_backend", None) is not None:
            for name in ("gate_up_proj", "up_proj", "down_proj"):
                p = getattr(mod, name, None)
                if isinstance(p, nn.Parameter):
                    fp8_ids.add(id(p))
    total = fp8 = 0
    seen: set[int] = set()
    for p in model.parameters():  # parameters() already yields a shared parameter once; the set is for safety
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if id(p) in fp8_ids:
            fp8 += p.numel()
    return {"fp8_params": fp8, "total_params": total, "fraction": fp8 / total if total else 0.0}
