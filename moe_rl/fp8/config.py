"""FP8 training config (owned by :mod:`moe_rl.fp8`; the trainer embeds it as ``trainer.fp8``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from moe_rl.config import BaseConfig

__all__ = ["Fp8Config"]


class Fp8Config(BaseConfig):
    """Block-scaled FP8 training (DeepSeek-V3 recipe) for the policy's linears and routed experts.

    ``trainer.fp8 = true`` in TOML (or ``--trainer.fp8 true``) is shorthand for ``{enabled = true}``.
    """

    enabled: bool = False
    """Convert the model before FSDP2: ``nn.Linear`` -> :class:`moe_rl.fp8.Fp8BlockLinear` (router/gate,
    lm_head and embeddings excluded) and routed experts -> :class:`moe_rl.moe.Fp8GroupedExperts`."""
    backend: Literal["auto", "torch", "triton", "deep_gemm"] = "auto"
    """GEMM backend: ``auto`` = deep_gemm on CUDA when importable, else the torch reference (CPU)."""
    experts: bool = True
    """Also run the routed experts' grouped GEMMs in FP8 (contiguous layout, 128-row padded segments)."""
    shared_experts: bool = True
    """Also convert the shared experts' and dense MLPs' linears (ordinary FP8 GEMMs in DeepSeek-V3)."""

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"enabled": value}
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return {"enabled": value.strip().lower() == "true"}
        return value
