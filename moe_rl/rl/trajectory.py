"""Trajectory interleaving by token prefix: a rollout's model calls become trainable samples.

Shape legend:
    N   tokens of a sample (prompt + completion)
    Lm  layers of a routed-expert record, K experts per token (:class:`moe_rl.replay.RoutedExperts` ``[N, Lm, K]``)

An agentic rollout is a sequence of model calls (engine requests), each ``prompt tokens -> completion tokens``.
A chat template that only appends (the next prompt = everything so far + the environment's tokens) gives one
sample per agent; a template that re-renders history (e.g. strips past ``<think>`` blocks), several agents that
take turns, and rollbacks to an earlier state do not. :func:`interleave_calls` handles all of them by comparing
token ids only (no chat template, no message parsing). The calls are taken in order; each call's prompt ``P`` is
matched against the samples built so far:

* a **match** is a pair (sample ``S``, cut ``b``) with ``P[:b] == S.tokens[:b]``, where ``b`` is the end of one of
  ``S``'s completions (``b = len(S.tokens)``: the whole sample; smaller ``b``: the state after an earlier call), and
  ``S`` was sampled at the call's temperature. The match with the largest ``b`` wins (the longest matching prefix;
  ties: the whole sample before a cut, then the earliest sample);
* **extend** (``b = len(S.tokens)``): ``S`` grows by ``P[b:]`` (tokens the environment inserted: loss mask False,
  log-prob 0.0, version -1) and then the call's completion (loss mask True, the engine's log-probs and versions);
* **branch** (``b < len(S.tokens)``, a rollback to an earlier state of ``S``): a new sample starts as a copy of
  ``S.tokens[:b]``, with ``S``'s loss mask, log-probs, per-token versions and routed-expert rows for those tokens
  (``branch="train"``: the branch is a whole trajectory of the agent and trains its shared prefix again;
  ``branch="mask"``: the shared prefix is the new sample's prompt, not trained again), then ``P[b:]`` masked and
  the completion;
* otherwise (**break**: a re-rendered history, a new agent, another temperature) a new sample starts with prompt
  ``P``; its routed-expert rows for the longest prefix ``P`` shares with any earlier sample are copied from that
  sample (a token's routing depends only on the tokens up to it), so an engine that returns rows only for the
  uncached suffix still yields complete rows.

Every token of a sample sits at the same position as in the engine request that produced it (``P`` is the
sample's prefix in all three cases), so routed-expert records need no shift: the calls' records (and copied rows)
are merged with :func:`moe_rl.replay.stitch_records` (the earliest record that holds a row keeps it).

Per-token versions: a call's ``version_segments`` (canonical over its completion, :mod:`moe_rl.rl.token_versions`)
place the versions; a call without them is taken to be sampled by ``max(call.version, the sample's latest version)``.
Environment tokens inherit the preceding sampled token's version in :attr:`TrajectorySample.version_segments` (they
are off the loss mask, so the batch gives them -1).

Pure block: no process, no I/O, no engine; numpy only through :mod:`moe_rl.replay`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ModelCall", "TrajectorySample", "interleave_calls"]

RoutingStatus = Literal["stitched", "not_recorded", "missing_call", "incomplete"]


@dataclass(frozen=True)
class ModelCall:
    """One engine request of a rollout and what it returned.

    Attributes:
        prompt_ids: the request's prompt token ids (>= 1 token).
        completion_ids: the sampled token ids (a call with none trains nothing and is skipped).
        logprobs: the engine's log-prob of each sampled token (same length as ``completion_ids``).
        version: policy version the engine served when the request was sent (used when ``version_segments`` is
            None).
        version_segments: ``[(version, first completion index), ...]`` of the completion (brought to canonical form
            with :func:`moe_rl.rl.token_versions.normalize_segments`), or None.
        routed_experts: the engine's :class:`moe_rl.replay.RoutedExperts` rows in this request's token
            coordinates (``start`` may be > 0 for a prefix-cached prompt; the last token's row a placeholder), or
            None (not recorded).
        temperature: the sampling temperature of this call (> 0).
        finish_reason: the engine's finish reason.
        sampling_mask: the engine's top-k / top-p kept set of each completion token
            (:class:`moe_rl.rl.sampling_mask.SamplingMask`), or None. Carried into a sample only for a one-call
            episode (the orchestrator does not merge it across turns).
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    version: int
    version_segments: Sequence[tuple[int, int]] | None = None
    routed_experts: Any = None
    temperature: float = 1.0
    finish_reason: str = ""
    sampling_mask: Any = None


@dataclass
class TrajectorySample:
    """One trainable sample: ``prompt_ids + completion_ids`` with a loss mask over the completion.

    Attributes:
        prompt_ids: tokens before the first trained token (the first call's prompt; for a ``branch="mask"`` copy,
            the branching call's prompt).
        completion_ids: every later token (sampled and environment tokens).
        completion_logprobs: the engine's log-prob per completion token, 0.0 where ``completion_mask`` is False.
        completion_mask: True where the model sampled the token in this sample's lineage (trained).
        token_versions: per completion token, the version that sampled it; -1 where ``completion_mask`` is False.
        routed_experts: stitched ``[N, Lm, K]`` record (``start`` 0) or None (see ``routing``).
        routing: ``"stitched"``, ``"not_recorded"`` (no call of the sample returned rows), ``"missing_call"`` (some
            call returned none), ``"incomplete"`` (rows other than the last token's stayed missing).
        routing_conflict_rows: rows two records held with different ids (the earlier record's row is kept).
        temperature: the sampling temperature of every call of this sample.
        calls: indices (into the ``calls`` argument) of the calls whose completions this sample trains or holds.
        branched_from: index of the sample this one was copied from (a branch), else None.
        finish_reason: the last call's finish reason.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_mask: list[bool]
    token_versions: list[int]
    routed_experts: Any
    routing: RoutingStatus
    routing_conflict_rows: int
    temperature: float
    calls: list[int]
    branched_from: int | None = None
    finish_reason: str = ""

    @property
    def version_segments(self) -> list[tuple[int, int]]:
        """Canonical segments over the completion: a switch where a sampled token's version changes; environment
        tokens (and masked copied tokens) inherit the previous sampled token's version. Empty when no token is
        trained."""
        out: list[tuple[int, int]] = []
        for i, v in enumerate(self.token_versions):
            if v < 0:
                continue
            if not out:
                out.append((v, 0))
            elif v != out[-1][0]:
                out.append((v, i))
        return out


@dataclass
class _Work:
    """A sample under construction (whole-sequence coordinates)."""

    tokens: list[int]
    prompt_len: int
    logprobs: list[float]  # [N], 0.0 off-mask (prompt included)
    mask: list[bool]  # [N]
    versions: list[int]  # [N], -1 off-mask
    cuts: list[int]  # ends of completions (ascending); cuts[-1] == len(tokens)
    records: list[Any]  # one per call of ``calls`` (engine records in sample coordinates); None = no rows
    temperature: float
    calls: list[int]
    branched_from: int | None
    last_version: int
    finish_reason: str = ""
    copied_rows: list[Any] = field(default_factory=list)  # rows copied from earlier samples (never None)


def _check_call(i: int, c: ModelCall) -> None:
    if not isinstance(c, ModelCall):
        raise TypeError(f"calls[{i}] is a {type(c).__name__}; pass ModelCall objects (one per engine request)")
    if len(c.prompt_ids) == 0:
        raise ValueError(f"calls[{i}].prompt_ids is empty; a request's prompt has at least one token (e.g. BOS)")
    if len(c.logprobs) != len(c.completion_ids):
        raise ValueError(
            f"calls[{i}]: {len(c.logprobs)} logprobs for {len(c.completion_ids)} completion tokens; the engine must "
            "return one log-prob per sampled token"
        )
    t = c.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"calls[{i}].temperature={t!r} must be a finite number > 0 (the sampler's temperature)")


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice comparisons run in C: a whole-prefix check,
    then a binary search for the first mismatch; O(n log n) element compares at worst, no Python loop per token)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _prefix_rows(w: _Work, end: int, *, own_until: int | None = None) -> tuple[list[Any], list[Any]]:
    """``(own, copied)`` routed rows of ``w`` at positions ``< end``.

    ``own``: the records of ``w``'s calls whose completion ends at or before ``own_until`` (None entries kept: such a
    call returned no rows, so the copy misses them too); ``copied``: every other row below ``end`` (``w``'s copied
    rows and later calls' records, which hold rows of the shared prefix too; None entries dropped).
    """
    def clip(r: Any) -> Any:
        return r.slice_rows(r.start, min(r.end, end)) if r is not None and r.start < end else None

    own: list[Any] = []
    copied = [x for x in (clip(r) for r in w.copied_rows) if x is not None]
    for r, cut in zip(w.records, w.cuts, strict=True):
        if own_until is not None and cut <= own_until:
            own.append(clip(r) if r is not None else None)
        elif (x := clip(r)) is not None:
            copied.append(x)
    return own, copied


def _call_versions(i: int, c: ModelCall, last: int) -> list[int]:
    """Per completion token versions of call ``i`` (``last``: the sample's latest version, or -1)."""
    from moe_rl.rl.token_versions import normalize_segments, token_versions_from_segments

    n = len(c.completion_ids)
    if c.version_segments:
        segs = normalize_segments([(int(v), int(j)) for v, j in c.version_segments], n)
        if segs[0][0] < last:
            raise ValueError(
                f"calls[{i}]: version segments {segs} start at version {segs[0][0]}, below version {last} of the "
                "sample's earlier tokens; the engine's version bookkeeping is broken (versions never go back)"
            )
        return token_versions_from_segments(segs, n)
    return [max(int(c.version), last)] * n


def interleave_calls(
    calls: Sequence[ModelCall],
    *,
    errored: bool = False,
    branch: Literal["train", "mask"] = "train",
) -> list[TrajectorySample] | None:
    """Turn a rollout's model calls into trainable samples by token prefix (rules in the module docstring).

    Args:
        calls: the rollout's engine requests in the order they were sent.
        errored: the rollout failed (tool crash, timeout, engine error): it trains nothing.
        branch: what a branch (rollback) does with the prefix it copies: ``"train"`` keeps the copied sampled
            tokens trained (each branch is a whole trajectory), ``"mask"`` takes them off the loss (each sampled
            token is trained once; the routed rows are copied either way).

    Returns:
        None when there is no trajectory (``calls`` empty); ``[]`` when the rollout errored or no call sampled a
        token; otherwise the samples in order of creation (each with at least one trained token).

    Raises:
        TypeError: an entry is not a :class:`ModelCall`.
        ValueError: an empty prompt, a log-prob count that differs from the completion length, a bad temperature,
            non-canonical version segments, versions going back within a sample, or an unknown ``branch``.
    """
    if branch not in ("train", "mask"):
        raise ValueError(f"branch={branch!r} is not supported; use 'train' or 'mask'")
    if len(calls) == 0:
        return None
    for i, c in enumerate(calls):
        _check_call(i, c)
    if errored:
        return []
    work: list[_Work] = []
    for i, c in enumerate(calls):
        if len(c.completion_ids) == 0:
            continue
        prompt = [int(t) for t in c.prompt_ids]
        best: tuple[int, int, int] | None = None  # (b, whole, -index) maximised
        for j, w in enumerate(work):
            if w.temperature != float(c.temperature) or len(prompt) < w.cuts[0]:
                continue
            cp = _common_prefix(prompt, w.tokens)
            for b in reversed(w.cuts):
                if b <= cp:
                    key = (b, int(b == len(w.tokens)), -j)
                    if best is None or key > best:
                        best = key
                    break
        if best is not None and best[1]:  # extend a whole sample
            w = work[-best[2]]
        elif best is not None:  # branch: copy the state after an earlier completion of sample j
            j, b = -best[2], best[0]
            src = work[j]
            keep = branch == "train"
            own, copied = _prefix_rows(src, b, own_until=b if keep else None)
            w = _Work(
                tokens=src.tokens[:b],
                prompt_len=src.prompt_len if keep else len(prompt),
                logprobs=src.logprobs[:b] if keep else [0.0] * b,
                mask=src.mask[:b] if keep else [False] * b,
                versions=src.versions[:b] if keep else [-1] * b,
                cuts=[x for x in src.cuts if x <= b] if keep else [],
                records=own,
                temperature=src.temperature,
                calls=[k for k, e in zip(src.calls, src.cuts, strict=True) if e <= b] if keep else [],
                branched_from=j,
                last_version=max((v for v in src.versions[:b] if v >= 0), default=-1) if keep else -1,
                copied_rows=copied,
            )
            work.append(w)
        else:  # break: a new sample; copy the routed rows of the longest shared prefix
            rows: list[Any] = []
            share = 0
            for other in work:
                cp = min(_common_prefix(prompt, other.tokens), len(prompt))
                if cp > share:
                    share, rows = cp, _prefix_rows(other, cp)[1]
            w = _Work(tokens=[], prompt_len=len(prompt), logprobs=[], mask=[], versions=[], cuts=[],
                      records=[], temperature=float(c.temperature), calls=[], branched_from=None,
                      last_version=-1, copied_rows=rows)
            work.append(w)
        env = prompt[len(w.tokens):]
        w.tokens.extend(env)
        w.logprobs.extend([0.0] * len(env))
        w.mask.extend([False] * len(env))
        w.versions.extend([-1] * len(env))
        vers = _call_versions(i, c, w.last_version)
        w.tokens.extend(int(t) for t in c.completion_ids)
        w.logprobs.extend(float(x) for x in c.logprobs)
        w.mask.extend([True] * len(c.completion_ids))
        w.versions.extend(vers)
        w.last_version = vers[-1]
        w.cuts.append(len(w.tokens))
        w.records.append(c.routed_experts)
        w.calls.append(i)
        w.finish_reason = c.finish_reason
    return [_finish(w) for w in work]


def _finish(w: _Work) -> TrajectorySample:
    from moe_rl.replay import stitch_records

    p = w.prompt_len
    present = [r for r in w.records if r is not None]
    routed, conflicts = None, 0
    if not present:
        status: RoutingStatus = "not_recorded"
    elif len(present) < len(w.records):
        status = "missing_call"
    else:
        res = stitch_records([*w.copied_rows, *w.records], len(w.tokens))
        conflicts = res.conflicts
        if res.complete:
            status, routed = "stitched", res.record
        else:
            status = "incomplete"
    return TrajectorySample(
        prompt_ids=w.tokens[:p],
        completion_ids=w.tokens[p:],
        completion_logprobs=w.logprobs[p:],
        completion_mask=w.mask[p:],
        token_versions=w.versions[p:],
        routed_experts=routed,
        routing=status,
        routing_conflict_rows=conflicts,
        temperature=w.temperature,
        calls=list(w.calls),
        branched_from=w.branched_from,
        finish_reason=w.finish_reason,
    )
