"""GLM-4.5 (Hugging Face ``glm4_moe``) MoE language model built from ``moe_rl`` modules.

Imports are lazy: ``import moe_rl.models.glm4_moe`` loads no torch; a name loads its submodule on first use."""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr
from moe_rl.models.common import family_exports

_EXPORTS = family_exports(
    config=("GlmMoeConfig",),
    model=("GlmMoeAttention", "GlmMoeDecoderLayer", "GlmMoeForCausalLM", "RMSNorm"),
    parallelize=("parallelize_glm4_moe",),
)

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
