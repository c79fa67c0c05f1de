"""The environment protocol: an async, multi-turn episode that asks the policy for completions, talks to tools,
and ends with a reward and a stop reason.

An :class:`Environment` draws problems (``sample``) and plays one episode per sample (``episode``). The episode is
a coroutine that owns the conversation: each model call is ``await ctx.generate(ModelRequest(...))``, which sends
the request to the inference engine and returns a :class:`ModelResponse` (token ids, the engine's log-probs,
routed experts, the policy versions that sampled the tokens); tool results and other environment text are the
episode's own business (it appends their tokens to the next prompt and may record them with ``ctx.emit``). The
episode returns an :class:`EpisodeResult`: the scalar reward the trainer uses, named reward components, counters,
and a stop reason from :data:`STOP_REASONS`::

    class Echo(Environment):
        async def episode(self, problem, ctx):
            r = await ctx.generate(ModelRequest(SamplingParams(max_tokens=4), prompt_ids=self.tok.encode(problem)))
            return EpisodeResult(reward=float(self.tok.decode(r.token_ids) == problem), stop_reason="answered")

Everything engine-facing (the run's ``cache_salt``, per-sample seeds, the version bookkeeping, sharing the group's
first request) is done by the caller (:func:`moe_rl.envs.runner.run_group`), which records every call as a
:class:`moe_rl.rl.trajectory.ModelCall`; the orchestrator turns those into trainable samples by token prefix
(:func:`moe_rl.rl.trajectory.interleave_calls`), so an environment never builds loss masks.

Stop reasons:

* ``answered``: the episode ended normally (the model gave its final answer, or every turn was played);
* ``max_turns``: the environment's turn limit was reached;
* ``token_budget``: the conversation would exceed the environment's or the engine's length limit;
* ``tool_error``: a tool failed in a way that ends the episode (a crash, a hang, too much output, bytes that are
  not UTF-8; the environment counts which);
* ``timeout``: the episode ran past its wall-clock limit (set by the environment, or by the runner's
  ``episode_timeout_s``, in which case the episode is cancelled and not trained).
"""

from __future__ import annotations

import abc
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "STOP_REASONS",
    "Demonstration",
    "EnvMessage",
    "Environment",
    "EpisodeContext",
    "EpisodeResult",
    "ModelRequest",
    "ModelResponse",
    "SamplingParams",
    "StopReason",
]

