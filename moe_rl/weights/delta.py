"""Exact delta encoding of weight versions: only the changed elements travel, and a checksum proves the result.

Shape legend:
    N  elements of one tensor (``numel``)
    C  elements that changed since the base version (``0 <= C <= N``)
    M  bytes of the packed change mask, ``ceil(N / 8)``
    W  8-byte words of a tensor's bytes, ``ceil(N * itemsize / 8)``

Between two optimizer steps of RL post-training only a few percent of the bf16 weights change bit pattern
(an fp32 master-weight update crosses a bf16 rounding boundary for ~1-3% of the elements per step), so a
receiver that already holds version ``v`` needs only those elements to build ``v + 1``. This module encodes a
new version against a base version the receiver is known to hold, and decodes it **exactly**:

- **Bit patterns, not values.** Every comparison and copy runs on an integer view of the tensor's bytes
  (:func:`bit_view`: bf16/fp16 as ``int16``, fp32 as ``int32``, float8 as ``uint8``, ...), so NaN payloads,
  ``-0.0`` and subnormals survive and "unchanged" means "same bits".
- **Per-tensor encoding by size** (:func:`encode_tensor`): ``unchanged`` (no buffer), ``sparse`` (``index``
  ``[C]`` int32/int64 + ``values`` ``[C]``), ``bitmask`` (``mask`` ``[M]`` uint8, bit ``i % 8`` of byte
  ``i // 8`` set for a changed element, + ``values`` ``[C]``) or ``full`` (``values`` ``[N]``): whichever has
  the fewest bytes, ``0``, ``C (ib + s)``, ``M + C s`` or ``N s`` for index width ``ib`` and element size ``s``.
  A new tensor, a changed dtype or a changed shape is always ``full``.
- **A periodic full version** (:class:`DeltaEncoder` ``full_every``): the first update, every
  ``full_every``-th after it, and any update after :meth:`DeltaEncoder.reset` carry every tensor in full, so a
  receiver that joins late or lost a version recovers without a special path.
- **Checksums per tensor and per version.** :func:`tensor_checksum` is a 64-bit sum of a per-word hash (below);
  :func:`version_checksum` hashes the names, dtypes, shapes and tensor checksums of a whole version. An update
  names the checksum of the base it expects and of the state it produces, per tensor and per version. The
  receiver (:class:`DeltaDecoder`) refuses an update whose base is not what it holds
  (:class:`DeltaBaseError`) and, after applying, verifies every produced checksum; any mismatch
  (:class:`DeltaChecksumError`) rolls the receiver's tensors back to the base bit for bit. A malformed or
  truncated payload raises :class:`DeltaPayloadError` before anything is touched. A receiver therefore never
  drifts silently and never holds a mix of two versions.

The checksum. Split a tensor's bytes into little-endian 64-bit words ``w_k`` (the last one zero-padded) and sum,
modulo ``2**64``, ``h_k = mix64(w_k XOR ((k + 1) * 0x9E3779B97F4A7C15))`` where ``mix64`` is the SplitMix64
finalizer (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; the constants are
Stafford's "Mix13"). A sum of per-position hashes is order-free (the same on any device, chunking and thread
count: integer addition modulo ``2**64`` is exact) and **updatable in O(C)**: replacing words ``k in K`` changes
it by ``sum_K h(new) - sum_K h(old)``, so both sides of a delta verify it without reading unchanged memory. It
is a corruption and wrong-base detector (a random difference passes with probability ~``2**-64``), not a
cryptographic digest. Ready-made GPU tensors are hashed on their device with plain int64 torch ops (int64
overflow wraps modulo ``2**64`` in torch's CPU and CUDA kernels; the tests pin the value to a pure-Python
reference).

Wire forms of one :class:`DeltaUpdate`: :meth:`DeltaUpdate.to_tensors` (a JSON header plus flat named integer
tensors, for safetensors files or torch.distributed sends) and :meth:`DeltaUpdate.to_bytes` (one buffer,
little-endian)::

    offset  size  field
    0       8     magic b"MRLDELTA"
    8       8     header length H (uint64)
    16      H     header (UTF-8 JSON: versions, checksums, per tensor: name, dtype, shape, encoding,
                  checksums, changed count and its buffers' dtype and element count, in wire order)
    16 + H  ...   the buffers' raw bytes, in header order, back to back

The encoder keeps one copy of the last version it sent (the base of the next delta); the decoder needs none
beyond the receiver's own tensors plus, while it applies, an undo log: the old bits of the changed elements
(sparse/bitmask patches) or of the whole tensor (a full patch applied in place).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

__all__ = [
    "DeltaBaseError",
    "DeltaChecksumError",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaError",
    "DeltaPayloadError",
    "DeltaUpdate",
    "TensorPatch",
    "apply_patch",
    "bit_view",
    "encode_tensor",
    "tensor_checksum",
    "version_checksum",
]

Encoding = Literal["unchanged", "sparse", "bitmask", "full"]
ENCODINGS: tuple[str, ...] = get_args(Encoding)
FORMAT = "moe_rl.delta/1"
MAGIC = b"MRLDELTA"
_MASK64 = (1 << 64) - 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIRE_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}
_CHUNK_WORDS = 1 << 22  # 32 MiB of words per hashing step: bounds the int64 temporaries


def _s64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


class DeltaError(ValueError):
    """A delta update cannot be applied; the receiver's tensors are unchanged. Ask the sender for a full
    version (:meth:`DeltaEncoder.reset`)."""


class DeltaBaseError(DeltaError):
    """The update was encoded against a base the receiver does not hold (other version or other bits)."""


class DeltaChecksumError(DeltaError):
    """The state an update produced does not have the checksum the sender computed (corrupted payload)."""


class DeltaPayloadError(DeltaError):
    """The payload is malformed: truncated, a missing or mis-sized buffer, an index out of range."""


# ---------------------------------------------------------------------------------------------------------------
# bit views and the checksum


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """The flat integer view ``[N]`` of a tensor's bit patterns: same storage when ``t`` is contiguous.

    Args:
        t: any tensor whose element size is 1, 2, 4 or 8 bytes (bool, integer, float, float8 dtypes).

    Returns:
        ``[N]`` ``uint8`` / ``int16`` / ``int32`` / ``int64`` (by element size). Writing into it writes ``t``
        when ``t`` is contiguous (a non-contiguous ``t`` is copied first).

    Raises:
        TypeError: ``t`` is not a tensor, or its element size has no integer view (complex128).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bit_view: t must be a torch.Tensor, got {type(t).__name__}")
    size = t.element_size()
    if size not in _INT_OF_SIZE:
        raise TypeError(f"bit_view: dtype {t.dtype} has {size}-byte elements; only 1/2/4/8-byte dtypes have an "
                        "integer bit view (split complex tensors with torch.view_as_real first)")
    flat = t.contiguous().reshape(-1)
    return flat if flat.dtype == _INT_OF_SIZE[size] else flat.view(_INT_OF_SIZE[size])


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _hash_words(words: torch.Tensor, positions: torch.Tensor) -> int:
    """``sum_k mix64(w_k ^ ((k + 1) G)) mod 2**64`` of int64 words ``[n]`` at word positions ``[n]``."""
    z = words ^ ((positions + 1) * _GOLDEN)
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    z = z ^ _srl(z, 31)
    return int(z.sum()) & _MASK64


