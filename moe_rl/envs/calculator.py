"""The calculator environment: multi-step arithmetic solved with a Python tool run in a subprocess sandbox; a
multi-turn agentic task for CPU runs whose episode lengths have a heavy tail.

A problem is a start value and a list of steps ``(op, operand)``; the answer is the running result after the last
step. The number of steps is heavy-tailed: ``P(steps >= m) = m ** -tail_alpha`` for ``1 <= m <= max_ops`` (the
rest of the mass at ``max_ops``), so most episodes take one or two tool calls and a few take ``max_ops``. The
environment reveals one step at a time; the model calls the tool on the current value and the step, and answers
once no step is left. With the character tokenizer (every character one token)::

    <bos>=7|+5;[7+5]=12|-3;[12-3]=9|.9<eos>
    |prompt   |model|env    |model |env|model
                tool call     tool call  answer

* prompt: ``=<start>|<op><operand>;`` (the first value and the first step);
* a model turn that starts with ``[`` is a tool call, ended by the stop token ``]``; the text inside is evaluated
  by the tool (Python ``eval`` with no builtins, in a :class:`moe_rl.envs.sandbox.Sandbox` with CPU, wall-time,
  memory and output limits);
* the environment answers ``=<result>|`` followed by the next step ``<op><operand>;``, or ``.`` when none is left.
  A call whose result is not an integer, or that the tool rejects (a syntax error, a division by zero), gets
  ``=?|`` and the same step again (counted in ``tool_call_errors``); a call cut off before its ``]`` likewise;
* any other model turn is the final answer (its text up to ``<eos>``).

Reward: :func:`moe_rl.envs.addition.addition_reward` of the answer against the true result (1.0 exact, partial
credit for digits in place); 0.0 when the episode ends otherwise. Stop reasons: ``answered``; ``max_turns``
(``max_turns`` model calls without an answer); ``token_budget`` (the next call would pass ``max_episode_tokens`` or
the engine's context); ``tool_error`` (the sandbox reported a fault: a hang or CPU limit, a memory error, a crash,
too much output, output that is not UTF-8; e.g. the model wrote ``[9**9**9]``). A fault costs its episode only;
the episode still trains (reward 0.0) since the model wrote the call. Episode metrics: ``steps``, ``turns``,
``tool_calls``, ``tool_call_errors``, ``tool_faults``, ``tool_fault_<status>``, ``tool_s``, ``correct``.

The held-out split: a problem is held out when a hash of it ``% 100 < heldout_percent``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.envs.addition import addition_reward
from moe_rl.envs.protocol import (
    Demonstration,
    Environment,
    EnvMessage,
    EpisodeContext,
    EpisodeResult,
    ModelRequest,
    SamplingParams,
)
from moe_rl.envs.sandbox import Sandbox, SandboxLimits

__all__ = ["CalcProblem", "CalculatorEnv", "CalculatorEnvConfig", "TOOL_CODE", "make_env"]

TOOL_CODE = r"""
import sys
src = sys.stdin.read()
try:
    v = eval(compile(src, "<call>", "eval"), {"__builtins__": {}}, {})
    if type(v) is not int:
        raise TypeError("not an integer")
    out = str(v)
except MemoryError:
    raise
except BaseException as e:
    sys.stderr.write(type(e).__name__ + ": " + str(e)[:200])
    sys.exit(2)
