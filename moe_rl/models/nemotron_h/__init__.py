"""Nemotron-H / Nemotron-3 (Hugging Face ``nemotron_h``) hybrid Mamba-2 / attention / latent-MoE language model
built from ``moe_rl`` modules. See ``docs/blocks/models.md``.

Imports are lazy: ``import moe_rl.models.nemotron_h`` loads no torch; a name loads its submodule on first use."""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr
from moe_rl.models.common import family_exports

_EXPORTS = family_exports(
    config=("NemotronHConfig",),
    model=("NemotronHAttention", "NemotronHBlock", "NemotronHForCausalLM", "NemotronHRMSNorm", "parameter_counts"),
    moe=("NemotronHMLP", "NemotronHMoE", "ReluSquaredExperts"),
    parallelize=("parallelize_nemotron_h",),
)

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
