"""cache_salt derivation (shared/cases B17, the parts that need no engine)."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.rl.salt import RUN_ID_MAX_CHARS, WEIGHT_DTYPES, cache_salt_for, check_cache_salt, check_run_id


def test_b17_salt_is_a_function_of_the_start_version_only():
    assert cache_salt_for(1) == cache_salt_for(1)
    assert cache_salt_for(1) != cache_salt_for(2)
    assert cache_salt_for(1, weight_dtype="bfloat16") != cache_salt_for(1, weight_dtype="float32")
    assert cache_salt_for(1, run_id="a") != cache_salt_for(1, run_id="b")


def test_b17_steps_without_weight_change_keep_the_salt():
    # an orchestrator loop with 3 steps where the weights change only before step 3
    versions_at_start = [7, 7, 8]
    salts = [cache_salt_for(v) for v in versions_at_start]
    assert salts[0] == salts[1] and salts[2] != salts[1]


def test_salt_rejects_bad_versions():
    with pytest.raises(ValueError, match="policy_version=-1"):
        cache_salt_for(-1)
    with pytest.raises(TypeError, match="policy_version must be an int"):
        cache_salt_for(1.0)


# vLLM 0.32's rule (vllm/entrypoints/generate/base/protocol.py::validate_cache_salt): None, or a non-empty str of at
# most 128 characters without '@', '/', '\\' or NUL.
_SALTS = ["s", "moe_rl-v3-float32", "x" * 128, "x" * 129, "", "a/b", "a@b", "a\\b", "a\x00b", "ü" * 128, " ", None]


def test_check_cache_salt_matches_the_installed_vllm_rule():
    vproto = pytest.importorskip("vllm.entrypoints.generate.base.protocol")
    from vllm.exceptions import VLLMValidationError

    for salt in _SALTS:
        try:
            vproto.validate_cache_salt(salt)
            vllm_ok = True
        except VLLMValidationError:
            vllm_ok = False
        try:
            ours_ok = check_cache_salt(salt) == salt
        except ValueError:
            ours_ok = False
        assert ours_ok == vllm_ok, (salt, vllm_ok)


def test_check_cache_salt_refuses_empty_and_names_the_rule():
    assert check_cache_salt(None) is None
    with pytest.raises(ValueError, match=r"cache_salt='' is empty; .*non-empty str of at most 128 characters"):
        check_cache_salt("")
    with pytest.raises(ValueError, match=r"cache_salt='a/b' contains '/'.*Pass None for no salt"):
        check_cache_salt("a/b")
    with pytest.raises(TypeError, match="cache_salt=3 has type int"):
        check_cache_salt(3)


@pytest.mark.parametrize("run_id,problem", [
    ("exp/1", "contains '/'"), ("x" * 200, "is 200 characters long"), ("a@b", "contains '@'"),
    ("a\\b", "contains '\\\\\\\\'"), ("a\x00b", "contains '\\\\x00'"), ("x" * (RUN_ID_MAX_CHARS + 1), "is 87 characters long"),
])
def test_a_run_id_that_cannot_make_a_valid_salt_is_refused(run_id, problem):
    with pytest.raises(ValueError, match=rf"run_id=.* {problem}, so it cannot make a valid cache_salt .*at most 128 "
                                         rf"characters.* run_id must be at most 86 characters.*Shorten it"):
        cache_salt_for(3, run_id=run_id)
    with pytest.raises(TypeError, match="run_id=3 has type int"):
        cache_salt_for(3, run_id=3)


def test_the_longest_run_id_gives_valid_salts_up_to_int64_versions():
    for dtype in WEIGHT_DTYPES:
        salt = cache_salt_for(2**63 - 1, weight_dtype=dtype, run_id="r" * RUN_ID_MAX_CHARS)
        assert check_cache_salt(salt) == salt and len(salt) <= 128
    assert len(cache_salt_for(2**63 - 1, weight_dtype="fp8", run_id="r" * RUN_ID_MAX_CHARS)) == 128
    with pytest.raises(ValueError, match=r"policy_version=9223372036854775808 must be >= 0 and < 2\*\*63"):
        cache_salt_for(2**63)
    with pytest.raises(ValueError, match="its name.* must be at most 77 characters"):
        check_run_id("r" * 78, name="its name", reserve=9)


def test_salt_module_imports_without_torch():
    code = "import moe_rl.rl.salt, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_rl_config_refuses_an_output_dir_whose_name_cannot_salt(tmp_path):
    from moe_rl.runtime.config import RLConfig

    RLConfig(output_dir=tmp_path / ("r" * 77))  # 77 + "-<8 hex>" after --resume = 86
    for name, problem in (("r" * 78, "is 78 characters long"), ("exp@2", "contains '@'")):
        with pytest.raises(ValueError, match=rf"output_dir=.*the run id is the directory's name; its directory name="
                                             rf"'{name}' {problem}.*at most 77 characters"):
            RLConfig(output_dir=tmp_path / name)


def test_run_id_type_and_reserve_are_checked():
    with pytest.raises(TypeError, match=r"run_id=None has type NoneType"):
        cache_salt_for(0, run_id=None)
    for reserve in (-50, 86, "9", True):
        with pytest.raises(ValueError, match=r"reserve=.* must be an int in \[0, 86\)"):
            check_run_id("run", reserve=reserve)
    assert check_run_id("r" * 77, reserve=9) == "r" * 77
