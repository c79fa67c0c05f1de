"""GLM-5 / GLM-5.1 architecture (``glm_moe_dsa``: MLA + DSA attention, DeepSeek-V3-style MoE, optional MTP)."""

from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
from moe_rl.models.glm_moe_dsa.model import (
    GlmMoeDsaDecoderLayer,
    GlmMoeDsaForCausalLM,
    GlmMoeDsaMTPLayer,
    GlmMoeDsaOutput,
    mla_config,
)
from moe_rl.models.glm_moe_dsa.parallelize import parallelize_glm_moe_dsa
from moe_rl.models.glm_moe_dsa.state_dict import (
    from_hf_state_dict,
    hf_key_names,
    load_hf_state_dict,
    save_hf_checkpoint,
    to_hf_state_dict,
)

__all__ = [
    "GlmMoeDsaConfig",
    "GlmMoeDsaDecoderLayer",
    "GlmMoeDsaForCausalLM",
    "GlmMoeDsaMTPLayer",
    "GlmMoeDsaOutput",
    "from_hf_state_dict",
    "hf_key_names",
    "load_hf_state_dict",
    "parallelize_glm_moe_dsa",
    "mla_config",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
