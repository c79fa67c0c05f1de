"""DeepSeek-V3 / Kimi-K2 architecture (Hugging Face ``deepseek_v3``: MLA without DSA, sigmoid-routed MoE with expert
bias, group-limited top-k, shared experts and leading dense layers)."""

from moe_rl.models.deepseek_v3.config import DeepseekV3Config
from moe_rl.models.deepseek_v3.model import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, mla_config
from moe_rl.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from moe_rl.models.deepseek_v3.state_dict import (
    from_hf_state_dict,
    hf_key_names,
    hf_sources,
    load_hf_state_dict,
    save_hf_checkpoint,
    to_hf_state_dict,
)

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3DecoderLayer",
    "DeepseekV3ForCausalLM",
    "from_hf_state_dict",
    "hf_key_names",
    "hf_sources",
    "load_hf_state_dict",
    "mla_config",
    "parallelize_deepseek_v3",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
