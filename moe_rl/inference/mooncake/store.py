"""A checked client for the Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

What it adds to the raw binding (mooncake 0.3.13):

- **errors instead of codes**: every negative return code becomes :class:`StoreError` naming the op, the
  key and the code (``-900 RPC_FAIL``: the master is unreachable); a missing object becomes
  :class:`MissingKeyError` (the raw ``get`` returns ``b""`` both for a missing key and for a dead master,
  so an empty answer is disambiguated with ``is_exist``);
- **idempotent puts with a conflict check**: Mooncake objects are immutable and a second ``put`` of an
  existing key returns 0 while keeping the *first* payload, so a changed payload would be lost silently.
  :meth:`StoreClient.put_batch` writes duplicates within a batch once, skips keys already stored with the
  same bytes, and raises ValueError for a key stored with different bytes;
- **fail fast on a dead master**: after a -900, calls raise at once for ``unreachable_cooldown_s`` instead
  of each waiting ~4 s for the binding's reconnect attempt to time out (``rpc_failures`` counts them);
- **size checks**: an object may be at most ``max_object_bytes`` (half the client's ``local_buffer_bytes``;
  beyond the buffer the binding fails with -600) and may not be empty (a 0-byte put fails with -600); puts
  are split into sub-batches that fit the buffer, and a batched get that overflows it is completed key by key.

The conflict check reads existing keys back before writing; two writers racing on the same key with
different bytes are not detected (the first one wins, as in Mooncake).

Tensors use Mooncake's own tensor codec (``pub_tensor``/``get_tensor``: dtype and shape travel with the
bytes), which round-trips fp32, bf16, float8_e4m3fn and integer tensors bit-exactly.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from moe_rl.config import BaseConfig
from moe_rl.inference.mooncake._common import INSTALL_HINT
from moe_rl.inference.mooncake.keys import StoreKey

__all__ = ["MissingKeyError", "PutReport", "StoreClient", "StoreClientConfig", "StoreError", "ERROR_CODES"]

MiB = 1 << 20

ERROR_CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (no segment has room: full of pinned/leased objects, or none mounted yet)",
    -600: "INVALID_PARAMS (also: object empty or larger than the local transfer buffer)",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE (a get/exist leased it; retry after default_kv_lease_ttl or pass force=True)",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (master unreachable)",
}
"""Mooncake ``ErrorCode`` values seen from the Python binding (``mooncake-store/include/types.h``)."""

KeyLike = StoreKey | str


def _key(key: KeyLike) -> str:
    if isinstance(key, StoreKey):
        return key.to_str()
    if isinstance(key, str) and key:
        return key
    raise TypeError(f"key={key!r} must be a StoreKey or a non-empty str")


class StoreError(RuntimeError):
    """A Mooncake call returned an error code.

    Attributes:
        op: the binding method (``put_batch``, ``get``, ...).
        key: the (first) key concerned.
        code: the negative Mooncake error code.
    """

    def __init__(self, op: str, key: str, code: int, detail: str = "") -> None:
        self.op, self.key, self.code = op, key, int(code)
        name = ERROR_CODES.get(int(code), "unknown code")
        super().__init__(f"Mooncake {op}({key!r}) failed with code {code} {name}{': ' + detail if detail else ''}")


class MissingKeyError(LookupError):
    """The store holds no object under these keys (never written, removed, or evicted)."""

    def __init__(self, op: str, keys: Sequence[str]) -> None:
        self.op, self.keys = op, list(keys)
        shown = ", ".join(repr(k) for k in self.keys[:3]) + (f" (+{len(self.keys) - 3} more)" if len(self.keys) > 3 else "")
        super().__init__(f"Mooncake {op}: no object under {shown}")


class StoreClientConfig(BaseConfig):
    """How a :class:`StoreClient` joins a Mooncake Store (``MooncakeMaster.client_config()`` fills the
    addresses)."""

    master_address: str
    """``host:port`` of the master RPC service."""
    metadata_url: str
    """Transfer-engine metadata service: ``http://host:port/metadata`` (or ``P2PHANDSHAKE``/etcd URL)."""
    local_hostname: str = "127.0.0.1"
    """Address other clients reach this one at (its segment is served from here)."""
    global_segment_bytes: int = Field(256 * MiB, ge=0)
    """Memory this client contributes to the store (objects of any client may land in it); 0 = pure reader.
    Objects live in some client's segment: when that client closes, its objects disappear."""
    local_buffer_bytes: int = Field(64 * MiB, ge=MiB)
    """Transfer staging buffer; every single object put or get must fit in it."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transfer-engine protocol."""
    rdma_devices: str = ""
    """Comma-separated RDMA NICs for ``protocol="rdma"`` (empty: auto)."""
    unreachable_cooldown_s: float = Field(5.0, ge=0)
    """After a call fails with -900 (master unreachable), further calls fail at once for this many seconds
    instead of each waiting ~4 s for the connection attempt to the dead master to time out (0: always try)."""


