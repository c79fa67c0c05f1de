"""``moe_rl.models.families``: the one table of model families. Each config and model class resolves to its own
family (DeepSeek-V3 and GLM-5 share a config base, not a family), a subclass to its nearest registered class, and
anything else raises a TypeError naming the accepted classes; every family's ``state_dict`` module defines the
whole state-dict protocol; importing the table (and resolving a config) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_rl.models.families import (
    FAMILIES,
    ModelFamily,
    config_class,
    family_of,
    get_family,
    model_class,
    state_dict_module,
)

NAMES = ("glm4_moe", "glm_moe_dsa", "deepseek_v3", "nemotron_h")
CONFIG_NAMES = {"glm4_moe": "GlmMoeConfig", "glm_moe_dsa": "GlmMoeDsaConfig", "deepseek_v3": "DeepseekV3Config",
                "nemotron_h": "NemotronHConfig"}


def test_the_table_names_the_four_families_once():
    assert tuple(f.name for f in FAMILIES) == NAMES
    assert {f.name: f.config_name for f in FAMILIES} == CONFIG_NAMES
    assert [f.name for f in FAMILIES if f.mtp_keys_optional] == ["glm_moe_dsa"]
    with pytest.raises(ValueError, match=r"model family 'glm5' does not exist; use one of \['glm4_moe'"):
        get_family("glm5")


@pytest.mark.parametrize("name", NAMES)
def test_family_of_a_config_is_its_own_family(name):
    import moe_rl.models as models

    cls = getattr(models, CONFIG_NAMES[name])
    cfg = cls.tiny_debug()
    fam = family_of(cfg)
    assert fam is get_family(name) and fam.name == name
    assert family_of(cfg, kind="config") is fam
    assert config_class(fam) is cls and config_class(name) is cls and config_class(cfg) is cls
    with pytest.raises(TypeError, match=rf"model \(GlmMoeForCausalLM, .*\), got {CONFIG_NAMES[name]}"):
        family_of(cfg, kind="model")


def test_mla_configs_resolve_to_their_own_family_not_their_shared_base():
    from moe_rl.models import DeepseekV3Config, GlmMoeDsaConfig
    from moe_rl.models.common.config import MlaMoeConfig

    dsv3, glm5 = DeepseekV3Config.tiny_debug(), GlmMoeDsaConfig.tiny_debug()
    assert isinstance(dsv3, MlaMoeConfig) and isinstance(glm5, MlaMoeConfig)  # the shared base the ladders feared
    assert family_of(dsv3).name == "deepseek_v3"
    assert family_of(glm5).name == "glm_moe_dsa"

    class MyDeepseek(DeepseekV3Config):  # a subclass resolves through the MRO to its nearest registered class
        pass

    assert family_of(MyDeepseek.tiny_debug()).name == "deepseek_v3"


@pytest.mark.parametrize("name", ["glm4_moe", "glm_moe_dsa"])
def test_family_of_a_model_and_its_classes(name):
    import torch

    cfg = config_class(name).tiny_debug()
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    assert type(model).__name__ == get_family(name).model_name
    assert family_of(model) is get_family(name) and family_of(model, kind="model") is get_family(name)
    assert model_class(model) is type(model)
    assert state_dict_module(model) is state_dict_module(name)
    assert state_dict_module(name).__name__ == f"moe_rl.models.{name}.state_dict"
    with pytest.raises(TypeError, match=r"config \(GlmMoeConfig, GlmMoeDsaConfig, DeepseekV3Config, "
                       rf"NemotronHConfig\), got {type(model).__name__}"):
        family_of(model, kind="config")


@pytest.mark.parametrize("obj", [{"num_hidden_layers": 2}, "glm4_moe", None])
def test_family_of_anything_else_raises_type_error_naming_the_accepted_types(obj):
    with pytest.raises(TypeError, match=r"family_of: expected an instance of a model family's config "
                       r"\(GlmMoeConfig, .*NemotronHConfig\) or model \(GlmMoeForCausalLM, .*NemotronHForCausalLM\), "
                       rf"got {type(obj).__name__}"):
        family_of(obj)


def test_family_of_a_plain_module_raises():
    from torch import nn

    with pytest.raises(TypeError, match=r"got Linear"):
        family_of(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"kind='weights' is not 'config', 'model' or None"):
        family_of(nn.Linear(2, 2), kind="weights")
    with pytest.raises(TypeError, match=r"got ModelFamily"):  # a record is not an instance of a family
        family_of(ModelFamily("x", "X", "Y"))


@pytest.mark.parametrize("name", NAMES)
def test_every_state_dict_module_defines_the_whole_protocol(name):
    from moe_rl.models.common.state_dict import STATE_DICT_API

    assert len(STATE_DICT_API) == 7 and {"hf_sources", "hf_key_ignored", "load_hf_state_dict"} <= set(STATE_DICT_API)
    mod = state_dict_module(name)
    for fn in STATE_DICT_API:
        assert callable(getattr(mod, fn, None)), f"{mod.__name__} lacks {fn}"
        assert getattr(mod, fn).__module__ == mod.__name__, f"{mod.__name__}.{fn} is not the family's own"
    assert set(STATE_DICT_API) <= set(mod.__all__)


def test_import_and_config_resolution_load_no_torch():
    code = (
        "import sys; import moe_rl.models.families as f; assert 'torch' not in sys.modules, 'import'; "
        "from moe_rl.models import DeepseekV3Config; "
        "assert f.family_of(DeepseekV3Config.tiny_debug()).name == 'deepseek_v3'; "
        "assert f.config_class('nemotron_h').__name__ == 'NemotronHConfig'; "
        "assert 'torch' not in sys.modules, 'family_of / config_class'; print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok"


@pytest.mark.parametrize("name", NAMES)
def test_the_loader_and_the_publisher_dispatch_through_the_table(name, tmp_path):
    """``build_on_meta`` builds the family's model, ``hf_sources_of`` asks the family's ``state_dict`` module (also
    for a module that is not a family model: then the config decides), and the sharded loader refuses a config of
    another family with the message naming both classes, before it reads the path."""
    from torch import nn

    from moe_rl.models.hf_io import strip_wrappers
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint
    from moe_rl.weights.regions import hf_sources_of

    fam = get_family(name)
    cfg = config_class(name).tiny_debug()
    model = build_on_meta(cfg)
    assert type(model) is model_class(name)
    shapes = {strip_wrappers(k): tuple(v.shape) for k, v in model.state_dict().items()}
    want = state_dict_module(name).hf_sources(shapes, cfg)
    assert want and hf_sources_of(model, cfg, shapes) == want
    assert hf_sources_of(nn.Module(), cfg, shapes) == want
    with pytest.raises(TypeError, match=r"hf_sources_of: model is a Module, .*got dict"):
        hf_sources_of(nn.Module(), {}, shapes)
    other = FAMILIES[(FAMILIES.index(fam) + 1) % len(FAMILIES)]
    with pytest.raises(TypeError, match=rf"cfg must be a {fam.config_name} for {fam.model_name}, got "
                       rf"{other.config_name}"):
        load_sharded_hf_checkpoint(model, tmp_path / "absent", config_class(other).tiny_debug())


def test_the_loader_refuses_what_is_no_family():
    from torch import nn

    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint

    with pytest.raises(TypeError, match=r"cfg must be a GlmMoeConfig, GlmMoeDsaConfig, DeepseekV3Config or "
                       r"NemotronHConfig, got dict"):
        build_on_meta({"num_hidden_layers": 2})
    model = build_on_meta(config_class("glm4_moe").tiny_debug())
    with pytest.raises(TypeError, match=r"cfg must be a GlmMoeConfig, .* got GlmMoeForCausalLM"):
        build_on_meta(model)  # a model is not a config
    with pytest.raises(TypeError, match=r"model must be a GlmMoeForCausalLM, GlmMoeDsaForCausalLM, "
                       r"DeepseekV3ForCausalLM or NemotronHForCausalLM, got Linear"):
        load_sharded_hf_checkpoint(nn.Linear(2, 2), "absent", model.config)


def test_get_family_and_family_of_name_a_wrong_kind_of_argument():
    from moe_rl.models.families import family_of, get_family
    from moe_rl.models.glm4_moe.config import GlmMoeConfig

    for bad in (None, 123):
        with pytest.raises(TypeError, match=r"get_family: name=.* pass a family name"):
            get_family(bad)
    with pytest.raises(TypeError, match=r"got the class GlmMoeConfig, not an instance.*GlmMoeConfig.tiny_debug\(\)"):
        family_of(GlmMoeConfig)
