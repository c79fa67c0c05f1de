"""Config composition (@ TOML files, dotted overrides) and validation messages."""

import pytest

from moe_rl.config import ConfigError, load_config, parse_cli_args
from moe_rl.runtime.config import RLConfig

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
        (["--max-steps"], r"max_steps = true: expects a number, got the boolean true"),
        (["--alphabet", "0123456789-=*"], r"alphabet='0123456789-=\*' lacks \['\+'\]"),
        (["--task.num-digits", "6"], r"task.max_new_tokens=4 cannot hold the longest answer"),
        (["--inference.max-model-len", "1024"], r"exceeds model.max_position_embeddings=512"),
        (["--trainer.cpu-affinity", "[99]"], r"trainer.cpu_affinity=\[99\] must be a non-empty subset"),
        (["--seed", "99999999999999999999"], r"seed = .*less than or equal to 4294967295"),
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


def test_output_dir_rules(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        load_config(RLConfig, ["@", RECIPE, "--output-dir", str(f)])
    with pytest.raises(ConfigError, match="must name a run directory"):
        load_config(RLConfig, ["@", RECIPE, "--output-dir", ""])
    with pytest.raises(ConfigError, match="output_dir: required field is missing"):
        load_config(RLConfig, ["@", RECIPE])


def test_foreign_nonempty_output_dir_is_refused(tmp_path):
    from moe_rl.entrypoints.rl import RunFailed, prepare_run_dir
    from moe_rl.runtime.run_dir import RunPaths

    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "mine.bin").write_text("user data")
    for existing in ("refuse", "overwrite"):  # --overwrite does not delete files moe-rl rl did not write
        with pytest.raises(RunFailed, match="not created by moe-rl rl"):
            prepare_run_dir(RunPaths(tmp_path), existing)
    assert (tmp_path / "weights" / "mine.bin").exists()


def test_multiturn_recipe_loads_and_survivors_with_data_ranks_is_refused(tmp_path):
    """A later turn that fails removes one sample; with partial_groups='survivors' the batch would then not split
    over the trainer's data-parallel ranks (review finding), so that combination is a config error, and the
    shipped multi-turn recipe uses drop_group."""
    multi = "recipes/debug_cpu/rl_multiturn.toml"
    cfg = load_config(RLConfig, ["@", RECIPE, "@", multi, "--output-dir", str(tmp_path / "a")])
    assert cfg.task.num_turns == 2 and cfg.orchestrator.partial_groups == "drop_group"
    with pytest.raises(ConfigError, match=r"num_turns=2 with orchestrator.partial_groups='survivors'.*drop_group"):
        load_config(RLConfig, ["@", RECIPE, "@", multi, "--output-dir", str(tmp_path / "b"),
                               "--orchestrator.partial-groups", "survivors"])
    one_rank = load_config(RLConfig, ["@", RECIPE, "@", multi, "--output-dir", str(tmp_path / "c"),
                                      "--orchestrator.partial-groups", "survivors", "--trainer.nproc-per-node", "1"])
    assert one_rank.orchestrator.partial_groups == "survivors"
