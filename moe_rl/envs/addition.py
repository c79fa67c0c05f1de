"""Verifiable task: multi-digit addition, ``"12+34="`` -> ``"46"``.

Reward (exact match with partial credit, measured to learn at a visible pace on a 2-core CPU):
1.0 for the exact answer, otherwise ``0.5 * (digits in the right
position) / max(len(answer), len(target))``; a completion that never emits ``<eos>`` within the token
budget is scored on what it produced.

A deterministic held-out split keeps evaluation prompts out of training: a pair ``(a, b)`` is held out
when ``hash_u32(a, b, salt) % 100 < heldout_percent``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pydantic import Field

from moe_rl.config import BaseConfig
from moe_rl.envs.protocol import Environment, EpisodeContext, EpisodeResult, ModelRequest, SamplingParams
from moe_rl.envs.tokenizer import CharTokenizer

__all__ = ["AdditionTaskConfig", "AdditionTask", "Problem", "addition_reward", "single_turn_episode"]


class AdditionTaskConfig(BaseConfig):
    """Config of the addition task."""

    num_digits: int = Field(2, ge=1, le=6)
    """Operands have at most this many digits (uniform in [0, 10**num_digits))."""
    heldout_percent: int = Field(5, ge=1, le=50)
    """Share of operand pairs (in percent) reserved for evaluation, never used in SFT or RL."""
    max_new_tokens: int = Field(4, ge=1, le=64)
    """Generation budget: enough for the answer digits plus ``<eos>``."""


@dataclass(frozen=True)
class Problem:
    """One addition problem ``a + b``: its prompt text ``"a+b="`` and its answer (the decimal sum)."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def addition_reward(completion: str, target: str) -> float:
    """Exact-match reward with partial credit.

    Returns:
        1.0 if ``completion == target``; else ``0.5 * matches / max(len(completion), len(target))``
        where ``matches`` counts positions where both strings hold the same character.
    """
    if completion == target:
        return 1.0
    denom = max(len(completion), len(target))
    if denom == 0:
        return 0.0
    matches = sum(1 for x, y in zip(completion, target, strict=False) if x == y)
    return 0.5 * matches / denom


def _mix(a: int, b: int) -> int:
    # splitmix-style integer hash, stable across processes (unlike hash()).
    x = (a * 0x9E3779B1 + b * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x


class AdditionTask(Environment):
    """Prompt generator, tokenization and reward for addition; an :class:`moe_rl.envs.protocol.Environment` whose
    episode is one model call (``prompt_ids`` -> ``reward``).

    Args:
        cfg: the task config.
        tokenizer: a ``CharTokenizer`` whose alphabet holds the digits, ``+`` and ``=``.
    """

    def __init__(self, cfg: AdditionTaskConfig, tokenizer: CharTokenizer) -> None:
        missing = set("0123456789+=") - set(tokenizer.alphabet)
        if missing:
            raise ValueError(f"tokenizer alphabet {tokenizer.alphabet!r} lacks {sorted(missing)} needed by addition")
        self.cfg = cfg
        self.tok = tokenizer
        self.limit = 10**cfg.num_digits

    def is_heldout(self, p: Problem) -> bool:
        return _mix(p.a, p.b) % 100 < self.cfg.heldout_percent

    def sample(self, rng: random.Random, heldout: bool = False) -> Problem:
        """Draw a problem from the train split (or the held-out split)."""
        while True:
            p = Problem(rng.randrange(self.limit), rng.randrange(self.limit))
            if self.is_heldout(p) == heldout:
                return p

    def heldout_set(self, n: int, seed: int = 1234) -> list[Problem]:
        rng = random.Random(seed)
        return [self.sample(rng, heldout=True) for _ in range(n)]

    def prompt_ids(self, p: Problem) -> list[int]:
        return self.tok.encode(p.prompt, bos=True)

    def target_ids(self, p: Problem) -> list[int]:
        """Answer ids followed by ``<eos>`` (the SFT target)."""
        return self.tok.encode(p.answer, bos=False) + [self.tok.eos_id]

    def reward(self, p: Problem, completion_ids: list[int]) -> float:
        return addition_reward(self.tok.decode(completion_ids), p.answer)

    def max_sequence_len(self) -> int:
        """``<bos>`` + ``"a+b="`` + the generation budget."""
        return 1 + 2 * self.cfg.num_digits + 2 + self.cfg.max_new_tokens

    async def episode(self, problem: Problem, ctx: EpisodeContext) -> EpisodeResult:
        """One model call on ``prompt_ids(problem)`` scored by ``reward``; stop reason ``answered`` (``<eos>`` or
        another stop) or ``token_budget`` (``max_new_tokens`` reached without one)."""
        return await single_turn_episode(self, problem, ctx)


async def single_turn_episode(task: object, problem: object, ctx: EpisodeContext) -> EpisodeResult:
    """The episode of a single-turn task with the addition task's interface (``prompt_ids``, ``reward``,
    ``cfg.max_new_tokens``): one call, scored by ``task.reward``."""
    r = await ctx.generate(ModelRequest(SamplingParams(max_tokens=task.cfg.max_new_tokens),  # type: ignore[attr-defined]
                                        prompt_ids=task.prompt_ids(problem)))  # type: ignore[attr-defined]
    stop = "token_budget" if r.finish_reason == "length" else "answered"
    return EpisodeResult(float(task.reward(problem, r.token_ids)), stop)  # type: ignore[attr-defined]
