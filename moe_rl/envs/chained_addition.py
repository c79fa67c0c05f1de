"""Multi-turn verifiable task: chained addition, one running sum per turn.

Turn 1 is the addition task's prompt, ``"<bos>12+34="``; the model answers (``"46<eos>"``). Before each later
turn the environment appends the next user segment ``"+c="`` to the whole history (prompt, every sampled
token including the ``<eos>``, earlier segments), and the model answers the running sum::

    <bos>12+34=46<eos>+5=51<eos>+7=58<eos>
    |prompt |model   |env|model  |env|model
              turn 1        turn 2       turn 3

Turn ``k``'s target is the true running sum ``a_0 + ... + a_k`` (never the model's own earlier answer), so an
early mistake does not make later correct sums wrong. Per-turn reward: ``moe_rl.envs.addition.addition_reward``
(exact match 1.0, partial credit below). Sample reward (``reward``): the mean over turns (``"mean"``, a denser
signal) or the last turn's (``"final"``).

The tokenizer is the addition task's character tokenizer: every token of the history is one character, so
the ids the orchestrator sends are exactly the ids the trainer sees (no re-tokenization across turns).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from moe_rl.envs.addition import AdditionTask, AdditionTaskConfig, Problem, addition_reward
from moe_rl.envs.protocol import EnvMessage, EpisodeContext, EpisodeResult, ModelRequest, SamplingParams
from moe_rl.envs.tokenizer import CharTokenizer

__all__ = ["ChainedAdditionTaskConfig", "ChainedAdditionTask", "ChainedProblem", "multi_turn_episode"]


class ChainedAdditionTaskConfig(AdditionTaskConfig):
    """Config of the chained (multi-turn) addition task; the fields of ``AdditionTaskConfig`` apply per turn."""

    num_turns: int = Field(2, ge=1, le=8)
    """Model turns per rollout (1 = the single-turn addition task)."""
    reward: Literal["mean", "final"] = "mean"
    """Sample reward: mean of the per-turn rewards, or the last turn's reward only."""

    @model_validator(mode="after")
    def _check_budget(self) -> ChainedAdditionTaskConfig:
        # the last turn's answer sums num_turns + 1 operands (a + b, then one more per later turn)
        longest = len(str((self.num_turns + 1) * (10**self.num_digits - 1)))  # largest running sum
        if self.max_new_tokens < longest + 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} cannot hold the largest running sum of num_turns="
                f"{self.num_turns} turns ({self.num_turns + 1} operands) of num_digits={self.num_digits} ({longest} "
                "digits + <eos>); set "
                f"max_new_tokens >= {longest + 1}"
            )
        return self

    def max_sequence_len(self) -> int:
        """Most tokens of one rollout: ``<bos>`` + ``"a+b="`` + every answer + every env segment ``"+c="``."""
        first = 1 + 2 * self.num_digits + 2
        return first + self.num_turns * self.max_new_tokens + (self.num_turns - 1) * (self.num_digits + 2)


@dataclass(frozen=True)
class ChainedProblem(Problem):
    """``a + b`` then ``+ rest[0]``, ``+ rest[1]``, ... (one extra operand per turn after the first)."""

    rest: tuple[int, ...] = ()

    @property
    def num_turns(self) -> int:
        return 1 + len(self.rest)

    def turn_answer(self, turn: int) -> str:
        """Target of turn ``turn`` (0-based): the running sum ``a + b + rest[0] + ... + rest[turn - 1]``.

        Raises:
            ValueError: ``turn`` outside ``[0, num_turns)``.
        """
        if not 0 <= turn < self.num_turns:
            raise ValueError(f"turn={turn} must be in [0, {self.num_turns}) for this problem")
        return str(self.a + self.b + sum(self.rest[:turn]))

    def turn_segment(self, turn: int) -> str:
        """The env's user segment before turn ``turn`` (>= 1): ``"+c="``.

        Raises:
            ValueError: ``turn`` outside ``[1, num_turns)``.
        """
        if not 1 <= turn < self.num_turns:
            raise ValueError(f"turn={turn} must be in [1, {self.num_turns}); turn 0's prompt is `prompt`")
        return f"+{self.rest[turn - 1]}="


