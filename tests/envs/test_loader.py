"""``env = "module:factory"``: the loader builds the environment with ``env_args`` and names what is wrong for each
kind of bad spec; objects with the older task interface are adapted."""

import asyncio
import sys
from pathlib import Path

import pytest

from moe_rl.envs import (
    CharTokenizer,
    Environment,
    EnvLoadError,
    TaskEnvironment,
    as_environment,
    load_env,
    run_group,
)

sys.path.insert(0, str(Path(__file__).parent))  # the factory modules next to this file

TOK = CharTokenizer()


def test_loads_an_environment_with_env_args():
    env = load_env("_env_factories:make_const", TOK, {"value": 0.5})
    assert isinstance(env, Environment) and env.value == 0.5 and env.tok is TOK
    (ep,) = asyncio.run(run_group(env, 0, 1, object()))
    assert ep.result.reward == 0.5


def test_an_environment_subclass_is_used_as_is_and_old_style_tasks_are_adapted():
    env = load_env("_env_factories:legacy_task", TOK)
    assert type(env).__name__ == "AdditionTask"  # already an Environment
    old = load_env("_env_factories:old_style", TOK)
    assert isinstance(old, TaskEnvironment) and old.num_turns == 1
    assert old.max_sequence_len() is None
    assert as_environment(env) is env


@pytest.mark.parametrize(("spec", "args", "match"), [
    ("no_colon", None, "must be 'package.module:factory'"),
    ("a.b:c:d", None, "must be 'package.module:factory'"),
    ("_env_no_such_module:make", None, "no module named '_env_no_such_module'"),
    ("_env_missing_dep:make", None, "imports a missing module"),
    ("_env_broken:make", None, "raised RuntimeError: broken at import"),
    ("_env_factories:nope", None, r"has no attribute 'nope'; its public callables: \[.*'make_const'"),
    ("_env_factories:NOT_CALLABLE", None, "is a int, not callable"),
    ("_env_factories:make_const", {"colour": "red"}, r"make_const\(tokenizer, \*\*env_args\) with env_args=\{'colour'"),
    ("_env_factories:raises", None, "raised RuntimeError: factory refuses"),
    ("_env_factories:not_an_env", None, "returned a object, which is not an environment"),
])
def test_each_bad_spec_gets_a_clear_error(spec, args, match):
    with pytest.raises(EnvLoadError, match=match):
        load_env(spec, TOK, args)


def test_the_option_name_is_in_the_message():
    with pytest.raises(EnvLoadError, match=r"task.env='x'"):
        load_env("x", TOK, option="task.env")
    assert issubclass(EnvLoadError, ValueError)


def test_rl_config_takes_env_and_env_args_and_build_env_checks_the_context(tmp_path):
    import tomllib

    from moe_rl.entrypoints.rl import RunFailed, build_env
    from moe_rl.envs.calculator import CalculatorEnv
    from moe_rl.runtime.config import RLConfig

    recipe = tomllib.loads((Path(__file__).parents[2] / "recipes/agentic_cpu/rl.toml").read_text())
    cfg = RLConfig(**{**recipe, "output_dir": tmp_path / "run"})
    assert cfg.env == "moe_rl.envs.calculator:make_env"
    env = build_env(cfg, TOK)
    assert isinstance(env, CalculatorEnv) and env.cfg.max_ops == recipe["env_args"]["max_ops"]
    assert env.max_sequence_len() <= cfg.inference.max_model_len
    longer = cfg.model_copy(update={"env_args": {**cfg.env_args, "max_episode_tokens": 1024}})
    with pytest.raises(RunFailed, match=r"reach 1024 tokens .* inference.max_model_len=512"):
        build_env(longer, TOK)
    with pytest.raises(RunFailed, match="no attribute 'nope'"):
        build_env(cfg.model_copy(update={"env": "moe_rl.envs.calculator:nope"}), TOK)
    with pytest.raises(ValueError, match="must be 'package.module:factory'"):
        RLConfig(output_dir=tmp_path / "r", env="calculator")
    with pytest.raises(ValueError, match="env_args=.* is set but env is not"):
        RLConfig(output_dir=tmp_path / "r", env_args={"max_ops": 3})
    with pytest.raises(ValueError, match="partial_groups='drop_group'"):
        RLConfig(output_dir=tmp_path / "r", env="a:b", orchestrator={"batch_size": 8, "group_size": 4})