StopReason = Literal["answered", "max_turns", "token_budget", "tool_error", "timeout"]
STOP_REASONS: tuple[str, ...] = ("answered", "max_turns", "token_budget", "tool_error", "timeout")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one model call.

    Attributes:
        max_tokens: most tokens to sample (>= 1).
        temperature: sampling temperature (> 0); None = the run's ``orchestrator.temperature``. The trainer divides
            each sample's logits by the temperature its tokens were sampled at.
        seed: the engine's sampling seed (0 <= seed < 2**63); None = derived by the runner from the group's seed,
            the sample's index and the call's index (distinct per sample and call, reproducible per run seed).
        stop_token_ids: extra token ids that end the completion (kept in it, like EOS); e.g. a tool call's
            closing token.

    Raises:
        ValueError: a field outside its range (the message names it and the rule).
    """

    max_tokens: int
    temperature: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r} must be an int >= 1 (tokens to sample)")
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                              or t <= 0):
            raise ValueError(f"SamplingParams.temperature={t!r} must be a finite number > 0, or None for the run's "
                             "orchestrator.temperature")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed={self.seed!r} must be an int in [0, 2**63) or None (derived)")
        stops = tuple(self.stop_token_ids)
        if any(not _is_int(s) or s < 0 for s in stops):
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r} must hold token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", stops)


@dataclass(frozen=True)
class ModelRequest:
    """One model call of an episode: a prompt (token ids, or chat messages the environment renders with
    :meth:`Environment.render`) and its sampling parameters.

    Attributes:
        sampling: the call's :class:`SamplingParams`.
        prompt_ids: the whole prompt as token ids (>= 1 token), or None when ``messages`` is given.
        messages: chat messages (``{"role": ..., "content": ...}`` mappings), or None when ``prompt_ids`` is given.

    Raises:
        ValueError: neither or both of ``prompt_ids`` and ``messages``, an empty prompt, or ids that are not ints.
        TypeError: ``sampling`` is not a :class:`SamplingParams`.
    """

    sampling: SamplingParams
    prompt_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"ModelRequest.sampling is a {type(self.sampling).__name__}; pass SamplingParams(...)")
        if (self.prompt_ids is None) == (self.messages is None):
            raise ValueError("ModelRequest needs exactly one of prompt_ids (token ids) and messages (chat messages); "
                             f"got prompt_ids={'None' if self.prompt_ids is None else 'set'}, "
                             f"messages={'None' if self.messages is None else 'set'}")
        if self.prompt_ids is not None:
            ids = tuple(self.prompt_ids)
            if not ids:
                raise ValueError("ModelRequest.prompt_ids is empty; a prompt holds at least one token (e.g. BOS)")
            if any(not _is_int(t) or t < 0 for t in ids):
                bad = next(t for t in ids if not _is_int(t) or t < 0)
                raise ValueError(f"ModelRequest.prompt_ids holds {bad!r}; token ids are ints >= 0")
            object.__setattr__(self, "prompt_ids", ids)
        else:
            msgs = tuple(self.messages)  # type: ignore[arg-type]
            if not msgs or any(not isinstance(m, Mapping) or "role" not in m for m in msgs):
                raise ValueError("ModelRequest.messages must be a non-empty sequence of mappings with a 'role' (and "
                                 "'content'), e.g. [{'role': 'user', 'content': '1+2='}]")
            object.__setattr__(self, "messages", msgs)


@dataclass(frozen=True)
class ModelResponse:
    """What one model call returned.

    Attributes:
        prompt_ids: the prompt that was sent (rendered, for a request with messages).
        token_ids: the sampled token ids, ``[k]`` (a stop token or EOS included when it ended the completion).
        logprobs: the engine's log-prob of each sampled token under the sampling distribution, ``[k]``.
        finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (``max_tokens`` reached) or the engine's.
        version: the policy version the engine served when the request was sent.
        version_segments: ``[(version, first token index), ...]``: the versions that sampled the tokens across
            in-flight weight updates, or None when the engine does not track them.
        routed_experts: the engine's routed-expert record of ``prompt + completion`` (router replay), or None.
        temperature: the temperature the tokens were sampled at.
        seed: the sampling seed sent with the request.
        sampling_mask: the engine's top-k / top-p kept set of each sampled token
            (:class:`moe_rl.rl.sampling_mask.SamplingMask`, sampling-mask replay), or None.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    version_segments: list[tuple[int, int]] | None = None
    routed_experts: Any = None
    temperature: float = 1.0
    seed: int | None = None
    sampling_mask: Any = None


@dataclass(frozen=True)
class EnvMessage:
    """A message the environment added to the conversation (a tool result, a user turn), for logs and counters.

    Attributes:
        role: who speaks, e.g. ``"tool"``, ``"user"``, ``"env"``.
        content: its text.
        token_ids: its tokens as appended to the next prompt (empty if the environment does not say).
    """

    role: str
    content: str
    token_ids: tuple[int, ...] = ()


@dataclass
class EpisodeResult:
    """How an episode ended.

    Attributes:
        reward: the scalar reward of the episode, carried by each of its samples (one per trajectory branch; the
            trainer's group baseline is the mean over the group's episodes); finite.
        stop_reason: one of :data:`STOP_REASONS`.
        rewards: named reward components (logged; not used by the trainer), e.g. ``{"correct": 1.0}``.
        metrics: per-episode counters and measurements (numbers), summed over episodes in the run's metrics,
            e.g. ``{"tool_calls": 3, "tool_faults": 0}``.

    Raises:
        ValueError: a non-finite reward, an unknown stop reason, or a metric that is not a number.
    """

    reward: float
    stop_reason: str
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"EpisodeResult.reward={self.reward!r} must be a finite number")
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"EpisodeResult.stop_reason={self.stop_reason!r} must be one of {list(STOP_REASONS)}")
        for name, d in (("rewards", self.rewards), ("metrics", self.metrics)):
            for k, v in d.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"EpisodeResult.{name}[{k!r}]={v!r} must be a number")


