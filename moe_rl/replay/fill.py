"""Turn replayed rows with sentinels into the ids a router dispatches (sgl-project/sglang PR #36404), in torch.

Shape legend:
    T  tokens (flattened), K ids per token, E routed experts

Rows (see :mod:`moe_rl.replay.layout`):

- ids ``>= 0``: used as given (range-checked: an id ``>= E`` would index past the expert table);
- ``FILL_ROW`` (-1) everywhere: pad tokens and the never-forwarded last token. They still run through the
  experts (fixed shapes), so they must get in-range, distinct ids; a constant fill (0..K-1, or 0) sends every
  pad token to the first experts and the first EP rank (radixark/miles #2697: an OOM). The fill is spread by
  the pad ordinal ``p`` (0, 1, 2, ... over the fill rows in token order): ``ids[p, j] = (p*K + j) mod E``,
  distinct for ``K <= E`` and cycling through every expert, so each EP rank (a contiguous block of ``E/ep``
  experts) receives the same share up to one cycle. These positions must carry no loss.
- ``OWN_ROW`` (-2) everywhere: the trainer routes the token itself (``own_ids_TK``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from moe_rl.replay.layout import FILL_ROW, OWN_ROW

__all__ = ["fill_ids", "model_replay_ids", "resolve_replay_ids"]


def fill_ids(num_rows: int, top_k: int, num_experts: int, device: torch.device | str | None = None) -> Tensor:
    """``[num_rows, K]`` int64 spread fill ``(p*K + j) mod E`` for fill-row ordinals ``p = 0..num_rows-1``."""
    p = torch.arange(num_rows, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(top_k, device=device, dtype=torch.int64)[None, :]
    return (p * top_k + j) % num_experts


def resolve_replay_ids(
    replay_ids_TK: Tensor, num_experts: int, own_ids_TK: Tensor | None = None, *, validate: bool = True
) -> Tensor:
    """Replace sentinel rows of ``replay_ids_TK`` (``[T, K]``, any integer dtype) and return int64 ids.

    Args:
        replay_ids_TK: ``[T, K]`` replayed ids with ``FILL_ROW``/``OWN_ROW`` rows.
        num_experts: E.
        own_ids_TK: ``[T, K]`` the trainer's own selection, required when any row is ``OWN_ROW``.
        validate: check ranges and sentinel rows (one host sync); disable only for trusted inputs.

    Returns:
        ``[T, K]`` int64 ids, all in ``[0, E)``; fill rows distinct per row when ``K <= E``.

    Raises:
        TypeError: ``replay_ids_TK`` is a float, complex or bool tensor.
        ValueError: ``replay_ids_TK`` is not 2-D; (with ``validate``) an id ``>= E`` or ``< -2``, a row mixing
            sentinels and ids, or a non-sentinel row repeating an id; ``K > E`` with fill rows, or ``OWN_ROW``
            rows without ``own_ids_TK``.
    """
    if replay_ids_TK.dtype.is_floating_point or replay_ids_TK.dtype.is_complex or replay_ids_TK.dtype == torch.bool:
        raise TypeError(
            f"replay_ids_TK has dtype {replay_ids_TK.dtype}; expected an integer tensor of expert ids (a float "
            "tensor would be truncated silently, a bool tensor read as ids 0/1)"
        )
    if replay_ids_TK.dim() != 2:
        raise ValueError(f"replay_ids_TK has shape {tuple(replay_ids_TK.shape)}; expected [T, K]")
    ids = replay_ids_TK.to(torch.int64)
    num_tokens, top_k = ids.shape
    fill_rows = (ids == FILL_ROW).all(dim=1)
    own_rows = (ids == OWN_ROW).all(dim=1)
    if validate:
        real = ~(fill_rows | own_rows)
        bad = real[:, None] & ((ids < 0) | (ids >= num_experts))
        if bool(bad.any()):
            t, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"replayed expert id {int(ids[t, j])} at token {t}, slot {j} is outside [0, {num_experts}); a row "
                f"must be K ids in [0, E), all {FILL_ROW} (pad/placeholder) or all {OWN_ROW} (trainer routes it)"
            )
        if top_k > 1:
            # Vectorised: sort each row, equal neighbours are repeats; sentinel rows are excluded.
            srt = ids.sort(dim=1).values
            dup = real & (srt[:, 1:] == srt[:, :-1]).any(dim=1)
            if bool(dup.any()):
                t = int(dup.nonzero()[0, 0])
                raise ValueError(
                    f"replayed expert ids {ids[t].tolist()} at token {t} repeat an expert ({int(dup.sum())} such "
                    "row(s)); a token's K routed experts must be distinct (a repeat would give that expert two "
                    "gates); check the recorder / transport of routed_experts"
                )
    num_fill = int(fill_rows.sum())
    if num_fill:
        if top_k > num_experts:
            raise ValueError(f"cannot fill pad rows with {top_k} distinct ids from {num_experts} experts")
        ids = ids.clone()
        ids[fill_rows] = fill_ids(num_fill, top_k, num_experts, ids.device)
    if bool(own_rows.any()):
        if own_ids_TK is None:
            raise ValueError(f"{int(own_rows.sum())} rows are OWN_ROW ({OWN_ROW}) but own_ids_TK was not given")
        ids = torch.where(own_rows[:, None], own_ids_TK.to(torch.int64), ids)
    return ids.contiguous()  # dispatchers flatten the ids with .view(-1)


def model_replay_ids(routed_experts: Tensor, state: Tensor, moe_layers: list[bool]) -> list[Tensor | None]:
    """Per-decoder-layer replay input from a batch's transport tensors.

    Args:
        routed_experts: ``[B, S, M, K]`` uint8/int16 ids (``TrainingBatch.routed_experts``), one slice per MoE
            layer in decoder order.
        state: ``[B, S]`` int8 row state (0 replay, -1 fill, -2 own routing).
        moe_layers: per decoder layer, whether it is an MoE layer (``len = L``, ``sum = M``).

    Returns:
        ``L`` entries: ``[B, S, K]`` int64 rows with sentinels for MoE layers, None for dense layers (the
        ``replay_ids`` list form of ``GlmMoeForCausalLM``).

    Raises:
        TypeError: ``state`` is not an integer tensor.
        ValueError: ``M`` differs from the model's MoE layer count, ``state`` is not ``[B, S]`` (both shapes
            named), or ``state`` holds a value other than 0, -1, -2.
    """
    if routed_experts.dim() != 4 or tuple(state.shape) != tuple(routed_experts.shape[:2]):
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)} and its state {tuple(state.shape)}; expected "
            "[B, S, M, K] and [B, S]"
        )
    num_moe = sum(bool(m) for m in moe_layers)
    if routed_experts.shape[2] != num_moe:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)} ([B, S, M, K]) but the model has {num_moe} MoE "
            f"layers of {len(moe_layers)}; the engine and the trainer must serve the same architecture"
        )
    if state.dtype.is_floating_point or state.dtype.is_complex or state.dtype == torch.bool:
        raise TypeError(f"state has dtype {state.dtype}; expected an integer tensor (0 replay, -1 fill, -2 own)")
    sentinel = state.to(torch.int64)[..., None, None]
    bad_state = (sentinel != 0) & (sentinel != FILL_ROW) & (sentinel != OWN_ROW)
    if bool(bad_state.any()):
        b, s = (int(v) for v in bad_state[..., 0, 0].nonzero()[0])
        raise ValueError(
            f"state[{b}, {s}] = {int(sentinel[b, s, 0, 0])} is not a row state ({int(bad_state.sum())} bad "
            f"entries); allowed: 0 (replay), {FILL_ROW} (fill), {OWN_ROW} (trainer routes); the batch's "
            "routed_experts_state is corrupt or was not built by moe_rl.replay.layout"
        )
    rows = torch.where(sentinel != 0, sentinel, routed_experts.to(torch.int64))
    out: list[Tensor | None] = []
    j = 0
    for is_moe in moe_layers:
        if is_moe:
            out.append(rows[:, :, j])
            j += 1
        else:
            out.append(None)
    return out


@contextmanager
def installed_replay_ids(routers: Sequence[object], per_layer: Sequence[Tensor | None], attr: str) -> Iterator[None]:
    """Set ``router.<attr> = ids`` on each router (pairwise, in order) for the duration of the block; afterwards the
    instance attribute is removed again, so the router's class default (None: its own routing) is back, also when
    the block raises.

    Args:
        routers: the replay-capable routers, in model order.
        per_layer: one ids tensor (or None) per router; same length as ``routers``.
        attr: the routers' replay attribute (e.g. ``"replay_ids_TK"``).

    Raises:
        ValueError: ``per_layer`` and ``routers`` differ in length (``zip(strict=True)``).
    """
    try:
        for r, ids in zip(routers, per_layer, strict=True):
            setattr(r, attr, ids)
        yield
    finally:
        for r in routers:
            r.__dict__.pop(attr, None)
