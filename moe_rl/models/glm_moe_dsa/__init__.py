"""GLM-5 / GLM-5.1 architecture (``glm_moe_dsa``: MLA + DSA attention, DeepSeek-V3-style MoE, optional MTP).

Imports are lazy: ``import moe_rl.models.glm_moe_dsa`` loads no torch; a name loads its submodule on first use."""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr
from moe_rl.models.common import family_exports

_EXPORTS = family_exports(
    config=("GlmMoeDsaConfig",),
    model=("GlmMoeDsaDecoderLayer", "GlmMoeDsaForCausalLM", "GlmMoeDsaMTPLayer", "GlmMoeDsaOutput", "mla_config"),
    parallelize=("parallelize_glm_moe_dsa",),
)

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
