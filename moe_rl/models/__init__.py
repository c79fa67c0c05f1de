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

__all__ = [
    "GlmMoeConfig",
    "GlmMoeDsaConfig",
    "GlmMoeDsaForCausalLM",
    "GlmMoeForCausalLM",
    "from_hf_state_dict",
    "hf_key_names",
    "load_hf_state_dict",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
