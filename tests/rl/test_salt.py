"""cache_salt derivation (shared/cases B17, the parts that need no engine)."""

import pytest

from moe_rl.rl.salt import cache_salt_for


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