@dataclass(frozen=True)
class Demonstration:
    """An expert episode as one token sequence, for the SFT warm-up.

    Attributes:
        token_ids: the whole conversation, ``[N]`` (prompt, model turns, environment turns).
        loss_mask: ``[N]``, True at the tokens the model should produce (its turns), False elsewhere.

    Raises:
        ValueError: the lengths differ, or no token is trained.
    """

    token_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask):
            raise ValueError(f"Demonstration: {len(self.token_ids)} tokens but {len(self.loss_mask)} mask entries")
        if not any(self.loss_mask):
            raise ValueError("Demonstration.loss_mask trains no token; mark the model's turns True")


@runtime_checkable
class EpisodeContext(Protocol):
    """What an episode sees of the run (provided by :func:`moe_rl.envs.runner.run_group`).

    Attributes:
        index: the sample's index in its group (``0 .. group_size - 1``).
        group_size: samples of this problem played concurrently.
        max_model_len: the engine's context limit in tokens (prompt + completion), or None when unknown.
    """

    index: int
    group_size: int
    max_model_len: int | None

    async def generate(self, request: ModelRequest) -> ModelResponse:
        """Send ``request`` to the engine and return its completion (raises what the engine raised)."""
        ...

    def emit(self, message: EnvMessage) -> None:
        """Record an environment message of this episode."""
        ...


class Environment(abc.ABC):
    """Base class of an environment (see the module docstring).

    Subclasses set ``tok`` (a tokenizer with ``encode(text, bos=...)``, ``decode(ids)``, ``pad_id``, ``eos_id``,
    ``vocab_size``) and implement :meth:`sample` and :meth:`episode`. Optional: :meth:`demonstration` (enables the
    built-in SFT warm-up), :meth:`max_sequence_len` (checked against the engine's context at startup),
    :meth:`render` (chat messages to token ids; the default uses the tokenizer's chat template).
    """

    tok: Any

    @abc.abstractmethod
    def sample(self, rng: random.Random, heldout: bool = False) -> Any:
        """Draw a problem (any object the episode understands) from the training split, or the held-out split."""

    @abc.abstractmethod
    async def episode(self, problem: Any, ctx: EpisodeContext) -> EpisodeResult:
        """Play one episode of ``problem``: model calls through ``ctx.generate``; returns how it ended.

        Raising ends the episode as failed: it trains nothing and is counted (an engine failure as an engine error,
        anything else as an environment error). An environment that can recover from a tool failure should end
        with ``stop_reason="tool_error"`` instead.
        """

    def heldout_set(self, n: int, seed: int = 1234) -> list[Any]:
        """``n`` held-out problems, reproducible for ``seed``."""
        rng = random.Random(seed)
        return [self.sample(rng, heldout=True) for _ in range(n)]

    def demonstration(self, problem: Any) -> Demonstration | None:
        """An expert episode of ``problem`` for the SFT warm-up, or None (this environment has none)."""
        return None

    def max_sequence_len(self) -> int | None:
        """Most tokens one conversation may reach (prompt + every turn), or None when unbounded/unknown."""
        return None

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Chat ``messages`` -> prompt token ids (with the generation prompt), through the tokenizer's chat template.

        Raises:
            TypeError: the tokenizer has no ``apply_chat_template`` (send ``prompt_ids`` instead, or override this).
        """
        apply = getattr(self.tok, "apply_chat_template", None)
        if apply is None:
            raise TypeError(f"{type(self).__name__}: the tokenizer {type(self.tok).__name__} has no chat template "
                            "(apply_chat_template); send ModelRequest(prompt_ids=...) or override Environment.render")
        return [int(t) for t in apply(list(messages), add_generation_prompt=True, tokenize=True)]
