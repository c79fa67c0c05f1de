"""GLM-5.1's token ids: the preset carries those of the public ``zai-org/GLM-5.1`` ``config.json`` (eos
[154820, 154827, 154829], pad 154820, bos 0), so every version the trainer publishes writes them."""

from __future__ import annotations

from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig


def test_glm5_1_token_ids_are_the_public_configs():
    cfg = GlmMoeDsaConfig.glm5_1()
    assert cfg.eos_token_id == [154820, 154827, 154829]
    assert cfg.pad_token_id == 154820 and cfg.bos_token_id == 0
    hf = cfg.to_hf_config_dict(torch_dtype="bfloat16")
    assert (hf["eos_token_id"], hf["pad_token_id"], hf["bos_token_id"]) == ([154820, 154827, 154829], 154820, 0)
    assert GlmMoeDsaConfig.from_hf_config_dict(hf) == cfg
    # overrides still win; the tiny CPU model keeps its own small ids
    assert GlmMoeDsaConfig.glm5_1(pad_token_id=None).pad_token_id is None
    assert GlmMoeDsaConfig.tiny_debug().pad_token_id is None


def test_the_cluster_recipe_publishes_the_glm5_1_ids():
    from pathlib import Path

    from moe_rl.config import load_config
    from moe_rl.launch.config import ClusterConfig

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "glm5_1" / "rl.toml"
    cfg = load_config(ClusterConfig, ["@", str(recipe)])
    mcfg = cfg.model.model_config_obj()
    assert mcfg.to_hf_config_dict()["eos_token_id"] == [154820, 154827, 154829]
    assert mcfg.attn_backend == "torch"  # the memory-bounded DSA path


def test_token_ids_outside_the_vocabulary_are_refused():
    import pytest

    with pytest.raises(ValueError, match=r"eos_token_id=154820 must be in \[0, vocab_size=64\).*pad_token_id=154820 must be in \[0, vocab_size=64\)"):
        GlmMoeDsaConfig.glm5_1(vocab_size=64)
