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

from pydantic import ConfigDict, Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.models.common.config import hf_config_dict, hf_config_values, moe_routing_problems

__all__ = ["GLM5_1_EOS_TOKEN_IDS", "GLM5_1_PAD_TOKEN_ID", "GlmMoeDsaConfig"]

GLM5_1_EOS_TOKEN_IDS = (154820, 154827, 154829)
"""``eos_token_id`` of the public GLM-5.1 ``config.json`` (``zai-org/GLM-5.1``)."""
GLM5_1_PAD_TOKEN_ID = 154820
"""``pad_token_id`` of the public GLM-5.1 ``config.json``."""
_HF_MODEL_TYPE = "glm_moe_dsa"
_HF_ARCHITECTURE = "GlmMoeDsaForCausalLM"


class GlmMoeDsaConfig(BaseConfig):
    """GLM-5 architecture hyper-parameters (Hugging Face ``GlmMoeDsaConfig`` names); defaults = GLM-5/5.1."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    vocab_size: int = Field(154880, ge=1)
    """Token ids (rows of the embedding and of the output head)."""
    hidden_size: int = Field(6144, ge=1)
    """Residual stream width D."""
    intermediate_size: int = Field(12288, ge=1)
    """Width of the dense SwiGLU MLP of the first ``first_k_dense_replace`` layers."""
    moe_intermediate_size: int = Field(2048, ge=1)
    """Width F of each routed and shared expert."""
    num_hidden_layers: int = Field(78, ge=1)
    """Decoder layers (the MTP layers are counted by ``num_nextn_predict_layers``)."""
    num_nextn_predict_layers: int = Field(1, ge=0)
    """Multi-token-prediction layers (each: ``enorm``, ``hnorm``, ``eh_proj [D, 2D]``, ``shared_head.norm`` and
    one MoE decoder layer with its own indexer; embedding and head shared with the main model)."""
    num_attention_heads: int = Field(64, ge=1)
    """Query heads H."""
    q_lora_rank: int = Field(2048, ge=1)
    """Rank of the query down-projection ``q_a_proj [q_lora_rank, D]``."""
    kv_lora_rank: int = Field(512, ge=1)
    """Rank of the compressed KV latent (the part of ``kv_a_proj_with_mqa`` before the rope key)."""
    qk_nope_head_dim: int = Field(192, ge=1)
    """Per-head query/key dims without rotary."""
    qk_rope_head_dim: int = Field(64, ge=2)
    """Per-head rotary query dims; the rotary key (one, shared by all heads) has the same width."""
    v_head_dim: int = Field(256, ge=1)
    """Per-head value width."""
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
    first_k_dense_replace: int = Field(3, ge=0)
    """Leading layers with a dense MLP instead of MoE."""
    n_routed_experts: int = Field(256, ge=1)
    """Routed experts E per MoE layer."""
    num_experts_per_tok: int = Field(8, ge=1)
    """Experts K per token (top_k)."""
    n_shared_experts: int = Field(1, ge=0)
    """Always-on shared experts (one SwiGLU of width ``n_shared_experts * moe_intermediate_size``)."""
    n_group: int = Field(1, ge=1)
    """Expert groups for group-limited routing."""
    topk_group: int = Field(1, ge=1)
    """Groups kept per token."""
    norm_topk_prob: bool = True
    """Renormalize the K gathered sigmoid scores."""
    routed_scaling_factor: float = Field(2.5, gt=0.0)
    """Multiplier of the routed gate weights."""
    rms_norm_eps: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm."""
    rope_theta: float = Field(1_000_000.0, gt=0.0)
    """Rotary base."""
    max_position_embeddings: int = Field(202752, ge=1)
    """Longest supported context."""
    attention_bias: bool = False
    """Biases on the attention projections (GLM-5: none)."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    bos_token_id: int | None = Field(0, ge=0)
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = Field(None, ge=0)
    initializer_range: float = Field(0.02, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> GlmMoeDsaConfig:
        problems = moe_routing_problems(self)
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            problems.append(
                f"pad_token_id={self.pad_token_id} must be < vocab_size={self.vocab_size} (a row of the embedding); "
                "set pad_token_id to a token of this vocabulary or None"
            )
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
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
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when decoder layer ``layer_idx`` uses the MoE block (MTP layers, ``layer_idx >=
        num_hidden_layers``, are MoE layers)."""
        return layer_idx >= self.first_k_dense_replace

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

    def to_hf_config_dict(self, torch_dtype: Any = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that transformers' ``GlmMoeDsaConfig`` reads.

        Args:
            torch_dtype: dtype of the saved weights, a ``torch.dtype`` or its name; written as ``dtype`` and
                ``torch_dtype``.

        Returns:
            JSON-serializable dict: ``model_type="glm_moe_dsa"``, ``architectures=["GlmMoeDsaForCausalLM"]``,
            every field here (``indexer_types`` spelled out per layer), ``num_key_value_heads =
            num_attention_heads`` and default ``rope_parameters``.
        """
        return hf_config_dict(
            self,
            architecture=_HF_ARCHITECTURE,
            model_type=_HF_MODEL_TYPE,
            torch_dtype=torch_dtype,
            extra={
                "num_key_value_heads": self.num_attention_heads,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            },
            replace={"indexer_types": ["full" if self.has_indexer(i) else "shared" for i in range(self.num_hidden_layers)]},
            drop=("rope_theta", "attn_backend"),  # attn_backend: a moe_rl execution choice, not architecture
        )

    @classmethod
    def from_hf_config_dict(cls, d: dict[str, Any]) -> GlmMoeDsaConfig:
        """Build a config from a Hugging Face ``glm_moe_dsa`` ``config.json`` dict.

        Keys that are not fields here are ignored. ``rope_theta`` is read from ``rope_parameters`` (or
        ``rope_scaling``) when not top-level; ``indexer_types`` missing is derived like transformers does
        from ``index_topk_pattern`` ("F"/"S" letters) or ``index_topk_freq`` / ``index_skip_topk_offset``
        (default: all full), and stored as None when every layer is full.

        Raises:
            ValueError: ``model_type`` is not ``glm_moe_dsa``, ``hidden_act`` is not silu, a non-default
                rotary type (YaRN & co. are not implemented), ``num_key_value_heads`` differs from
                ``num_attention_heads``, or the values fail validation.
        """
        values, rope = hf_config_values(cls, d, model_type=_HF_MODEL_TYPE, model_name="GlmMoeDsaForCausalLM")
        heads = values.get("num_attention_heads", cls.model_fields["num_attention_heads"].default)
        if d.get("num_key_value_heads", heads) != heads:
            raise ValueError(
                f"num_key_value_heads={d['num_key_value_heads']} must equal num_attention_heads={heads} (MLA has "
                "no grouped KV heads)"
            )
        if "rope_theta" not in values and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
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
        return cls(**values)

    @classmethod
    def glm5_1(cls, **overrides: Any) -> GlmMoeDsaConfig:
        """GLM-5.1: the architecture of the field defaults (GLM-5) with the token ids of the public
        ``zai-org/GLM-5.1`` ``config.json``: ``eos_token_id = [154820, 154827, 154829]``, ``pad_token_id = 154820``, ``bos_token_id = 0``, so every published
        version's ``config.json`` carries them. ``overrides`` replace any field."""
        values: dict[str, Any] = dict(eos_token_id=list(GLM5_1_EOS_TOKEN_IDS), pad_token_id=GLM5_1_PAD_TOKEN_ID)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def tiny_debug(cls, **overrides: Any) -> GlmMoeDsaConfig:
        """A 3-layer CPU-sized model with every feature on (1 dense + 2 MoE layers, 1 MTP layer)."""
        values: dict[str, Any] = dict(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_nextn_predict_layers=1,
            num_attention_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=16,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            max_position_embeddings=1024,
        )
        values.update(overrides)
        return cls(**values)
