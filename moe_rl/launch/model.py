"""Which model a cluster recipe trains and serves, and what the launcher knows about its architecture.

Two kinds of architecture:

- **modelled** (``glm_moe_dsa``: GLM-5 / GLM-5.1; ``glm4_moe``: GLM-4.5; ``deepseek_v3``: DeepSeek-V3 and Kimi-K2;
  ``nemotron_h``: Nemotron-3 Nano / Super / Ultra hybrid Mamba-2 / attention / latent MoE; ``preset`` picks the
  published model of a family): the recipe gives the field values of :class:`moe_rl.models.GlmMoeDsaConfig` /
  :class:`moe_rl.models.GlmMoeConfig` / :class:`moe_rl.models.deepseek_v3.DeepseekV3Config` /
  :class:`moe_rl.models.nemotron_h.NemotronHConfig` (defaults = the published model), the cluster trainer builds
  it, and the dry run runs :func:`moe_rl.distributed.memory.plan_memory` on the trainer layout.
- **published only** (none today; the machinery stays for a family before its model exists): the recipe gives the
  published figures (routed experts, total and active parameters, and where they come from), and the dry run
  checks only the parameter state (a strict lower bound) and says so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from moe_rl.config import BaseConfig, error_rule

__all__ = ["HYBRID_ARCHITECTURES", "ModelSpec", "MODELLED_ARCHITECTURES"]

Architecture = Literal["glm_moe_dsa", "glm4_moe", "deepseek_v3", "nemotron_h"]
MODELLED_ARCHITECTURES = ("glm_moe_dsa", "glm4_moe", "deepseek_v3", "nemotron_h")
HYBRID_ARCHITECTURES = ("nemotron_h",)
"""Architectures with Mamba-2 layers: each sequence holds a fixed-size recurrent state beside its KV cache, and the
engines get ``--mamba-ssm-cache-dtype`` (:attr:`moe_rl.launch.engines.EngineGroup.mamba_ssm_cache_dtype`)."""
Preset = Literal["deepseek_v3", "kimi_k2", "nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra"]
_PRESETS = {"deepseek_v3": ("deepseek_v3", "deepseek_v3"), "kimi_k2": ("deepseek_v3", "kimi_k2"),
            "nemotron_3_nano": ("nemotron_h", "nano_30b_a3b"), "nemotron_3_super": ("nemotron_h", "super_120b_a12b"),
            "nemotron_3_ultra": ("nemotron_h", "ultra_550b_a55b")}
"""``preset -> (architecture, the constructor of its config class)``."""
_DEFAULT_CONFIG = {"glm_moe_dsa": "glm5_1", "glm4_moe": "glm45_air", "deepseek_v3": "deepseek_v3",
                   "nemotron_h": "nano_30b_a3b"}
"""``architecture -> the constructor of its config class`` without a ``preset``."""


class ModelSpec(BaseConfig):
    """The model of a cluster run.

    Raises (at construction):
        ValueError: a modelled architecture given published-only fields, or a published-only architecture missing
            ``n_routed_experts`` / ``total_params`` / ``source``; ``config`` values the model config rejects.
    """

    architecture: Architecture
    """Block family: ``glm_moe_dsa``, ``glm4_moe``, ``deepseek_v3`` and ``nemotron_h`` are built by the trainer and
    planned by the memory planner."""
    trainer_checkpoint: str
    """Hugging Face id or path the trainer loads (bf16 master weights), e.g. ``zai-org/GLM-5.1``."""
    inference_checkpoint: str
    """Hugging Face id or path the engines serve (often the FP8 release), e.g. ``zai-org/GLM-5.1-FP8``."""
    inference_quantization: Literal["none", "fp8", "int4"] | None = None
    """The weight format of ``inference_checkpoint``, which the engines keep for every weight update: ``"none"``
    (``weights.dtype``), ``"fp8"`` (128 x 128 block FP8, the DeepSeek-V3 format) or ``"int4"`` (compressed-tensors
    INT4 routed experts, group size 32, as Kimi-K2-Thinking is released). None: not declared (read from a local
    checkpoint's ``config.json`` when there is one). The trainer publishes ``weights.dtype`` or FP8 blocks
    (``weights.quantize_fp8``), never INT4, so ``"int4"`` is refused (:func:`moe_rl.runtime.checks.
    engine_format_problem`)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Modelled architectures only: field overrides of ``GlmMoeDsaConfig`` / ``GlmMoeConfig`` /
    ``DeepseekV3Config`` / ``NemotronHConfig`` (empty = the published GLM-5.1 / GLM-4.5-Air / ``preset`` shapes)."""
    preset: Preset | None = None
    """The published model ``config`` overrides: for ``deepseek_v3`` ``"deepseek_v3"``
    (:meth:`DeepseekV3Config.deepseek_v3`, the default) or ``"kimi_k2"`` (:meth:`DeepseekV3Config.kimi_k2`); for
    ``nemotron_h`` ``"nemotron_3_nano"`` (the default), ``"nemotron_3_super"`` or ``"nemotron_3_ultra"``
    (:meth:`NemotronHConfig.nano_30b_a3b` / ``super_120b_a12b`` / ``ultra_550b_a55b``)."""
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
        if self.preset is not None and _PRESETS[self.preset][0] != self.architecture:
            raise ValueError(f"model.preset={self.preset!r} is read only for architecture="
                             f"{_PRESETS[self.preset][0]!r}; remove it or pick one of "
                             f"{sorted(k for k, (a, _) in _PRESETS.items() if a == self.architecture)} "
                             f"(architecture={self.architecture!r})")
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

    @property
    def hybrid(self) -> bool:
        """True when the model has Mamba-2 layers (:data:`HYBRID_ARCHITECTURES`)."""
        return self.architecture in HYBRID_ARCHITECTURES

    def model_config_obj(self):
        """The ``GlmMoeDsaConfig`` / ``GlmMoeConfig`` / ``DeepseekV3Config`` / ``NemotronHConfig`` of a modelled
        architecture, or None.

        Raises:
            ValueError: an override the model config rejects (the message names it).
        """
        if self.architecture not in MODELLED_ARCHITECTURES:
            return None
        from moe_rl.models.families import config_class

        make = _PRESETS[self.preset][1] if self.preset is not None else _DEFAULT_CONFIG[self.architecture]
        return getattr(config_class(self.architecture), make)(**self.config)

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer."""
        cfg = self.model_config_obj()
        return int(cfg.n_routed_experts) if cfg is not None else int(self.n_routed_experts)  # type: ignore[arg-type]
