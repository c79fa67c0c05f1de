"""The model family packages export lazily: importing one (or taking a config from it) loads no torch, and every
exported name, the shared checkpoint functions included, resolves to the object its submodule defines."""

from __future__ import annotations

import subprocess
import sys

import pytest

FAMILIES = ("glm4_moe", "glm_moe_dsa", "deepseek_v3", "nemotron_h")

_PROBE = """
import importlib, sys
from moe_rl.models.common import CHECKPOINT_FUNCTIONS
pkg = importlib.import_module("moe_rl.models.{family}")
assert "torch" not in sys.modules, "importing the package loaded torch"
config_names = [n for n in pkg.__all__ if n.endswith("Config")]
assert len(config_names) == 1, config_names
getattr(pkg, config_names[0])
assert "torch" not in sys.modules, "taking the config loaded torch"
missing = sorted(set(CHECKPOINT_FUNCTIONS) - set(pkg.__all__))
assert not missing, missing
for name in pkg.__all__:
    obj = getattr(pkg, name)
    module = obj.__module__ if hasattr(obj, "__module__") else None
    assert module and module.startswith("moe_rl."), (name, module)
assert pkg.load_hf_state_dict is importlib.import_module("moe_rl.models.{family}.state_dict").load_hf_state_dict
print("ok", len(pkg.__all__))
"""


@pytest.mark.parametrize("family", FAMILIES)
def test_family_package_is_lazy_and_resolves_every_export(family):
    res = subprocess.run([sys.executable, "-c", _PROBE.format(family=family)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok ")


def test_family_exports_refuses_a_name_listed_twice():
    from moe_rl.models.common import family_exports

    assert family_exports(config=("Cfg",))["load_hf_state_dict"] == "state_dict"
    with pytest.raises(ValueError, match=r"'Cfg' is listed under 'config' and 'model'"):
        family_exports(config=("Cfg",), model=("Cfg",))
