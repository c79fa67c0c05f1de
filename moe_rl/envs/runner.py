"""Play a group of episodes of one problem against an inference engine (the engine side of the environment
protocol, :mod:`moe_rl.envs.protocol`).

:func:`run_group` starts ``n`` concurrent episodes of ``problem`` and gives each an :class:`EpisodeContext` whose
``generate`` sends the request to the engine with the run's ``cache_salt`` and a per-sample, per-call seed, and
records it as a :class:`moe_rl.rl.trajectory.ModelCall` (prompt, completion, engine log-probs, the version served
when it was sent, version segments, routed experts, temperature). The episodes' first requests are held until
every episode has made its first call (or ended); identical ones (same prompt and sampling parameters, no seed
of their own) go out as one engine request with ``n`` completions, so the group shares one prefill, as a
single-turn group always did.

Seeds (``seed``: the group's): a shared first request uses ``seed`` itself (the ``b``-th distinct shared request
``derive_seed(seed, 10_000 + b)``); otherwise call ``j`` of sample ``i`` uses
``derive_seed(derive_seed(seed, i), j)`` unless the request carries its own seed. Every sample thus samples
differently, and a run is reproducible from its seed.

An episode that raises trains nothing: :attr:`Episode.error_kind` is ``"engine"`` when an engine request failed
(:class:`EngineCallError`), ``"env"`` for any other exception, ``"timeout"`` when ``episode_timeout_s`` cancelled
it (its result then has stop reason ``"timeout"``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from moe_rl.envs.protocol import (
    Environment,
    EnvMessage,
    EpisodeResult,
    ModelRequest,
    ModelResponse,
    SamplingParams,
)
from moe_rl.rl.salt import check_cache_salt
from moe_rl.rl.trajectory import ModelCall

__all__ = ["EngineCallError", "Episode", "derive_seed", "run_group"]


class EngineCallError(RuntimeError):
    """An engine request of an episode failed (the engine's exception is the ``__cause__``)."""


def derive_seed(seed: int, index: int) -> int:
    """A child seed of ``seed`` for ``index`` (deterministic, in ``[0, 2**31)``)."""
    return (seed * 1_000_003 + 7_919 * (index + 1)) % 2**31


@dataclass
class Episode:
    """One played episode.

    Attributes:
        index: the sample's index in its group.
        calls: its engine requests in the order sent (what the trainer's samples are built from).
        messages: the environment messages it emitted.
        result: how it ended (None when it raised).
        error: ``"ExceptionType: message"`` when it raised or timed out, else None.
        error_kind: ``"engine"``, ``"env"``, ``"timeout"`` or None.
        exception: the exception that ended it (for an engine failure, the engine's own exception), or None.
        t_start: ``time.monotonic()`` at its start (s).
        t_end: ``time.monotonic()`` at its end (s).
    """

    index: int
    calls: list[ModelCall] = field(default_factory=list)
    messages: list[EnvMessage] = field(default_factory=list)
    result: EpisodeResult | None = None
    error: str | None = None
    error_kind: Literal["engine", "env", "timeout"] | None = None
    exception: BaseException | None = None
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def wall_s(self) -> float:
        """Seconds from start to end."""
        return self.t_end - self.t_start


class _Context:
    """The :class:`moe_rl.envs.protocol.EpisodeContext` of one episode."""

    def __init__(self, group: _Group, index: int) -> None:
        self._group = group
        self.index = index
        self.group_size = group.n
        self.max_model_len = group.max_model_len
        self.episode = Episode(index)
        self._sample_seed = derive_seed(group.seed, index)
        self.session_id = f"{group.session_id}/{index}"

    async def generate(self, request: ModelRequest) -> ModelResponse:
        if not isinstance(request, ModelRequest):
            raise TypeError(f"ctx.generate takes a ModelRequest, got {type(request).__name__}")
        g = self._group
        prompt = list(request.prompt_ids) if request.prompt_ids is not None else g.env.render(request.messages)
        sp = request.sampling
        temperature = float(sp.temperature if sp.temperature is not None else g.temperature)
        if g.max_model_len is not None and len(prompt) + sp.max_tokens > g.max_model_len:
            raise ValueError(
                f"episode {self.index}: prompt of {len(prompt)} tokens + max_tokens={sp.max_tokens} exceeds the engine's "
                f"max_model_len={g.max_model_len}; end the episode with stop_reason='token_budget' before this call")
        j = len(self.episode.calls)
        if j == 0 and g.share_first and sp.seed is None:
            sent_under, comp, seed = await g.first_call(self.index, prompt, sp, temperature)
        else:
            if j == 0:
                g.leave(self.index)
            seed = sp.seed if sp.seed is not None else derive_seed(self._sample_seed, j)
            sent_under = g.version()
            comps = await g.call_engine(prompt, 1, sp, temperature, seed, self.session_id)
            if len(comps) != 1:
                raise EngineCallError(f"the engine returned {len(comps)} completions for n=1")
            comp = comps[0]
        resp = ModelResponse(prompt_ids=prompt, token_ids=[int(t) for t in comp.token_ids],
                             logprobs=[float(x) for x in comp.logprobs], finish_reason=comp.finish_reason,
                             version=sent_under, version_segments=getattr(comp, "version_segments", None),
                             routed_experts=getattr(comp, "routed_experts", None), temperature=temperature, seed=seed,
                             sampling_mask=getattr(comp, "sampling_mask", None))
        self.episode.calls.append(ModelCall(prompt, resp.token_ids, resp.logprobs, sent_under,
                                            version_segments=resp.version_segments,
                                            routed_experts=resp.routed_experts, temperature=temperature,
                                            finish_reason=resp.finish_reason, sampling_mask=resp.sampling_mask))
        return resp

    def emit(self, message: EnvMessage) -> None:
        if not isinstance(message, EnvMessage):
            raise TypeError(f"ctx.emit takes an EnvMessage, got {type(message).__name__}")
        self.episode.messages.append(message)


class _Group:
    """Shared state of one group: the engine, the run's parameters and the first-call barrier."""

    def __init__(self, env: Environment, n: int, engine: Any, *, temperature: float, seed: int,
                 cache_salt: str | None | Callable[[], str | None], version: Callable[[], int],
                 request_timeout_s: float | None,
                 max_model_len: int | None, share_first: bool) -> None:
        self.env = env
        self.n = n
        self.engine = engine
        self.temperature = temperature
        self.seed = seed
        # a callable salt is asked (once) by the group's first request; a str or None is the salt itself
        self._salt_source = cache_salt if callable(cache_salt) else None
        self._salt: str | None = None if callable(cache_salt) else cache_salt
        self.version = version
        self.request_timeout_s = request_timeout_s
        self.max_model_len = max_model_len
        self.share_first = share_first
        self._open = set(range(n))  # episodes whose first call is not known yet
        self._waiting: dict[int, tuple[tuple, list[int], SamplingParams, float, asyncio.Future]] = {}
        self._tasks: list[asyncio.Task] = []
        self.session_id = f"g-{uuid.uuid4().hex[:16]}"  # the shared first call's; episode i's is f"{it}/{i}"
        self.sends_session = _takes_session_id(engine)

    def cache_salt(self) -> str | None:
        """The group's salt: a callable ``cache_salt`` is asked once, when the group's first request is sent (so a
        weight update between the group's start and its first request cannot leave it with the previous version's
        salt), and its answer serves every later request of the group."""
        if self._salt_source is not None:
            salt = self._salt_source()
            if salt is not None and not isinstance(salt, str):
                raise TypeError(f"cache_salt() returned {type(salt).__name__} {salt!r}; the callable must return a "
                                "str (or None for no salt)")
            check_cache_salt(salt, name="cache_salt() result")
            self._salt, self._salt_source = salt, None
        return self._salt

    async def call_engine(self, prompt: list[int], n: int, sp: SamplingParams, temperature: float,
                          seed: int, session_id: str) -> list[Any]:
        kwargs: dict[str, Any] = {}
        if sp.stop_token_ids:
            kwargs["stop_token_ids"] = list(sp.stop_token_ids)
        if self.sends_session:
            kwargs["session_id"] = session_id
        salt = self.cache_salt()  # outside the try: a failing salt callable is the caller's error, not the engine's
        try:
            coro = self.engine.generate(prompt, n=n, max_tokens=sp.max_tokens, temperature=temperature,
                                        cache_salt=salt, seed=seed, **kwargs)
            comps, _cached = await asyncio.wait_for(coro, timeout=self.request_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as the episode's engine failure
            raise EngineCallError(f"{type(exc).__name__}: {exc}") from exc
        return list(comps)

    async def first_call(self, index: int, prompt: list[int], sp: SamplingParams,
                         temperature: float) -> tuple[int, Any, int]:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        key = (tuple(prompt), sp.max_tokens, temperature, sp.stop_token_ids)
        self._waiting[index] = (key, prompt, sp, temperature, fut)
        self._open.discard(index)
        self._maybe_dispatch()
        return await fut

    def leave(self, index: int) -> None:
        """Episode ``index`` ended (or made its first call with its own seed) without joining the shared call."""
        if index in self._open:
            self._open.discard(index)
            self._maybe_dispatch()

    def _maybe_dispatch(self) -> None:
        if self._open or not self._waiting:
            return
        batches: dict[tuple, list[int]] = {}
        for i, (key, *_rest) in sorted(self._waiting.items()):
            batches.setdefault(key, []).append(i)
        waiting, self._waiting = self._waiting, {}
        for b, members in enumerate(batches.values()):
            seed = self.seed if b == 0 else derive_seed(self.seed, 10_000 + b)
            self._tasks.append(asyncio.ensure_future(self._dispatch([waiting[i] for i in members], seed)))

    async def _dispatch(self, members: list[tuple], seed: int) -> None:
        _, prompt, sp, temperature, _ = members[0]
        sent_under = self.version()
        try:
            comps = await self.call_engine(prompt, len(members), sp, temperature, seed, self.session_id)
            if len(comps) != len(members):
                raise EngineCallError(f"the engine returned {len(comps)} completions for n={len(members)}")
        except BaseException as exc:  # noqa: BLE001 - every waiting episode receives the failure
            for *_, fut in members:
                if not fut.done():
                    fut.set_exception(exc if not isinstance(exc, asyncio.CancelledError) else EngineCallError(
                        "the shared first request was cancelled"))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (*_, fut), comp in zip(members, comps, strict=True):
            if not fut.done():
                fut.set_result((sent_under, comp, seed))

    def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()


def _takes_session_id(engine: Any) -> bool:
    """Whether ``engine.generate`` accepts a ``session_id`` keyword (by name, or through ``**options`` as every
    moe_rl client does); a minimal engine with the documented positional signature does not get one."""
    try:
        params = inspect.signature(engine.generate).parameters.values()
    except (AttributeError, TypeError, ValueError):  # no generate (its first call says so) or no introspectable
        return False  # signature (a C callable): send only the documented keywords
    return any(p.name == "session_id" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


async def run_group(
    env: Environment,
    problem: Any,
    n: int,
    engine: Any,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    cache_salt: str | None | Callable[[], str | None] = None,
    version: Callable[[], int] = lambda: 0,
    request_timeout_s: float | None = None,
    episode_timeout_s: float | None = None,
    max_model_len: int | None = None,
    share_first_call: bool = True,
) -> list[Episode]:
    """Play ``n`` concurrent episodes of ``problem`` (module docstring).

    Args:
        env: the environment.
        problem: a problem drawn by ``env.sample``.
        n: episodes (samples) of the group, >= 1.
        engine: an engine client: ``await engine.generate(prompt_ids, n=, max_tokens=, temperature=, cache_salt=,
            seed=[, stop_token_ids=][, session_id=])`` -> ``(completions, cached_tokens)``, each completion with
            ``token_ids``, ``logprobs``, ``finish_reason`` and optionally ``version_segments`` and
            ``routed_experts`` (``moe_rl.inference.VllmClient``). ``stop_token_ids`` is passed only when a request
            has some. ``session_id`` is passed when ``generate`` accepts it (by name or ``**options``, as every
            ``moe_rl.inference`` client does): the group's shared first call has the group's id, every later call
            of episode ``i`` the id ``"<group id>/<i>"``, so a router with sticky sessions (``RoutedClient``,
            vllm-router's ``X-Session-ID`` policies) keeps a multi-turn episode on one engine.
        temperature: default sampling temperature (> 0) of requests that set none.
        seed: the group's seed.
        cache_salt: sent with every request: a str, None (no salt), or a callable ``() -> str | None`` called when
            the group's first request is sent, whose answer is then sent with every request of the group (the
            orchestrator passes the salt of the version the engine serves then, so later turns reuse the history's
            KV). A salt must be valid for vLLM (``moe_rl.rl.salt.check_cache_salt``: non-empty, at most 128
            characters, no ``'@'``, ``'/'``, ``'\\'`` or NUL; None, not ``""``, means no salt). A callable that
            raises, or returns neither None nor a valid salt, fails the episodes whose request it salted as
            environment errors (``error_kind = "env"``), not engine errors; it is asked again by the group's next
            request until it answers.
        version: returns the policy version the engine serves now (recorded per call as sent under).
        request_timeout_s: timeout of one engine request (None: none).
        episode_timeout_s: wall-clock limit of one episode (None: none); a cancelled episode trains nothing.
        max_model_len: the engine's context limit; a request beyond it raises ``ValueError`` in the episode.
        share_first_call: send identical first requests as one request with ``n`` completions.

    Returns:
        The ``n`` episodes in index order.

    Raises:
        ValueError: ``n`` < 1, a non-positive temperature / timeout, or a str ``cache_salt`` vLLM would reject.
        TypeError: ``env`` is not an :class:`~moe_rl.envs.protocol.Environment`, or ``cache_salt`` is neither a str,
            None nor a callable.
    """
    if cache_salt is not None and not isinstance(cache_salt, str) and not callable(cache_salt):
        raise TypeError(f"cache_salt={cache_salt!r} must be a str, None or a callable returning one "
                        "(e.g. moe_rl.rl.cache_salt_for(version))")
    if isinstance(cache_salt, str):
        check_cache_salt(cache_salt)
    if not isinstance(env, Environment):
        raise TypeError(f"env is a {type(env).__name__}; pass a moe_rl.envs.Environment (moe_rl.envs.as_environment "
                        "adapts an object with the addition task's interface)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1 (episodes per group)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    for name, v in (("request_timeout_s", request_timeout_s), ("episode_timeout_s", episode_timeout_s)):
        if v is not None and not v > 0:
            raise ValueError(f"{name}={v!r} must be > 0 seconds or None")
    group = _Group(env, n, engine, temperature=temperature, seed=seed, cache_salt=cache_salt, version=version,
                   request_timeout_s=request_timeout_s, max_model_len=max_model_len, share_first=share_first_call)
    contexts = [_Context(group, i) for i in range(n)]
    try:
        await asyncio.gather(*(_play(env, problem, ctx, group, episode_timeout_s) for ctx in contexts))
    finally:
        group.cancel()
    return [ctx.episode for ctx in contexts]


async def _play(env: Environment, problem: Any, ctx: _Context, group: _Group, timeout_s: float | None) -> None:
    ep = ctx.episode
    ep.t_start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s) as cm:
            result = await env.episode(problem, ctx)
        if not isinstance(result, EpisodeResult):
            raise TypeError(f"{type(env).__name__}.episode returned {type(result).__name__}; return an EpisodeResult")
        ep.result = result
    except asyncio.CancelledError:
        raise
    except TimeoutError as exc:
        if cm.expired():
            ep.result = EpisodeResult(0.0, "timeout")
            ep.error, ep.error_kind = f"episode_timeout_s={timeout_s} exceeded", "timeout"
        else:
            ep.error, ep.error_kind, ep.exception = f"{type(exc).__name__}: {exc}", "env", exc
    except EngineCallError as exc:
        ep.error, ep.error_kind, ep.exception = f"{type(exc).__name__}: {exc}", "engine", exc.__cause__ or exc
    except Exception as exc:  # noqa: BLE001 - an environment failure costs its episode only
        ep.error, ep.error_kind, ep.exception = f"{type(exc).__name__}: {exc}", "env", exc
    finally:
        group.leave(ctx.index)
        ep.t_end = time.monotonic()
