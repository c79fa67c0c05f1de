"""``RequestRouter``: pick an inference engine per request from live load, queue depth and expected KV reuse.

The router runs in the orchestrator's event loop and sees every request it routes: ``choose`` picks an engine,
``on_start`` / ``on_finish`` keep its view of each engine up to date. Nothing is read from the engines; the
router *models* each engine's prefix cache from the requests it sent there (as approximate prefix-cache scorers
do, e.g. llm-d's, rather than consuming the engines' KV events).

Per engine ``e`` the router tracks:

- ``T_e``, **in-flight tokens**: the sum of ``n_tokens`` over requests started on ``e`` and not finished
  (``RoutedClient`` passes ``prompt_len + n * max_tokens``: the tokens the request makes the engine process).
- ``Q_e``, **queue depth**: requests started on ``e`` and not finished.
- a **cached-block model**: an LRU set of prefix-block hashes (``moe_rl.inference.prefix_hash``, bit-identical to
  vLLM's, so ``cache_salt`` is honoured exactly: it enters block 0 only and later blocks chain from it),
  bounded by ``cache_capacity_blocks``. A started request inserts its prompt's full blocks (vLLM caches them
  once prefilled, so later requests of the same group hit them); a finished request inserts the full blocks of
  prompt + output (``(len - 1) // block_size`` of them: the last sampled token's KV is never computed).

Score (``policy="score"``), for a request of ``P`` prompt tokens, ``B = (P - 1) // block_size`` hittable blocks
(vLLM always recomputes the last prompt token) and ``H_e`` = the longest run of its leading block hashes present
in engine ``e``'s model, with ``mean(.)`` over engines::

    reuse_e = H_e / B                         (0 when B == 0)       in [0, 1]
    load_e  = T_e / (mean(T) + P)             below 1 for an average engine, 0 when idle
    queue_e = Q_e / (mean(Q) + 1)
    score_e = w_reuse * reuse_e - w_load * load_e - w_queue * queue_e

The highest score wins; ties (within 1e-12) go to the fewest in-flight tokens, then the fewest queued requests,
then the fewest requests routed so far, then the lowest index, so equal idle engines are filled in turn.
Loads are normalised by the *mean* engine, so only imbalance matters. With the defaults (1, 1, 1) and two
engines whose in-flight tokens and requests stand in ratio ``r``, a request whose whole prefix sits on the busier
one still goes there while ``4 (r - 1) / (r + 1) < 1``, i.e. up to ``r`` of about 5/3 (more when ``P`` and the
``+ 1`` are not negligible). A shared system prompt is cheap to recompute once on the other engine, while an
imbalance costs every request on the busy engine; a session's own history is kept by stickiness, not by the score.

Other policies: ``"round_robin"`` (engine ``i mod N`` for the i-th request; the baseline of vllm-router) and
``"least_loaded"`` (lowest ``T_e``, then the tie order above; prime-rl's orchestrator picks the client with the
fewest in-flight tasks).

Unavailable engines (``set_available(e, False)``: a dead engine, or one restarting until it serves the run's
current weights) are never chosen: every policy and the tie order run over the available engines only, the
``mean(.)`` above included, and a session pinned to an unavailable engine is routed anew (a sticky break).

Sticky sessions (``sticky_sessions=True``, any policy): the first request of a ``session_id`` is routed by the
policy and pins the session to that engine; later requests of the session go to the pinned engine unless it is
**overloaded**: ``Q_e >= overload_min_queue`` and ``T_e > overload_factor * mean(T)``. Then the request is routed
by the policy over all engines; if that picks another engine the session moves there and a *sticky break* is
counted. (prime-rl pins by ``X-Session-ID`` consistent hashing in vllm-router; a hash never looks at load.)

``stats()`` counts everything: requests routed per engine, sticky hits and breaks, new and evicted sessions,
predicted hit blocks (and, when ``on_finish`` gets the engine's ``cached_tokens``, the observed ones), evicted
cache-model blocks, finished and failed requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig
from moe_rl.inference.prefix_hash import (
    cached_blocks_after,
    extend_block_hashes,
    hittable_blocks,
    prefix_block_hashes,
)

__all__ = ["RouterConfig", "RequestRouter", "RouteDecision"]

_TIE_EPS = 1e-12


class RouterConfig(BaseConfig):
    """How ``RequestRouter`` picks an engine (see the module docstring for the score)."""

    policy: Literal["score", "round_robin", "least_loaded"] = "score"
    """``score``: reuse/load/queue score; ``round_robin``: i-th request to engine ``i mod N``;
    ``least_loaded``: fewest in-flight tokens."""

    w_reuse: float = Field(1.0, ge=0.0, le=1e6)
    """Weight of ``reuse_e``, the fraction of the prompt's hittable blocks expected in engine e's prefix cache."""

    w_load: float = Field(1.0, ge=0.0, le=1e6)
    """Weight of ``load_e = T_e / (mean(T) + P)``, in-flight tokens relative to the average engine."""

    w_queue: float = Field(1.0, ge=0.0, le=1e6)
    """Weight of ``queue_e = Q_e / (mean(Q) + 1)``, requests in flight relative to the average engine."""

    block_size: int = Field(32, ge=1, le=65536)
    """Tokens per KV block; must equal the engines' ``--block-size`` or no predicted hit is real."""

    cache_capacity_blocks: int = Field(8192, ge=1)
    """Prefix blocks each engine's cache model holds before evicting the least recently used; set it to the
    engine's KV blocks (``kv_cache_memory_bytes / bytes_per_block``; vLLM logs ``GPU KV cache size: N tokens``,
    divide by ``block_size``)."""

    sticky_sessions: bool = True
    """Later requests of a ``session_id`` go to the engine of its first request unless it is overloaded."""

    overload_factor: float = Field(1.5, gt=1.0, le=1e6)
    """A session's engine is overloaded when its in-flight tokens exceed ``overload_factor`` times the mean over
    engines (and ``overload_min_queue`` holds); then stickiness yields to the policy."""

    overload_min_queue: int = Field(2, ge=1)
    """...and it has at least this many requests in flight (one long request never breaks stickiness)."""

    max_sessions: int = Field(1_000_000, ge=1)
    """Sessions remembered for stickiness; beyond it the least recently used is forgotten (counted in
    ``stats()['sessions_evicted']``). Call ``end_session`` when a rollout ends."""

    @model_validator(mode="after")
    def _score_needs_a_weight(self) -> RouterConfig:
        if self.policy == "score" and self.w_reuse == 0 and self.w_load == 0 and self.w_queue == 0:
            raise ValueError(
                "w_reuse = w_load = w_queue = 0 with policy='score': every engine scores 0; give at least one "
                "weight > 0, or use policy='round_robin'"
            )
        return self


