"""GLM-4.5 (Hugging Face ``glm4_moe``) MoE language model built from ``moe_rl`` modules."""

from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.glm4_moe.model import GlmMoeAttention, GlmMoeDecoderLayer, GlmMoeForCausalLM, RMSNorm
from moe_rl.models.glm4_moe.parallelize import parallelize_glm4_moe
from moe_rl.models.glm4_moe.state_dict import (
    from_hf_state_dict,
    hf_key_names,
    load_hf_state_dict,
    save_hf_checkpoint,
    to_hf_state_dict,
)

__all__ = [
    "GlmMoeAttention",
    "GlmMoeConfig",
    "GlmMoeDecoderLayer",
    "GlmMoeForCausalLM",
    "RMSNorm",
    "from_hf_state_dict",
    "hf_key_names",
    "load_hf_state_dict",
    "parallelize_glm4_moe",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
