"""Configuration of the DeepSeek-V3 architecture (``deepseek_v3``: MLA without DSA, sigmoid-routed MoE with expert
bias and group-limited top-k, shared experts, leading dense layers), which Kimi-K2 uses too.

Field names are those of Hugging Face ``DeepseekV3Config`` (``transformers/models/deepseek_v3/
configuration_deepseek_v3.py``, transformers 5.19); the defaults are DeepSeek-V3 (``deepseek-ai/DeepSeek-V3``
``config.json``): 61 layers (3 dense + 58 MoE) + 1 MTP layer, hidden 7168, dense FFN 18432, MLA with 128 heads
(q_lora 1536, kv_lora 512, qk_nope 128 + rope 64, v_head 128), 256 routed experts of width 2048 + 1 shared, top-8
sigmoid routing in 8 groups of which 4 are kept, routed scaling 2.5, YaRN rotary (factor 40 over 4096 positions,
theta 10000, ``mscale = mscale_all_dim = 1``), vocab 129,280. DeepSeek-V3 technical report (arXiv 2412.19437):
671B total / 37B active parameters without the MTP module.

:meth:`DeepseekV3Config.kimi_k2` is Kimi-K2 (``moonshotai/Kimi-K2-Instruct`` ``config.json``; Kimi K2 technical
report arXiv 2507.20534): 61 layers (1 dense), 64 heads, 384 experts top-8 in one group, routed scaling 2.827,
YaRN factor 32 (theta 50000, beta_fast = beta_slow = 1), vocab 163,840, no MTP layer.

This module does not import torch or transformers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from moe_rl.attention.yarn import YarnRope, yarn_softmax_mscale
from moe_rl.models.common.config import MlaMoeConfig

__all__ = ["DeepseekV3Config", "KIMI_K2_BOS_TOKEN_ID", "KIMI_K2_EOS_TOKEN_ID"]

KIMI_K2_BOS_TOKEN_ID = 163584
"""``bos_token_id`` of the public ``moonshotai/Kimi-K2-Instruct`` ``config.json``."""
KIMI_K2_EOS_TOKEN_ID = 163585
"""``eos_token_id`` of the public ``moonshotai/Kimi-K2-Instruct`` ``config.json``."""


class DeepseekV3Config(MlaMoeConfig):
    """DeepSeek-V3 architecture hyper-parameters (Hugging Face ``DeepseekV3Config`` names); defaults = DeepSeek-V3.

    The fields, checks and ``config.json`` round trip it shares with GLM-5 are :class:`moe_rl.models.common.config.
    MlaMoeConfig`'s (whose defaults are DeepSeek-V3's); the YaRN rotary fields are its own. The model is built
    without the ``num_nextn_predict_layers`` MTP layers (their tensors are dropped on load, as transformers'
    ``DeepseekV3ForCausalLM`` does); the field is kept for the ``config.json`` round trip.
    """

    _hf_architecture = "DeepseekV3ForCausalLM"
    _hf_model_types = ("deepseek_v3", "kimi_k2")  # Kimi-K2 checkpoints declare model_type "kimi_k2", same layout
    _hf_rope_types = ("default", "yarn")
    _hf_drop = ("rope_scaling",)  # written as rope_parameters

    rope_scaling: YarnRope | None = Field(
        default_factory=lambda: YarnRope(
            factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
            mscale_all_dim=1.0,
        )
    )
    """YaRN scaling (Hugging Face ``rope_parameters`` with ``rope_type="yarn"``); None = plain RoPE."""
    rope_interleave: bool = True
    """Rotate interleaved pairs of the rope dims (DeepSeek checkpoints; HF ``rope_interleave``)."""

    @property
    def softmax_scale(self) -> float:
        """Attention scale: ``qk_head_dim ** -0.5`` times the YaRN ``mscale_all_dim`` factor squared
        (:func:`moe_rl.attention.yarn_softmax_mscale`; DeepSeek-V3: ``(0.1 ln 40 + 1) ** 2 = 1.873``)."""
        return self.qk_head_dim**-0.5 * yarn_softmax_mscale(self.rope_scaling)

    def arch_spec(self):
        """The memory planner's :class:`moe_rl.distributed.memory.ArchSpec` of this model (plain MLA in its dense
        form, no DSA indexer; the MTP layers are not built, so not counted): parameter counts and activation bytes
        per token (:func:`moe_rl.distributed.memory.mla_arch_spec`)."""
        from moe_rl.distributed.memory import mla_arch_spec

        return mla_arch_spec(self, name="deepseek_v3")

    # ------------------------------------------------------------------ Hugging Face config.json

    def _hf_rope_parameters(self) -> dict[str, Any]:
        if self.rope_scaling is None:
            return super()._hf_rope_parameters()
        y = self.rope_scaling.model_dump(exclude_none=True)
        if y.get("truncate", True):
            y.pop("truncate", None)  # transformers' default
        return {"rope_type": "yarn", "rope_theta": self.rope_theta, **y}

    @classmethod
    def _hf_family_values(
        cls, d: dict[str, Any], values: dict[str, Any], rope_type: str, rope: dict[str, Any]
    ) -> None:
        """``rope_scaling``: None for plain RoPE, else a :class:`~moe_rl.attention.YarnRope` of the YaRN keys."""
        keep = set(YarnRope.model_fields)
        yarn = rope_type == "yarn"
        values["rope_scaling"] = YarnRope(**{k: v for k, v in rope.items() if k in keep}) if yarn else None

    # ------------------------------------------------------------------ published models

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> DeepseekV3Config:
        """DeepSeek-V3 (the field defaults: ``deepseek-ai/DeepSeek-V3`` ``config.json``). ``overrides`` replace any
        field."""
        return cls(**overrides)

    @classmethod
    def kimi_k2(cls, **overrides: Any) -> DeepseekV3Config:
        """Kimi-K2 (``moonshotai/Kimi-K2-Instruct`` ``config.json``): 61 layers (1 dense), 64 heads, 384 routed
        experts top-8 in one group, routed scaling 2.827, YaRN factor 32 over 4096 positions with theta 50000 and
        ``beta_fast = beta_slow = 1``, context 131072, vocab 163,840, bos/eos 163584/163585, no MTP layer. The
        Kimi-K2.7-Code recipe assumes the code model keeps this architecture. ``overrides`` replace any field."""
        kimi = YarnRope(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                        mscale_all_dim=1.0)
        return cls(**{
            "vocab_size": 163840, "num_attention_heads": 64, "first_k_dense_replace": 1, "n_routed_experts": 384,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
            "rope_theta": 50000.0, "rope_scaling": kimi, "max_position_embeddings": 131072,
            "bos_token_id": KIMI_K2_BOS_TOKEN_ID, "eos_token_id": KIMI_K2_EOS_TOKEN_ID, **overrides,
        })

    @classmethod
    def tiny_debug(cls, **overrides: Any) -> DeepseekV3Config:
        """A 3-layer CPU-sized model with every feature on (1 dense + 2 MoE layers, 2 groups of 4 experts with one
        kept, a shared expert, YaRN with both mscale factors != 1)."""
        # mscale_all_dim != mscale: a cos/sin attention factor != 1 and a softmax mscale
        yarn = YarnRope(factor=40.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                        mscale_all_dim=0.5)
        return cls(**{
            "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_nextn_predict_layers": 0, "num_attention_heads": 4, "q_lora_rank": 32,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "n_group": 2, "topk_group": 1, "rope_scaling": yarn, "max_position_embeddings": 640, **overrides,
        })