@dataclass
class RouteDecision:
    """What ``RequestRouter.route`` decided for one request.

    Attributes:
        engine: the chosen engine index.
        block_hashes: the prompt's full-block hashes ``[prompt_len // block_size]`` (32-byte digests).
        hittable_blocks: ``(prompt_len - 1) // block_size``, the most blocks the prompt can hit.
        predicted_hit_blocks: per engine, leading hittable blocks in its cache model, ``[num_engines]``.
        scores: per engine ``score_e`` (``policy="score"``), else None.
        sticky: ``"new"`` (first request of a session), ``"hit"`` (sent to the pinned engine), ``"break"``
            (pinned engine overloaded, moved), or None (no session / stickiness off).
        cache_salt: the salt the hashes were computed with (``on_start(decision=...)`` reuses it, so the blocks
            of prompt + output inserted by ``on_finish`` carry the same salt).
    """

    engine: int
    block_hashes: list[bytes]
    hittable_blocks: int
    predicted_hit_blocks: list[int]
    scores: list[float] | None = None
    sticky: str | None = None
    cache_salt: str | None = None


@dataclass
class _Inflight:
    engine: int
    n_tokens: int
    cache_salt: str | None
    prompt_hashes: list[bytes]
    predicted_hit_blocks: int
    hittable_blocks: int


