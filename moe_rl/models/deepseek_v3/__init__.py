"""DeepSeek-V3 / Kimi-K2 architecture (Hugging Face ``deepseek_v3``: MLA without DSA, sigmoid-routed MoE with expert
bias, group-limited top-k, shared experts and leading dense layers).

Imports are lazy: ``import moe_rl.models.deepseek_v3`` loads no torch; a name loads its submodule on first use."""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr
from moe_rl.models.common import family_exports

_EXPORTS = family_exports(
    config=("DeepseekV3Config",),
    model=("DeepseekV3DecoderLayer", "DeepseekV3ForCausalLM", "mla_config"),
    parallelize=("parallelize_deepseek_v3",),
    state_dict=("hf_sources",),
)

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
