"""Per-token, per-layer index records (routed experts, DSA indexer top-k) and their pickle-free codec.

Shape legend:
    S  tokens of one sample (rows)
    L  layers the record covers (decoder layers for routed experts, indexer layers for DSA)
    K  indices per token per layer (top_k experts, or index_topk keys)
    N  id space: experts E for routing, keys (max sequence length) for DSA

One record holds ``ids [S, L, K]``: for every token (row) and layer, the K ids the inference engine used.
Two kinds share the container:

- :class:`RoutedExperts` (router replay, R3; Ma et al., arXiv 2510.11370; vLLM ``routed_experts``): a row
  is either fully recorded or a **placeholder** (``-1`` everywhere): the last sampled token, which the
  engine never forwards (vLLM returns ``S-1`` rows, prime-rl PR #1807), and rows the recorder could not recover.
  Within a recorded row, the ids are in ``[0, E)`` and distinct.
- :class:`DsaIndices` (DSA index replay; DeepSeek-V3.2 sparse attention, arXiv 2512.02556): the indexer's
  ``index_topk`` selected key positions per query token and indexer layer. A recorded row may hold ``-1``
  in its tail slots (query ``i`` sees only ``i+1`` keys, so ``min(index_topk, i+1)`` slots are valid),
  so ``-1`` is a per-entry value here.

Storage dtype (:func:`storage_dtype`): the smallest integer dtype that holds every id: ``uint8`` up to 256
experts, ``int16`` up to 32768 ids, else ``int32``. Kinds with per-entry ``-1`` use a signed dtype
(``int16``/``int32``). Placeholder rows are kept in a separate ``[S]`` bool mask, so ``uint8`` works for
E = 256 (no id value is free for a sentinel).

Wire format (:meth:`TokenIndices.to_bytes`, little-endian, no pickle)::

    offset size  field
    0      4     magic b"MRIX"
    4      1     format version (1)
    5      1     kind     (0 routed_experts, 1 dsa_indices)
    6      1     encoding (0 raw array, 1 bit-packed)
    7      1     storage dtype code (0 uint8, 1 int16, 2 int32)
    8      4     S   (uint32)
    12     4     L   (uint32)
    16     4     K   (uint32)
    20     4     N   (uint32; id space)
    24     4     start (uint32; position of row 0 in the sample)
    28     4     bits per id (uint32; 0 for raw)
    32     ...   row mask: ceil(S/8) bytes, np.packbits(row_valid, bitorder="little")
    ...    ...   payload: raw ``ids`` bytes (C order) or the bit-packed ids

Bit-packed encoding: every id of every row is written with ``b = ceil(log2(N))`` bits (``ceil(log2(N+1))``
for kinds with per-entry ``-1``, which store ``id + 1``), little-endian bit order, so a token costs
``ceil(L*K*b/8)``-ish bytes instead of ``L*K*itemsize`` (:meth:`TokenIndices.nbytes_per_token`).
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "DsaIndices",
    "RoutedExperts",
    "TokenIndices",
    "bits_per_id",
    "storage_dtype",
]

MAGIC = b"MRIX"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIIIIII")
_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.uint8), np.dtype("<i2"), np.dtype("<i4"))
_KINDS: dict[int, type[TokenIndices]] = {}


def storage_dtype(num_ids: int, *, entry_sentinel: bool = False) -> np.dtype:
    """Smallest integer dtype for ids in ``[0, num_ids)`` (plus ``-1`` when ``entry_sentinel``).

    Args:
        num_ids: size N of the id space (experts E, or keys).
        entry_sentinel: ids may be ``-1`` per entry (DSA), which needs a signed dtype.

    Returns:
        ``uint8`` (N <= 256, no sentinel), ``int16`` (N <= 32768) or ``int32``.

    Raises:
        ValueError: ``num_ids`` < 1 or > 2**31.
    """
    if not 1 <= num_ids <= 2**31:
        raise ValueError(f"num_ids={num_ids} must be in [1, 2**31] (the size of the id space)")
    if num_ids <= 256 and not entry_sentinel:
        return _DTYPES[0]
    if num_ids <= 2**15:
        return _DTYPES[1]
    return _DTYPES[2]


def bits_per_id(num_ids: int, *, entry_sentinel: bool = False) -> int:
    """Bits per id in the bit-packed form: ``ceil(log2(N))`` (``ceil(log2(N+1))`` with sentinel), min 1."""
    values = num_ids + 1 if entry_sentinel else num_ids
    return max(1, math.ceil(math.log2(values)))


def _pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative ints ``values`` (any shape) with ``bits`` bits each, little-endian bit order."""
    flat = values.reshape(-1).astype(np.uint32)
    shifts = np.arange(bits, dtype=np.uint32)
    bit_matrix = ((flat[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes()


def _unpack_bits(buf: bytes, count: int, bits: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8)
    bit_matrix = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    return bit_matrix.astype(np.uint32) @ (np.uint32(1) << np.arange(bits, dtype=np.uint32))


@dataclass(frozen=True, eq=False)
class TokenIndices:
    """Integer ids per token and layer, ``[S, L, K]``, with placeholder rows (base class; use a subclass).

    Attributes:
        ids: ``[S, L, K]`` ids in :func:`storage_dtype` (placeholder rows hold 0, or -1 for sentinel kinds).
        row_valid: ``[S]`` bool, False for placeholder rows.
        num_ids: N, the id space (experts E or keys).
        start: position in the sample of row 0 (a multi-turn delta starts after row 0 of the sample).

    Build with :meth:`from_array`; the constructor is for already-validated storage arrays.
    """

    ids: np.ndarray
    row_valid: np.ndarray
    num_ids: int
    start: int = 0

    kind: ClassVar[str] = "token_indices"
    kind_code: ClassVar[int] = -1
    entry_sentinel: ClassVar[bool] = False
    causal_keys: ClassVar[bool] = False  # ids are key positions: row r may hold only ids <= start + r

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind_code >= 0:
            _KINDS[cls.kind_code] = cls

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_array(cls, ids: Any, num_ids: int, *, start: int = 0) -> TokenIndices:
        """Validate and store an int array ``[S, L, K]`` whose placeholder rows are all ``-1``.

        Args:
            ids: ``[S, L, K]`` integer array-like (numpy, torch, nested lists). A row (token) that is
                ``-1`` in every slot is a placeholder.
            num_ids: N; recorded ids must be in ``[0, N)``.
            start: position of row 0 within the sample (>= 0).

        A zero-row record (``S = 0``, e.g. an empty delta of a multi-turn sample) is valid and round-trips
        through :meth:`to_bytes` / :meth:`from_bytes`.

        Raises:
            TypeError: ``ids`` is not integer.
            TypeError: ``num_ids`` or ``start`` is not an int.
            ValueError: wrong rank, an id outside ``[0, N)``, a row mixing ``-1`` and ids (routed experts),
                duplicate ids within a row (``-1`` fill slots excepted), a key after its query (DSA: an id
                ``> start + row``), or a negative ``start``.
        """
        for name, value in (("num_ids", num_ids), ("start", start)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise TypeError(
                    f"{cls.__name__}.from_array: {name}={value!r} has type {type(value).__name__}; expected an int "
                    "(a float would be truncated silently)"
                )
        arr = _as_numpy(ids)
        if arr.ndim != 3:
            raise ValueError(
                f"{cls.__name__}.from_array: ids has shape {arr.shape}; expected [S, L, K] (tokens, layers, "
                "ids per layer)"
            )
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{cls.__name__}.from_array: ids has dtype {arr.dtype}; expected an integer dtype")
        if start < 0:
            raise ValueError(f"{cls.__name__}.from_array: start={start} must be >= 0")
        dtype = storage_dtype(num_ids, entry_sentinel=cls.entry_sentinel)
        arr64 = arr.astype(np.int64, copy=False)
        neg = arr64 == -1
        if arr.shape[1] * arr.shape[2] == 0:
            row_valid = np.ones(arr.shape[0], dtype=bool)
        else:  # explicit row width: reshape(0, -1) is ambiguous for a zero-row record
            row_valid = ~neg.reshape(arr.shape[0], arr.shape[1] * arr.shape[2]).all(axis=1)
        bad = (arr64 < -1) | (arr64 >= num_ids)
        if not cls.entry_sentinel:
            bad |= neg & row_valid[:, None, None]
        if bad.any():
            s, layer, k = (int(v) for v in np.argwhere(bad)[0])
            rule = "[-1, N)" if cls.entry_sentinel else "[0, N) in recorded rows (a placeholder row is all -1)"
            raise ValueError(
                f"{cls.__name__}.from_array: ids[{s}, {layer}, {k}] = {int(arr64[s, layer, k])} is outside "
                f"{rule} with N = num_ids = {num_ids}"
            )
        if arr.shape[2] > 1 and row_valid.any():
            srt = np.sort(arr64[row_valid], axis=-1)
            same = np.diff(srt, axis=-1) == 0
            if cls.entry_sentinel:
                same &= srt[..., 1:] >= 0  # repeated -1 fill slots are fine
            dup = same.any(axis=-1)
            if dup.any():
                r, layer = (int(v) for v in np.argwhere(dup)[0])
                row = int(np.flatnonzero(row_valid)[r])
                raise ValueError(
                    f"{cls.__name__}.from_array: row {row}, layer {layer} repeats an id {arr64[row, layer].tolist()}"
                    f"; a token's {'key indices' if cls.entry_sentinel else 'top-k ids'} must be distinct"
                )
        if cls.causal_keys and arr.size:
            # Row r is sample position start + r; a causal query sees only keys at positions <= its own.
            pos = int(start) + np.arange(arr.shape[0], dtype=np.int64)[:, None, None]
            late = arr64 > pos
            if late.any():
                r, layer, k = (int(v) for v in np.argwhere(late)[0])
                raise ValueError(
                    f"{cls.__name__}.from_array: ids[{r}, {layer}, {k}] = {int(arr64[r, layer, k])} is a key after its "
                    f"query (row {r} is position start + {r} = {int(start) + r}; causal rows hold keys <= their "
                    "position); record key positions in the sample's token coordinates and set start for a delta"
                )
        stored = np.where(row_valid[:, None, None], arr64, -1 if cls.entry_sentinel else 0).astype(dtype)
        return cls(np.ascontiguousarray(stored), row_valid.astype(bool), int(num_ids), int(start))

    @classmethod
    def placeholder(cls, num_tokens: int, num_layers: int, k: int, num_ids: int, *, start: int = 0) -> TokenIndices:
        """A record of ``num_tokens`` placeholder rows."""
        return cls.from_array(np.full((num_tokens, num_layers, k), -1, dtype=np.int64), num_ids, start=start)

    # ------------------------------------------------------------------ views
    @property
    def shape(self) -> tuple[int, int, int]:
        """``(S, L, K)``."""
        return tuple(self.ids.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def end(self) -> int:
        """Position just past the last row: ``start + S``."""
        return self.start + self.num_tokens

    @property
    def num_placeholder_rows(self) -> int:
        return int((~self.row_valid).sum())

    def to_numpy(self, dtype: Any = np.int32) -> np.ndarray:
        """``[S, L, K]`` signed ids with ``-1`` in placeholder rows (and per-entry sentinels)."""
        out = self.ids.astype(dtype)
        out[~self.row_valid] = -1
        return out

    def to_tensor(self, dtype: Any = None) -> Any:
        """``[S, L, K]`` torch tensor (default int64) with ``-1`` placeholders (imports torch)."""
        import torch

        return torch.from_numpy(self.to_numpy(np.int64)).to(dtype or torch.int64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenIndices) or type(other) is not type(self):
            return NotImplemented
        return (
            self.num_ids == other.num_ids
            and self.start == other.start
            and self.shape == other.shape
            and bool(np.array_equal(self.row_valid, other.row_valid))
            and bool(np.array_equal(self.to_numpy(), other.to_numpy()))
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={self.shape}, num_ids={self.num_ids}, start={self.start}, "
            f"placeholder_rows={self.num_placeholder_rows}, dtype={self.ids.dtype})"
        )

    def slice_rows(self, begin: int, end: int) -> TokenIndices:
        """Rows for sample positions ``[begin, end)`` (must lie inside ``[start, start+S)``)."""
        if not self.start <= begin <= end <= self.end:
            raise ValueError(
                f"slice_rows: positions [{begin}, {end}) are not inside this record's [{self.start}, {self.end})"
            )
        a, b = begin - self.start, end - self.start
        return type(self)(self.ids[a:b].copy(), self.row_valid[a:b].copy(), self.num_ids, begin)

    # ------------------------------------------------------------------ codec
    def bits(self) -> int:
        """Bits per id in the bit-packed form (:func:`bits_per_id`)."""
        return bits_per_id(self.num_ids, entry_sentinel=self.entry_sentinel)

    def nbytes_per_token(self, packed: bool = False) -> float:
        """Payload bytes per token (the row mask adds 1/8 byte per token, the header 32 bytes per record)."""
        _, layers, k = self.shape
        if packed:
            return layers * k * self.bits() / 8
        return float(layers * k * self.ids.dtype.itemsize)

    def to_bytes(self, packed: bool = False) -> bytes:
        """Serialize (header + row mask + raw or bit-packed ids); see the module docstring for the layout."""
        s, layers, k = self.shape
        bits = self.bits() if packed else 0
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.kind_code, 1 if packed else 0, _dtype_code(self.ids.dtype),
            s, layers, k, self.num_ids, self.start, bits,
        )
        mask = np.packbits(self.row_valid, bitorder="little").tobytes()
        if packed:
            values = self.ids.astype(np.int64) + (1 if self.entry_sentinel else 0)
            values[~self.row_valid] = 0
            payload = _pack_bits(values, bits)
        else:
            payload = self.ids.astype(self.ids.dtype.newbyteorder("<"), copy=False).tobytes()
        return header + mask + payload

    @staticmethod
    def from_bytes(data: bytes | bytearray | memoryview) -> TokenIndices:
        """Inverse of :meth:`to_bytes`; returns the subclass named in the header.

        Raises:
            ValueError: bad magic, an unknown format version/kind/encoding/dtype, a length that does not
                match the header, or decoded ids that :meth:`from_array` rejects (an id ``>= num_ids``, a repeat
                within a row, a non-causal DSA key); the message names the value and the bound.
        """
        buf = memoryview(data).cast("B")
        if len(buf) < _HEADER.size:
            raise ValueError(f"TokenIndices.from_bytes: {len(buf)} bytes is shorter than the {_HEADER.size}-byte header")
        magic, version, kind, enc, dcode, s, layers, k, n, start, bits = _HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise ValueError(f"TokenIndices.from_bytes: magic {magic!r} != {MAGIC!r}; not a moe_rl index record")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"TokenIndices.from_bytes: format version {version} is not supported (this build reads "
                f"{FORMAT_VERSION}); upgrade moe_rl on the reading side"
            )
        if kind not in _KINDS or enc not in (0, 1) or dcode >= len(_DTYPES):
            raise ValueError(f"TokenIndices.from_bytes: unknown kind={kind}, encoding={enc} or dtype code={dcode}")
        cls = _KINDS[kind]
        dtype = _DTYPES[dcode]
        off = _HEADER.size
        mask_len = (s + 7) // 8
        row_valid = np.unpackbits(np.frombuffer(buf[off : off + mask_len], np.uint8), count=s, bitorder="little")
        off += mask_len
        count = s * layers * k
        if enc == 0:
            need = count * dtype.itemsize
            payload = buf[off:]
            if len(payload) != need:
                raise ValueError(f"TokenIndices.from_bytes: payload is {len(payload)} bytes, header says {need}")
            ids = np.frombuffer(payload, dtype=dtype).reshape(s, layers, k).copy()
        else:
            need = (count * bits + 7) // 8
            payload = buf[off:]
            if len(payload) != need:
                raise ValueError(f"TokenIndices.from_bytes: packed payload is {len(payload)} bytes, header says {need}")
            values = _unpack_bits(bytes(payload), count, bits).astype(np.int64).reshape(s, layers, k)
            if cls.entry_sentinel:
                values -= 1
            valid = row_valid.astype(bool)
            values[~valid] = -1 if cls.entry_sentinel else 0
            ids = values.astype(dtype)
        # Re-validate the decoded ids (a corrupt or foreign payload must not decode to ids >= N, repeats, ...).
        valid = row_valid.astype(bool)
        signed = ids.astype(np.int64)
        signed[~valid] = -1
        try:
            rec = cls.from_array(signed, int(n), start=int(start))
        except ValueError as exc:
            raise ValueError(f"TokenIndices.from_bytes: corrupt payload (header N = num_ids = {n}): {exc}") from None
        if not np.array_equal(rec.row_valid, valid):
            r = int(np.flatnonzero(rec.row_valid != valid)[0])
            raise ValueError(
                f"TokenIndices.from_bytes: corrupt payload: row {r} is marked recorded in the row mask but holds only -1"
            )
        return rec


def _dtype_code(dtype: np.dtype) -> int:
    for i, d in enumerate(_DTYPES):
        if np.dtype(dtype).newbyteorder("<") == d.newbyteorder("<") and np.dtype(dtype).kind == d.kind:
            return i
    raise ValueError(f"storage dtype {dtype} is not one of {[str(d) for d in _DTYPES]}")


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor, without importing torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


class RoutedExperts(TokenIndices):
    """Routed-expert ids of one sample, ``[S, L, K]`` (vLLM's ``routed_experts`` layout; see module docstring).

    ``num_ids`` is the number of routed experts E. ``L`` follows the engine's layer axis: vLLM numbers the
    MoE layers by their absolute decoder-layer index, so dense layers' slices are present (and ignored at
    replay).
    """

    kind = "routed_experts"
    kind_code = 0
    entry_sentinel = False

    @property
    def num_experts(self) -> int:
        return self.num_ids


class DsaIndices(TokenIndices):
    """DSA indexer top-k key positions of one sample, ``[S, L_index, index_topk]`` with per-entry ``-1``.

    ``num_ids`` is the key-space size (the longest sequence the ids may point into). A recorded row ``i`` is
    sample position ``p = start + i`` and holds distinct key positions ``<= p`` (causal), unused slots ``-1``;
    :meth:`from_array` and :meth:`from_bytes` enforce both, matching what
    :func:`moe_rl.attention.dsa.dsa_attention` needs from ``topk_indices`` (it rejects repeated keys and would
    silently drop keys outside the causal window).
    """

    kind = "dsa_indices"
    kind_code = 1
    entry_sentinel = True
    causal_keys = True