@dataclass
class _Engine:
    inflight_tokens: int = 0
    queue_depth: int = 0
    routed: int = 0
    blocks: OrderedDict = field(default_factory=OrderedDict)
    evicted_blocks: int = 0


class RequestRouter:
    """Chooses an engine per request (score / round-robin / least-loaded) with sticky sessions.

    Use from one thread or one asyncio loop: call ``route``/``choose`` and then ``on_start`` with no ``await``
    between them, so that concurrent requests see each other's load; call ``on_finish`` when the request ends
    (also on failure). ``RoutedClient`` does all three around ``VllmClient.generate``.

    Example::

        router = RequestRouter(RouterConfig(block_size=32), num_engines=2)
        d = router.route(prompt_ids, cache_salt="moe_rl-v3-float32", session_id="traj-17")
        router.on_start(d.engine, "req-1", n_tokens=len(prompt_ids) + max_tokens, decision=d)
        ...  # send the request to engine d.engine
        router.on_finish(d.engine, "req-1", sequences=[prompt_ids + output_ids], cached_tokens=cached)

    Args:
        cfg: router settings.
        num_engines: engines to route over, >= 1.

    Raises:
        ValueError: ``num_engines < 1``.
    """

    def __init__(self, cfg: RouterConfig, num_engines: int):
        if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"RequestRouter: num_engines={num_engines!r} must be an int >= 1")
        self.cfg = cfg
        self.num_engines = num_engines
        self._engines = [_Engine() for _ in range(num_engines)]
        self._inflight: dict[str, _Inflight] = {}
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._rr_next = 0
        self._available = [True] * num_engines
        self._counts = {
            "requests": 0, "sticky_new": 0, "sticky_hits": 0, "sticky_breaks": 0, "sticky_kept_overloaded": 0,
            "sessions_evicted": 0, "sessions_ended": 0, "finished": 0, "failed": 0,
            "hittable_blocks": 0, "predicted_hit_blocks": 0,
            "observed_requests": 0, "observed_cached_blocks": 0, "observed_predicted_blocks": 0,
            "observed_exact": 0,
        }  # fmt: skip

    # ------------------------------------------------------------------ choosing
    def choose(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, session_id: str | None = None
    ) -> int:
        """The engine index for this request (``route(...).engine``)."""
        return self.route(prompt_token_ids, cache_salt, session_id).engine

    def route(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, session_id: str | None = None
    ) -> RouteDecision:
        """Choose an engine for a request and return the decision (with the prompt's block hashes for
        ``on_start``). Updates the round-robin cursor, the session pin and the counters; the load changes only
        in ``on_start``.

        Args:
            prompt_token_ids: ``[prompt_len]`` prompt token ids (non-empty).
            cache_salt: the request's ``cache_salt`` (None: unsalted).
            session_id: groups the turns of one multi-turn rollout (None: no stickiness).

        Returns:
            A ``RouteDecision``.

        Raises:
            ValueError: ``prompt_token_ids`` is empty.
        """
        if len(prompt_token_ids) == 0:
            raise ValueError("RequestRouter.route: prompt_token_ids is empty; pass at least one token id")
        if not any(self._available):
            raise RuntimeError("RequestRouter.route: no engine is available (every one was set_available(e, False)); "
                               "wait until one is available again before routing")
        bs = self.cfg.block_size
        hashes = prefix_block_hashes(prompt_token_ids, bs, cache_salt)
        hittable = hittable_blocks(len(prompt_token_ids), bs)
        predicted = [self._longest_hit(e, hashes[:hittable]) for e in range(self.num_engines)]
        scores = (
            self._scores(predicted, hittable, len(prompt_token_ids)) if self.cfg.policy == "score" else None
        )

        sticky: str | None = None
        pinned = (
            self._sessions.get(session_id) if (self.cfg.sticky_sessions and session_id is not None) else None
        )
        if pinned is not None and self._available[pinned] and not self._overloaded(pinned):
            engine, sticky = pinned, "hit"
        else:
            engine = self._by_policy(scores)
            if pinned is not None:
                sticky = "break" if engine != pinned else "hit"
                if engine == pinned:
                    self._counts["sticky_kept_overloaded"] += 1
            elif self.cfg.sticky_sessions and session_id is not None:
                sticky = "new"
        if self.cfg.sticky_sessions and session_id is not None:
            self._pin(session_id, engine)
            self._counts[{"hit": "sticky_hits", "break": "sticky_breaks", "new": "sticky_new"}[sticky]] += 1
        self._counts["requests"] += 1
        self._engines[engine].routed += 1
        return RouteDecision(engine, hashes, hittable, predicted, scores, sticky, cache_salt)

    def _longest_hit(self, engine: int, hashes: Sequence[bytes]) -> int:
        blocks = self._engines[engine].blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def _candidates(self) -> list[int]:
        """The engines that may be chosen (available ones), in index order."""
        return [i for i in range(self.num_engines) if self._available[i]]

    def _scores(self, predicted: list[int], hittable: int, prompt_len: int) -> list[float]:
        c = self.cfg
        live = [self._engines[i] for i in self._candidates()]
        mean_t = sum(e.inflight_tokens for e in live) / len(live)
        mean_q = sum(e.queue_depth for e in live) / len(live)
        out = []
        for i, e in enumerate(self._engines):
            reuse = predicted[i] / hittable if hittable else 0.0
            load = e.inflight_tokens / (mean_t + prompt_len)
            queue = e.queue_depth / (mean_q + 1.0)
            out.append(c.w_reuse * reuse - c.w_load * load - c.w_queue * queue)
        return out

    def _tie_key(self, i: int) -> tuple[int, int, int, int]:
        e = self._engines[i]
        return (e.inflight_tokens, e.queue_depth, e.routed, i)

    def _by_policy(self, scores: list[float] | None) -> int:
        policy = self.cfg.policy
        candidates = self._candidates()
        if policy == "round_robin":
            while True:  # the next available engine in turn
                engine = self._rr_next % self.num_engines
                self._rr_next += 1
                if self._available[engine]:
                    return engine
        if policy == "least_loaded":
            return min(candidates, key=self._tie_key)
        if scores is None:
            raise RuntimeError("RequestRouter: policy 'score' needs scores (internal error)")
        best = max(scores[i] for i in candidates)
        tied = [i for i in candidates if scores[i] >= best - _TIE_EPS]
        return min(tied, key=self._tie_key)

    def _overloaded(self, engine: int) -> bool:
        e = self._engines[engine]
        live = [self._engines[i] for i in self._candidates()]
        mean_t = sum(x.inflight_tokens for x in live) / len(live)
        return (
            e.queue_depth >= self.cfg.overload_min_queue
            and e.inflight_tokens > self.cfg.overload_factor * mean_t
        )

    def _pin(self, session_id: str, engine: int) -> None:
        self._sessions[session_id] = engine
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.cfg.max_sessions:
            self._sessions.popitem(last=False)
            self._counts["sessions_evicted"] += 1

    def end_session(self, session_id: str) -> bool:
        """Forget a session's pin (call when its rollout ends). Returns whether it was known."""
        known = self._sessions.pop(session_id, None) is not None
        self._counts["sessions_ended"] += int(known)
        return known

    # ------------------------------------------------------------------ lifecycle
    def on_start(
        self,
        engine: int,
        request_id: str,
        n_tokens: int,
        prompt_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        *,
        decision: RouteDecision | None = None,
    ) -> None:
        """Record that ``request_id`` was sent to ``engine``: its load counts and its prompt blocks enter the
        engine's cache model.

        Args:
            engine: the engine it was sent to (normally ``decision.engine``).
            request_id: unique among requests in flight.
            n_tokens: tokens the request makes the engine process, e.g. ``prompt_len + n * max_tokens`` (>= 1).
            prompt_token_ids, cache_salt: the prompt and salt; needed when ``decision`` is None.
            decision: the ``route`` result for this request (reuses its block hashes, salt and predicted hits).

        Raises:
            ValueError: bad engine index, duplicate ``request_id``, ``n_tokens < 1``, neither a decision
                nor a prompt, or a ``cache_salt`` that differs from ``decision.cache_salt``.
        """
        self._check_engine(engine, "on_start")
        if request_id in self._inflight:
            raise ValueError(f"RequestRouter.on_start: request_id={request_id!r} is already in flight; ids must be "
                             "unique among requests in flight")  # fmt: skip
        if n_tokens < 1:
            raise ValueError(
                f"RequestRouter.on_start: n_tokens={n_tokens} must be >= 1 (prompt + max new tokens)"
            )
        bs = self.cfg.block_size
        if decision is not None:
            if cache_salt is not None and (cache_salt or None) != (decision.cache_salt or None):
                raise ValueError(
                    f"RequestRouter.on_start: cache_salt={cache_salt!r} differs from decision.cache_salt="
                    f"{decision.cache_salt!r}; route and start a request with the same salt (or omit cache_salt)"
                )
            cache_salt = decision.cache_salt  # the hashes' salt: on_finish extends them under it
            hashes, hittable = decision.block_hashes, decision.hittable_blocks
            predicted = decision.predicted_hit_blocks[engine]
        elif prompt_token_ids is not None and len(prompt_token_ids) > 0:
            hashes = prefix_block_hashes(prompt_token_ids, bs, cache_salt)
            hittable = hittable_blocks(len(prompt_token_ids), bs)
            predicted = self._longest_hit(engine, hashes[:hittable])
        else:
            raise ValueError(
                "RequestRouter.on_start: pass decision= (from route) or a non-empty prompt_token_ids"
            )
        e = self._engines[engine]
        e.inflight_tokens += int(n_tokens)
        e.queue_depth += 1
        self._insert(engine, hashes)
        self._counts["hittable_blocks"] += hittable
        self._counts["predicted_hit_blocks"] += predicted
        self._inflight[request_id] = _Inflight(engine, int(n_tokens), cache_salt, hashes, predicted, hittable)

    def on_finish(
        self,
        engine: int,
        request_id: str,
        sequences: Sequence[Sequence[int]] = (),
        cached_tokens: int | None = None,
        failed: bool = False,
    ) -> None:
        """Record that ``request_id`` ended: its load is released and, unless it failed, the full blocks of
        each ``prompt + output`` sequence enter the engine's cache model.

        Args:
            engine: the engine it was started on.
            request_id: as given to ``on_start``.
            sequences: per completion, ``prompt + output`` token ids ``[prompt_len + num_generated]``.
            cached_tokens: the engine's reported prefix-cache hit for the prompt (counted against the prediction).
            failed: the request errored or was cancelled (nothing is inserted; counted in ``failed``).

        Raises:
            ValueError: unknown ``request_id``, or ``engine`` differs from the one it started on.
        """
        rec = self._inflight.get(request_id)
        if rec is None:
            raise ValueError(f"RequestRouter.on_finish: request_id={request_id!r} is not in flight; call on_start "
                             "first (and on_finish once)")  # fmt: skip
        if rec.engine != engine:
            raise ValueError(f"RequestRouter.on_finish: request_id={request_id!r} started on engine {rec.engine}, "
                             f"not engine={engine}")  # fmt: skip
        del self._inflight[request_id]
        e = self._engines[engine]
        e.inflight_tokens -= rec.n_tokens
        e.queue_depth -= 1
        if failed:
            self._counts["failed"] += 1
            return
        self._counts["finished"] += 1
        bs = self.cfg.block_size
        for seq in sequences:
            n = cached_blocks_after(len(seq), bs)
            known = rec.prompt_hashes[: min(len(rec.prompt_hashes), n)]
            self._insert(engine, extend_block_hashes(known, seq, bs, rec.cache_salt, max_blocks=n))
        if cached_tokens is not None:
            observed = int(cached_tokens) // bs
            self._counts["observed_requests"] += 1
            self._counts["observed_cached_blocks"] += observed
            self._counts["observed_predicted_blocks"] += rec.predicted_hit_blocks
            self._counts["observed_exact"] += int(observed == rec.predicted_hit_blocks)

    def _insert(self, engine: int, hashes: Sequence[bytes]) -> None:
        e = self._engines[engine]
        for h in hashes:
            if h in e.blocks:
                e.blocks.move_to_end(h)
            else:
                e.blocks[h] = None
        while len(e.blocks) > self.cfg.cache_capacity_blocks:
            e.blocks.popitem(last=False)
            e.evicted_blocks += 1

    def _check_engine(self, engine: int, where: str) -> None:
        if isinstance(engine, bool) or not isinstance(engine, int) or not 0 <= engine < self.num_engines:
            raise ValueError(
                f"RequestRouter.{where}: engine={engine!r} must be an int in [0, {self.num_engines})"
            )

    def set_available(self, engine: int, available: bool) -> None:
        """Let ``engine`` be chosen (``True``) or not (``False``: dead, or restarting until it serves the current
        weights). Requests already started on it are unaffected (finish them with ``on_finish``); an engine made
        unavailable also forgets its cache model (a restarted engine's prefix cache is empty).

        Raises:
            ValueError: bad engine index, or ``available`` is not a bool.
        """
        self._check_engine(engine, "set_available")
        if not isinstance(available, bool):
            raise ValueError(f"RequestRouter.set_available: available={available!r} must be True or False")
        if not available:
            self._engines[engine].blocks.clear()
        self._available[engine] = available

    @property
    def available(self) -> list[bool]:
        """Per engine, whether it may be chosen (``set_available``)."""
        return list(self._available)

    def reset_engine_cache(self, engine: int | None = None) -> None:
        """Forget the cache model of one engine (or all): call after ``reset_prefix_cache`` on it."""
        for i in range(self.num_engines) if engine is None else [engine]:
            self._check_engine(i, "reset_engine_cache")
            self._engines[i].blocks.clear()

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Counters and per-engine state (plain ints/floats/lists; JSON-serialisable).

        Keys: ``policy``; ``requests``; ``routed``, ``inflight_tokens``, ``queue_depth``, ``cached_blocks``,
        ``evicted_blocks``, ``available`` (lists, one entry per engine); ``sticky_new``, ``sticky_hits``, ``sticky_breaks``,
        ``sticky_kept_overloaded`` (overloaded but the policy chose it anyway), ``sessions``,
        ``sessions_evicted``, ``sessions_ended``; ``finished``, ``failed``, ``inflight``; ``hittable_blocks``
        and ``predicted_hit_blocks`` (summed over started requests) and ``predicted_hit_rate`` (their ratio; None before any);
        ``observed_requests``, ``observed_cached_blocks``, ``observed_predicted_blocks``, ``observed_exact``
        (requests finished with the engine's ``cached_tokens``; how many predictions were exact).
        """
        out: dict[str, Any] = {"policy": self.cfg.policy, **self._counts}
        out["routed"] = [e.routed for e in self._engines]
        out["inflight_tokens"] = [e.inflight_tokens for e in self._engines]
        out["queue_depth"] = [e.queue_depth for e in self._engines]
        out["cached_blocks"] = [len(e.blocks) for e in self._engines]
        out["evicted_blocks"] = [e.evicted_blocks for e in self._engines]
        out["available"] = list(self._available)
        out["sessions"] = len(self._sessions)
        out["inflight"] = len(self._inflight)
        h = self._counts["hittable_blocks"]
        out["predicted_hit_rate"] = self._counts["predicted_hit_blocks"] / h if h else None
        return out