sys.stdout.write(out)
"""
"""The tool: evaluate stdin as a Python expression without builtins; print the integer, or exit 2 naming the error."""

_CHARS = set("0123456789=|;.[]?")


class CalculatorEnvConfig(BaseConfig):
    """Config of :class:`CalculatorEnv` (the ``env_args`` of ``moe_rl.envs.calculator:make_env``)."""

    max_ops: int = Field(24, ge=1, le=256)
    """Most steps of a problem (the cap of the heavy tail)."""
    tail_alpha: float = Field(1.2, gt=0.0, le=10.0)
    """Tail exponent: ``P(steps >= m) = m ** -tail_alpha`` (smaller = heavier tail)."""
    operand_max: int = Field(9, ge=1, le=10**6)
    """Start value and operands are drawn uniformly from ``[0, operand_max]``."""
    ops: str = "+-"
    """Operators drawn uniformly for the steps (characters of ``+-*``)."""
    max_turns: int = Field(40, ge=1)
    """Model calls per episode (tool calls + the answer) before the episode ends with ``max_turns``."""
    max_call_tokens: int = Field(12, ge=2, le=4096)
    """Tokens sampled per model call."""
    max_episode_tokens: int = Field(768, ge=16)
    """Token budget of one conversation (prompt + every turn)."""
    demo_max_ops: int = Field(4, ge=1)
    """Longest problem (steps) with a demonstration for the SFT warm-up: every step looks the same, so short
    demonstrations teach the pattern at a fraction of the tokens (the heavy tail would dominate padded batches)."""
    heldout_percent: int = Field(5, ge=1, le=50)
    """Share of problems (percent) reserved for evaluation."""
    tool_wall_s: float = Field(5.0, gt=0.0)
    """Wall-clock limit of one tool call (s)."""
    tool_cpu_s: int = Field(1, ge=1)
    """CPU-time limit of one tool call (s)."""
    tool_memory_mb: int = Field(256, ge=64)
    """Address-space limit of one tool call (MiB)."""
    tool_output_bytes: int = Field(64, ge=1)
    """Stdout bytes a tool call may print."""
    max_concurrent_tools: int = Field(4, ge=1)
    """Tool processes running at once (over all episodes of the environment)."""

    @model_validator(mode="after")
    def _check(self) -> CalculatorEnvConfig:
        if not self.ops or set(self.ops) - set("+-*") or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops={self.ops!r} must be distinct characters of '+-*', e.g. '+-'")
        return self

    def sandbox_limits(self) -> SandboxLimits:
        """The tool calls' :class:`~moe_rl.envs.sandbox.SandboxLimits`."""
        return SandboxLimits(wall_s=self.tool_wall_s, cpu_s=self.tool_cpu_s, memory_bytes=self.tool_memory_mb << 20,
                             output_bytes=self.tool_output_bytes)


@dataclass(frozen=True)
class CalcProblem:
    """A start value and its steps ``((op, operand), ...)``; ``answer`` is the result after every step."""

    start: int
    steps: tuple[tuple[str, int], ...]

    @property
    def answer(self) -> int:
        v = self.start
        for op, x in self.steps:
            v = v + x if op == "+" else v - x if op == "-" else v * x
        return v


def _mix(values: tuple[int, ...]) -> int:
    x = 0x27D4EB2F
    for v in values:
        x = (x ^ (v & 0xFFFFFFFF)) * 0x9E3779B1 & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 12
    return x


def _step_text(problem: CalcProblem, k: int) -> str:
    """The step announcement after ``k`` completed steps: ``"<op><operand>;"``, or ``"."`` when none is left."""
    if k >= len(problem.steps):
        return "."
    op, x = problem.steps[k]
    return f"{op}{x};"


