"""Which model a cluster recipe trains and serves, and what the launcher knows about its architecture.

Two kinds of architecture:

- **modelled** (``glm_moe_dsa``: GLM-5 / GLM-5.1; ``glm4_moe``: GLM-4.5): the recipe gives the field values of
  :class:`moe_rl.models.GlmMoeDsaConfig` / :class:`moe_rl.models.GlmMoeConfig` (defaults = the published model),
  and the dry run runs :func:`moe_rl.distributed.memory.plan_memory` on the trainer layout.
- **published only** (``deepseek_v3``: Kimi-K2 and other DeepSeek-V3-architecture models; ``nemotron_h``:
  Nemotron-3 hybrid Mamba-Transformer MoE): the recipe gives the published figures (routed experts, total and active
  parameters, and where they come from). The memory planner does not model these blocks (its activation
  coefficients were measured on this library's GLM modules: a dense MLA without DSA and Mamba-2 layers save other
  tensors), so the dry run checks only the parameter state (a strict lower bound) and says so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from moe_rl.config import BaseConfig, error_rule

__all__ = ["ModelSpec", "MODELLED_ARCHITECTURES"]

Architecture = Literal["glm_moe_dsa", "glm4_moe", "deepseek_v3", "nemotron_h"]
MODELLED_ARCHITECTURES = ("glm_moe_dsa", "glm4_moe")


class ModelSpec(BaseConfig):
    """The model of a cluster run.

    Raises (at construction):
        ValueError: a modelled architecture given published-only fields, or a published-only architecture missing
            ``n_routed_experts`` / ``total_params`` / ``source``; ``config`` values the model config rejects.
    """

    architecture: Architecture
    """Block family: ``glm_moe_dsa`` and ``glm4_moe`` are planned by the memory planner; ``deepseek_v3`` and
    ``nemotron_h`` are described by published figures only."""
    trainer_checkpoint: str
    """Hugging Face id or path the trainer loads (bf16 master weights), e.g. ``zai-org/GLM-5.1``."""
    inference_checkpoint: str
    """Hugging Face id or path the engines serve (often the FP8 release), e.g. ``zai-org/GLM-5.1-FP8``."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Modelled architectures only: field overrides of ``GlmMoeDsaConfig`` / ``GlmMoeConfig`` (empty = the
    published GLM-5.1 / GLM-4.5-Air shapes, their defaults)."""
    n_routed_experts: int | None = Field(None, ge=1)
    """Published-only architectures: routed experts per MoE layer (EP must divide it)."""
    total_params: float | None = Field(None, gt=0)
    """Published-only architectures: total parameters (embedding and head included), from ``source``."""
    active_params: float | None = Field(None, gt=0)
    """Published-only architectures: parameters used per token, from ``source`` (informational)."""
    source: str = ""
    """Where the published figures come from (model card, config.json, paper)."""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.architecture in MODELLED_ARCHITECTURES:
            given = [n for n in ("n_routed_experts", "total_params", "active_params") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"architecture={self.architecture!r} is computed from model.config; remove {given} (they are "
                    "derived from the config, not given)"
                )
            try:
                self.model_config_obj()  # validates the overrides now, naming the bad field
            except ValidationError as exc:
                raise ValueError("; ".join(
                    (f"config.{'.'.join(map(str, e['loc']))} = {e['input']!r}: " if e["loc"] else "config: ")
                    + e["msg"].removeprefix("Value error, ") + error_rule(e) for e in exc.errors()
                )) from None
        else:
            missing = [n for n in ("n_routed_experts", "total_params") if getattr(self, n) is None]
            if missing or not self.source.strip():
                raise ValueError(
                    f"architecture={self.architecture!r} is not modelled by the memory planner, so the recipe must give "
                    f"the published figures: missing {missing + ([] if self.source.strip() else ['source'])}"
                )
            if self.config:
                raise ValueError(
                    f"model.config is only read for {list(MODELLED_ARCHITECTURES)}; architecture="
                    f"{self.architecture!r} takes n_routed_experts / total_params / source instead"
                )
        return self

    @property
    def modelled(self) -> bool:
        """True when :func:`moe_rl.distributed.memory.plan_memory` models this architecture."""
        return self.architecture in MODELLED_ARCHITECTURES

    def model_config_obj(self):
        """The ``GlmMoeDsaConfig`` / ``GlmMoeConfig`` of a modelled architecture, or None.

        Raises:
            ValueError: an override the model config rejects (the message names it).
        """
        if self.architecture == "glm_moe_dsa":
            from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

            return GlmMoeDsaConfig.glm5_1(**self.config)
        if self.architecture == "glm4_moe":
            from moe_rl.models.glm4_moe.config import GlmMoeConfig

            return GlmMoeConfig.glm45_air(**self.config)
        return None

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer."""
        cfg = self.model_config_obj()
        return int(cfg.n_routed_experts) if cfg is not None else int(self.n_routed_experts)  # type: ignore[arg-type]
