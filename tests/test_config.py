"""Config composition (@ TOML files, dotted overrides) and validation messages."""

import pytest

from moe_rl.config import ConfigError, load_config, parse_cli_args
from moe_rl.entrypoints.rl import RLConfig

RECIPE = "recipes/debug_cpu/rl.toml"


def test_recipe_loads_and_overrides_win(tmp_path):
    cfg = load_config(RLConfig, ["@", RECIPE, "--output-dir", str(tmp_path), "--orchestrator.max-off-policy-steps", "2",
                                 "--max-steps", "7", "--trainer.optim.lr=1e-4"])
    assert cfg.orchestrator.max_off_policy_steps == 2
    assert cfg.max_steps == 7
    assert cfg.trainer.optim.lr == 1e-4
    assert cfg.model.n_routed_experts == 8


def test_files_merge_left_to_right(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text("max_steps = 3\n[orchestrator]\ngroup_size = 4\nbatch_size = 16\n")
    b = tmp_path / "b.toml"
    b.write_text("[orchestrator]\ngroup_size = 2\n")
    values, files = parse_cli_args(["@", str(a), f"@{b}"])
    assert values == {"max_steps": 3, "orchestrator": {"group_size": 2, "batch_size": 16}}
    assert files == [str(a), str(b)]


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--orchestrator.max-off-policy-steps", "-1"], r"orchestrator\.max_off_policy_steps = -1: .*greater than or equal to 0"),
        (["--orchestrator.batch-size", "100"], r"batch_size=100 must be a multiple of group_size=8"),
        (["--model.head-dim", "16"], r"head_dim=16 is not supported by vLLM's CPU attention"),
        (["--orchestrator.typo", "1"], r"orchestrator\.typo = 1: Extra inputs are not permitted"),
        (["--inference.block-size", "16"], r"block_size"),
    ],
)
def test_invalid_values_name_field_value_and_rule(tmp_path, args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(RLConfig, ["@", RECIPE, "--output-dir", str(tmp_path), *args])


def test_missing_file_and_stray_token():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cli_args(["@", "nope.toml"])
    with pytest.raises(ConfigError, match="unexpected argument 'oops'"):
        parse_cli_args(["oops"])
