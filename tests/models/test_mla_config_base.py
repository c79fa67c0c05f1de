"""The MLA families' shared config base (:class:`moe_rl.models.common.config.MlaMoeConfig`): a family's defaults
(``with_defaults``) keep the base field's type, bounds and description, and the families stay distinct classes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from moe_rl.models.common.config import MlaMoeConfig
from moe_rl.models.deepseek_v3.config import DeepseekV3Config
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig


def test_with_defaults_keeps_type_bounds_description_and_order():
    base = MlaMoeConfig.model_fields
    glm = GlmMoeDsaConfig.model_fields
    assert glm["vocab_size"].default == 154880 and base["vocab_size"].default == 129280
    assert glm["vocab_size"].description == base["vocab_size"].description
    assert glm["rms_norm_eps"].default == 1e-5 and glm["rms_norm_eps"].annotation is float
    assert list(glm)[: len(base)] == list(base)  # the shared fields first, in the base's order
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        GlmMoeDsaConfig(vocab_size=0)  # the base's ge=1 survives the new default
    with pytest.raises(ValidationError, match="greater than 0"):
        GlmMoeDsaConfig(rms_norm_eps=0.0)


def test_with_defaults_refuses_unknown_fields():
    with pytest.raises(TypeError, match=r"\['vocab'\] are not fields of MlaMoeConfig"):
        MlaMoeConfig.with_defaults(vocab=1)


def test_families_are_distinct_and_share_the_checks():
    assert not isinstance(GlmMoeDsaConfig(), DeepseekV3Config)
    assert not isinstance(DeepseekV3Config(), GlmMoeDsaConfig)
    for cls in (GlmMoeDsaConfig, DeepseekV3Config):
        with pytest.raises(ValidationError, match=r"qk_rope_head_dim=7 must be even"):
            cls.tiny_debug(qk_rope_head_dim=7)
        with pytest.raises(ValueError, match=r"model_type='glm4_moe' in config.json"):
            cls.from_hf_config_dict({"model_type": "glm4_moe"})
