"""State-space layers for hybrid models: the Mamba-2 selective scan by the chunked SSD algorithm, its sequential
reference, the Mamba-2 mixer (Hugging Face parameter names), and context parallelism that passes the recurrent
state between CP ranks. See ``docs/blocks/ssm.md``.

Tensors are token-major and batched by rows (``[b, T, H, P]``, each row its own sequence); CP functions take an
explicit process group and keep no global state.

Imports are lazy: ``import moe_rl.ssm`` loads no torch; a name loads its submodule.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "GatedRMSNorm": "mamba2",
    "Mamba2Mixer": "mamba2",
    "Mamba2MixerConfig": "mamba2",
    "SSDOutput": "ssd",
    "all_gather_stack": "cp",
    "causal_conv1d": "mamba2",
    "segment_sum": "ssd",
    "ssd_scan": "ssd",
    "ssd_scan_cp": "cp",
    "ssd_sequential": "ssd",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
