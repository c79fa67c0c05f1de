"""Verifiable tasks for recipes and tests: prompt generators, tokenizers and reward functions."""

from moe_rl.envs.addition import AdditionTask, AdditionTaskConfig, Problem, addition_reward
from moe_rl.envs.tokenizer import CharTokenizer

__all__ = ["AdditionTask", "AdditionTaskConfig", "CharTokenizer", "Problem", "addition_reward"]
