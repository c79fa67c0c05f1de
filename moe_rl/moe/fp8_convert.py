"""Convert a model for FP8 block-scaled training: linears and routed experts, in place, before FSDP2."""

from __future__ import annotations

import logging

from torch import nn

from moe_rl.fp8.config import Fp8Config
from moe_rl.fp8.linear import Fp8BlockLinear, convert_to_fp8_block_linear, default_fp8_filter
from moe_rl.moe.experts import GroupedExperts
from moe_rl.moe.fp8_experts import Fp8GroupedExperts

__all__ = ["convert_model_to_fp8"]

logger = logging.getLogger(__name__)


def convert_model_to_fp8(model: nn.Module, cfg: Fp8Config | None = None) -> dict[str, int]:
    """Swap ``model``'s ``nn.Linear`` and :class:`moe_rl.moe.GroupedExperts` modules for FP8 ones, in place.

    Exclusions (DeepSeek-V3 §3.3): router/gate, ``lm_head`` (see :func:`moe_rl.fp8.linear.default_fp8_filter`)
    and embeddings (not ``nn.Linear``). Dimensions need not be multiples of 128: tail blocks get their own
    scale (case B03) and the deep_gemm backend zero-pads K. Parameters are shared, so the state dict is unchanged.

    Args:
        model: e.g. :class:`moe_rl.models.GlmMoeForCausalLM`; call before ``fully_shard``.
        cfg: :class:`Fp8Config` (``enabled`` is not consulted: calling this converts).

    Returns:
        ``{"linear": n, "experts": m, "skipped_linear": k}`` counts (also logged), so nothing is skipped silently.
    """
    cfg = cfg or Fp8Config(enabled=True)
    backend = cfg.backend

    def _filter(fqn: str, mod: nn.Module) -> bool:
        if not default_fp8_filter(fqn, mod):
            return False
        return cfg.shared_experts or not any(p in ("shared_experts", "mlp") for p in fqn.split(".")[:-1])

    n_lin_before = sum(type(m) is nn.Linear for m in model.modules())
    convert_to_fp8_block_linear(model, filter_fn=_filter, backend=backend)
    n_lin = sum(isinstance(m, Fp8BlockLinear) for m in model.modules())
    n_exp = 0
    if cfg.experts:
        for fqn, mod in list(model.named_modules()):
            if type(mod) is GroupedExperts:
                parent_name, _, child = fqn.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, Fp8GroupedExperts.from_experts(mod, backend=backend))
                n_exp += 1
    counts = {"linear": n_lin, "experts": n_exp, "skipped_linear": n_lin_before - n_lin}
    logger.info("fp8: converted %d linear(s) and %d expert group(s); %d linear(s) kept high precision "
                "(router/gate/lm_head or filtered), backend=%r", n_lin, n_exp, counts["skipped_linear"], backend)
    return counts
