"""Sampling-mask replay: the engine's top-k / top-p kept-token set per sampled token, and the trainer's log-probs
over that same truncated distribution.

Shape legend:
    T  sampled tokens of one completion
    V  vocabulary
    N  token ids listed by one record (all positions together)
    B  batch rows, L padded row length (L-1 predicted positions), W widest listed set of the batch

Why: with ``top_k`` / ``top_p`` the engine samples from ``softmax(logits / T)`` restricted to a kept set and
renormalised over it, and reports that distribution's log-prob (vLLM ``logprobs_mode = processed_logprobs``). A
trainer that recomputes ``log_softmax(logits / T)`` over the whole vocabulary is off by ``log(mass of the kept
set)`` on every token, which ``mismatch_kl`` and every importance ratio see as a policy mismatch. Replaying the
engine's kept set (the sampler counterpart of router replay) makes the two distributions the same one.

What is recorded (exact, never re-derived): the kept set of each sampled position as the engine's sampler
applied it, i.e. the finite entries of the logits after vLLM's ``apply_top_k_top_p`` on the temperature-scaled
logits the sampler saw. Each position is one of three kinds:

- :data:`FULL` (0): every token is kept (no top-k / top-p at this position); nothing is listed.
- :data:`KEEP` (1): the listed ids are the kept set (used when at most half the vocabulary is kept).
- :data:`DROP` (-1): the listed ids are the *dropped* set (more than half kept); the complement is kept.

So a record never lists more than ``V / 2`` ids per position. Why ids and not a count: a count (``k`` tokens
with the largest logits) or a threshold only reproduces the set when the trainer ranks the tokens exactly as the
engine did; near the boundary of the set the two forwards differ by rounding (another kernel, another batch
shape), so a count can select a different set. For top-k a count would also be ambiguous under ties: vLLM keeps
every token whose logit equals the k-th largest (``logits < kth`` are dropped), so a tie at the threshold keeps
more than ``k`` tokens. The ids are what the engine sampled from, under any ranking and any tie.

The trainer's side, :func:`masked_logprobs`, follows vLLM's order of operations (``logits / T``, dropped entries
set to ``-inf``, ``log_softmax``), which equals ``log_softmax(logits / T)`` renormalised over the kept set:
``lp_i - logsumexp_{j kept} lp_j``. Gradients flow only through kept entries (the ``-inf`` fill has zero
gradient).

Source: the design follows router replay (R3) and prime-rl's replay of the sampler's top-k / top-p mask;
vLLM 0.32 ``vllm/v1/sample/ops/topk_topp_sampler.py`` (``apply_top_k_top_p_pytorch``, ``apply_top_k_only``) for
the engine's rule.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DROP", "FULL", "KEEP", "SamplingMask", "batch_mask_tensors", "dense_keep", "encode_kept", "encode_row",
           "from_rows", "masked_logprobs"]

FULL = 0
"""Every token kept; no ids listed."""
KEEP = 1
"""The listed ids are the kept set."""
DROP = -1
"""The listed ids are the dropped set (the complement is kept)."""


@dataclass(frozen=True)
class SamplingMask:
    """The kept-token sets of ``T`` consecutive sampled positions (one completion), CSR-encoded.

    Attributes:
        vocab_size: V (ids are in ``[0, V)``).
        kind: ``[T]`` int8, :data:`FULL` / :data:`KEEP` / :data:`DROP` per position.
        offsets: ``[T + 1]`` int64, position ``t`` lists ``ids[offsets[t]:offsets[t + 1]]`` (empty for FULL).
        ids: ``[N]`` int32, each position's listed ids, ascending.

    Build with :func:`encode_kept`; move with :meth:`to_wire` / :meth:`from_wire` (JSON-safe).
    """

    vocab_size: int
    kind: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray

    def __post_init__(self) -> None:
        v, kind, off, ids = self.vocab_size, self.kind, self.offsets, self.ids
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"SamplingMask: vocab_size={v!r} must be an int >= 1")
        if kind.ndim != 1 or off.shape != (kind.shape[0] + 1,) or ids.ndim != 1:
            raise ValueError(f"SamplingMask: kind {kind.shape}, offsets {off.shape}, ids {ids.shape} must be [T], "
                             "[T + 1], [N]")
        if off.shape[0] and (off[0] != 0 or off[-1] != ids.shape[0] or (np.diff(off) < 0).any()):
            raise ValueError("SamplingMask: offsets must start at 0, be non-decreasing and end at len(ids)")
        if not np.isin(kind, (FULL, KEEP, DROP)).all():
            raise ValueError(f"SamplingMask: kind holds {sorted(set(kind.tolist()) - {FULL, KEEP, DROP})}; allowed "
                             "are 0 (FULL), 1 (KEEP), -1 (DROP)")
        if ids.shape[0] and (ids.min() < 0 or ids.max() >= v):
            raise ValueError(f"SamplingMask: ids must lie in [0, vocab_size={v}); got [{ids.min()}, {ids.max()}]")
        counts = np.diff(off)
        if ((kind == FULL) & (counts != 0)).any() or ((kind == KEEP) & (counts == 0)).any() or (
                (kind == DROP) & (counts >= v)).any():
            raise ValueError("SamplingMask: a FULL position lists ids, or a KEEP / DROP position keeps no token")

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def kept_counts(self) -> np.ndarray:
        """``[T]`` int64 size of each position's kept set."""
        counts = np.diff(self.offsets)
        return np.where(self.kind == FULL, self.vocab_size, np.where(self.kind == KEEP, counts,
                                                                     self.vocab_size - counts)).astype(np.int64)

    def to_dense(self) -> np.ndarray:
        """``[T, V]`` bool, True where the token is kept."""
        t = len(self)
        out = np.zeros((t, self.vocab_size), dtype=bool)
        rows = np.repeat(np.arange(t), np.diff(self.offsets))
        out[rows, self.ids] = True
        flip = self.kind != KEEP  # FULL (nothing listed) and DROP: the complement of the listed ids
        out[flip] = ~out[flip]
        return out

    def contains(self, token_ids: Any) -> np.ndarray:
        """``[T]`` bool: whether ``token_ids[t]`` (``[T]`` ints) is in position ``t``'s kept set.

        Raises:
            ValueError: ``token_ids`` does not have one id per position.
        """
        tok = np.asarray(token_ids, dtype=np.int64)
        if tok.shape != (len(self),):
            raise ValueError(f"SamplingMask.contains: token_ids has shape {tok.shape}; pass one id per position "
                             f"({len(self)})")
        listed = np.zeros(len(self), dtype=bool)
        for t in np.nonzero(self.kind != FULL)[0]:
            seg = self.ids[self.offsets[t]:self.offsets[t + 1]]
            i = np.searchsorted(seg, tok[t])
            listed[t] = i < seg.shape[0] and seg[i] == tok[t]
        return np.where(self.kind == KEEP, listed, ~listed)

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe dict (base64 little-endian arrays): ``{"vocab_size", "kind", "offsets", "ids"}``."""
        def b64(a: np.ndarray, dt: str) -> str:
            return base64.b64encode(np.ascontiguousarray(a, dtype=dt).tobytes()).decode("ascii")

        return {"vocab_size": int(self.vocab_size), "kind": b64(self.kind, "<i1"),
                "offsets": b64(self.offsets, "<i8"), "ids": b64(self.ids, "<i4")}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> SamplingMask:
        """Inverse of :meth:`to_wire` (validated).

        Raises:
            ValueError: a missing field or inconsistent arrays.
        """
        try:
            def arr(name: str, dt: str) -> np.ndarray:
                return np.frombuffer(base64.b64decode(wire[name]), dtype=dt).astype(dt[1:])

            return cls(int(wire["vocab_size"]), arr("kind", "<i1"), arr("offsets", "<i8"), arr("ids", "<i4"))
        except KeyError as exc:
            raise ValueError(f"SamplingMask.from_wire: missing field {exc}; expected vocab_size, kind, offsets, "
                             "ids") from None


def encode_row(kept_row: np.ndarray) -> tuple[int, np.ndarray]:
    """One position's ``(kind, listed ids int32)`` from its ``[V]`` kept flags (the rule of :func:`encode_kept`).

    Raises:
        ValueError: no token is kept.
    """
    v = int(kept_row.shape[0])
    n = int(kept_row.sum())
    if n == 0:
        raise ValueError("encode_row: the position keeps no token; a sampler always keeps at least one")
    if n == v:
        return FULL, np.zeros(0, dtype=np.int32)
    if n <= v // 2:
        return KEEP, np.flatnonzero(kept_row).astype(np.int32)
    return DROP, np.flatnonzero(~kept_row).astype(np.int32)


def from_rows(vocab_size: int, rows: list[tuple[int, np.ndarray]]) -> SamplingMask:
    """A :class:`SamplingMask` from per-position ``(kind, listed ids)`` pairs (:func:`encode_row`), in order.

    Raises:
        ValueError: as :class:`SamplingMask` (an id out of range, an empty kept set).
    """
    kind = np.array([k for k, _ in rows], dtype=np.int8)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([ids.shape[0] for _, ids in rows], out=offsets[1:])
    ids = np.concatenate([ids for _, ids in rows]).astype(np.int32) if rows else np.zeros(0, dtype=np.int32)
    return SamplingMask(int(vocab_size), kind, offsets, ids)


def encode_kept(kept: Any) -> SamplingMask:
    """Encode ``[T, V]`` kept flags (bool; numpy or torch) as a :class:`SamplingMask` (the compact kinds of the
    module docstring: FULL when all kept, KEEP when at most ``V // 2`` are kept, DROP otherwise).

    Raises:
        ValueError: ``kept`` is not 2-D, or some position keeps no token (a sampler always keeps at least one).
    """
    k = kept.numpy() if hasattr(kept, "numpy") else np.asarray(kept)
    k = k.astype(bool, copy=False)
    if k.ndim != 2 or k.shape[1] < 1:
        raise ValueError(f"encode_kept: kept has shape {k.shape}; pass [T, V] bool flags")
    t, v = k.shape
    n = k.sum(axis=1)
    if (n == 0).any():
        raise ValueError(f"encode_kept: position {int(np.argmin(n))} keeps no token; every sampled position keeps "
                         "at least one (the sampled one)")
    kind = np.where(n == v, FULL, np.where(n <= v // 2, KEEP, DROP)).astype(np.int8)
    listed = np.where((kind == KEEP)[:, None], k, ~k) & (kind != FULL)[:, None]  # [T, V]
    rows, cols = np.nonzero(listed)  # row-major: ascending ids within each row
    offsets = np.zeros(t + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=t), out=offsets[1:])
    return SamplingMask(v, kind, offsets, cols.astype(np.int32))


def batch_mask_tensors(masks: list[SamplingMask | None], starts: list[int], length: int) -> dict[str, Any]:
    """The batch fields ``sampling_mask_ids`` / ``sampling_mask_kind`` (``moe_rl.rl.batch.TrainingBatch``).

    Args:
        masks: one per row: its completion's record (position ``j`` = completion token ``j``), or None (no record:
            the row's positions are FULL, the whole vocabulary).
        starts: per row, the predicted position of completion token 0 (``prompt_len - 1``).
        length: L, the padded row length (L-1 predicted positions).

    Returns:
        ``{}`` when no row has a record, else ``{"sampling_mask_ids": [B, L-1, W] int32 (ids, -1 padding),
        "sampling_mask_kind": [B, L-1] int8}`` (torch tensors; FULL wherever nothing is recorded).

    Raises:
        ValueError: the records disagree on ``vocab_size``, or a record runs past ``L - 1``.
    """
    import torch

    if not any(m is not None for m in masks):
        return {}
    vocab = {m.vocab_size for m in masks if m is not None}
    if len(vocab) != 1:
        raise ValueError(f"batch_mask_tensors: records have vocab sizes {sorted(vocab)}; one model, one vocabulary")
    b = len(masks)
    width = max([int(np.diff(m.offsets).max(initial=0)) for m in masks if m is not None] + [1])
    ids = np.full((b, length - 1, width), -1, dtype=np.int32)
    kind = np.zeros((b, length - 1), dtype=np.int8)
    for i, (m, s) in enumerate(zip(masks, starts, strict=True)):
        if m is None:
            continue
        t = len(m)
        if s < 0 or s + t > length - 1:
            raise ValueError(f"batch_mask_tensors: row {i}'s record of {t} positions from {s} runs past the "
                             f"{length - 1} predicted positions")
        kind[i, s:s + t] = m.kind
        counts = np.diff(m.offsets)
        rows = np.repeat(np.arange(t), counts)
        cols = np.arange(m.ids.shape[0]) - m.offsets[rows]
        ids[i, s + rows, cols] = m.ids
    return {"sampling_mask_ids": torch.from_numpy(ids), "sampling_mask_kind": torch.from_numpy(kind)}


def dense_keep(ids: Any, kind: Any, vocab_size: int) -> Any:
    """``[..., V]`` bool kept flags from the batch fields (torch).

    Args:
        ids: ``[..., W]`` int32/int64 listed ids, -1 padding.
        kind: ``[...]`` int8, FULL / KEEP / DROP.
        vocab_size: V.

    Returns:
        ``[..., V]`` bool on ``ids``' device: KEEP -> the listed ids, DROP -> all but the listed ids, FULL -> all
        (whatever ids are listed: a caller may turn a position FULL by its kind alone).

    Raises:
        ValueError: shapes disagree, or an id is >= ``vocab_size``.
    """
    import torch

    if ids.shape[:-1] != kind.shape:
        raise ValueError(f"dense_keep: ids {tuple(ids.shape)} and kind {tuple(kind.shape)} must share the leading "
                         "dims ([..., W] and [...])")
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"dense_keep: id {int(ids.max())} >= vocab_size={vocab_size}; the records come from "
                         "another vocabulary")
    listed = torch.zeros((*kind.shape, vocab_size + 1), dtype=torch.bool, device=ids.device)
    idx = torch.where(ids < 0, vocab_size, ids).long()  # padding goes to a spare column
    listed.scatter_(-1, idx, True)
    listed = listed[..., :vocab_size]
    keep = torch.where((kind == KEEP)[..., None], listed, ~listed)
    return keep | (kind == FULL)[..., None]  # FULL keeps everything whatever is listed


def masked_logprobs(logits: Any, labels: Any, temperature: Any, keep: Any | None) -> Any:
    """``log_softmax(logits / temperature)`` renormalised over the kept set, at ``labels``.

    Args:
        logits: ``[..., S, V]`` float (any float dtype; computed in float32).
        labels: ``[..., S]`` int64 token ids.
        temperature: a float, or a tensor broadcasting against ``[..., S]`` (per row ``[B, 1]``, per token).
        keep: ``[..., S, V]`` bool kept flags (:func:`dense_keep`) or None (the whole vocabulary: plain
            ``log_softmax``).

    Returns:
        ``[..., S]`` float32 ``z_y - logsumexp_{j kept} z_j`` with ``z = logits / temperature`` (vLLM's order:
        scale, drop to ``-inf``, ``log_softmax``). ``-inf`` where the label is not kept. Gradients reach only kept
        logits.

    Raises:
        ValueError: ``keep``'s shape differs from ``logits``'.
    """
    import torch
    import torch.nn.functional as F

    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float()[..., None]
    z = logits.float() / temperature
    if keep is not None:
        if keep.shape != z.shape:
            raise ValueError(f"masked_logprobs: keep {tuple(keep.shape)} must have logits' shape {tuple(z.shape)}")
        z = z.masked_fill(~keep, float("-inf"))
    return F.log_softmax(z, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