class ChainedAdditionTask(AdditionTask):
    """Chained addition: the addition task's first turn plus ``num_turns - 1`` env turns (module docstring).

    The single-turn interface of ``AdditionTask`` (``prompt_ids``, ``target_ids``, ``reward``) describes turn 1
    (the SFT warm-up uses it); the episode (:func:`multi_turn_episode`, the environment protocol) uses
    ``num_turns``, ``turn_ids`` and ``reward_turns``.

    Args:
        cfg: the task config.
        tokenizer: a ``CharTokenizer`` whose alphabet holds the digits, ``+`` and ``=``.

    Raises:
        ValueError: the alphabet lacks a character the task writes.
    """

    cfg: ChainedAdditionTaskConfig

    def __init__(self, cfg: ChainedAdditionTaskConfig, tokenizer: CharTokenizer) -> None:
        if not isinstance(cfg, ChainedAdditionTaskConfig):
            raise TypeError(f"cfg must be a ChainedAdditionTaskConfig, got {type(cfg).__name__}")
        super().__init__(cfg, tokenizer)

    @property
    def num_turns(self) -> int:
        return self.cfg.num_turns

    def sample(self, rng: random.Random, heldout: bool = False) -> ChainedProblem:
        """Draw a problem; the split is decided by the first pair ``(a, b)`` as in ``AdditionTask``."""
        first = super().sample(rng, heldout=heldout)
        rest = tuple(rng.randrange(self.limit) for _ in range(self.cfg.num_turns - 1))
        return ChainedProblem(first.a, first.b, rest)

    def turn_ids(self, p: ChainedProblem, turn: int) -> list[int]:
        """Env token ids appended to the history before model turn ``turn`` (1-based after the first: >= 1)."""
        return self.tok.encode(p.turn_segment(turn), bos=False)

    def turn_reward(self, p: ChainedProblem, turn: int, completion_ids: Sequence[int]) -> float:
        """``addition_reward`` of turn ``turn``'s answer (decoded up to ``<eos>``) against the running sum."""
        return addition_reward(self.tok.decode(list(completion_ids)), p.turn_answer(turn))

    def reward_turns(self, p: ChainedProblem, turn_completions: Sequence[Sequence[int]]) -> float:
        """Sample reward from the model's tokens of each turn, ``[num_turns]`` id lists in turn order.

        Raises:
            ValueError: not one completion per turn of ``p``.
        """
        if len(turn_completions) != p.num_turns:
            raise ValueError(
                f"reward_turns: got {len(turn_completions)} turn completions for a {p.num_turns}-turn problem; pass "
                "one per turn"
            )
        rewards = [self.turn_reward(p, k, c) for k, c in enumerate(turn_completions)]
        return rewards[-1] if self.cfg.reward == "final" else sum(rewards) / len(rewards)

    def max_sequence_len(self) -> int:
        """Most tokens of one rollout (``ChainedAdditionTaskConfig.max_sequence_len``)."""
        return self.cfg.max_sequence_len()

    async def episode(self, problem: ChainedProblem, ctx: EpisodeContext) -> EpisodeResult:
        """The chained episode (:func:`multi_turn_episode`)."""
        return await multi_turn_episode(self, problem, ctx)


async def multi_turn_episode(task: object, problem: object, ctx: EpisodeContext) -> EpisodeResult:
    """The episode of a multi-turn task with the chained addition interface (``prompt_ids``, ``num_turns``,
    ``turn_ids``, ``reward_turns``, ``cfg.max_new_tokens``).

    Turn 1 sends ``prompt_ids(problem)``; before each later turn ``k`` the history (prompt, every sampled token,
    earlier segments) grows by ``turn_ids(problem, k)`` (emitted as a ``"user"`` message). Reward:
    ``reward_turns(problem, [each turn's tokens])``; stop reason ``answered`` after the last turn.
    """
    history = list(task.prompt_ids(problem))  # type: ignore[attr-defined]
    answers: list[list[int]] = []
    sampling = SamplingParams(max_tokens=task.cfg.max_new_tokens)  # type: ignore[attr-defined]
    for turn in range(task.num_turns):  # type: ignore[attr-defined]
        if turn:
            seg = list(task.turn_ids(problem, turn))  # type: ignore[attr-defined]
            history.extend(seg)
            tok = getattr(task, "tok", None)
            ctx.emit(EnvMessage("user", tok.decode(seg) if tok is not None else "", tuple(seg)))
        r = await ctx.generate(ModelRequest(sampling, prompt_ids=history))
        history.extend(r.token_ids)
        answers.append(list(r.token_ids))
    return EpisodeResult(float(task.reward_turns(problem, answers)), "answered")  # type: ignore[attr-defined]
