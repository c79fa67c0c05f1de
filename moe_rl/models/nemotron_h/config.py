"""Configuration of the Nemotron-H / Nemotron-3 hybrid decoder (Hugging Face ``nemotron_h``).

Field names are those of Hugging Face ``NemotronHConfig`` (``transformers/models/nemotron_h/
configuration_nemotron_h.py``), so a ``config.json`` maps onto this model field by field. The layer stack is
``hybrid_override_pattern``, one character per layer::

    M   Mamba-2 mixer (:class:`moe_rl.ssm.Mamba2Mixer`)
    *   causal GQA attention without positional encoding (NoPE)
    -   dense squared-ReLU MLP of width ``intermediate_size``
    E   latent MoE: sigmoid router on the hidden state, routed squared-ReLU experts of width
        ``moe_intermediate_size`` in a ``moe_latent_size`` space (or the hidden space when None), plus one shared
        squared-ReLU expert of width ``moe_shared_expert_intermediate_size`` on the hidden state

Presets (``config.json`` values of the public checkpoints; see ``docs/blocks/models.md`` for the sources):
:meth:`NemotronHConfig.nano_30b_a3b`, :meth:`NemotronHConfig.super_120b_a12b`, :meth:`NemotronHConfig.ultra_550b_a55b`;
:meth:`NemotronHConfig.tiny_debug` is a 6-layer CPU model with every layer kind.

This module does not import torch or transformers.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.models.common.config import expert_routing_problems, token_id_problems

__all__ = ["LAYER_KINDS", "NemotronHConfig"]

_HF_ARCHITECTURE = "NemotronHForCausalLM"
_HF_MODEL_TYPE = "nemotron_h"

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
"""``hybrid_override_pattern`` characters and the layer kinds they stand for."""

_HF_BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""transformers 5's ``layers_block_type`` names of the pattern characters; released ``config.json`` files also
spell them ``mamba`` and ``attention`` (:meth:`NemotronHConfig.from_hf_config_dict` reads every spelling)."""
_BLOCK_TYPE_CHARS = {**{v: k for k, v in _HF_BLOCK_TYPES.items()}, "mamba": "M", "attention": "*"}

# transformers' pre-5 spellings of the Mamba fields (NemotronHConfig.__post_init__ maps them the same way).
_HF_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
               "mamba_dt_max": "time_step_max", "mamba_dt_init_floor": "time_step_floor",
               "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size", "norm_eps": "layer_norm_epsilon"}

_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
_ULTRA_PATTERN = ("MEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*"
                  "EMEMEMEME")


