"""Environments: the async multi-turn environment protocol, the runner that plays episodes against an engine, the
``"module:factory"`` loader, the built-in tasks (addition, chained addition, the calculator tool environment), ``verifiers`` (v1)
environments through :class:`VerifiersEnv` (the optional ``envs`` extra), the subprocess tool sandbox and the
tokenizers.

Imports are lazy: a name from this package loads only its submodule (``transformers`` is imported only when an
``HfTokenizer`` is built).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "STOP_REASONS": "protocol",
    "AdditionTask": "addition",
    "AdditionTaskConfig": "addition",
    "CalculatorEnv": "calculator",
    "CalculatorEnvConfig": "calculator",
    "ChainedAdditionTask": "chained_addition",
    "ChainedAdditionTaskConfig": "chained_addition",
    "ChainedProblem": "chained_addition",
    "CharTokenizer": "tokenizer",
    "Demonstration": "protocol",
    "EngineCallError": "runner",
    "EnvLoadError": "loader",
    "EnvMessage": "protocol",
    "Environment": "protocol",
    "Episode": "runner",
    "EpisodeContext": "protocol",
    "EpisodeResult": "protocol",
    "HfTokenizer": "hf_tokenizer",
    "ModelRequest": "protocol",
    "ModelResponse": "protocol",
    "Problem": "addition",
    "Sandbox": "sandbox",
    "SandboxLimits": "sandbox",
    "SamplingParams": "protocol",
    "TaskEnvironment": "loader",
    "ToolResult": "sandbox",
    "VerifiersEnv": "verifiers_env",
    "addition_reward": "addition",
    "as_environment": "loader",
    "load_env": "loader",
    "make_task": "loader",
    "run_group": "runner",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
