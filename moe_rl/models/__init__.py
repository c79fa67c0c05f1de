"""Model definitions, one folder per family: :mod:`moe_rl.models.glm4_moe` (GLM-4.5/4.6/4.7),
:mod:`moe_rl.models.glm_moe_dsa` (GLM-5/5.1: MLA + DSA), :mod:`moe_rl.models.deepseek_v3` (DeepSeek-V3 and
Kimi-K2: MLA without DSA, YaRN) and :mod:`moe_rl.models.nemotron_h` (Nemotron-H / Nemotron-3: hybrid Mamba-2,
attention and latent MoE), plus :mod:`moe_rl.models.common` (the chunked LM head)
and :mod:`moe_rl.models.sharded_load` (meta-device build and per-rank checkpoint load).

Checkpoint functions are family-qualified: ``moe_rl.models.glm4_moe.load_hf_state_dict`` and
``moe_rl.models.glm_moe_dsa.load_hf_state_dict`` differ (the latter takes ``with_mtp=``).

Imports are lazy: ``import moe_rl.models`` (and ``import moe_rl.models.<family>``) loads no torch; a name loads its
own module (a config: pydantic only; a model: torch; never transformers or vLLM).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "DeepseekV3Config": "deepseek_v3.config",
    "DeepseekV3ForCausalLM": "deepseek_v3.model",
    "GlmMoeConfig": "glm4_moe.config",
    "GlmMoeDsaConfig": "glm_moe_dsa.config",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa.model",
    "GlmMoeForCausalLM": "glm4_moe.model",
    "LoadStats": "sharded_load",
    "NemotronHConfig": "nemotron_h.config",
    "NemotronHForCausalLM": "nemotron_h.model",
    "build_on_meta": "sharded_load",
    "load_sharded_hf_checkpoint": "sharded_load",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
