"""The model family packages export lazily: importing one (or taking a config from it) loads no torch, and every
exported name, the shared checkpoint functions included, resolves to the object its submodule defines."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

FAMILIES = ("glm4_moe", "glm_moe_dsa", "deepseek_v3", "nemotron_h")

_PROBE = """
import importlib, sys
from moe_rl.models.common import CHECKPOINT_FUNCTIONS
pkg = importlib.import_module("moe_rl.models.{family}")
assert "torch" not in sys.modules, "importing the package loaded torch"
assert set(pkg.__all__) <= set(dir(pkg)), sorted(set(pkg.__all__) - set(dir(pkg)))
assert "torch" not in sys.modules, "dir(package) loaded torch"
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


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_page_renders_every_exporting_submodule(family):
    """The package exports lazily, so griffe sees no names in it: docs/reference/models.md renders the submodules
    that define them (``::: moe_rl.models.<family>.<submodule>``)."""
    pkg = importlib.import_module(f"moe_rl.models.{family}")
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "models.md").read_text()
    rendered = set(re.findall(r"^::: (\S+)$", page, re.MULTILINE))
    missing = sorted({f"moe_rl.models.{family}.{sub}" for sub in pkg._EXPORTS.values()} - rendered)
    assert not missing, f"docs/reference/models.md renders no `::: {missing}`"