class NemotronHConfig(BaseConfig):
    """Nemotron-H hybrid architecture hyper-parameters (Hugging Face ``NemotronHConfig`` names).

    Defaults describe Nemotron-3-Nano-30B-A3B (``nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16`` ``config.json``).
    Multi-token-prediction layers (``num_nextn_predict_layers``) are not part of this model.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    vocab_size: int = Field(131072, ge=1)
    """Token ids (rows of the embedding and of the output head)."""
    hidden_size: int = Field(2688, ge=1)
    """Residual stream width D."""
    hybrid_override_pattern: str = Field(_NANO_PATTERN, min_length=1)
    """One character per layer: ``M`` Mamba-2, ``*`` attention, ``-`` dense MLP, ``E`` MoE."""
    num_attention_heads: int = Field(32, ge=1)
    """Query heads H of the attention layers."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""
    head_dim: int = Field(128, ge=1)
    """Per-head width of the attention layers."""
    intermediate_size: int = Field(1856, ge=1)
    """Width of the dense ``-`` MLP layers."""
    mlp_bias: bool = False
    """Bias on the dense MLP, shared-expert and latent projections (routed experts never have one)."""
    mamba_num_heads: int = Field(64, ge=1)
    """SSM heads of the Mamba-2 layers."""
    mamba_head_dim: int = Field(64, ge=1)
    """Channels per SSM head (the inner width is ``mamba_num_heads * mamba_head_dim``)."""
    ssm_state_size: int = Field(128, ge=1)
    """SSM state size N per channel."""
    n_groups: int = Field(8, ge=1)
    """B/C groups of the Mamba-2 layers (and groups of their gated RMSNorm)."""
    conv_kernel: int = Field(4, ge=1)
    """Width of the depthwise causal conv of the Mamba-2 layers."""
    chunk_size: int = Field(128, ge=1)
    """Chunk length of the SSD scan (numerics only: any chunk size computes the same recurrence)."""
    use_conv_bias: bool = True
    """Bias on the Mamba-2 conv."""
    use_bias: bool = False
    """Bias on the Mamba-2 ``in_proj`` / ``out_proj``."""
    time_step_min: float = Field(0.001, gt=0.0)
    """Lower clamp of the discretized step ``dt`` (transformers' mixer clamps to ``[time_step_min, inf)``) and the
    low end of the ``dt_bias`` initialization range."""
    time_step_max: float = Field(0.1, gt=0.0)
    """High end of the ``dt_bias`` initialization range."""
    time_step_floor: float = Field(1e-4, gt=0.0)
    """Floor of the initial steps."""
    layer_norm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every RMSNorm (block norms, final norm, the Mamba gated norm)."""
    n_routed_experts: int = Field(128, ge=1)
    """Routed experts E per MoE layer."""
    num_experts_per_tok: int = Field(6, ge=1)
    """Experts K chosen per token (top_k)."""
    n_shared_experts: int = Field(1, ge=0)
    """Shared experts as written in ``config.json``; the shared branch is one MLP of width
    ``moe_shared_expert_intermediate_size`` whatever this says (as in transformers)."""
    moe_intermediate_size: int = Field(1856, ge=1)
    """Width F of each routed expert."""
    moe_shared_expert_intermediate_size: int = Field(3712, ge=1)
    """Width of the shared expert."""
    moe_latent_size: int | None = Field(None, ge=1)
    """Latent width L of the routed experts (LatentMoE: ``fc1_latent_proj`` D -> L before, ``fc2_latent_proj`` L -> D
    after); None: the experts work on the hidden state (Nano)."""
    n_group: int = Field(1, ge=1)
    """Expert groups for group-limited routing; must divide E."""
    topk_group: int = Field(1, ge=1)
    """Groups kept per token before the top-k; at most ``n_group``."""
    norm_topk_prob: bool = True
    """Renormalize the K gathered sigmoid scores to sum to one."""
    routed_scaling_factor: float = Field(2.5, gt=0.0)
    """Multiplier on the routed gate weights."""
    max_position_embeddings: int = Field(262144, ge=1)
    """Longest supported context (written to config.json; inference engines size caches from it)."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    bos_token_id: int | None = Field(1, ge=0)
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = 2
    """End-of-sequence token id, or several."""
    pad_token_id: int | None = Field(0, ge=0)
    """Padding token id (written to config.json only: the embedding has no padding row, as in transformers)."""
    initializer_range: float = Field(0.02, ge=0.0)
    """Standard deviation of the normal initialization of every weight matrix."""

    @model_validator(mode="after")
    def _check_consistency(self) -> NemotronHConfig:
        problems = []
        bad = sorted(set(self.hybrid_override_pattern) - set(LAYER_KINDS))
        if bad:
            problems.append(f"hybrid_override_pattern={self.hybrid_override_pattern!r} has characters {bad}; use only "
                            "M (Mamba-2), * (attention), - (MLP), E (MoE)")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} must be divisible by num_key_value_heads="
                            f"{self.num_key_value_heads} (each KV head serves a whole group of query heads)")
        if self.mamba_num_heads % self.n_groups:
            problems.append(f"mamba_num_heads={self.mamba_num_heads} must be divisible by n_groups={self.n_groups} "
                            "(each B/C group serves a whole group of SSM heads)")
        if self.time_step_min > self.time_step_max:
            problems.append(f"time_step_min={self.time_step_min} must be <= time_step_max={self.time_step_max}")
        problems += expert_routing_problems(self) + token_id_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ------------------------------------------------------------------ derived

    @property
    def num_hidden_layers(self) -> int:
        """Number of layers L (the pattern's length)."""
        return len(self.hybrid_override_pattern)

    def layer_kind(self, layer_idx: int) -> str:
        """``"mamba"``, ``"attention"``, ``"mlp"`` or ``"moe"`` for layer ``layer_idx``."""
        return LAYER_KINDS[self.hybrid_override_pattern[layer_idx]]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` is a MoE (``E``) layer."""
        return self.hybrid_override_pattern[layer_idx] == "E"

    def arch_spec(self):
        """The memory planner's :class:`moe_rl.distributed.memory.ArchSpec` of this model: parameter counts and
        activation bytes per token of each layer kind (:func:`moe_rl.distributed.memory.hybrid_arch_spec`)."""
        from moe_rl.distributed.memory import hybrid_arch_spec

        return hybrid_arch_spec(self, name="nemotron_h")

    # ------------------------------------------------------------------ presets

    @classmethod
    def tiny_debug(cls, **overrides: Any) -> NemotronHConfig:
        """A 6-layer CPU model with every layer kind (pattern ``ME*EM-``): vocab 64, hidden 64, 4 query heads x 16
        with 2 KV heads, Mamba-2 with 4 heads x 16, state 8, 2 groups, chunk 4 (so a few tokens span several chunks),
        8 experts of width 32 in a latent space of 32, top-2 in 2 groups (1 kept), scaling 2.5, shared expert of
        width 48. ``overrides`` replace any field."""
        return cls(**dict(
            vocab_size=64, hidden_size=64, hybrid_override_pattern="ME*EM-", num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=4, mamba_head_dim=16,
            ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=512,
        ) | overrides)

    @classmethod
    def nano_30b_a3b(cls, **overrides: Any) -> NemotronHConfig:
        """Nemotron-3-Nano-30B-A3B (31.6B total, 3.2B active without the input embedding): the field defaults."""
        return cls(**overrides)

    @classmethod
    def super_120b_a12b(cls, **overrides: Any) -> NemotronHConfig:
        """Nemotron-3-Super-120B-A12B (``nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16`` ``config.json``): 88 layers,
        hidden 4096, LatentMoE (512 experts of width 2688 in a 1024 latent, top-22, scaling 5)."""
        return cls(**dict(
            hidden_size=4096, hybrid_override_pattern=_SUPER_PATTERN, num_attention_heads=32, num_key_value_heads=2,
            head_dim=128, intermediate_size=2688, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128,
            n_groups=8, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
            moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, routed_scaling_factor=5.0,
        ) | overrides)

    @classmethod
    def ultra_550b_a55b(cls, **overrides: Any) -> NemotronHConfig:
        """Nemotron-3-Ultra-550B-A55B: 108 layers (48 Mamba-2, 48 MoE, 12 attention), hidden 8192, 64 query heads
        x 128 with 2 KV heads, Mamba-2 with 256 heads x 64, LatentMoE (512 experts of width 5120 in a 2048 latent,
        top-22, scaling 5, shared expert 10240). ``vocab_size`` 131072 is assumed (the family's tokenizer; the
        public training recipe names a 128k vocabulary); see ``docs/blocks/models.md``."""
        return cls(**dict(
            hidden_size=8192, hybrid_override_pattern=_ULTRA_PATTERN, num_attention_heads=64, num_key_value_heads=2,
            head_dim=128, intermediate_size=5120, mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=128,
            n_groups=8, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=5120,
            moe_shared_expert_intermediate_size=10240, moe_latent_size=2048, routed_scaling_factor=5.0,
        ) | overrides)

    # ------------------------------------------------------------------ Hugging Face config.json

    def to_hf_config_dict(self, torch_dtype: Any = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that transformers' ``NemotronHConfig`` reads.

        Args:
            torch_dtype: dtype of the saved weights, a ``torch.dtype`` or its name; written as ``dtype`` and
                ``torch_dtype``.

        Returns:
            JSON-serializable dict: ``model_type="nemotron_h"``, ``architectures=["NemotronHForCausalLM"]``, every
            field, the pattern also as transformers 5's ``layers_block_type`` list, ``num_hidden_layers``, the
            activations (``relu2``, ``silu``) and ``num_nextn_predict_layers=0`` (no MTP weights are saved).
        """
        name = str(torch_dtype).removeprefix("torch.")
        d: dict[str, Any] = {"architectures": [_HF_ARCHITECTURE], "model_type": _HF_MODEL_TYPE}
        d.update(self.model_dump())
        d.update(layers_block_type=[_HF_BLOCK_TYPES[c] for c in self.hybrid_override_pattern],
                 num_hidden_layers=self.num_hidden_layers, mlp_hidden_act="relu2", mamba_hidden_act="silu",
                 attention_bias=False, attention_dropout=0.0, hidden_dropout=0.0, num_nextn_predict_layers=0,
                 use_cache=True, dtype=name, torch_dtype=name)
        return d

    @classmethod
    def from_hf_config_dict(cls, d: dict[str, Any]) -> NemotronHConfig:
        """Build a config from a Hugging Face ``nemotron_h`` ``config.json`` dict.

        The layer stack comes from ``hybrid_override_pattern`` or, when absent, ``layers_block_type`` (any of
        its spellings: ``mamba``/``linear_attention``, ``attention``/``full_attention``, ``mlp``, ``moe``).
        transformers' older Mamba spellings (``mamba_n_groups``, ``mamba_d_conv``, ``norm_eps``...) are read.
        Keys that are not fields (``rope_theta``, ``num_nextn_predict_layers``, ``residual_in_fp32``, ...) are
        ignored: transformers' model does not use them either (its attention has no rotary embedding).

        Raises:
            ValueError: ``model_type`` is present and not ``nemotron_h``; ``mlp_hidden_act`` not ``relu2``,
                ``mamba_hidden_act`` not ``silu``, ``attention_bias`` true (transformers builds bias-free
                projections but the flag would promise biases), an unknown block type, or the values fail
                validation.
        """
        got = d.get("model_type", _HF_MODEL_TYPE)
        if got != _HF_MODEL_TYPE:
            raise ValueError(f"model_type={got!r} in config.json; NemotronHConfig reads only {_HF_MODEL_TYPE!r}")
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if d.get(key, want) != want:
                raise ValueError(f"{key}={d[key]!r} is not supported; NemotronHForCausalLM uses {want}")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported: Nemotron-H attention projections have no bias")
        values = {_HF_ALIASES.get(k, k): v for k, v in d.items()}
        values = {k: v for k, v in values.items() if k in cls.model_fields}
        if "hybrid_override_pattern" not in values and d.get("layers_block_type") is not None:
            kinds = d["layers_block_type"]
            unknown = sorted({k for k in kinds if k not in _BLOCK_TYPE_CHARS})
            if unknown:
                raise ValueError(f"layers_block_type has unknown block types {unknown}; known: "
                                 f"{sorted(_BLOCK_TYPE_CHARS)}")
            values["hybrid_override_pattern"] = "".join(_BLOCK_TYPE_CHARS[k] for k in kinds)
        return cls(**values)
