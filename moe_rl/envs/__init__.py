"""Verifiable tasks for recipes and tests: prompt generators, tokenizers and reward functions."""

from moe_rl.envs.addition import AdditionTask, AdditionTaskConfig, Problem, addition_reward
from moe_rl.envs.chained_addition import ChainedAdditionTask, ChainedAdditionTaskConfig, ChainedProblem
from moe_rl.envs.hf_tokenizer import HfTokenizer  # transformers is imported only when one is built
from moe_rl.envs.tokenizer import CharTokenizer

__all__ = [
    "AdditionTask",
    "AdditionTaskConfig",
    "ChainedAdditionTask",
    "ChainedAdditionTaskConfig",
    "ChainedProblem",
    "CharTokenizer",
    "HfTokenizer",
    "Problem",
    "addition_reward",
    "make_task",
]


def make_task(cfg: AdditionTaskConfig, tokenizer: CharTokenizer) -> AdditionTask:
    """The task ``cfg`` describes: ``ChainedAdditionTask`` for a ``ChainedAdditionTaskConfig``, else
    ``AdditionTask``."""
    if isinstance(cfg, ChainedAdditionTaskConfig):
        return ChainedAdditionTask(cfg, tokenizer)
    return AdditionTask(cfg, tokenizer)
