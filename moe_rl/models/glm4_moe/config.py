"""Configuration of the GLM-4.5 (``glm4_moe``) MoE decoder.

Field names are those of Hugging Face ``Glm4MoeConfig`` (``transformers/models/glm4_moe/
configuration_glm4_moe.py``), so a ``config.json`` maps onto this model field by field. Defaults describe
GLM-4.5-Air (``zai-org/GLM-4.5-Air``); :meth:`GlmMoeConfig.tiny_debug` is the 2-layer CPU model of
the addition task (:mod:`moe_rl.envs.addition`).

This module does not import torch or transformers.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.models.common.config import (
    hf_config_dict,
    hf_config_values,
    moe_routing_problems,
    token_id_problems,
)

__all__ = ["GlmMoeConfig"]

_HF_ARCHITECTURE = "Glm4MoeForCausalLM"
_HF_MODEL_TYPE = "glm4_moe"


class GlmMoeConfig(BaseConfig):
    """GLM-4.5 MoE architecture hyper-parameters (Hugging Face ``Glm4MoeConfig`` names).

    Layers ``[0, first_k_dense_replace)`` use a dense SwiGLU MLP of width ``intermediate_size``; the others
    use an MoE block of ``n_routed_experts`` experts of width ``moe_intermediate_size`` with top
    ``num_experts_per_tok`` routing plus ``n_shared_experts`` shared experts.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    vocab_size: int = Field(151552, ge=1)
    """Number of token ids (rows of the embedding and of the output head)."""
    hidden_size: int = Field(4096, ge=1)
    """Residual stream width D."""
    intermediate_size: int = Field(10944, ge=1)
    """Width of the dense SwiGLU MLP used by the first ``first_k_dense_replace`` layers."""
    moe_intermediate_size: int = Field(1408, ge=1)
    """Width F of each routed expert (and of each shared expert)."""
    num_hidden_layers: int = Field(46, ge=1)
    """Number of decoder layers (MTP layers excluded)."""
    num_attention_heads: int = Field(96, ge=1)
    """Query heads H."""
    num_key_value_heads: int = Field(8, ge=1)
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""
    head_dim: int = Field(128, ge=1)
    """Per-head width; independent of ``hidden_size / num_attention_heads`` (GLM-4.5 uses 128)."""
    partial_rotary_factor: float = Field(0.5, gt=0.0, le=1.0)
    """Share of each head's leading dims that get rotary embeddings; ``head_dim * factor`` must be even."""
    rope_theta: float = Field(1_000_000.0, gt=0.0)
    """Rotary base frequency."""
    rms_norm_eps: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm."""
    attention_bias: bool = True
    """Bias on the q/k/v projections (GLM-4.5: true). ``o_proj`` never has a bias."""
    use_qk_norm: bool = False
    """RMSNorm over each head of q and k before rotary (GLM-4.5: true, GLM-4.5-Air: false)."""
    first_k_dense_replace: int = Field(1, ge=0)
    """Number of leading layers that use the dense MLP instead of MoE."""
    n_routed_experts: int = Field(128, ge=1)
    """Routed experts E per MoE layer."""
    num_experts_per_tok: int = Field(8, ge=1)
    """Experts K chosen per token (top_k)."""
    n_shared_experts: int = Field(1, ge=0)
    """Always-on shared experts, fused into one SwiGLU of width ``n_shared_experts * moe_intermediate_size``."""
    n_group: int = Field(1, ge=1)
    """Expert groups for group-limited routing (DeepSeek-V3 node-limited routing); must divide E."""
    topk_group: int = Field(1, ge=1)
    """Groups kept per token before the top-k; at most ``n_group``."""
    norm_topk_prob: bool = True
    """Renormalize the K gathered sigmoid scores to sum to one."""
    routed_scaling_factor: float = Field(1.0, gt=0.0)
    """Multiplier on the routed gate weights (GLM-4.5: 2.5, GLM-4.5-Air: 1.0)."""
    max_position_embeddings: int = Field(131072, ge=1)
    """Longest supported context (written to config.json; inference engines size caches from it)."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    bos_token_id: int | None = Field(None, ge=0)
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id, or several."""
    pad_token_id: int | None = Field(None, ge=0)
    """Padding token id (its embedding row starts at zero and gets no gradient, as in ``nn.Embedding``)."""
    initializer_range: float = Field(0.02, ge=0.0)
    """Standard deviation of the normal initialization of every weight matrix."""

    @model_validator(mode="after")
    def _check_consistency(self) -> GlmMoeConfig:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} must be divisible by num_key_value_heads="
                f"{self.num_key_value_heads} (each KV head serves a whole group of query heads)"
            )
        rotary = self.head_dim * self.partial_rotary_factor
        if rotary != int(rotary) or int(rotary) % 2:
            problems.append(
                f"head_dim * partial_rotary_factor = {self.head_dim} * {self.partial_rotary_factor} = {rotary} must "
                "be an even integer (rotary dims are rotated in pairs)"
            )
        problems += moe_routing_problems(self) + token_id_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ------------------------------------------------------------------ derived sizes

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that get rotary embeddings (``head_dim * partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` uses the MoE block (``layer_idx >= first_k_dense_replace``)."""
        return layer_idx >= self.first_k_dense_replace

    def arch_spec(self):
        """The memory planner's :class:`moe_rl.distributed.memory.ArchSpec` of this model (GQA attention):
        parameter counts and activation bytes per token (:func:`moe_rl.distributed.memory.gqa_arch_spec`)."""
        from moe_rl.distributed.memory import gqa_arch_spec

        return gqa_arch_spec(self, name="glm4_moe")

    # ------------------------------------------------------------------ presets

    @classmethod
    def tiny_debug(cls, **overrides: Any) -> GlmMoeConfig:
        """The 2-layer CPU model of the addition task (vocab 32, :mod:`moe_rl.envs.addition`).

        Layer 0 dense (intermediate 256), layer 1 MoE (8 experts of width 64, top-2, 1 shared expert);
        hidden 128, 4 query heads x 32, 2 KV heads, partial rotary 0.5, untied embeddings, with GLM-4.5's
        q/k/v biases. ``overrides`` replace any field.
        """
        return cls(**dict(
            vocab_size=32, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5, rope_theta=10000.0,
            attention_bias=True, use_qk_norm=False, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
            max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ) | overrides)

    @classmethod
    def glm45_air(cls, **overrides: Any) -> GlmMoeConfig:
        """GLM-4.5-Air (106B total, 12B active): the field defaults, with its token ids."""
        return cls(**dict(pad_token_id=151329, eos_token_id=[151329, 151336, 151338]) | overrides)

    # ------------------------------------------------------------------ Hugging Face config.json

    def to_hf_config_dict(self, torch_dtype: Any = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that transformers' ``Glm4MoeConfig`` and vLLM's ``Glm4MoeForCausalLM`` read.

        Args:
            torch_dtype: dtype of the saved weights, a ``torch.dtype`` or its name (``"bfloat16"``).
                Written as both ``dtype`` (transformers 5) and ``torch_dtype`` (older readers).

        Returns:
            JSON-serializable dict with ``model_type="glm4_moe"``, ``architectures=["Glm4MoeForCausalLM"]``,
            every field of this config, ``rope_parameters`` and ``num_nextn_predict_layers=0`` (no MTP
            weights are saved).
        """
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        return hf_config_dict(
            self,
            architecture=_HF_ARCHITECTURE,
            model_type=_HF_MODEL_TYPE,
            torch_dtype=torch_dtype,
            extra={"num_nextn_predict_layers": 0, "rope_parameters": rope},
        )

    @classmethod
    def from_hf_config_dict(cls, d: dict[str, Any]) -> GlmMoeConfig:
        """Build a config from a Hugging Face ``glm4_moe`` ``config.json`` dict.

        Keys that are not fields here (``hidden_act``, ``use_cache``, ``num_nextn_predict_layers``, ...)
        are ignored; ``rope_theta`` and ``partial_rotary_factor`` are read from ``rope_parameters`` when
        they are not top-level keys.

        Raises:
            ValueError: ``model_type`` is present and not ``glm4_moe``, ``hidden_act`` is not silu, or the
                values fail validation.
        """
        values, rope = hf_config_values(cls, d, model_type=_HF_MODEL_TYPE, model_name="GlmMoeForCausalLM")
        # transformers' fallbacks when config.json omits them: rope_theta 10000, partial_rotary_factor 0.5.
        for key, hf_default in (("rope_theta", 10000.0), ("partial_rotary_factor", 0.5)):
            if key not in values:
                values[key] = rope.get(key, hf_default)
        if "head_dim" not in values:
            values["head_dim"] = values.get("hidden_size", 4096) // values.get("num_attention_heads", 96)
        return cls(**values)
