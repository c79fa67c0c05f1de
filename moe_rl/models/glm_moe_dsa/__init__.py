"""GLM-5 / GLM-5.1 architecture (``glm_moe_dsa``: MLA + DSA attention, DeepSeek-V3-style MoE).

Only the configuration exists so far (used by :mod:`moe_rl.distributed.memory` to plan GLM-5.1 runs); the
module tree is assembled from :mod:`moe_rl.attention` and :mod:`moe_rl.moe` in a later change.
"""

from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

__all__ = ["GlmMoeDsaConfig"]
