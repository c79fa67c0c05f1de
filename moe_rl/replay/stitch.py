"""Assemble one sample's index record from engine outputs: the ``S-1`` contract and multi-turn deltas (prime-rl PR #1807).

Row ``t`` of a record is what the forward pass of the token at position ``t`` used. An engine forwards every
token except the last sampled one, so a request whose final sequence has ``n`` tokens yields rows for
positions ``[start, n-1)`` (vLLM ``routed_experts``: ``[seq_len-1, L, K]``; SGLang the same); row ``n-1``
is a placeholder (``-1``), never expert 0.

Multi-turn: turn ``j+1``'s prompt is the whole turn-``j`` sequence plus new tokens. The last token of turn
``j`` was sampled, never forwarded in turn ``j``, and is forwarded first thing in turn ``j+1``. So turn
``j+1``'s record must start at ``prev_len - 1`` (:func:`delta_start`, vLLM's ``routed_experts_prompt_start``)
and its first row fills turn ``j``'s placeholder. Appending turn ``j+1`` rows from ``prev_len`` on
(the bug in prime-rl PR #1807) leaves that row a placeholder and shifts nothing else; appending from ``prev_len`` while
the delta starts at ``prev_len-1`` shifts every later row by one. :func:`stitch_records` places rows by
their recorded ``start`` so neither can happen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_rl.replay.indices import TokenIndices

__all__ = ["StitchResult", "delta_start", "complete_engine_rows", "stitch_records"]


def delta_start(prefix_len: int) -> int:
    """First position an engine must return for a turn whose prompt repeats ``prefix_len`` known tokens.

    ``prefix_len - 1``: the previous turn's last (sampled, never forwarded) token. 0 for the first turn.

    Raises:
        ValueError: ``prefix_len`` < 0.
    """
    if prefix_len < 0:
        raise ValueError(f"delta_start: prefix_len={prefix_len} must be >= 0")
    return max(0, prefix_len - 1)


def complete_engine_rows(rows: TokenIndices, num_tokens: int) -> TokenIndices:
    """Append the placeholder row of the last (never forwarded) token to an engine record.

    Args:
        rows: the engine's rows for positions ``[rows.start, num_tokens - 1)``.
        num_tokens: the request's final sequence length (prompt + completion).

    Returns:
        A record covering ``[rows.start, num_tokens)``; the last row is a placeholder.

    Raises:
        ValueError: ``rows`` does not hold exactly ``num_tokens - 1 - start`` rows (names both shapes).
    """
    expected = num_tokens - 1 - rows.start
    if rows.num_tokens != expected:
        raise ValueError(
            f"complete_engine_rows: the engine record has shape {rows.shape} starting at position {rows.start}, "
            f"but a {num_tokens}-token sequence needs [{expected}, {rows.shape[1]}, {rows.shape[2]}] rows "
            "(every token from start except the last sampled one)"
        )
    _, layers, k = rows.shape
    ids = np.concatenate([rows.to_numpy(np.int64), np.full((1, layers, k), -1, dtype=np.int64)])
    return type(rows).from_array(ids, rows.num_ids, start=rows.start)


@dataclass(frozen=True)
class StitchResult:
    """Output of :func:`stitch_records`.

    Attributes:
        record: ``[num_tokens, L, K]`` record of the whole sample, ``start == 0``.
        conflicts: rows recorded by two records with different ids (the earlier one is kept: its routing
            produced the logprobs of the tokens sampled in its turn).
        missing_rows: placeholder rows other than the last token's; > 0 means the sample is incomplete.
    """

    record: TokenIndices
    conflicts: int
    missing_rows: int

    @property
    def complete(self) -> bool:
        return self.missing_rows == 0


def stitch_records(records: Sequence[TokenIndices], num_tokens: int) -> StitchResult:
    """Merge per-turn engine records (each placed at its own ``start``) into one ``[num_tokens, L, K]`` record.

    Rows of later records fill placeholder rows of earlier ones (turn ``j+1``'s first row fills turn
    ``j``'s last token); recorded rows are kept from the earliest record that has them.

    Args:
        records: engine records in turn order (all the same kind, ``L``, ``K`` and id space), each covering
            ``[start, start + S)``; they may overlap.
        num_tokens: the final sample's token count.

    Raises:
        ValueError: no records, mixed kinds or shapes, or a record reaching past ``num_tokens``.
    """
    if not records:
        raise ValueError("stitch_records: records=[] is empty; pass at least the first turn's record")
    first = records[0]
    _, layers, k = first.shape
    for r in records:
        if type(r) is not type(first) or r.shape[1:] != (layers, k) or r.num_ids != first.num_ids:
            raise ValueError(
                f"stitch_records: record {r!r} does not match the first record {first!r} (kind, [L, K], num_ids)"
            )
        if r.end > num_tokens:
            raise ValueError(
                f"stitch_records: record of shape {r.shape} at start {r.start} reaches position {r.end} but the "
                f"sample has only {num_tokens} tokens"
            )
    out = np.full((num_tokens, layers, k), -1, dtype=np.int64)
    have = np.zeros(num_tokens, dtype=bool)
    conflicts = 0
    for r in records:
        ids = r.to_numpy(np.int64)
        pos = np.arange(r.start, r.end)
        valid = r.row_valid
        new = valid & ~have[pos]
        both = valid & have[pos]
        if both.any():
            conflicts += int((out[pos[both]] != ids[both]).reshape(int(both.sum()), -1).any(axis=1).sum())
        out[pos[new]] = ids[new]
        have[pos[new]] = True
    missing = int((~have[: max(0, num_tokens - 1)]).sum())
    record = type(first).from_array(out, first.num_ids)
    return StitchResult(record, conflicts, missing)
