"""Configuration of the GLM-5 (``glm_moe_dsa``) MoE decoder with MLA + DSA attention.

Field names are those of Hugging Face ``GlmMoeDsaConfig`` (``transformers/models/glm_moe_dsa/
configuration_glm_moe_dsa.py``, transformers 5.19), whose defaults are GLM-5 (``zai-org/GLM-5``): 78 layers
(3 dense + 75 MoE) + 1 MTP layer, hidden 6144, MLA with 64 heads (q_lora 2048, kv_lora 512, qk_nope 192 +
rope 64, v_head 256), DSA indexer 32 heads x 128 with top-k 2048, 256 routed + 1 shared experts of width 2048,
top-8 sigmoid routing with routed scaling 2.5, vocab 154,880 (prime-rl ``configuration_glm_moe_dsa.py`` defaults; GLM-5 tech report
arXiv 2602.15763: 744B total / 40B active). GLM-5.1 has the same architecture.

This module does not import torch or transformers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from moe_rl.models.common.config import MlaMoeConfig

__all__ = ["GLM5_1_EOS_TOKEN_IDS", "GLM5_1_PAD_TOKEN_ID", "GlmMoeDsaConfig"]

GLM5_1_EOS_TOKEN_IDS = (154820, 154827, 154829)
"""``eos_token_id`` of the public GLM-5.1 ``config.json`` (``zai-org/GLM-5.1``)."""
GLM5_1_PAD_TOKEN_ID = 154820
"""``pad_token_id`` of the public GLM-5.1 ``config.json``."""

_Glm5Defaults = MlaMoeConfig.with_defaults(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
    q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1, rms_norm_eps=1e-5,
    rope_theta=1_000_000.0, max_position_embeddings=202752,
)


class GlmMoeDsaConfig(_Glm5Defaults):
    """GLM-5 architecture hyper-parameters (Hugging Face ``GlmMoeDsaConfig`` names); defaults = GLM-5/5.1.

    The MLA and MoE fields, their checks and the ``config.json`` round trip are :class:`moe_rl.models.common.
    config.MlaMoeConfig`'s (with GLM-5's defaults); the DSA indexer fields are its own. The model builds the
    ``num_nextn_predict_layers`` MTP layers (each with its own indexer) unless asked not to.
    """

    _hf_architecture = "GlmMoeDsaForCausalLM"
    _hf_model_types = ("glm_moe_dsa",)
    _hf_drop = ("attn_backend",)  # a moe_rl execution choice, not architecture

    index_n_heads: int = Field(32, ge=1)
    """DSA lightning-indexer heads."""
    index_head_dim: int = Field(128, ge=1)
    """DSA indexer head width (query heads and the single indexer key)."""
    index_topk: int = Field(2048, ge=1)
    """Keys each query attends to after the indexer's top-k."""
    indexer_types: list[Literal["full", "shared"]] | None = None
    """Per decoder layer: ``"full"`` runs its own indexer, ``"shared"`` has no indexer weights and reuses the
    previous full layer's top-k (IndexCache, arXiv 2603.12201; HF ``indexer_types``). None = every layer full
    (GLM-5 / GLM-5.1). The MTP layers always run their own indexer."""
    attn_backend: Literal["dense", "torch"] = "torch"
    """DSA attention kernel of every layer (not a Hugging Face field; left out of ``config.json``): ``"torch"``
    the memory-bounded chunked path (:mod:`moe_rl.attention.dsa_chunked`, O(T * index_topk) memory per layer),
    ``"dense"`` the ``[T, T]``-score reference. Both give the same selection, outputs and gradients (fp32
    rounding)."""

    def _family_problems(self) -> list[str]:
        problems = []
        if self.index_head_dim < self.qk_rope_head_dim:
            problems.append(
                f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim} "
                "(the indexer rotates its first qk_rope_head_dim dims)"
            )
        if self.indexer_types is not None:
            if len(self.indexer_types) != self.num_hidden_layers:
                problems.append(
                    f"indexer_types has {len(self.indexer_types)} entries but num_hidden_layers="
                    f"{self.num_hidden_layers}; give one 'full'/'shared' per decoder layer"
                )
            elif self.indexer_types and self.indexer_types[0] != "full":
                problems.append(
                    "indexer_types[0] must be 'full': a 'shared' layer reuses a previous layer's top-k"
                )
        return problems

    def has_indexer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` owns a DSA indexer (``indexer_types``; MTP layers always do)."""
        if self.indexer_types is None or layer_idx >= self.num_hidden_layers:
            return True
        return self.indexer_types[layer_idx] == "full"

    def arch_spec(self):
        """The memory planner's :class:`moe_rl.distributed.memory.ArchSpec` of this model (MLA + DSA attention, MTP
        layers included): parameter counts and activation bytes per token
        (:func:`moe_rl.distributed.memory.mla_dsa_arch_spec`)."""
        from moe_rl.distributed.memory import mla_dsa_arch_spec

        return mla_dsa_arch_spec(self, name="glm_moe_dsa")

    # ------------------------------------------------------------------ Hugging Face config.json

    def _hf_replace(self) -> dict[str, Any]:
        # indexer_types spelled out per layer
        return {"indexer_types": ["full" if self.has_indexer(i) else "shared" for i in range(self.num_hidden_layers)]}

    @classmethod
    def _hf_family_values(
        cls, d: dict[str, Any], values: dict[str, Any], rope_type: str, rope: dict[str, Any]
    ) -> None:
        """``indexer_types``: when missing, derived like transformers does from ``index_topk_pattern`` ("F"/"S"
        letters) or ``index_topk_freq`` / ``index_skip_topk_offset`` (default: all full); stored as None when every
        layer is full."""
        layers = values.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default)
        types = values.get("indexer_types")
        if types is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                types = (
                    [{"F": "full", "S": "shared"}[c] for c in pattern]
                    if isinstance(pattern, str)
                    else list(pattern)
                )
            else:  # transformers' GlmMoeDsaConfig.__post_init__ schedule
                freq, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
                types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        values["indexer_types"] = None if all(t == "full" for t in types) else list(types)

    @classmethod
    def glm5_1(cls, **overrides: Any) -> GlmMoeDsaConfig:
        """GLM-5.1: the architecture of the field defaults (GLM-5) with the token ids of the public
        ``zai-org/GLM-5.1`` ``config.json``: ``eos_token_id = [154820, 154827, 154829]``, ``pad_token_id = 154820``, ``bos_token_id = 0``, so every published
        version's ``config.json`` carries them. ``overrides`` replace any field."""
        return cls(**dict(eos_token_id=list(GLM5_1_EOS_TOKEN_IDS), pad_token_id=GLM5_1_PAD_TOKEN_ID) | overrides)

    @classmethod
    def tiny_debug(cls, **overrides: Any) -> GlmMoeDsaConfig:
        """A 3-layer CPU-sized model with every feature on (1 dense + 2 MoE layers, 1 MTP layer)."""
        return cls(**dict(
            vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_nextn_predict_layers=1, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=16,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            max_position_embeddings=1024,
        ) | overrides)
