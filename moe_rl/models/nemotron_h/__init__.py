"""Nemotron-H / Nemotron-3 (Hugging Face ``nemotron_h``) hybrid Mamba-2 / attention / latent-MoE language model
built from ``moe_rl`` modules. See ``docs/blocks/models.md``."""

from moe_rl.models.nemotron_h.config import NemotronHConfig
from moe_rl.models.nemotron_h.model import (
    NemotronHAttention,
    NemotronHBlock,
    NemotronHForCausalLM,
    NemotronHRMSNorm,
    parameter_counts,
)
from moe_rl.models.nemotron_h.moe import NemotronHMLP, NemotronHMoE, ReluSquaredExperts
from moe_rl.models.nemotron_h.parallelize import parallelize_nemotron_h
from moe_rl.models.nemotron_h.state_dict import (
    from_hf_state_dict,
    hf_key_names,
    load_hf_state_dict,
    save_hf_checkpoint,
    to_hf_state_dict,
)

__all__ = [
    "NemotronHAttention",
    "NemotronHBlock",
    "NemotronHConfig",
    "NemotronHForCausalLM",
    "NemotronHMLP",
    "NemotronHMoE",
    "NemotronHRMSNorm",
    "ReluSquaredExperts",
    "from_hf_state_dict",
    "hf_key_names",
    "load_hf_state_dict",
    "parallelize_nemotron_h",
    "parameter_counts",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
