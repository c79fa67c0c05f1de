"""Place per-sample index records into the training batch layout, one row per token, whatever the layout.

Shape legend:
    B  samples in the batch
    P  padded sequence length (batch-first layout)
    T  total tokens of a packed (sequence-first) layout, padding included
    L  layers, K ids per layer

Row semantics in the batch (int64 after :func:`decode_rows`):

- ``>= 0``: replay these ids;
- ``FILL_ROW`` (-1): no forward pass needs this routing to be right (pad tokens, a sample's last token,
  whose output predicts nothing): the router fills the row with in-range, distinct ids spread over the
  experts (:func:`moe_rl.replay.fill.resolve_replay_ids`; sgl-project/sglang PR #36404). These positions carry no loss.
- ``OWN_ROW`` (-2): no engine routing for this token (the sample has no record, or an incomplete one): the
  trainer routes it itself. A sample is never replayed partially: one missing row in the middle of a sample
  marks the whole sample ``OWN_ROW``, and :class:`LayoutStats` counts it.

Layouts: ``batch_first`` ``[B, P, L, K]`` (right padding, as ``moe_rl.rl.batch.TrainingBatch``) and
``packed`` ``[T, L, K]`` (samples concatenated in order, then padding; the flat token order of a packed
sequence-first batch, and the order a CP shard slices like ``input_ids``).

Transport (safetensors has no sentinel-friendly uint8): :func:`encode_rows` splits the int64 rows into ids
in the storage dtype (``uint8`` up to 256 experts, ``int16`` above) plus an ``int8`` row state ``[..]``
(0 replay, -1 fill, -2 own); :func:`decode_rows` inverts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moe_rl.replay.indices import TokenIndices, storage_dtype

__all__ = [
    "FILL_ROW",
    "OWN_ROW",
    "LayoutStats",
    "batch_rows",
    "batch_transport",
    "decode_rows",
    "encode_rows",
]

FILL_ROW = -1
OWN_ROW = -2


@dataclass(frozen=True)
class LayoutStats:
    """Counts from :func:`batch_rows`: samples replayed, samples routed by the trainer (no record / incomplete)."""

    replayed_samples: int
    no_record_samples: int
    incomplete_samples: int


def _sample_rows(rec: TokenIndices | None, length: int, layers: int, k: int, i: int) -> tuple[np.ndarray, str]:
    if rec is None:
        return np.full((length, layers, k), OWN_ROW, dtype=np.int64), "none"
    if rec.start != 0 or rec.num_tokens != length or rec.shape[1:] != (layers, k):
        raise ValueError(
            f"sample {i}: its record has shape {rec.shape} (start {rec.start}) but the batch holds {length} tokens "
            f"for it with [L, K] = [{layers}, {k}]; expected a record of shape ({length}, {layers}, {k}) starting "
            "at 0 (stitch multi-turn records first and append the last token's placeholder)"
        )
    rows = rec.to_numpy(np.int64)
    missing = ~rec.row_valid[: max(0, length - 1)]
    if missing.any():
        return np.full((length, layers, k), OWN_ROW, dtype=np.int64), "incomplete"
    return rows, "ok"  # the last row stays -1 (FILL_ROW) when it is a placeholder


def batch_rows(
    records: Sequence[TokenIndices | None],
    lengths: Sequence[int],
    *,
    num_layers: int,
    k: int,
    layout: Literal["batch_first", "packed"] = "batch_first",
    pad_to: int | None = None,
) -> tuple[np.ndarray, LayoutStats]:
    """Rows of every token of a batch, int64 with ``FILL_ROW``/``OWN_ROW`` sentinels.

    Args:
        records: one record per sample (``None``: the engine returned no routing for it), each
            ``[lengths[i], L, K]`` from position 0.
        lengths: tokens of each sample in the batch (prompt + completion).
        num_layers: L (layers of every record).
        k: K (ids per layer).
        layout: ``"batch_first"`` -> ``[B, P, L, K]`` with ``P = pad_to or max(lengths)``;
            ``"packed"`` -> ``[T, L, K]`` with ``T = pad_to or sum(lengths)``, sample ``i`` at offset
            ``sum(lengths[:i])``.
        pad_to: padded length (P or T); must be at least the natural one.

    Returns:
        ``(rows, stats)``; pad positions are ``FILL_ROW``.

    Raises:
        ValueError: ``records``/``lengths`` lengths differ, a record does not match its sample (both shapes
            named), or ``pad_to`` is too small.
    """
    if len(records) != len(lengths):
        raise ValueError(f"batch_rows: {len(records)} records for {len(lengths)} samples; pass one per sample")
    counts = {"ok": 0, "none": 0, "incomplete": 0}
    per_sample = []
    for i, (rec, n) in enumerate(zip(records, lengths, strict=True)):
        rows, status = _sample_rows(rec, int(n), num_layers, k, i)
        counts[status] += 1
        per_sample.append(rows)
    stats = LayoutStats(counts["ok"], counts["none"], counts["incomplete"])
    if layout == "batch_first":
        natural = max(lengths) if lengths else 0
        width = natural if pad_to is None else pad_to
        if width < natural:
            raise ValueError(f"batch_rows: pad_to={pad_to} is shorter than the longest sample ({natural} tokens)")
        out = np.full((len(lengths), width, num_layers, k), FILL_ROW, dtype=np.int64)
        for i, rows in enumerate(per_sample):
            out[i, : rows.shape[0]] = rows
        return out, stats
    if layout == "packed":
        natural = int(sum(lengths))
        total = natural if pad_to is None else pad_to
        if total < natural:
            raise ValueError(f"batch_rows: pad_to={pad_to} is shorter than the packed samples ({natural} tokens)")
        out = np.full((total, num_layers, k), FILL_ROW, dtype=np.int64)
        off = 0
        for rows in per_sample:
            out[off : off + rows.shape[0]] = rows
            off += rows.shape[0]
        return out, stats
    raise ValueError(f"batch_rows: layout={layout!r} is not supported; use 'batch_first' or 'packed'")


def encode_rows(rows: np.ndarray, num_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """Split int64 rows ``[..., L, K]`` into ``(ids in the storage dtype, int8 row state [...])`` for transport.

    Raises:
        ValueError: a row mixes sentinels and ids, or an id is outside ``[0, num_ids)``.
    """
    flat = rows.reshape(-1, rows.shape[-2] * rows.shape[-1])
    state = np.zeros(flat.shape[0], dtype=np.int8)
    for sentinel in (FILL_ROW, OWN_ROW):
        state[(flat == sentinel).all(axis=1)] = sentinel
    real = state == 0
    if ((flat[real] < 0) | (flat[real] >= num_ids)).any():
        raise ValueError(
            f"encode_rows: a row holds an id outside [0, {num_ids}) or mixes sentinels with ids; rows must be all "
            "ids, all FILL_ROW (-1) or all OWN_ROW (-2)"
        )
    ids = np.where(real[:, None], flat, 0).astype(storage_dtype(num_ids)).reshape(rows.shape)
    return ids, state.reshape(rows.shape[:-2])


def decode_rows(ids: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_rows`: int64 rows with sentinels.

    Raises:
        ValueError: ``state`` is not ``ids``'s leading shape.
    """
    if tuple(state.shape) != tuple(ids.shape[:-2]):
        raise ValueError(
            f"decode_rows: row state has shape {tuple(state.shape)} but ids has shape {tuple(ids.shape)}; the state "
            "must be the ids' leading shape (one entry per token)"
        )
    out = ids.astype(np.int64)
    sent = state.astype(np.int64)[..., None, None]
    return np.where(sent != 0, sent, out)


def batch_transport(
    records: Sequence[TokenIndices | None], lengths: Sequence[int], pad_to: int
) -> tuple[np.ndarray, np.ndarray, LayoutStats] | None:
    """Batch-first transport arrays for the training batch, or None when no sample has a record.

    The layer/top-k/id-space shape is taken from the first record; samples without one route themselves.

    Returns:
        ``(ids [B, pad_to, L, K] storage dtype, state [B, pad_to] int8, stats)``.
    """
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    _, layers, k = first.shape
    rows, stats = batch_rows(records, lengths, num_layers=layers, k=k, layout="batch_first", pad_to=pad_to)
    ids, state = encode_rows(rows, first.num_ids)
    return ids, state, stats
