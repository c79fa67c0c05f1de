"""Load an environment named ``"package.module:factory"`` (the ``env`` option of ``moe-rl rl`` and of a cluster
run), and adapt objects with the older task interface to the environment protocol.

The factory is called as ``factory(tokenizer, **env_args)`` and returns an
:class:`moe_rl.envs.protocol.Environment`, or an object with the addition task's interface (``sample(rng)``,
``prompt_ids(problem)``, ``reward(problem, completion_ids)``, ``cfg.max_new_tokens``, usually ``tok``; multi-turn:
``num_turns``, ``turn_ids``, ``reward_turns`` instead of ``reward``), which :func:`as_environment` wraps. Example::

    # my_envs/echo.py                       # in the config:
    def make_env(tokenizer, max_len=8):     #   env = "my_envs.echo:make_env"
        return EchoEnv(tokenizer, max_len)  #   [env_args]
                                            #   max_len = 4
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Mapping
from typing import Any

from moe_rl.envs.protocol import Environment, EpisodeContext, EpisodeResult

__all__ = ["ENV_SPEC_PATTERN", "EnvLoadError", "TaskEnvironment", "as_environment", "check_env_spec", "load_env",
           "make_task"]

ENV_SPEC_PATTERN = r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*"
"""``package.module:callable`` (dotted module path, one callable name)."""

_TASK_ATTRS = ("sample", "prompt_ids", "reward", "cfg")
_MULTI_ATTRS = ("sample", "prompt_ids", "cfg", "turn_ids", "reward_turns")


class EnvLoadError(ValueError):
    """The ``env`` option names no usable environment factory (the message says which part failed and the fix)."""


def check_env_spec(spec: Any, option: str = "env") -> str:
    """Check the syntax of ``spec`` (``"package.module:callable"``) and return it.

    Raises:
        EnvLoadError: not a string of that form (the message shows an example).
    """
    if not isinstance(spec, str) or not re.fullmatch(ENV_SPEC_PATTERN, spec):
        raise EnvLoadError(f"{option}={spec!r} must be 'package.module:factory' (a module importable here and a "
                           "callable in it), e.g. 'moe_rl.envs.calculator:make_env'")
    return spec


class TaskEnvironment(Environment):
    """The environment of an object with the addition task's interface (module docstring): one call per episode
    (``single_turn_episode``), or ``num_turns`` calls when ``num_turns > 1`` (``multi_turn_episode``).

    Args:
        task: the task object.

    Raises:
        TypeError: ``task`` lacks part of the interface (the message lists what).
    """

    def __init__(self, task: Any) -> None:
        multi = getattr(task, "num_turns", 1) > 1
        need = _MULTI_ATTRS if multi else _TASK_ATTRS
        missing = [a for a in need if not hasattr(task, a)]
        if not missing and not hasattr(task.cfg, "max_new_tokens"):
            missing.append("cfg.max_new_tokens")
        if missing:
            raise TypeError(f"{type(task).__name__} lacks {missing} of the task interface (sample, prompt_ids, reward, "
                            "cfg.max_new_tokens, tok; multi-turn: num_turns, turn_ids, reward_turns instead of reward); "
                            "implement them or subclass moe_rl.envs.Environment")
        self.task = task
        self.tok = getattr(task, "tok", None)
        self.cfg = task.cfg

    @property
    def num_turns(self) -> int:
        return int(getattr(self.task, "num_turns", 1))

    def sample(self, rng: random.Random, heldout: bool = False) -> Any:
        return self.task.sample(rng, heldout=True) if heldout else self.task.sample(rng)

    def max_sequence_len(self) -> int | None:
        f = getattr(self.task, "max_sequence_len", None)
        return f() if callable(f) else None

    async def episode(self, problem: Any, ctx: EpisodeContext) -> EpisodeResult:
        from moe_rl.envs.addition import single_turn_episode
        from moe_rl.envs.chained_addition import multi_turn_episode

        if self.num_turns > 1:
            return await multi_turn_episode(self.task, problem, ctx)
        return await single_turn_episode(self.task, problem, ctx)


def as_environment(obj: Any) -> Environment:
    """``obj`` itself when it is an :class:`Environment`, else a :class:`TaskEnvironment` around it.

    Raises:
        TypeError: neither an environment nor an object with the task interface.
    """
    if isinstance(obj, Environment):
        return obj
    try:
        return TaskEnvironment(obj)
    except TypeError as exc:
        raise TypeError(f"{type(obj).__name__} is not an environment: subclass moe_rl.envs.Environment "
                        f"(sample, episode) or provide the task interface ({exc})") from None


def load_env(spec: str, tokenizer: Any, env_args: Mapping[str, Any] | None = None, *, option: str = "env",
             args_option: str = "env_args") -> Environment:
    """Import ``"package.module:factory"`` and build the environment: ``factory(tokenizer, **env_args)``.

    Args:
        spec: ``"package.module:factory"``.
        tokenizer: the run's tokenizer (passed first).
        env_args: keyword arguments of the factory (the ``env_args`` table of the config).
        option: the config option's name in messages (``env``, ``task.env``, ...).
        args_option: the name of ``env_args`` in messages.

    Returns:
        The environment (:func:`as_environment` of what the factory returned).

    Raises:
        EnvLoadError: bad syntax; the module cannot be imported (not found, or it raised: the error says which);
            no such attribute; not callable; ``env_args`` do not fit the factory's signature; the factory raised;
            or it returned no environment.
    """
    check_env_spec(spec, option)
    mod_name, _, fn_name = spec.partition(":")
    args = dict(env_args or {})
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise EnvLoadError(f"{option}={spec!r}: no module named {exc.name!r}; check the spelling, install the "
                               "package, or add its directory to PYTHONPATH") from exc
        raise EnvLoadError(f"{option}={spec!r}: importing module {mod_name!r} failed because it imports a missing "
                           f"module ({exc}); install that dependency") from exc
    except Exception as exc:  # noqa: BLE001 - any import-time failure of user code is reported by name
        raise EnvLoadError(f"{option}={spec!r}: importing module {mod_name!r} raised {type(exc).__name__}: {exc}; "
                           "fix the module") from exc
    if not hasattr(mod, fn_name):
        public = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_"))[:12]
        raise EnvLoadError(f"{option}={spec!r}: module {mod_name!r} has no attribute {fn_name!r}; its public "
                           f"callables: {public}")
    fn = getattr(mod, fn_name)
    if not callable(fn):
        raise EnvLoadError(f"{option}={spec!r}: {mod_name}.{fn_name} is a {type(fn).__name__}, not callable; name a "
                           "function or class that builds the environment")
    try:
        inspect.signature(fn).bind(tokenizer, **args)
    except TypeError as exc:
        raise EnvLoadError(f"{option}={spec!r}: the factory is called as {fn_name}(tokenizer, **{args_option}) with "
                           f"{args_option}={args!r}, which does not fit its signature {fn_name}"
                           f"{inspect.signature(fn)} ({exc}); change {args_option} or the factory") from exc
    except ValueError:  # no signature (a builtin): call it and see
        pass
    try:
        obj = fn(tokenizer, **args)
    except Exception as exc:  # noqa: BLE001 - the factory's own validation errors, reported with the option
        raise EnvLoadError(f"{option}={spec!r}: {fn_name}(tokenizer, **{args_option}) raised "
                           f"{type(exc).__name__}: {exc}") from exc
    try:
        return as_environment(obj)
    except TypeError as exc:
        raise EnvLoadError(f"{option}={spec!r}: the factory returned a {type(obj).__name__}, which is not an "
                           f"environment ({exc})") from exc


def make_task(cfg: Any, tokenizer: Any) -> Environment:
    """The built-in task ``cfg`` describes: ``ChainedAdditionTask`` for a ``ChainedAdditionTaskConfig``, else
    ``AdditionTask`` (both are environments)."""
    from moe_rl.envs.addition import AdditionTask
    from moe_rl.envs.chained_addition import ChainedAdditionTask, ChainedAdditionTaskConfig

    if isinstance(cfg, ChainedAdditionTaskConfig):
        return ChainedAdditionTask(cfg, tokenizer)
    return AdditionTask(cfg, tokenizer)