@dataclass
class PutReport:
    """What :meth:`StoreClient.put_batch` did.

    Attributes:
        written: keys newly written.
        duplicates_in_batch: extra occurrences of a key within the batch (same bytes) that were not written again.
        already_present: keys that were stored before with the same bytes (not written again).
        bytes_written: payload bytes of ``written``.
    """

    written: int = 0
    duplicates_in_batch: int = 0
    already_present: int = 0
    bytes_written: int = 0


def _as_view(data: Any, key: str) -> memoryview:
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise TypeError(f"payload of key {key!r} has type {type(data).__name__}; expected bytes-like "
                        "(bytes, bytearray, memoryview, contiguous numpy array)") from None
    return view


class StoreClient:
    """A connected Mooncake Store client (context manager; :meth:`close` unmounts its segment).

    Args:
        config: where the master and metadata server are, and how much memory this client lends/uses.

    Raises:
        ImportError: Mooncake or libibverbs is missing (the message says how to install them).
        StoreError: ``setup`` failed (master unreachable, port clash).
    """

    def __init__(self, config: StoreClientConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError(f"cannot import mooncake.store ({exc}): {INSTALL_HINT}") from None
        self.config = config
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            config.local_hostname, config.metadata_url, config.global_segment_bytes, config.local_buffer_bytes,
            config.protocol, config.rdma_devices, config.master_address,
        )
        if rc != 0:
            raise StoreError("setup", config.master_address, rc,
                             f"could not join the store at master {config.master_address}, metadata {config.metadata_url}")
        self._closed = False
        self._unreachable_until = 0.0
        self.rpc_failures = 0
        """Calls that failed with -900 (master unreachable), fail-fast ones included."""

    @property
    def max_object_bytes(self) -> int:
        """Largest single object this client can put or get: half the local transfer buffer (headroom for the
        buffer's allocator; an object larger than the buffer fails with -600)."""
        return self.config.local_buffer_bytes // 2

    @property
    def raw(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (for calls this wrapper does not cover)."""
        self._check_open("raw", "")
        return self._store

    def _check_open(self, op: str, key: str) -> None:
        if self._closed:
            raise RuntimeError(f"StoreClient.{op}({key!r}): the client is closed")
        left = self._unreachable_until - time.monotonic()
        if left > 0:
            self.rpc_failures += 1
            raise StoreError(op, key, -900, f"not retried for another {left:.1f} s after the last RPC failure "
                             "(StoreClientConfig.unreachable_cooldown_s)")

    def _error(self, op: str, key: str, code: int, detail: str = "") -> StoreError:
        """The exception for a failed call; a -900 starts the fail-fast window."""
        if code == -900:
            self.rpc_failures += 1
            self._unreachable_until = time.monotonic() + self.config.unreachable_cooldown_s
        return StoreError(op, key, code, detail)

    # ------------------------------------------------------------------ queries
    def exists_batch(self, keys: Iterable[KeyLike]) -> list[bool]:
        """Whether each key holds an object (one RPC).

        Raises:
            StoreError: the master could not answer (code -900 when it is unreachable).
        """
        ks = [_key(k) for k in keys]
        if not ks:
            return []
        self._check_open("batch_is_exist", ks[0])
        codes = self._store.batch_is_exist(ks)
        out = []
        for k, c in zip(ks, codes, strict=True):
            if c < 0:
                # batch_is_exist reports -1 for any failure; is_exist gives the real code.
                raise self._error("batch_is_exist", k, self._store.is_exist(k) if c == -1 else c)
            out.append(c == 1)
        return out

    def exists(self, key: KeyLike) -> bool:
        """Whether ``key`` holds an object (see :meth:`exists_batch`)."""
        k = _key(key)
        self._check_open("is_exist", k)
        c = self._store.is_exist(k)
        if c < 0:
            raise self._error("is_exist", k, c)
        return c == 1

    # ------------------------------------------------------------------ bytes
    def put(self, key: KeyLike, data: Any, *, pin: bool = False) -> PutReport:
        """Store ``data`` (bytes-like) under ``key``; idempotent (see :meth:`put_batch`)."""
        return self.put_batch([(key, data)], pin=pin)

    def put_batch(self, items: Iterable[tuple[KeyLike, Any]], *, pin: bool = False) -> PutReport:
        """Store several objects; idempotent for duplicate keys.

        - a key repeated within ``items`` with the same bytes is written once (counted in
          ``duplicates_in_batch``); with different bytes -> ValueError;
        - a key already in the store with the same bytes is skipped (``already_present``); with different
          bytes -> ValueError (objects are immutable: put the new payload under a new version/salt).

        Args:
            items: ``(key, payload)`` pairs; payloads are bytes-like, non-empty, at most ``max_object_bytes``.
            pin: hard-pin the new objects (never evicted; only :meth:`remove` frees them).

        Returns:
            a :class:`PutReport`.

        Raises:
            ValueError: an empty or oversized payload, or a conflicting duplicate (the message names the key).
            StoreError: Mooncake returned an error (e.g. -900 master unreachable); keys of this call may be
                partly written, and calling again with the same items is safe.
        """
        self._check_open("put_batch", "")
        report = PutReport()
        unique: dict[str, memoryview] = {}
        for key, data in items:
            k = _key(key)
            view = _as_view(data, k)
            if view.nbytes == 0:
                raise ValueError(f"put_batch: payload of key {k!r} is empty; Mooncake cannot store 0-byte objects")
            if view.nbytes > self.max_object_bytes:
                raise ValueError(
                    f"put_batch: payload of key {k!r} is {view.nbytes} bytes > max_object_bytes="
                    f"{self.max_object_bytes} (half of local_buffer_bytes={self.config.local_buffer_bytes}); split "
                    "it into parts (StoreKey.part) or raise StoreClientConfig.local_buffer_bytes"
                )
            if k in unique:
                if not _same_bytes(unique[k], view):
                    raise ValueError(
                        f"put_batch: key {k!r} appears twice in the batch with different payloads "
                        f"({unique[k].nbytes} vs {view.nbytes} bytes); a key names one immutable object"
                    )
                report.duplicates_in_batch += 1
                continue
            unique[k] = view
        keys = list(unique)
        present = [k for k, there in zip(keys, self.exists_batch(keys), strict=True) if there]
        if present:
            stored = self._get_many("put_batch", present)
            for k, old in zip(present, stored, strict=True):
                if not _same_bytes(old, unique[k]):
                    raise ValueError(
                        f"put_batch: key {k!r} already holds a different payload ({len(old)} bytes stored, "
                        f"{unique[k].nbytes} given); Mooncake objects are immutable: write the new payload under a "
                        "new key (a new weight version or cache_salt)"
                    )
                del unique[k]
                report.already_present += 1
        config = self._replicate_config(pin)
        budget = self.max_object_bytes
        group: list[str] = []
        size = 0
        for k in list(unique) + [None]:  # type: ignore[list-item]
            if k is None or (group and size + unique[k].nbytes > budget):
                if group:
                    rc = self._store.put_batch(group, [unique[g] for g in group], config)
                    if rc != 0:
                        raise self._error("put_batch", group[0], rc, f"batch of {len(group)} keys, {size} bytes")
                    report.written += len(group)
                    report.bytes_written += size
                group, size = [], 0
            if k is not None:
                group.append(k)
                size += unique[k].nbytes
        return report

    def get(self, key: KeyLike) -> bytes:
        """The bytes stored under ``key``.

        Raises:
            MissingKeyError: no such object.
            StoreError: the master or the owner of the object could not be reached.
        """
        return self._get_many("get", [_key(key)])[0]

    def get_batch(self, keys: Iterable[KeyLike]) -> list[bytes]:
        """The bytes stored under each key (one batched transfer; see :meth:`get` for errors)."""
        return self._get_many("get_batch", [_key(k) for k in keys])

    def _get_many(self, op: str, keys: list[str]) -> list[bytes]:
        if not keys:
            return []
        self._check_open(op, keys[0])
        values = list(self._store.get_batch(keys)) if len(keys) > 1 else [self._store.get(keys[0])]
        empty = [i for i, v in enumerate(values) if len(v) == 0]
        if empty:  # missing, or an error the binding reports as b"": ask the master which
            there = self.exists_batch([keys[i] for i in empty])
            missing = [keys[i] for i, t in zip(empty, there, strict=True) if not t]
            if missing:
                raise MissingKeyError(op, missing)
            # A batch whose objects together overflow the local transfer buffer comes back partly empty:
            # fetch those one by one (each object fits on its own, see put_batch).
            for i in empty:
                values[i] = self._store.get(keys[i]) if len(keys) > 1 else b""
                if len(values[i]) == 0:
                    raise StoreError(op, keys[i], -800, "the object exists but no data came back (owner unreachable?)")
        return values

    # ------------------------------------------------------------------ tensors
    def put_tensor(self, key: KeyLike, tensor: Any, *, pin: bool = False) -> PutReport:
        """Store a CPU tensor (dtype and shape travel with it); idempotent like :meth:`put_batch` (an
        existing key must hold a bit-identical tensor of the same dtype and shape, else ValueError).

        Args:
            tensor: any-shape CPU tensor; made contiguous.

        Raises:
            ValueError: conflicting existing tensor, empty or oversized tensor.
            StoreError: Mooncake error code.
        """
        import torch

        k = _key(key)
        self._check_open("put_tensor", k)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put_tensor: tensor for key {k!r} has type {type(tensor).__name__}; expected torch.Tensor")
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes > self.max_object_bytes:
            raise ValueError(f"put_tensor: tensor for key {k!r} has {nbytes} bytes; need 0 < bytes <= "
                             f"max_object_bytes={self.max_object_bytes}")
        if self.exists(k):
            old = self.get_tensor(k)
            if not _bit_equal(old, t):
                raise ValueError(
                    f"put_tensor: key {k!r} already holds a different tensor (stored {old.dtype} "
                    f"{tuple(old.shape)}, given {t.dtype} {tuple(t.shape)}); write it under a new version/salt"
                )
            return PutReport(already_present=1)
        rc = self._store.pub_tensor(k, t, self._replicate_config(pin))
        if rc != 0:
            raise self._error("pub_tensor", k, rc)
        return PutReport(written=1, bytes_written=nbytes)

    def get_tensor(self, key: KeyLike) -> Any:
        """The tensor stored under ``key`` (CPU, the stored dtype and shape).

        Raises:
            MissingKeyError: no such object.
            StoreError: the master or the owner could not be reached.
        """
        k = _key(key)
        self._check_open("get_tensor", k)
        t = self._store.get_tensor(k)
        if t is None:
            if not self.exists(k):
                raise MissingKeyError("get_tensor", [k])
            raise StoreError("get_tensor", k, -800, "the object exists but no tensor came back")
        return t

    # ------------------------------------------------------------------ removal
    def remove(self, key: KeyLike, *, force: bool = False) -> bool:
        """Remove ``key``; False if there was no such object.

        Args:
            force: skip the lease check (an object read within ``default_kv_lease_ttl`` is leased and
                otherwise refused with -706).

        Raises:
            StoreError: any other error (-706 leased, -900 master unreachable).
        """
        k = _key(key)
        self._check_open("remove", k)
        rc = self._store.remove(k, force)
        if rc == -704:
            return False
        if rc != 0:
            raise self._error("remove", k, rc)
        return True

    def remove_prefix(self, prefix: str, *, force: bool = False) -> int:
        """Remove every object whose key starts with ``prefix``; returns how many (see :meth:`remove_regex`)."""
        return self.remove_regex("^" + re.escape(prefix) + ".*", force=force)

    def remove_regex(self, pattern: str, *, force: bool = False) -> int:
        """Remove every object whose key matches the regular expression ``pattern``; returns how many.

        Raises:
            StoreError: Mooncake error code (-900 master unreachable).
        """
        self._check_open("remove_by_regex", pattern)
        rc = self._store.remove_by_regex(pattern, force)
        if rc < 0:
            raise self._error("remove_by_regex", pattern, rc)
        return int(rc)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Leave the store (unmounts this client's segment: objects stored in it disappear); idempotent."""
        if not self._closed:
            self._closed = True
            self._store.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _replicate_config(pin: bool) -> Any:
        from mooncake.store import ReplicateConfig

        cfg = ReplicateConfig()
        cfg.with_hard_pin = bool(pin)
        return cfg


def _same_bytes(a: Any, b: Any) -> bool:
    """Byte equality of two bytes-like objects (numpy: ~30x faster than comparing memoryviews)."""
    import numpy as np

    a, b = memoryview(a).cast("B"), memoryview(b).cast("B")
    return a.nbytes == b.nbytes and bool(np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)))


def _bit_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