def _bytes_of(bits: torch.Tensor) -> torch.Tensor:
    return bits if bits.dtype == torch.uint8 else bits.view(torch.uint8)


def _main_words(u8: torch.Tensor) -> torch.Tensor:
    """The int64 view ``[nbytes // 8]`` of the whole words of ``u8`` (a copy when the storage offset is not
    8-byte aligned)."""
    main = u8[: (u8.numel() // 8) * 8]
    try:
        return main.view(torch.int64)
    except RuntimeError:  # storage offset not 8-byte aligned
        return main.clone().view(torch.int64)


def _tail_word(u8: torch.Tensor) -> torch.Tensor:
    """The zero-padded last word ``[1]`` int64 of ``u8`` when its length is not a multiple of 8 (else ``[0]``)."""
    n8, rem = divmod(u8.numel(), 8)
    if not rem:
        return torch.zeros(0, dtype=torch.int64, device=u8.device)
    b = u8[n8 * 8:].to(torch.int64)
    return (b << (torch.arange(rem, device=u8.device) * 8)).sum().reshape(1)


def _words_at(u8: torch.Tensor, widx: torch.Tensor) -> torch.Tensor:
    """Little-endian int64 words ``[n]`` of the byte tensor ``u8`` at sorted word indices ``widx`` ``[n]`` (the
    last word zero-padded)."""
    n8 = u8.numel() // 8
    if widx.numel() and int(widx[-1]) >= n8:  # the padded tail word (sorted: only the last index can be it)
        return torch.cat([_main_words(u8)[widx[:-1]], _tail_word(u8)])
    return _main_words(u8)[widx]


def _checksum_bytes(u8: torch.Tensor) -> int:
    words = _main_words(u8)
    n8 = words.numel()
    total = 0
    for k0 in range(0, n8, _CHUNK_WORDS):
        chunk = words[k0:k0 + _CHUNK_WORDS]
        total += _hash_words(chunk, torch.arange(k0, k0 + chunk.numel(), device=u8.device))
    tail = _tail_word(u8)
    if tail.numel():
        total += _hash_words(tail, torch.tensor([n8], device=u8.device))
    return total & _MASK64


def tensor_checksum(t: torch.Tensor) -> int:
    """64-bit checksum of a tensor's bytes (see the module docstring for the hash).

    Args:
        t: any tensor :func:`bit_view` accepts, on any device. Only its bytes count (dtype and shape are hashed
            by :func:`version_checksum`); the value does not depend on the device, chunking or thread count.

    Returns:
        An int in ``[0, 2**64)``; ``0`` for an empty tensor.
    """
    return _checksum_bytes(_bytes_of(bit_view(t)))


def _changed_words(idx: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Sorted unique word indices ``[<= C]`` holding the sorted element indices ``idx`` ``[C]``."""
    return torch.unique_consecutive((idx * itemsize) // 8)


def version_checksum(entries: Mapping[str, tuple[torch.dtype | str, Iterable[int], int]]) -> int:
    """64-bit checksum of a whole version: names, dtypes, shapes and tensor checksums.

    Args:
        entries: ``{name: (dtype, shape, tensor_checksum)}``; order does not matter.

    Returns:
        The first 8 bytes of BLAKE2b over the sorted entries, as an int in ``[0, 2**64)``.
    """
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(entries):
        dtype, shape, ck = entries[name]
        h.update(f"{name}\0{_dtype_name(dtype)}\0{tuple(int(s) for s in shape)}\0{ck:016x}\n".encode())
    return int.from_bytes(h.digest(), "little")


# ---------------------------------------------------------------------------------------------------------------
# one tensor


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise DeltaPayloadError(f"{where}: dtype {name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True)
class TensorPatch:
    """How one tensor of a version is sent: its encoding, checksums and buffers.

    Attributes:
        name: the tensor's name in the state dict.
        dtype: the new tensor's dtype.
        shape: the new tensor's shape.
        encoding: ``"unchanged"`` / ``"sparse"`` / ``"bitmask"`` / ``"full"`` (module docstring).
        checksum: :func:`tensor_checksum` of the new tensor.
        base_checksum: :func:`tensor_checksum` of the base tensor it applies to; ``None`` for ``"full"``.
        changed: C, the number of elements whose bits changed (N for ``"full"``).
        buffers: ``"full"``: ``{"values": [N]}``; ``"sparse"``: ``{"index": [C] int32|int64, "values": [C]}``;
            ``"bitmask"``: ``{"mask": [M] uint8, "values": [C]}``; ``"unchanged"``: ``{}``. ``values`` hold bit
            patterns (:func:`bit_view` dtype).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: Encoding
    checksum: int
    base_checksum: int | None
    changed: int
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def wire_bytes(self) -> int:
        """Bytes of this patch's buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def raw_bytes(self) -> int:
        """Bytes of the new tensor itself (what a full send moves)."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[N]`` -> uint8 ``[ceil(N/8)]``, element ``i`` at bit ``i % 8`` of byte ``i // 8``."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    weights = (1 << torch.arange(8, device=mask.device, dtype=torch.int32))
    return (padded.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def _unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    return ((packed.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[:n].bool()


def _full_patch(name: str, new: torch.Tensor) -> TensorPatch:
    bits = bit_view(new)
    return TensorPatch(name, new.dtype, tuple(new.shape), "full", _checksum_bytes(_bytes_of(bits)), None,
                       new.numel(), {"values": bits})


def encode_tensor(name: str, new: torch.Tensor, base: torch.Tensor | None = None, *,
                  base_checksum: int | None = None) -> TensorPatch:
    """Encode tensor ``new`` against ``base`` (the receiver's current tensor of the same name).

    The changed elements are those whose bit patterns differ. The encoding with the fewest bytes is chosen
    (module docstring); ``base=None`` or a dtype/shape change gives ``"full"``. The new checksum is updated from
    ``base_checksum`` in O(C) (module docstring), so both sides do the same arithmetic.

    Args:
        name: the tensor's name.
        new: ``[*shape]`` the new tensor, any dtype :func:`bit_view` accepts.
        base: ``[*shape]`` the base tensor on the same device, or ``None``.
        base_checksum: :func:`tensor_checksum` of ``base`` if already known (computed when ``None``).

    Returns:
        The :class:`TensorPatch`; its buffers may share memory with ``new`` (``"full"``).

    Raises:
        TypeError: ``new``/``base`` is not a tensor of a supported dtype.
        ValueError: ``base`` is on another device than ``new``.
    """
    if base is None or base.dtype != new.dtype or tuple(base.shape) != tuple(new.shape):
        return _full_patch(name, new)
    if base.device != new.device:
        raise ValueError(f"encode_tensor({name!r}): base is on {base.device}, new on {new.device}; "
                         "keep the base copy on the device of the new tensors")
    new_bits, base_bits = bit_view(new), bit_view(base)
    if base_checksum is None:
        base_checksum = _checksum_bytes(_bytes_of(base_bits))
    diff = new_bits != base_bits
    idx = diff.nonzero().reshape(-1)
    n, c, s = new_bits.numel(), idx.numel(), new.element_size()
    if c == 0:
        return TensorPatch(name, new.dtype, tuple(new.shape), "unchanged", base_checksum, base_checksum, 0, {})
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    ib = torch.empty((), dtype=index_dtype).element_size()
    sizes = {"sparse": c * (ib + s), "bitmask": -(-n // 8) + c * s, "full": n * s}
    choice = min(sizes, key=sizes.__getitem__)
    if choice == "full":
        return _full_patch(name, new)
    widx = _changed_words(idx, s)
    ck = (base_checksum - _hash_words(_words_at(_bytes_of(base_bits), widx), widx)
          + _hash_words(_words_at(_bytes_of(new_bits), widx), widx)) & _MASK64
    values = new_bits[idx]
    buffers = ({"index": idx.to(index_dtype), "values": values} if choice == "sparse"
               else {"mask": _pack_mask(diff), "values": values})
    return TensorPatch(name, new.dtype, tuple(new.shape), choice, ck, base_checksum, c, buffers)


def _patch_index(patch: TensorPatch) -> torch.Tensor:
    """Validated sorted element indices ``[C]`` int64 of a sparse/bitmask patch."""
    n, c = patch.numel, patch.changed
    where = f"tensor {patch.name!r} ({patch.encoding})"
    if patch.encoding == "sparse":
        idx = patch.buffers["index"].to(torch.int64)
        if idx.numel() != c:
            raise DeltaPayloadError(f"{where}: index has {idx.numel()} entries, the header says {c} changed")
        if c and (int(idx[0]) < 0 or int(idx[-1]) >= n or (c > 1 and not bool((idx[1:] > idx[:-1]).all()))):
            raise DeltaPayloadError(f"{where}: indices must be strictly increasing in [0, {n})")
        return idx
    mask = patch.buffers["mask"]
    if mask.numel() != -(-n // 8):
        raise DeltaPayloadError(f"{where}: mask has {mask.numel()} bytes, expected ceil({n}/8)")
    idx = _unpack_mask(mask, n).nonzero().reshape(-1)
    if idx.numel() != c:
        raise DeltaPayloadError(f"{where}: mask marks {idx.numel()} elements, the header says {c} changed")
    return idx


def apply_patch(target: torch.Tensor | None, patch: TensorPatch, *, base_checksum: int | None = None,
                verify: Literal["incremental", "full"] = "incremental",
                ) -> tuple[torch.Tensor, int, Callable[[], None]]:
    """Apply one patch to ``target`` in place (or build the tensor for ``"full"`` without a matching target).

    Args:
        target: the receiver's tensor of this name (contiguous, the patch's dtype and shape for
            ``"sparse"``/``"bitmask"``/``"unchanged"``), or ``None``.
        patch: the :class:`TensorPatch`.
        base_checksum: the receiver's checksum of ``target`` (computed when ``None``); must equal
            ``patch.base_checksum`` for a non-full patch.
        verify: ``"incremental"`` updates ``base_checksum`` over the changed words (O(C)); ``"full"`` re-hashes
            the whole result (also catches memory the receiver changed behind the decoder's back).

    Returns:
        ``(tensor, checksum, undo)``: the updated tensor (``target`` itself when updated in place), its checksum
        (already verified against ``patch.checksum``), and a callable that restores ``target``'s old bits.

    Raises:
        DeltaBaseError: no target, or a target of another dtype/shape/checksum, for a non-full patch.
        DeltaPayloadError: a buffer disagrees with the header (count, range, size).
        DeltaChecksumError: the result's checksum differs from ``patch.checksum``; ``target`` is restored first.
        ValueError: ``target`` is not contiguous (it cannot be updated in place), or ``verify`` is unknown.
    """
    if verify not in ("incremental", "full"):
        raise ValueError(f"apply_patch: verify must be 'incremental' or 'full', got {verify!r}")
    where = f"tensor {patch.name!r}"
    if target is not None and not target.is_contiguous():
        raise ValueError(f"apply_patch: {where} target is not contiguous; it cannot be updated in place "
                         "(pass a contiguous tensor)")

    def check(ck: int, undo: Callable[[], None]) -> int:
        if ck != patch.checksum:
            undo()
            raise DeltaChecksumError(f"{where}: checksum {ck:016x} after applying the {patch.encoding} patch, the "
                                     f"sender's is {patch.checksum:016x}: corrupted payload; the tensor is restored "
                                     "to its base (request a full version)")
        return ck

    if patch.encoding == "full":
        values = patch.buffers["values"]
        if values.numel() != patch.numel:
            raise DeltaPayloadError(f"{where} (full): {values.numel()} values, shape {patch.shape} needs "
                                    f"{patch.numel}")
        if target is not None and target.dtype == patch.dtype and tuple(target.shape) == patch.shape:
            bits = bit_view(target)
            old = bits.clone()
            bits.copy_(values.to(bits.device))

            def undo_full() -> None:
                bits.copy_(old)
            out, undo = target, undo_full
        else:
            out = values.clone().view(patch.dtype).reshape(patch.shape)
            if target is not None:
                out = out.to(target.device)
            undo = _noop
        return out, check(_checksum_bytes(_bytes_of(bit_view(out))), undo), undo

    if target is None:
        raise DeltaBaseError(f"{where}: a {patch.encoding} patch needs the base tensor, the receiver has none "
                             "(request a full version)")
    if target.dtype != patch.dtype or tuple(target.shape) != patch.shape:
        raise DeltaBaseError(f"{where}: the receiver holds {_dtype_name(target.dtype)} {tuple(target.shape)}, the "
                             f"{patch.encoding} patch applies to {_dtype_name(patch.dtype)} {patch.shape}")
    bits = bit_view(target)
    u8 = _bytes_of(bits)
    if base_checksum is None:
        base_checksum = _checksum_bytes(u8)
    if base_checksum != patch.base_checksum:
        raise DeltaBaseError(f"{where}: the receiver's tensor has checksum {base_checksum:016x}, the patch expects "
                             f"base {patch.base_checksum:016x}: it was encoded against other bits")
    if patch.encoding == "unchanged":
        return target, check(base_checksum, _noop), _noop
    idx = _patch_index(patch).to(bits.device)
    values = patch.buffers["values"].to(bits.device)
    if values.numel() != idx.numel() or values.dtype != bits.dtype:
        raise DeltaPayloadError(f"{where}: values are {values.numel()} x {values.dtype}, expected "
                                f"{idx.numel()} x {bits.dtype}")
    widx = _changed_words(idx, target.element_size())
    before = _hash_words(_words_at(u8, widx), widx) if verify == "incremental" else 0
    old_vals = bits[idx].clone()
    bits[idx] = values

    def undo_sparse() -> None:
        bits[idx] = old_vals
    if verify == "incremental":
        ck = (base_checksum - before + _hash_words(_words_at(u8, widx), widx)) & _MASK64
    else:
        ck = _checksum_bytes(u8)
    return target, check(ck, undo_sparse), undo_sparse


def _noop() -> None:
    return None


# ---------------------------------------------------------------------------------------------------------------
# one version


@dataclass(frozen=True)
class DeltaUpdate:
    """One version on the wire: full (``base_version is None``) or a delta against ``base_version``.

    Attributes:
        version: the version this update produces.
        base_version: the version it applies to; ``None`` for a full version.
        base_checksum: :func:`version_checksum` of the base; ``None`` for a full version.
        checksum: :func:`version_checksum` of the produced state.
        patches: one :class:`TensorPatch` per tensor of the new version.
        removed: names the base had and the new version drops.
    """

    version: int
    base_version: int | None
    base_checksum: int | None
    checksum: int
    patches: tuple[TensorPatch, ...]
    removed: tuple[str, ...] = ()

    @property
    def is_full(self) -> bool:
        return self.base_version is None

    @property
    def wire_bytes(self) -> int:
        """Bytes of every patch's buffers (the header excluded)."""
        return sum(p.wire_bytes for p in self.patches)

    @property
    def raw_bytes(self) -> int:
        """Bytes a full send of the produced state moves."""
        return sum(p.raw_bytes for p in self.patches)

    @property
    def changed(self) -> int:
        """Elements whose bits changed (every element of a full version)."""
        return sum(p.changed for p in self.patches)

    def header(self) -> dict[str, Any]:
        """The JSON-able header; buffers are listed in wire order as ``[key, dtype, numel]``."""
        return {
            "format": FORMAT, "version": self.version, "base_version": self.base_version,
            "base_checksum": None if self.base_checksum is None else f"{self.base_checksum:016x}",
            "checksum": f"{self.checksum:016x}", "removed": list(self.removed),
            "patches": [{
                "name": p.name, "dtype": _dtype_name(p.dtype), "shape": list(p.shape), "encoding": p.encoding,
                "checksum": f"{p.checksum:016x}",
                "base_checksum": None if p.base_checksum is None else f"{p.base_checksum:016x}",
                "changed": p.changed,
                "buffers": [[f"{i}/{k}", _dtype_name(b.dtype), b.numel()] for k, b in p.buffers.items()],
            } for i, p in enumerate(self.patches)],
        }

    def to_tensors(self) -> tuple[str, dict[str, torch.Tensor]]:
        """``(header JSON, {"<patch index>/<buffer>": 1-D integer tensor})`` (safetensors- and send-ready)."""
        tensors = {f"{i}/{k}": b for i, p in enumerate(self.patches) for k, b in p.buffers.items()}
        return json.dumps(self.header(), separators=(",", ":")), tensors

    @classmethod
    def from_tensors(cls, header: str | Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> DeltaUpdate:
        """Rebuild an update from :meth:`to_tensors` output.

        Raises:
            DeltaPayloadError: a malformed header, or a buffer that is missing or has another dtype or count.
        """
        try:
            h = json.loads(header) if isinstance(header, str | bytes) else dict(header)
        except json.JSONDecodeError as e:
            raise DeltaPayloadError(f"delta header is not JSON ({e}): truncated or corrupted payload") from e
        if h.get("format") != FORMAT:
            raise DeltaPayloadError(f"delta header format {h.get('format')!r}, expected {FORMAT!r}")
        patches = []
        try:
            for ph in h["patches"]:
                where = f"tensor {ph['name']!r}"
                if ph["encoding"] not in ENCODINGS:
                    raise DeltaPayloadError(f"{where}: encoding {ph['encoding']!r} is not one of {ENCODINGS}")
                buffers = {}
                for key, dtype, numel in ph["buffers"]:
                    if key not in tensors:
                        raise DeltaPayloadError(f"{where}: buffer {key!r} is missing from the payload")
                    b = tensors[key]
                    if _dtype_name(b.dtype) != dtype or b.numel() != numel:
                        raise DeltaPayloadError(f"{where}: buffer {key!r} is {b.numel()} x {_dtype_name(b.dtype)}, "
                                                f"the header says {numel} x {dtype} (truncated payload?)")
                    buffers[key.split("/", 1)[1]] = b.reshape(-1)
                patches.append(TensorPatch(
                    ph["name"], _parse_dtype(ph["dtype"], where), tuple(int(s) for s in ph["shape"]),
                    ph["encoding"], int(ph["checksum"], 16),
                    None if ph["base_checksum"] is None else int(ph["base_checksum"], 16), int(ph["changed"]),
                    buffers))
            return cls(int(h["version"]), None if h["base_version"] is None else int(h["base_version"]),
                       None if h["base_checksum"] is None else int(h["base_checksum"], 16),
                       int(h["checksum"], 16), tuple(patches), tuple(h["removed"]))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DeltaPayloadError):
                raise
            raise DeltaPayloadError(f"delta header is malformed ({type(e).__name__}: {e})") from e

    def to_bytes(self) -> bytes:
        """One little-endian buffer (module docstring); tensors are copied to the host."""
        header, tensors = self.to_tensors()
        hb = header.encode()
        parts = [MAGIC, struct.pack("<Q", len(hb)), hb]
        parts += [t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> DeltaUpdate:
        """Parse :meth:`to_bytes` output (CPU tensors).

        Raises:
            DeltaPayloadError: wrong magic, truncated or over-long data, or a malformed header.
        """
        data = memoryview(data)
        if len(data) < 16 or bytes(data[:8]) != MAGIC:
            raise DeltaPayloadError(f"delta payload of {len(data)} bytes does not start with {MAGIC!r} and a "
                                    "header length: not a delta update or truncated")
        (hlen,) = struct.unpack("<Q", data[8:16])
        if 16 + hlen > len(data):
            raise DeltaPayloadError(f"delta payload truncated: header of {hlen} bytes, only {len(data) - 16} follow")
        try:
            header = json.loads(bytes(data[16:16 + hlen]))
            specs = [(key, _WIRE_DTYPES[dt], int(n)) for ph in header["patches"] for key, dt, n in ph["buffers"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DeltaPayloadError(f"delta header is malformed ({type(e).__name__}: {e})") from e
        need = 16 + hlen + sum(torch.empty((), dtype=dt).element_size() * n for _, dt, n in specs)
        if len(data) != need:
            raise DeltaPayloadError(f"delta payload has {len(data)} bytes, its header describes {need}: "
                                    f"{'truncated' if len(data) < need else 'trailing bytes'}")
        tensors, off = {}, 16 + hlen
        for key, dt, n in specs:
            nb = torch.empty((), dtype=dt).element_size() * n
            tensors[key] = torch.frombuffer(bytearray(data[off:off + nb]), dtype=torch.uint8).view(dt)
            off += nb
        return cls.from_tensors(header, tensors)


# ---------------------------------------------------------------------------------------------------------------
# stateful sender and receiver


class DeltaEncoder:
    """The sender's side: keeps the last version it encoded and emits full or delta updates.

    Args:
        full_every: a full version every ``full_every`` updates (the first update is full; ``1`` sends every
            version in full, i.e. delta encoding off).
        copy_base: keep a private copy of each version's bits (default). ``False`` keeps references to the
            caller's tensors: only correct if the caller never modifies a tensor after passing it in.

    Memory: one copy of the encoded tensors (on their device) plus C-sized temporaries per tensor.

    Raises:
        ValueError: ``full_every < 1``.
    """

    def __init__(self, *, full_every: int = 10, copy_base: bool = True) -> None:
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"DeltaEncoder: full_every = {full_every!r} must be an int >= 1 (1 = every version "
                             "full, N = a full version every N updates)")
        self.full_every = full_every
        self.copy_base = copy_base
        self._base: dict[str, torch.Tensor] = {}
        self._checksums: dict[str, int] = {}
        self._version: int | None = None
        self._version_checksum: int | None = None
        self._since_full = 0
        self._force_full = True

    @property
    def version(self) -> int | None:
        """The last version encoded (the base of the next delta)."""
        return self._version

    def reset(self) -> None:
        """Make the next update full (call when a receiver reported a :class:`DeltaError`)."""
        self._force_full = True

    def encode(self, state: Mapping[str, torch.Tensor], version: int, *, full: bool = False) -> DeltaUpdate:
        """Encode ``state`` as ``version``.

        Args:
            state: ``{name: tensor}`` the new version (any dtypes :func:`bit_view` accepts).
            version: strictly larger than the previous one.
            full: force a full version.

        Returns:
            The :class:`DeltaUpdate` (its buffers may share memory with ``state``: send before modifying it).

        Raises:
            ValueError: ``version`` does not increase, or ``state`` is empty.
            TypeError: a value is not a tensor of a supported dtype.
        """
        if self._version is not None and version <= self._version:
            raise ValueError(f"DeltaEncoder.encode: version {version} must be larger than the last one encoded "
                             f"({self._version})")
        if not state:
            raise ValueError("DeltaEncoder.encode: state is empty; pass the version's tensors")
        as_full = full or self._force_full or self._since_full + 1 >= self.full_every
        patches = []
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"DeltaEncoder.encode: state[{name!r}] is a {type(t).__name__}, not a tensor")
            base = None if as_full else self._base.get(name)
            patches.append(encode_tensor(name, t, base, base_checksum=self._checksums.get(name)))
        new_ck = version_checksum({p.name: (p.dtype, p.shape, p.checksum) for p in patches})
        update = DeltaUpdate(
            version, None if as_full else self._version, None if as_full else self._version_checksum, new_ck,
            tuple(patches), () if as_full else tuple(sorted(set(self._base) - set(state))))
        self._base = {n: (t.detach().clone() if self.copy_base else t.detach()) for n, t in state.items()}
        self._checksums = {p.name: p.checksum for p in patches}
        self._version, self._version_checksum = version, new_ck
        self._since_full = 0 if as_full else self._since_full + 1
        self._force_full = False
        return update


class DeltaDecoder:
    """The receiver's side: applies updates to a mapping of tensors in place, all or nothing.

    Args:
        target: the mapping to update (e.g. an engine's ``{name: parameter}``); a fresh dict when ``None``.
            Tensors of a matching dtype/shape are updated in place; others are replaced in the mapping.
        verify: ``"incremental"`` (O(C) per delta, default) or ``"full"`` (re-hash every touched tensor).
        device: where tensors that ``target`` lacks are created (default: where the payload is).

    Raises:
        ValueError: ``verify`` is unknown.
    """

    def __init__(self, target: MutableMapping[str, torch.Tensor] | None = None, *,
                 verify: Literal["incremental", "full"] = "incremental",
                 device: torch.device | str | None = None) -> None:
        if verify not in ("incremental", "full"):
            raise ValueError(f"DeltaDecoder: verify must be 'incremental' or 'full', got {verify!r}")
        self.state: MutableMapping[str, torch.Tensor] = {} if target is None else target
        self.verify = verify
        self.device = None if device is None else torch.device(device)
        self.version: int | None = None
        self.checksum: int | None = None
        self.checksums: dict[str, int] = {}
        self._staged: list[tuple[Any, ...]] = []

    def apply(self, update: DeltaUpdate, *, staged: bool = False) -> dict[str, Any]:
        """Apply ``update``; on any error every tensor is restored and the error re-raised.

        Args:
            update: the :class:`DeltaUpdate`.
            staged: keep this update's undo log after it succeeded, so :meth:`rollback` can restore the state
                before it (several staged updates roll back in reverse order); :meth:`commit` drops the logs.
                Memory: the old bits of every changed element (a whole tensor for a full patch applied in place).

        Returns:
            ``{"version", "full", "changed", "wire_bytes", "raw_bytes"}``.

        Raises:
            DeltaBaseError: a delta whose ``base_version``/``base_checksum`` is not this receiver's state.
            DeltaPayloadError: malformed buffers.
            DeltaChecksumError: a produced tensor or the produced version has another checksum than the sender's.
        """
        if not update.is_full:
            if self.version is None:
                raise DeltaBaseError(f"delta update {update.version} (base {update.base_version}) reached a "
                                     "receiver that holds no version: request a full version")
            if update.base_version != self.version or update.base_checksum != self.checksum:
                raise DeltaBaseError(
                    f"delta update {update.version} applies to version {update.base_version} (checksum "
                    f"{update.base_checksum:016x}), this receiver holds version {self.version} (checksum "
                    f"{self.checksum:016x}): request a full version")
            unknown = [p.name for p in update.patches if p.encoding != "full" and p.name not in self.state]
            if unknown:
                raise DeltaBaseError(f"delta update {update.version} patches tensors this receiver lacks: "
                                     f"{unknown[:5]}")
        undos: list[Callable[[], None]] = []
        replaced: dict[str, torch.Tensor | None] = {}
        checksums: dict[str, int] = {}
        try:
            for p in update.patches:
                target = self.state.get(p.name)
                if p.encoding == "full" and target is None and self.device is not None:
                    p = TensorPatch(p.name, p.dtype, p.shape, p.encoding, p.checksum, p.base_checksum, p.changed,
                                    {"values": p.buffers["values"].to(self.device)})
                base_ck = None if self.verify == "full" or p.encoding == "full" else self.checksums.get(p.name)
                out, ck, undo = apply_patch(target, p, base_checksum=base_ck, verify=self.verify)
                undos.append(undo)
                if out is not target:
                    replaced[p.name] = target
                    self.state[p.name] = out
                checksums[p.name] = ck
            names = {p.name for p in update.patches}
            got = version_checksum({p.name: (p.dtype, p.shape, checksums[p.name]) for p in update.patches})
            if got != update.checksum:
                raise DeltaChecksumError(f"version {update.version}: checksum {got:016x} after applying, the "
                                         f"sender's is {update.checksum:016x}; restored to the base")
        except BaseException:
            self._undo(undos, replaced)
            raise
        # only names of the previous version go: other entries of ``target`` are not this decoder's
        dropped = [n for n in self.checksums if n not in names] if update.is_full else list(update.removed)
        popped = {n: self.state.pop(n) for n in dropped if n in self.state}
        if staged:
            self._staged.append((undos, replaced, popped, self.version, self.checksum, self.checksums))
        self.checksums = checksums
        self.version, self.checksum = update.version, update.checksum
        return {"version": update.version, "full": update.is_full, "changed": update.changed,
                "wire_bytes": update.wire_bytes, "raw_bytes": update.raw_bytes}

    def rollback(self) -> int:
        """Undo every update applied with ``staged=True`` since the last :meth:`commit`, newest first: the tensors,
        version and checksums are those before the first of them, bit for bit. Returns how many were undone."""
        n = len(self._staged)
        while self._staged:
            undos, replaced, popped, version, checksum, checksums = self._staged.pop()
            for name, old in popped.items():
                self.state[name] = old
            self._undo(undos, replaced)
            self.version, self.checksum, self.checksums = version, checksum, checksums
        return n

    def _undo(self, undos: list[Callable[[], None]], replaced: dict[str, torch.Tensor | None]) -> None:
        """Restore what one update's patches changed: run its in-place undo closures newest first, then put back
        the tensors it replaced in ``state`` (``None``: the name was new and goes)."""
        for undo in reversed(undos):
            undo()
        for name, old in replaced.items():
            if old is None:
                self.state.pop(name, None)
            else:
                self.state[name] = old

    def commit(self) -> None:
        """Keep the staged updates (drop their undo logs)."""
        self._staged.clear()

    def reset(self) -> None:
        """Forget the held version (the tensors stay in ``state`` but no delta applies until a full version)."""
        self._staged.clear()
        self.version = self.checksum = None
        self.checksums = {}
