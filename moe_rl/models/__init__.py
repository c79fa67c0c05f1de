"""Model definitions. Importing this package imports torch and pydantic, never transformers or vLLM."""

from moe_rl.models.glm4_moe import (
    GlmMoeConfig,
    GlmMoeForCausalLM,
    from_hf_state_dict,
    hf_key_names,
    load_hf_state_dict,
    save_hf_checkpoint,
    to_hf_state_dict,
)
from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from moe_rl.models.sharded_load import LoadStats, build_on_meta, load_sharded_hf_checkpoint

__all__ = [
    "GlmMoeConfig",
    "GlmMoeDsaConfig",
    "GlmMoeDsaForCausalLM",
    "GlmMoeForCausalLM",
    "LoadStats",
    "build_on_meta",
    "from_hf_state_dict",
    "hf_key_names",
    "load_hf_state_dict",
    "load_sharded_hf_checkpoint",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
