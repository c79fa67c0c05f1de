"""Per-token policy versions of a completion, stored as version segments.

A completion generated while the engine loads new weights mixes policies: its tokens ``0 .. k-1`` were
sampled by version ``v0``, tokens ``k ..`` by ``v1`` (and so on). The engine side reports this as
*segments* ``[(version, first_token_index), ...]``::

    completion tokens   t0 t1 t2 t3 t4 t5 t6
    segments            [(4, 0), (5, 3), (7, 6)]
    token versions       4  4  4  5  5  5  7

Canonical form (``normalize_segments``): the first segment starts at 0, start indices strictly increase and
are ``< num_tokens``, versions strictly increase (a later weight load never carries an older version).
The version of a token is the version of the weights whose forward pass produced the logits it was
sampled from (its KV prefix may have been computed by older weights: vLLM applies a weight update between two engine steps without
draining requests in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["normalize_segments", "check_segments", "token_versions", "token_versions_from_segments", "version_runs"]


def normalize_segments(raw: Sequence[tuple[int, int]], num_tokens: int) -> list[tuple[int, int]]:
    """Canonical segments from a chronological list of ``(version, first_token_index)`` switch points.

    Entries at the same index keep the last one (two weight loads between two tokens: the later one sampled
    the token); entries at or beyond ``num_tokens`` are dropped (a load after the last token); consecutive
    equal versions merge.

    Args:
        raw: switch points in the order they happened; the first must have index 0.
        num_tokens: completion length (>= 1).

    Returns:
        Canonical segments (see the module docstring).

    Raises:
        ValueError: ``raw`` is empty, does not start at 0, or its indices or versions decrease.
    """
    if not raw:
        raise ValueError("normalize_segments: raw=[] is empty; a completion has at least one segment (v, 0)")
    if raw[0][1] != 0:
        raise ValueError(f"normalize_segments: the first switch point {raw[0]} must start at token 0")
    out: list[tuple[int, int]] = []
    for (v, i), prev in zip(raw, [None, *raw[:-1]], strict=True):
        if prev is not None and (i < prev[1] or v < prev[0]):
            raise ValueError(
                f"normalize_segments: switch points {list(raw)} go backwards at {(v, i)} after {prev}; indices "
                "and versions must be non-decreasing"
            )
        if i >= num_tokens and out:
            continue
        if out and out[-1][1] == i:
            out[-1] = (int(v), int(i))
        else:
            out.append((int(v), int(i)))
        if len(out) >= 2 and out[-1][0] == out[-2][0]:
            out.pop()
    return out


def check_segments(segments: Sequence[tuple[int, int]], num_tokens: int) -> None:
    """Raise ``ValueError`` unless ``segments`` is canonical for a completion of ``num_tokens`` tokens."""
    if not segments or segments[0][1] != 0:
        raise ValueError(f"version segments {list(segments)!r} must start with (version, 0)")
    for (v0, i0), (v1, i1) in zip(segments, segments[1:], strict=False):
        if not (i1 > i0 and v1 > v0):
            raise ValueError(
                f"version segments {list(segments)!r}: {(v1, i1)} after {(v0, i0)}; start indices and versions "
                "must strictly increase (use normalize_segments)"
            )
    if segments[-1][1] >= num_tokens:
        raise ValueError(
            f"version segments {list(segments)!r}: last start index {segments[-1][1]} >= num_tokens={num_tokens}"
        )
    if min(v for v, _ in segments) < 0:
        raise ValueError(f"version segments {list(segments)!r}: versions must be >= 0")


def version_runs(
    num_tokens: int, version_start: int, version_segments: Sequence[tuple[int, int]] | None
) -> list[tuple[int, int, int]]:
    """``[(version, first, end), ...]`` runs covering ``[0, num_tokens)``.

    Tokens before the first segment have ``version_start`` (segments may start after token 0, e.g. when a
    simulator only records the switch points); None or empty segments = every token has ``version_start``.

    Raises:
        ValueError: first indices do not increase within ``[0, num_tokens]`` or versions decrease (below
            ``version_start`` included).
    """
    runs: list[tuple[int, int, int]] = []
    prev_idx, prev_v = -1, version_start
    cur_v, cur_a = version_start, 0
    for i, (v, idx) in enumerate(version_segments or ()):
        if not (prev_idx < idx <= num_tokens) or v < prev_v:
            raise ValueError(
                f"version_segments[{i}]=({v}, {idx}) is invalid after (version {prev_v}, index {prev_idx}) for "
                f"{num_tokens} tokens starting at version {version_start}: first indices must increase within "
                f"[0, {num_tokens}] and versions must not decrease"
            )
        if idx > cur_a:
            runs.append((cur_v, cur_a, idx))
        cur_v, cur_a = v, idx
        prev_idx, prev_v = idx, v
    if num_tokens > cur_a:
        runs.append((cur_v, cur_a, num_tokens))
    return runs


def token_versions(
    num_tokens: int, version_start: int, version_segments: Sequence[tuple[int, int]] | None = None
) -> list[int]:
    """The policy version of each of ``num_tokens`` completion tokens (lenient form: see :func:`version_runs`).

    Raises:
        ValueError: as :func:`version_runs`.
    """
    out: list[int] = []
    for v, a, b in version_runs(num_tokens, version_start, version_segments):
        out += [v] * (b - a)
    return out


def token_versions_from_segments(segments: Sequence[tuple[int, int]], num_tokens: int) -> list[int]:
    """The version of every completion token, ``[num_tokens]`` ints, from canonical segments.

    Raises:
        ValueError: ``segments`` is not canonical (``check_segments``).
    """
    check_segments(segments, num_tokens)
    return token_versions(num_tokens, segments[0][0], segments)
