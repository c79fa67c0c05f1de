"""Sequence sharding layouts for context parallelism: contiguous and zigzag (head-tail), with padding.

Shape legend:
    T    real tokens of the packed stream (``cu_seqlens[-1]``)
    Tp   padded length (a multiple of ``cp`` for contiguous, of ``2 * cp`` for zigzag)
    Tl   tokens per rank, ``Tp / cp``
    cp   context-parallel ranks

Layouts (rank r of cp)::

    contiguous: rank r holds token indices [r*Tl, (r+1)*Tl)
    zigzag    : the stream is cut into 2*cp equal chunks c_0..c_{2cp-1}; rank r holds c_r then c_{2cp-1-r}
                cp=2, Tp=8:  rank0 = [0 1 | 6 7]   rank1 = [2 3 | 4 5]
                Under a causal mask every rank then does the same attention work (ring-flash-attention
                ``zigzag``, Megatron CP, PyTorch ``_HeadTailLoadBalancer``).

Lengths that are not a multiple (jzhang38/EasyContext issue #47: 2999 tokens at cp=4 needs 8 equal chunks): with ``pad=True`` (default)
the stream is padded at the end to ``Tp`` (3000; 7 tokens -> 8). Padding tokens get token indices
``>= cu_seqlens[-1]``, which :func:`moe_rl.attention.core.key_windows` turns into empty key windows: they attend
to nothing (output 0), nothing attends to them, and :meth:`ShardPlan.valid` marks them for the loss mask.
With ``pad=False`` :func:`make_shard_plan` raises ``ValueError`` — before any communication, since every rank
computes the same plan from the same length. :meth:`ShardPlan.unshard` inverts :meth:`ShardPlan.shard` exactly
(the padding is dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Layout", "ShardPlan", "make_shard_plan"]

Layout = Literal["contiguous", "zigzag"]


@dataclass(frozen=True)
class ShardPlan:
    """Which token indices each CP rank holds. Build with :func:`make_shard_plan`.

    Attributes:
        layout: ``"contiguous"`` or ``"zigzag"``.
        cp: number of ranks.
        total_len: real tokens T.
        padded_len: Tp >= T.
        token_idx: ``[cp, Tl]`` int64, the token indices of rank r's rows, in order.
    """

    layout: Layout
    cp: int
    total_len: int
    padded_len: int
    token_idx: Tensor

    @property
    def local_len(self) -> int:
        """Tl = Tp / cp tokens per rank."""
        return self.padded_len // self.cp

    @property
    def num_pad(self) -> int:
        """Padding tokens added at the end of the stream."""
        return self.padded_len - self.total_len

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank={rank} is outside [0, cp={self.cp})")

    def local_token_idx(self, rank: int, device: torch.device | None = None) -> Tensor:
        """``[Tl]`` int64 token indices held by ``rank``."""
        self._check_rank(rank)
        return self.token_idx[rank].to(device) if device is not None else self.token_idx[rank]

    def valid(self, rank: int) -> Tensor:
        """``[Tl]`` bool: True for real tokens, False for padding (use it in the loss mask)."""
        return self.local_token_idx(rank) < self.total_len

    def shard(self, x: Tensor, rank: int, dim: int = 0, pad_value: float = 0.0) -> Tensor:
        """Rank ``rank``'s rows of the global tensor ``x`` (``T`` rows along ``dim``; padding filled with
        ``pad_value``). Returns ``Tl`` rows along ``dim``."""
        self._check_rank(rank)
        if x.shape[dim] != self.total_len:
            raise ValueError(f"x has {x.shape[dim]} rows along dim {dim}; this plan shards total_len={self.total_len}")
        if self.num_pad:
            pad_shape = list(x.shape)
            pad_shape[dim] = self.num_pad
            x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
        return x.index_select(dim, self.token_idx[rank].to(x.device))

    def unshard(self, parts: Sequence[Tensor] | Tensor, dim: int = 0) -> Tensor:
        """Inverse of :meth:`shard`: ``unshard([shard(x, r) for r in range(cp)]) == x``.

        Args:
            parts: every rank's ``Tl`` rows in rank order, as one of: a list of ``cp`` tensors; their
                concatenation along ``dim`` (``cp*Tl`` rows, e.g. ``all_gather_into_tensor``); or their
                ``torch.stack`` (a rank axis of size ``cp`` at ``dim`` followed by ``Tl`` rows). When a tensor
                fits both readings (``Tl == 1``), the concatenation wins.
            dim: the row axis of each shard.

        Returns:
            the ``T`` real rows along ``dim`` in stream order (padding dropped).

        Raises:
            ValueError: a list with a number of shards other than ``cp``, or a tensor of neither shape.
        """
        if isinstance(parts, Tensor):
            full = parts
            d = dim % max(full.dim(), 1)
            if (
                full.shape[d] != self.padded_len
                and full.shape[d] == self.cp
                and d + 1 < full.dim()
                and full.shape[d + 1] == self.local_len
            ):
                full = full.flatten(d, d + 1)  # stacked [.., cp, Tl, ..] -> concatenated [.., cp*Tl, ..]
            dim = d  # the row axis of the (flattened) tensor, counted from the front
            if full.shape[d] != self.padded_len:
                raise ValueError(
                    f"unshard got a tensor of shape {tuple(parts.shape)} with {parts.shape[d]} rows along dim {dim}; "
                    f"expected cp*Tl = {self.cp}*{self.local_len} = {self.padded_len} rows (the shards concatenated "
                    f"along dim) or a stacked [cp={self.cp}, Tl={self.local_len}] at dim; or pass a list of the cp "
                    "shards: unshard([plan.shard(x, r) for r in range(cp)])"
                )
        else:
            parts = list(parts)
            if len(parts) != self.cp:
                raise ValueError(
                    f"unshard got a list of {len(parts)} shards; pass one per rank (cp={self.cp}) in rank order: "
                    "unshard([plan.shard(x, r) for r in range(cp)])"
                )
            full = torch.cat(parts, dim=dim)
            if full.shape[dim] != self.padded_len:
                raise ValueError(
                    f"unshard got {full.shape[dim]} rows along dim {dim} from {self.cp} shards; expected "
                    f"cp*Tl={self.padded_len} (each shard is plan.shard(x, rank) with Tl={self.local_len} rows)"
                )
        inv = torch.empty(self.padded_len, dtype=torch.int64)
        inv[self.token_idx.reshape(-1)] = torch.arange(self.padded_len)
        return full.index_select(dim, inv[: self.total_len].to(full.device))


def make_shard_plan(total_len: int, cp: int, layout: Layout = "zigzag", *, pad: bool = True) -> ShardPlan:
    """Build the sharding of a packed stream of ``total_len`` tokens over ``cp`` ranks.

    Args:
        total_len: T >= 1 (``cu_seqlens[-1]``).
        cp: ranks >= 1.
        layout: ``"zigzag"`` (causal load balance, needs 2*cp chunks) or ``"contiguous"``.
        pad: pad the stream end to the next multiple (documented masking); False raises instead.

    Returns:
        :class:`ShardPlan`.

    Raises:
        ValueError: bad ``cp`` / ``total_len`` / ``layout``, or ``pad=False`` with a length that is not a
            multiple of ``2*cp`` (zigzag) or ``cp`` (contiguous) (jzhang38/EasyContext issue #47).
    """
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an int >= 1, got {cp!r}")
    if not isinstance(total_len, int) or total_len < 1:
        raise ValueError(f"total_len must be an int >= 1, got {total_len!r}")
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout={layout!r} is not supported; use 'contiguous' or 'zigzag'")
    multiple = 2 * cp if layout == "zigzag" else cp
    padded = -(-total_len // multiple) * multiple
    if padded != total_len and not pad:
        raise ValueError(
            f"sequence length {total_len} must be a multiple of {'2*cp' if layout == 'zigzag' else 'cp'}={multiple} "
            f"for layout={layout!r}; pad it to {padded} (make_shard_plan(..., pad=True) masks the padding) or "
            "choose another length"
        )
    Tl = padded // cp
    ar = torch.arange(padded, dtype=torch.int64)
    if layout == "contiguous":
        idx = ar.view(cp, Tl)
    else:
        chunks = ar.view(2 * cp, Tl // 2)
        idx = torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])
    return ShardPlan(layout=layout, cp=cp, total_len=total_len, padded_len=padded, token_idx=idx.contiguous())