class CalculatorEnv(Environment):
    """The calculator environment (module docstring).

    Args:
        cfg: its config.
        tokenizer: a character tokenizer (``moe_rl.envs.CharTokenizer``) whose alphabet holds the digits and
            ``=|;.[]?`` plus the operators of ``cfg.ops``.
        sandbox: the tool sandbox (default: one with ``cfg``'s limits).

    Raises:
        ValueError: the alphabet lacks a character the environment writes.
    """

    def __init__(self, cfg: CalculatorEnvConfig, tokenizer: Any, sandbox: Sandbox | None = None) -> None:
        alphabet = getattr(tokenizer, "alphabet", "")
        missing = sorted((_CHARS | set(cfg.ops) | {"-"}) - set(alphabet))
        if missing:
            raise ValueError(f"tokenizer alphabet {alphabet!r} lacks {missing}, which the calculator environment "
                             "writes; add them (moe_rl.envs.tokenizer.DEFAULT_ALPHABET has all)")
        self.cfg = cfg
        self.tok = tokenizer
        self.sandbox = sandbox or Sandbox(cfg.sandbox_limits(), max_concurrent=cfg.max_concurrent_tools)
        self.call_close_id = tokenizer.encode("]", bos=False)[0]

    # ------------------------------------------------------------------ problems
    def draw_steps(self, rng: random.Random) -> int:
        """Steps of a new problem: ``min(max_ops, floor(U ** (-1 / tail_alpha)))`` with ``U`` uniform in (0, 1]
        (a discrete Pareto tail, ``P(steps >= m) = m ** -tail_alpha``)."""
        u = 1.0 - rng.random()  # (0, 1]
        return max(1, min(self.cfg.max_ops, int(u ** (-1.0 / self.cfg.tail_alpha))))

    def is_heldout(self, p: CalcProblem) -> bool:
        flat = (p.start, *(v for op, x in p.steps for v in (ord(op), x)))
        return _mix(flat) % 100 < self.cfg.heldout_percent

    def sample(self, rng: random.Random, heldout: bool = False) -> CalcProblem:
        """Draw a problem of the training (or held-out) split; the step count is drawn once, so both splits have
        the same tail."""
        n = self.draw_steps(rng)
        c = self.cfg
        while True:
            p = CalcProblem(rng.randint(0, c.operand_max),
                            tuple((rng.choice(c.ops), rng.randint(0, c.operand_max)) for _ in range(n)))
            if self.is_heldout(p) == heldout:
                return p

    def prompt_text(self, p: CalcProblem) -> str:
        return f"={p.start}|{_step_text(p, 0)}"

    def max_sequence_len(self) -> int:
        return self.cfg.max_episode_tokens

    def demonstration(self, p: CalcProblem) -> Demonstration | None:
        """The expert episode: one correct tool call per step, then the answer; model turns trained. None for a
        problem of more than ``demo_max_ops`` steps."""
        if len(p.steps) > self.cfg.demo_max_ops:
            return None
        ids = self.tok.encode(self.prompt_text(p), bos=True)
        mask = [False] * len(ids)
        v = p.start
        for k, (op, x) in enumerate(p.steps):
            call = self.tok.encode(f"[{v}{op}{x}]", bos=False)
            v = v + x if op == "+" else v - x if op == "-" else v * x
            reply = self.tok.encode(f"={v}|{_step_text(p, k + 1)}", bos=False)
            ids += call + reply
            mask += [True] * len(call) + [False] * len(reply)
        ans = self.tok.encode(str(v), bos=False) + [self.tok.eos_id]
        return Demonstration(tuple(ids + ans), tuple(mask + [True] * len(ans)))

    # ------------------------------------------------------------------ episode
    async def episode(self, problem: CalcProblem, ctx: EpisodeContext) -> EpisodeResult:
        c = self.cfg
        history = self.tok.encode(self.prompt_text(problem), bos=True)
        sampling = SamplingParams(max_tokens=c.max_call_tokens, stop_token_ids=(self.call_close_id,))
        m: dict[str, float] = {"steps": len(problem.steps), "turns": 0, "tool_calls": 0, "tool_call_errors": 0,
                               "tool_faults": 0, "tool_s": 0.0, "correct": 0}
        budget = c.max_episode_tokens if ctx.max_model_len is None else min(c.max_episode_tokens, ctx.max_model_len)
        done_steps = 0
        for _ in range(c.max_turns):
            if len(history) + c.max_call_tokens > budget:
                return EpisodeResult(0.0, "token_budget", metrics=m)
            r = await ctx.generate(ModelRequest(sampling, prompt_ids=history))
            m["turns"] += 1
            history.extend(r.token_ids)
            text = self.tok.decode(r.token_ids)
            if not text.startswith("["):
                correct = text == str(problem.answer)
                m["correct"] = int(correct)
                return EpisodeResult(addition_reward(text, str(problem.answer)), "answered",
                                     rewards={"correct": float(correct)}, metrics=m)
            m["tool_calls"] += 1
            close = text.find("]")
            result = None
            if close >= 0:
                res = await self.sandbox.run_python(TOOL_CODE, text[1:close].encode())
                m["tool_s"] += res.wall_s
                if res.fault:
                    m["tool_faults"] += 1
                    m[f"tool_fault_{res.status}"] = m.get(f"tool_fault_{res.status}", 0) + 1
                    ctx.emit(EnvMessage("tool", f"fault: {res.status}"))
                    return EpisodeResult(0.0, "tool_error", metrics=m)
                if res.status == "ok" and set(res.stdout) <= set(self.tok.alphabet) and res.stdout:
                    result = res.stdout
            if result is None:
                m["tool_call_errors"] += 1
                reply = f"=?|{_step_text(problem, done_steps)}"
            else:
                done_steps = min(done_steps + 1, len(problem.steps))
                reply = f"={result}|{_step_text(problem, done_steps)}"
            seg = self.tok.encode(reply, bos=False)
            ctx.emit(EnvMessage("tool", reply, tuple(seg)))
            history.extend(seg)
        return EpisodeResult(0.0, "max_turns", metrics=m)


def make_env(tokenizer: Any, **env_args: Any) -> CalculatorEnv:
    """Factory for ``env = "moe_rl.envs.calculator:make_env"``: ``CalculatorEnv(CalculatorEnvConfig(**env_args),
    tokenizer)``.

    Raises:
        pydantic.ValidationError: an ``env_args`` entry is unknown or out of range.
    """
    return CalculatorEnv(CalculatorEnvConfig(**env_args), tokenizer)
