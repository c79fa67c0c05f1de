"""The ``p2p`` weight transport: engine workers pull the pieces they need from the trainer ranks that own them.

Trainer side (:class:`P2PPublisher`, one per trainer rank): ``publish(model, version)`` snapshots this rank's pieces
(:mod:`moe_rl.weights.regions`: cast, copied) and, given ``on_ready`` (the run's publisher passes the announcement),
returns: that snapshot is the trainer's whole blocking time, with no collective. A :class:`PieceServer` thread in
the same process keeps the last ``keep_versions`` snapshots and serves pull requests while the trainer computes the
next step. Each rank's index thread then computes the CRC-32 per piece and posts its piece list (names, dtypes,
shapes, bytes, CRC-32s; no tensor data) to trainer rank 0's TCPStore; rank 0's index thread collects every rank's
list, writes the version's index ``<weights>/announce/p2p_<v>.json`` and only then announces (``source: "p2p"``).

Engine side (:class:`PiecePuller`, one per engine worker, held by ``WeightSyncExtension.init_p2p``): from the index
it computes which pieces it needs (only the tensors it serves, ``names``) and which rank owns each, pulls them from
every owner concurrently, checks every piece's CRC-32 (a mismatch is re-pulled, ``retries`` times, counted), assembles
the whole tensors and only then hands them to the engine: never a mix of two versions, nothing partial.

Mechanism on CPU: ``torch.distributed`` point-to-point ``send``/``recv`` on one gloo group per trainer rank
``{that rank (rank 0), every engine worker}``, built by the ``broadcast`` transport's group code
(``moe_rl.weights.broadcast._Group``, a directly constructed ``ProcessGroupGloo`` on a TCPStore the trainer rank
hosts, outside both sides' default groups; endpoints in ``<weights>/announce/p2p_group.json``,
``broadcast.share_endpoints``). Requests and replies are small JSON values in that TCPStore (prefix ``moe_rl_p2p``)::

    worker:  n = add("seq", 1); set("req/<n>", {"worker", "version", "keys": [piece keys]})
    server:  wait("req/<n>") in order; set("resp/<n>", {"version", "bucket_nbytes"} | {"error"});
             then send the pieces, packed in buckets of <= bucket_bytes (16-byte aligned), with tag n
    worker:  wait("resp/<n>"); recv each bucket from rank 0 with tag n

This is the default backend (``backend="gloo"``); with ``backend="nixl"`` the engines READ the trainer ranks'
NIXL-registered snapshots themselves (:mod:`moe_rl.weights.p2p_nixl`: no serving thread, a version tag per slot).

Faults: a version the rank no longer holds, an unknown piece -> the reply names it (:class:`P2PError`, nothing
loaded); a CRC-32 mismatch -> re-pulled (counted), then :class:`P2PError`; an owner rank gone, a transfer that
stops part-way or times out -> :class:`P2PTransferError` (the puller's groups are closed: a failed point-to-point
op leaves a gloo pair unusable; the run ends with the error, as for ``broadcast``).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from moe_rl.config import BaseConfig

__all__ = ["P2PError", "P2PPublisher", "P2PTransferError", "P2PTransportConfig", "PiecePuller", "PieceServer",
           "fill_checksums", "group_path", "index_path", "read_index", "write_index"]

INDEX_FORMAT = "moe_rl.weights.p2p/1"
GROUP_FILE = "p2p_group.json"
_PREFIX = "moe_rl_p2p"
_INDEX_PREFIX = "moe_rl_p2p_index"
_ALIGN = 16
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.05


class P2PError(RuntimeError):
    """A pull failed and nothing was loaded: version not held, unknown piece, CRC-32 mismatch after retries."""


class P2PTransferError(P2PError):
    """A transfer failed (owner rank gone, stopped part-way, timeout); the puller's groups are closed."""


class P2PTransportConfig(BaseConfig):
    """``trainer.p2p``: every trainer rank serves its pieces; engine workers pull the ones they need."""

    host: str = "127.0.0.1"
    """Address the engine workers reach the trainer ranks at (each rank's TCPStore listens there)."""
    engine_workers: int = Field(1, ge=1)
    """Engine workers pulling (all engines' TP x PP x DP workers; the CPU job runs one engine with one)."""
    timeout_s: float = Field(300.0, gt=0.0)
    """Bound on the engines joining the groups and on every request, reply and bucket of a pull (seconds)."""
    keep_versions: int = Field(2, ge=1)
    """Versions each trainer rank keeps for the engines to pull (each costs one copy of the rank's pieces)."""
    bucket_bytes: int = Field(64 << 20, ge=1)
    """Bound on one packed bucket (the extra memory each side holds while serving / receiving a request)."""
    checksums: bool = True
    """CRC-32 per piece of the snapshot (``zlib.crc32``, on the rank's index thread: outside the trainer's blocking
    time when the publisher announces from there); checked by the engine before loading."""
    backend: Literal["gloo", "nixl"] = "gloo"
    """How the pieces move: ``"gloo"`` (point-to-point over TCP, served by the trainer rank's thread) or ``"nixl"``
    (engines READ the ranks' registered snapshots; the publisher is then built by
    :func:`moe_rl.weights.p2p_nixl.p2p_publisher`, an ImportError naming ``pip install 'moe_rl[nixl]'`` without NIXL)."""


def index_path(weights_root: str | Path, version: int) -> Path:
    """``<weights_root>/announce/p2p_<version>.json``: the version's piece index (rank 0 writes it)."""
    return Path(weights_root) / "announce" / f"p2p_{version}.json"


def group_path(weights_root: str | Path) -> Path:
    """``<weights_root>/announce/p2p_group.json``: every trainer rank's ``[host, port]`` (rank 0 writes it)."""
    return Path(weights_root) / "announce" / GROUP_FILE


def _layout(nbytes: list[int], bucket_bytes: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Consecutive items packed into buckets of at most ``bucket_bytes`` (a larger item: a bucket alone), each at a
    16-byte aligned offset. Returns ``([[(item, offset), ...] per bucket], bucket sizes)``; both sides compute it."""
    buckets: list[list[tuple[int, int]]] = []
    sizes: list[int] = []
    cur: list[tuple[int, int]] = []
    used = 0
    for i, n in enumerate(nbytes):
        off = -(-used // _ALIGN) * _ALIGN
        if cur and off + n > bucket_bytes:
            buckets.append(cur)
            sizes.append(used)
            cur, used, off = [], 0, 0
        cur.append((i, off))
        used = off + n
    if cur:
        buckets.append(cur)
        sizes.append(used)
    return buckets, sizes


def fill_checksums(metas: list[list[Any]], tensors: list[Any]) -> None:
    """Set ``metas[i][4]`` to the CRC-32 (``zlib.crc32`` of the bytes) of ``tensors[i]``, in place.

    Args:
        metas: index entries ``[key, dtype, shape, nbytes, crc32]``.
        tensors: the pieces (CPU, contiguous), in the same order.

    Raises:
        ValueError: ``metas`` and ``tensors`` differ in length.
    """
    from moe_rl.weights.filesystem import _crc

    if len(metas) != len(tensors):
        raise ValueError(f"fill_checksums: {len(metas)} index entries for {len(tensors)} tensors; pass the lists "
                         "PieceServer.snapshot returned")
    for m, t in zip(metas, tensors, strict=True):
        m[4] = _crc(t)


# ---------------------------------------------------------------------------------------------------- index
def write_index(weights_root: str | Path, version: int, ranks: list[list[list[Any]]],
                delta: list[str | None] | None = None) -> Path:
    """Write version ``version``'s piece index atomically after checking that the pieces tile every tensor.

    Args:
        weights_root: the run's ``weights/`` folder.
        version: the policy version.
        ranks: per trainer rank, its pieces as ``[key, dtype, shape, nbytes, crc32]`` (``crc32 = -1``: unchecked).
        delta: with delta encoding, per trainer rank the :class:`moe_rl.weights.delta.DeltaUpdate` header (None: a
            rank with no pieces); ``ranks`` then lists the updates' buffers (keys ``"<patch>/<buffer>"``) and the
            tiling is checked by the engine after decoding (the headers name the pieces).

    Returns:
        The index file (:func:`index_path`).

    Raises:
        ValueError: pieces of one tensor disagree on dtype or full shape, or do not cover it exactly once.
    """
    from moe_rl.weights.regions import parse_piece_key

    count: dict[str, int] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for metas in ranks if delta is None else []:
        for key, dtype, shape, _, _ in metas:
            name, _, full = parse_piece_key(key)
            if meta.setdefault(name, (dtype, full)) != (dtype, full):
                raise ValueError(f"write_index: version {version}: pieces of {name!r} disagree on dtype/full shape "
                                 f"({meta[name]} vs {(dtype, full)}); the trainer ranks cut different models")
            n = 1
            for s in shape:
                n *= int(s)
            count[name] = count.get(name, 0) + n
    for name, (_, full) in meta.items():
        need = 1
        for s in full:
            need *= s
        if count[name] != need:
            raise ValueError(f"write_index: version {version}: the trainer ranks' pieces of {name!r} hold "
                             f"{count[name]} of its {need} elements; a rank's pieces are missing or published twice")
    out = index_path(weights_root, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    body: dict[str, Any] = {"format": INDEX_FORMAT, "version": version, "ranks": ranks}
    if delta is not None:
        body["delta"] = list(delta)
    tmp.write_text(json.dumps(body))
    os.replace(tmp, out)
    return out


def read_index(index: str | Path | Mapping[str, Any], version: int) -> dict[str, Any]:
    """The index of ``version`` (a path or an already read dict).

    Raises:
        P2PError: missing file, another format, or the index of another version.
    """
    if not isinstance(index, Mapping):
        try:
            index = json.loads(Path(index).read_text())
        except FileNotFoundError:
            raise P2PError(f"read_index: no p2p index at {index}: version {version} was not published with the p2p "
                           "transport (or the file was removed)") from None
    if index.get("format") != INDEX_FORMAT or index.get("version") != version:
        raise P2PError(f"read_index: index of format {index.get('format')!r}, version {index.get('version')!r}; "
                       f"expected {INDEX_FORMAT!r}, version {version} (trainer and engine run different moe_rl "
                       "versions, or the wrong index was passed)")
    return dict(index)


# ---------------------------------------------------------------------------------------------------- trainer
class PieceServer:
    """One trainer rank's held versions and the thread serving pull requests for them.

    The server hosts a TCPStore at ``host:port`` (0: a free port, see :attr:`port`); its thread forms the gloo group
    ``{this rank = 0, engine workers 1..world_size-1}`` (returns once every worker joined, at most ``timeout_s``),
    then answers requests in arrival order. :meth:`hold` never waits for the engines.

    Args:
        host: address the workers connect to.
        world_size: 1 + the number of engine workers.
        port: TCPStore port (0: pick one).
        timeout_s: bound on forming the group and on each send (seconds, > 0).
        keep_versions: versions held (>= 1); older ones are dropped by :meth:`hold`.
        bucket_bytes: bound on one packed bucket (>= 1).
        rank: this trainer rank (for messages).

    Raises:
        ValueError: ``world_size < 2`` or a bound out of range.
    """

    def __init__(self, host: str, world_size: int, *, port: int = 0, timeout_s: float = 300.0,
                 keep_versions: int = 2, bucket_bytes: int = 64 << 20, rank: int = 0) -> None:
        import torch.distributed as dist

        if world_size < 2:
            raise ValueError(f"PieceServer: world_size={world_size} must be >= 2 (this rank + >= 1 engine worker)")
        if not timeout_s > 0 or keep_versions < 1 or bucket_bytes < 1:
            raise ValueError(f"PieceServer: timeout_s={timeout_s} must be > 0, keep_versions={keep_versions} >= 1 "
                             f"and bucket_bytes={bucket_bytes} >= 1")
        self.host, self.world_size, self.rank = host, world_size, rank
        self.timeout_s, self.keep_versions, self.bucket_bytes = timeout_s, keep_versions, bucket_bytes
        self._store = dist.TCPStore(host, port, world_size, True, datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        self.port = int(self._store.port)
        self._held: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: str | None = None
        """Why the serving thread stopped (group not formed, a send failed), or None while it serves."""
        self.connected = threading.Event()
        self.fault: str | None = None
        """Test hook for the next reply: ``"stop_after_first_bucket"`` sends one bucket, then nothing;
        ``"corrupt_once"`` flips one byte of the first bucket on the wire (the held copy stays right)."""
        self.stats: dict[str, float] = {"requests": 0, "refused": 0, "bytes_sent": 0, "send_s": 0.0}
        """Totals: requests served, requests refused (version not held, unknown piece), bytes sent, seconds sending."""
        self._thread = threading.Thread(target=self._run, name=f"p2p-server-rank{rank}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- held versions
    def hold(self, version: int, pieces: list[Any], checksums: bool = True) -> list[list[Any]]:
        """Snapshot ``pieces`` (:class:`moe_rl.weights.regions.Piece`) as ``version``: copies (the trainer may update
        its parameters in place right after), CRC-32s; drops versions beyond ``keep_versions``.

        Returns:
            ``[[key, dtype, shape, nbytes, crc32], ...]`` (this rank's part of the index; ``crc32 = -1`` without
            ``checksums``).

        Raises:
            ValueError: ``version`` not above every held version (versions strictly increase), repeated keys.
        """
        metas, tensors = self.snapshot(version, pieces)
        if checksums:
            fill_checksums(metas, tensors)
        return metas

    def snapshot(self, version: int, pieces: list[Any]) -> tuple[list[list[Any]], list[Any]]:
        """Copy ``pieces`` and hold the copies as ``version`` (servable from now on), without CRC-32s; drops versions
        beyond ``keep_versions``. The trainer's only blocking work in the ``p2p`` transport.

        Returns:
            ``(metas, tensors)``: ``[[key, dtype, shape, nbytes, -1], ...]`` and the held copies in the same order
            (never modified afterwards: :func:`fill_checksums` may read them from another thread).

        Raises:
            ValueError: ``version`` not above every held version (versions strictly increase), repeated keys.
        """
        import torch

        with self._lock:
            if self._held and version <= next(reversed(self._held)):
                raise ValueError(f"PieceServer.hold: version={version} must exceed the latest held version "
                                 f"{next(reversed(self._held))}; versions strictly increase")
        snap: dict[str, Any] = {}
        metas: list[list[Any]] = []
        for p in pieces:
            if p.key in snap:
                raise ValueError(f"PieceServer.hold: piece {p.key!r} given twice for version {version}")
            t = p.tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
            snap[p.key] = t
            metas.append([p.key, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size(),
                          -1])
        with self._lock:
            self._held[version] = snap
            while len(self._held) > self.keep_versions:
                self._held.popitem(last=False)
        return metas, list(snap.values())

    @property
    def held_versions(self) -> list[int]:
        with self._lock:
            return list(self._held)

    # ---------------------------------------------------------------- serving thread
    def _run(self) -> None:
        import torch.distributed as dist

        from moe_rl.weights.broadcast import WeightBroadcastError, _Group

        try:
            group = _Group("gloo", self.host, self.port, 0, self.world_size, self.timeout_s, store=self._store)
        except WeightBroadcastError as exc:
            self.error = f"the engine workers did not join trainer rank {self.rank}'s p2p group: {exc}"
            return
        self.connected.set()
        ps = dist.PrefixStore(_PREFIX, self._store)
        n = 1
        idle_since = time.monotonic()
        poll = _POLL_MIN_S
        while not self._stop.is_set():
            if not ps.check([f"req/{n}"]):  # polled (a store wait() with a timeout logs a warning per timeout)
                time.sleep(poll)
                poll = min(_POLL_MAX_S, 2 * poll)
                if time.monotonic() - idle_since > self.timeout_s and int(ps.add("seq", 0)) >= n:
                    n, idle_since = n + 1, time.monotonic()  # the worker took number n and never sent its request
                continue
            poll = _POLL_MIN_S
            req = json.loads(ps.get(f"req/{n}"))
            ps.delete_key(f"req/{n}")
            try:
                self._serve(group, ps, n, req)
            except Exception as exc:  # noqa: BLE001 - a failed send leaves the gloo pair unusable: stop, say why
                self.error = f"trainer rank {self.rank} stopped serving: {type(exc).__name__}: {exc}"
                return
            n += 1
            idle_since = time.monotonic()

    def _serve(self, group: Any, ps: Any, n: int, req: dict[str, Any]) -> None:
        import torch

        version, worker, keys = int(req["version"]), int(req["worker"]), list(req["keys"])
        with self._lock:
            snap = self._held.get(version)
            held = list(self._held)
        missing = [] if snap is None else [k for k in keys if k not in snap]
        if snap is None or missing:
            self.stats["refused"] += 1
            why = (f"trainer rank {self.rank} does not hold version {version} (it holds {held}, keep_versions="
                   f"{self.keep_versions}): load a newer version" if snap is None else
                   f"trainer rank {self.rank} has no piece {missing[0]!r} of version {version} ({len(missing)} "
                   "unknown): the index and the trainer disagree")
            ps.set(f"resp/{n}", json.dumps({"error": why}))
            return
        tensors = [snap[k] for k in keys]
        buckets, sizes = _layout([t.numel() * t.element_size() for t in tensors], self.bucket_bytes)
        ps.set(f"resp/{n}", json.dumps({"version": version, "bucket_bytes": self.bucket_bytes,
                                        "bucket_nbytes": sizes}))
        t0 = time.perf_counter()
        for b, (items, size) in enumerate(zip(buckets, sizes, strict=True)):
            buf = torch.empty(size, dtype=torch.uint8)
            for i, off in items:
                src = tensors[i].reshape(-1).view(torch.uint8)
                buf[off:off + src.numel()].copy_(src)
            if self.fault == "corrupt_once" and size:
                self.fault = None
                buf[0] ^= 0xFF
            group.p2p("send", buf, worker, n, f"bucket {b + 1}/{len(sizes)} of version {version} to worker {worker}")
            self.stats["bytes_sent"] += size
            if self.fault == "stop_after_first_bucket" and len(sizes) > 1:
                self.fault = None
                break
        self.stats["send_s"] += time.perf_counter() - t0
        self.stats["requests"] += 1

    def close(self) -> None:
        """Stop serving (within about 50 ms) and drop the held versions; idempotent."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        with self._lock:
            self._held.clear()


@dataclass(frozen=True)
class _Buffer:
    """A named buffer of a delta update, held and served like a piece (``key``, ``tensor``)."""

    key: str
    tensor: Any


def _as_pieces(model_or_state: Any, cutter: Any, world: int) -> list[Any]:
    import torch

    from moe_rl.weights.regions import Piece

    if isinstance(model_or_state, list) and all(isinstance(p, Piece) for p in model_or_state):
        return model_or_state
    if isinstance(model_or_state, torch.nn.Module):
        if cutter is None:
            raise ValueError("P2PPublisher.publish: a model needs mcfg= (its config) to name its pieces")
        return cutter(model_or_state)
    if isinstance(model_or_state, Mapping) and world == 1:
        return [Piece(k, tuple(v.shape), (0,) * v.dim(), v.detach()) for k, v in model_or_state.items()]
    raise TypeError("P2PPublisher.publish: pass the (sharded) model, a list of moe_rl.weights.regions.Piece, or a "
                    f"dict of HF name -> tensor on a single rank (got {type(model_or_state).__name__} on {world} ranks)")


class _Jobs:
    """One daemon thread running this rank's index jobs in submission order (a stuck job cannot hold up the
    interpreter's exit, unlike a ``ThreadPoolExecutor`` worker)."""

    def __init__(self, name: str) -> None:
        import queue

        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def stop(self) -> None:
        self._q.put(None)


class P2PPublisher:
    """Trainer side of the ``p2p`` transport (one per trainer rank; construction is a collective over the trainer
    ranks when the default group is initialized, ``publish`` is not).

    Construction starts this rank's :class:`PieceServer` and shares every rank's endpoint; rank 0 writes
    ``<weights>/announce/p2p_group.json`` (``{"endpoints", "world_size", "timeout_s"}``). It does not wait for the
    engines: each server's thread forms its group when the workers join (``WeightSyncExtension.init_p2p``).

    ``publish`` copies this rank's pieces (the snapshot) on the calling thread; everything else runs on this rank's
    index thread, in version order: the CRC-32s of the copies, then on ranks > 0 posting this rank's part of the
    index (``[metas, delta header]``, a few KB of JSON) to a key of trainer rank 0's TCPStore
    (``moe_rl_p2p_index/<v>/<r>``), on rank 0 waiting for every rank's part, writing the index (the tiling check
    included) and calling ``on_ready`` (the announcement). No collective runs per version. An engine learns of a
    version only from the announcement, which follows the index, which follows every rank's snapshot: a pull never
    meets a rank that does not hold the version yet.

    Args:
        weights_root: the run's ``weights/`` folder.
        config: :class:`P2PTransportConfig`.
        mcfg: the model's config (to cut a model into pieces).
        dtype: dtype on the wire (fp32-kept names stay fp32).
        delta: a :class:`moe_rl.weights.delta_sync.DeltaConfig` (delta encoding when enabled), or None.
    """

    name = "p2p"
    server_class: Any = PieceServer
    """The held versions' server (gloo); ``moe_rl.weights.p2p_nixl.NixlP2PPublisher`` sets ``NixlPieceServer``."""

    def __init__(self, weights_root: str | Path, config: P2PTransportConfig | None = None, *, mcfg: Any = None,
                 dtype: Any = None, delta: Any = None) -> None:
        import torch
        import torch.distributed as dist

        from moe_rl.weights.broadcast import share_endpoints

        self.root = Path(weights_root)
        self.delta = None  # this rank's RankDeltaEncoder when delta encoding is on
        if delta is not None and delta.enabled:
            from moe_rl.weights.delta_sync import RankDeltaEncoder

            self.delta = RankDeltaEncoder(self.root, delta)
        self.config = config or P2PTransportConfig()
        self.mcfg = mcfg
        self.dtype = dtype if dtype is not None else torch.bfloat16
        from moe_rl.weights.regions import PieceCutter

        self._cutter = PieceCutter(mcfg, self.dtype) if mcfg is not None else None  # the cut, planned once
        on = dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        c = self.config
        server_cls: Any = self.server_class
        if c.backend != getattr(server_cls, "backend", "gloo"):
            raise ValueError(f"P2PPublisher: config.backend={c.backend!r} with server {server_cls.__name__}; build it "
                             "with moe_rl.weights.p2p_nixl.p2p_publisher(weights_root, config, ...), which picks the "
                             "publisher of the backend")
        self.server = server_cls(c.host, 1 + c.engine_workers, timeout_s=c.timeout_s, keep_versions=c.keep_versions,
                                 bucket_bytes=c.bucket_bytes, rank=self.rank)
        self.endpoints = share_endpoints(group_path(self.root), c.host, self.server.port,
                                         world_size=1 + c.engine_workers, timeout_s=c.timeout_s, backend=c.backend)
        self._link: Any = None  # this rank's own client of trainer rank 0's TCPStore: the index parts
        if self.world > 1:
            host, port = self.endpoints[0]
            client = dist.TCPStore(str(host), int(port), None, False, datetime.timedelta(seconds=c.timeout_s))
            self._link = dist.PrefixStore(_INDEX_PREFIX, client)
        self._jobs = _Jobs(f"p2p-index-rank{self.rank}")
        self._pending: list[tuple[int, Future]] = []
        self.background_error: str | None = None
        """Why an index job of an earlier version failed (raised by the next :meth:`publish` / :meth:`flush`)."""

    # ---------------------------------------------------------------- publish
    def publish(self, model_or_state: Any, version: int, *,
                on_ready: Callable[[Any], None] | None = None) -> Any:
        """Snapshot this rank's pieces of ``version`` for the engines to pull; the rest runs on the index thread.

        Args:
            model_or_state: the (sharded) model, a list of :class:`moe_rl.weights.regions.Piece`, or ``{hf name:
                tensor}`` on a single rank.
            version: the policy version (above every earlier one).
            on_ready: None: return once rank 0 wrote the index (every rank's CRC-32s and parts included; a caller
                that announces right after may). A callable: return right after the snapshot; rank 0's index thread
                calls ``on_ready(stats)`` once the index is written (``stats``: this version's
                :class:`moe_rl.weights.protocol.UpdateStats` with ``bytes_total`` and ``extra["index"]``); the
                other ranks never call it. Errors of the index thread are raised by the next ``publish`` or by
                :meth:`flush` / :meth:`close`.

        Returns:
            :class:`moe_rl.weights.protocol.UpdateStats` (``blocking_s``: the time this call took: the pieces and
            their snapshot, plus, with ``on_ready=None``, the wait for the index; ``bytes``: this rank's pieces;
            ``extra``: ``snapshot_s``, ``held_versions``, ``rank``, ``background`` and, with ``on_ready=None``, on
            rank 0 ``index``).

        Raises:
            P2PError: this rank's server stopped (the engines never joined within ``timeout_s``, or a send failed),
                or an earlier version's index job failed (a trainer rank's part did not arrive within
                ``timeout_s``, the index could not be written, ``on_ready`` raised).
            ValueError: ``version`` not above the latest held one; with ``on_ready=None``, the pieces do not tile
                the tensors (rank 0).
            TypeError: ``model_or_state`` is none of the accepted kinds, ``version`` is not an int, or ``on_ready``
                is neither None nor callable.
        """
        from moe_rl.weights.protocol import UpdateStats

        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"P2PPublisher.publish: version={version!r} is a {type(version).__name__}; pass the policy "
                            "version as an int")
        if on_ready is not None and not callable(on_ready):
            raise TypeError(f"P2PPublisher.publish: on_ready={on_ready!r} is not callable; pass None (return once the "
                            "index is written) or a function taking the version's UpdateStats")
        t0 = time.perf_counter()
        self._reap()
        if self.background_error is not None:
            if self.delta is not None:
                self.delta.failed()  # the engines may lack the failed version: the next one goes in full
            raise P2PError(f"P2PPublisher.publish(version={version}): an earlier version's index job failed: "
                           f"{self.background_error}")
        if self.server.error is not None:
            raise P2PError(f"P2PPublisher.publish(version={version}): {self.server.error}")
        pieces = _as_pieces(model_or_state, self._cutter, self.world)
        header, summary = None, None
        try:
            if self.delta is not None:  # hold the update's buffers (a full update: every piece's bits)
                from moe_rl.weights.delta_sync import update_summary

                update = self.delta.encode(pieces, version)
                pieces = []
                if update is not None:
                    header, tensors = update.to_tensors()
                    pieces = [_Buffer(k, t) for k, t in tensors.items()]
                    summary = {**update_summary(update, len(header.encode())), **self.delta.stats()}
            metas, held = self.server.snapshot(version, pieces)
        except BaseException:
            if self.delta is not None:
                self.delta.failed()
            raise
        snapshot_s = time.perf_counter() - t0
        extra: dict[str, Any] = {"rank": self.rank, "snapshot_s": snapshot_s, "held_versions":
                                 self.server.held_versions, "background": on_ready is not None}
        if summary is not None:
            extra["delta"] = summary
        st = UpdateStats(version=version, transport=self.name,
                         bytes=sum(m[3] for m in metas) + (len(header.encode()) if header is not None else 0),
                         tensors=len(metas), extra=extra)
        # the index thread reports on its own copy (the caller may change st once this returns) and starts once
        # this call is about to return (it would otherwise take the interpreter lock from this thread meanwhile)
        released = threading.Event()
        job = self._jobs.submit(self._index_job, version, metas, held, header,
                                UpdateStats(**{**st.as_dict(), "blocking_s": snapshot_s}), on_ready, released)
        if on_ready is None:
            released.set()
            try:
                done = job.result()
            except BaseException:
                if self.delta is not None:
                    self.delta.failed()
                raise
            if done is not None:
                st.bytes_total = done["bytes_total"]
                st.extra["index"] = done["index"]
        else:
            self._pending.append((version, job))
        st.blocking_s = time.perf_counter() - t0
        released.set()
        return st

    def _index_job(self, version: int, metas: list[list[Any]], held: list[Any], header: str | None, st: Any,
                   on_ready: Callable[[Any], None] | None, released: threading.Event) -> dict[str, Any] | None:
        """The index thread's part of ``publish`` (once ``released``): CRC-32s, this rank's part posted (ranks > 0)
        or every part collected, the index written and ``on_ready`` called (rank 0). Returns ``{"index",
        "bytes_total"}`` on rank 0, else None."""
        released.wait(self.config.timeout_s)
        t0 = time.perf_counter()
        if self.config.checksums:
            fill_checksums(metas, held)
        if self.rank != 0:
            self._link.set(f"{version}/{self.rank}", json.dumps([metas, header]))
            return None
        parts: list[Any] = [[metas, header]]
        if self.world > 1:
            keys = [f"{version}/{r}" for r in range(1, self.world)]
            try:
                self._link.wait(keys, datetime.timedelta(seconds=self.config.timeout_s))
            except Exception as exc:  # noqa: BLE001 - name the ranks that did not post their part
                late = [r for r, k in enumerate(keys, 1) if not self._link.check([k])]
                raise P2PError(f"trainer ranks {late} did not post their part of version {version}'s index within "
                               f"timeout_s={self.config.timeout_s} ({type(exc).__name__}): a rank is gone or "
                               "stuck") from exc
            for k in keys:
                parts.append(json.loads(self._link.get(k)))
                self._link.delete_key(k)
        ranks = [m for m, _ in parts]
        index = write_index(self.root, version, ranks, None if self.delta is None else [h for _, h in parts])
        total = sum(m[3] for ms in ranks for m in ms)
        for old in range(version - self.config.keep_versions - 4, version - self.config.keep_versions + 1):
            if 0 <= old < version:
                index_path(self.root, old).unlink(missing_ok=True)  # no longer held: nobody can pull it
        st.bytes_total = total
        st.extra.update(index=str(index), index_s=time.perf_counter() - t0)
        if on_ready is not None:
            on_ready(st)
        return {"index": str(index), "bytes_total": total}

    def _reap(self) -> None:
        """Drop finished index jobs; the first failure becomes :attr:`background_error`."""
        keep = []
        for version, job in self._pending:
            if not job.done():
                keep.append((version, job))
            elif job.exception() is not None and self.background_error is None:
                exc = job.exception()
                self.background_error = f"version {version}: {type(exc).__name__}: {exc}"
        self._pending = keep

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for this rank's pending index jobs (rank 0: until every announced-by-``on_ready`` version is
        announced).

        Args:
            timeout_s: bound on the whole wait (seconds); None: ``config.timeout_s`` plus 30 s (each job is itself
                bounded by ``timeout_s``).

        Raises:
            P2PError: a job failed (the first failure is named), or the wait timed out.
        """
        end = time.monotonic() + (self.config.timeout_s + 30.0 if timeout_s is None else timeout_s)
        for version, job in list(self._pending):
            try:
                job.exception(timeout=max(0.0, end - time.monotonic()))
            except TimeoutError:
                raise P2PError(f"P2PPublisher.flush: the index job of version {version} did not finish in time "
                               f"(timeout_s={timeout_s})") from None
        self._reap()
        if self.background_error is not None:
            raise P2PError(f"P2PPublisher: an index job failed: {self.background_error}")

    def close(self) -> None:
        """Finish the pending index jobs (:meth:`flush`), then stop serving; idempotent.

        Raises:
            P2PError: a pending index job failed (the server is stopped all the same).
        """
        try:
            if self._pending:
                self.flush()
        finally:
            self._pending = []
            self._jobs.stop()
            self.server.close()


# ---------------------------------------------------------------------------------------------------- engine
class PiecePuller:
    """Engine-worker side: one gloo group per trainer rank (joined here), and :meth:`pull` of whole versions.

    Args:
        endpoints: ``[[host, port], ...]`` in trainer-rank order (``p2p_group.json``).
        rank: this worker's rank in every group, 1..world_size-1.
        world_size: 1 + the number of engine workers.
        timeout_s: bound on joining and on every reply and bucket (seconds, > 0).

    Raises:
        ValueError: empty ``endpoints``, ``rank`` out of range, ``timeout_s <= 0``.
        P2PTransferError: a group could not be joined within ``timeout_s``.
    """

    def _check_args(self, endpoints: list[list[Any]], rank: int, world_size: int, timeout_s: float) -> None:
        """Check and keep the constructor's arguments (shared by the backends' pullers)."""
        if not endpoints:
            raise ValueError("PiecePuller: endpoints=[]; pass one [host, port] per trainer rank (p2p_group.json)")
        if not 1 <= rank < world_size:
            raise ValueError(f"PiecePuller: rank={rank} must be in 1..world_size-1={world_size - 1} (rank 0 is the "
                             "trainer rank of each group); check rank_offset and world_size")
        if not timeout_s > 0:
            raise ValueError(f"PiecePuller: timeout_s={timeout_s} must be > 0 seconds")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    def __init__(self, endpoints: list[list[Any]], rank: int, world_size: int, *, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        from moe_rl.weights.broadcast import WeightBroadcastError, _Group

        self._check_args(endpoints, rank, world_size, timeout_s)
        t0 = time.perf_counter()
        try:
            self.groups = [_Group("gloo", str(h), int(p), rank, world_size, timeout_s) for h, p in endpoints]
        except WeightBroadcastError as exc:
            raise P2PTransferError(f"PiecePuller: {exc}") from exc
        self._stores = [dist.PrefixStore(_PREFIX, g.store) for g in self.groups]
        self.init_s = time.perf_counter() - t0
        self.closed: str | None = None

    def plan(self, index: dict[str, Any], names: set[str] | None = None) -> list[list[list[Any]]]:
        """Per trainer rank, the index entries ``[key, dtype, shape, nbytes, crc]`` this worker needs (pieces of the
        tensors in ``names``; None: all).

        Raises:
            P2PError: the index has another number of ranks than this puller has groups, or lacks a name.
        """
        from moe_rl.weights.regions import parse_piece_key

        ranks = index["ranks"]
        if len(ranks) != len(self.groups):
            raise P2PError(f"PiecePuller.plan: the index lists {len(ranks)} trainer ranks, this worker joined "
                           f"{len(self.groups)} groups; re-join with the current p2p_group.json")
        out = [[m for m in metas if names is None or parse_piece_key(m[0])[0] in names] for metas in ranks]
        if names is not None:
            have = {parse_piece_key(m[0])[0] for ms in out for m in ms}
            if have != set(names):
                raise P2PError(f"PiecePuller.plan: {len(set(names) - have)} requested tensors are not in the index "
                               f"(e.g. {sorted(set(names) - have)[:3]}); the engine serves a different model")
        return out

    def _request(self, r: int, version: int, metas: list[list[Any]]) -> list[tuple[str, Any]]:
        """Pull ``metas`` from trainer rank ``r``; ``[(key, tensor)]`` (views of fresh bucket buffers)."""
        import torch

        from moe_rl.weights.broadcast import WeightBroadcastError, _dtype

        ps, g = self._stores[r], self.groups[r]
        td = datetime.timedelta(seconds=self.timeout_s)
        try:
            n = int(ps.add("seq", 1))
            ps.set(f"req/{n}", json.dumps({"worker": self.rank, "version": version, "keys": [m[0] for m in metas]}))
            ps.wait([f"resp/{n}"], td)
            resp = json.loads(ps.get(f"resp/{n}"))
            ps.delete_key(f"resp/{n}")
        except Exception as exc:  # noqa: BLE001 - the store is the trainer rank's: it is gone or stuck
            raise P2PTransferError(f"trainer rank {r} did not answer the request for version {version} within "
                                   f"timeout_s={self.timeout_s} ({type(exc).__name__}: {exc}): the rank is gone") from exc
        if "error" in resp:
            raise P2PError(resp["error"])
        buckets, sizes = _layout([int(m[3]) for m in metas], int(resp["bucket_bytes"]))
        if sizes != resp["bucket_nbytes"]:
            raise P2PError(f"trainer rank {r} packs version {version} into buckets of {resp['bucket_nbytes'][:4]} "
                           f"bytes, the index's piece sizes give {sizes[:4]}: the index and the trainer disagree")
        out: list[tuple[str, Any]] = []
        for b, (items, size) in enumerate(zip(buckets, sizes, strict=True)):
            buf = torch.empty(size, dtype=torch.uint8)
            try:
                g.p2p("recv", buf, 0, n, f"bucket {b + 1}/{len(sizes)} of version {version} from trainer rank {r}")
            except WeightBroadcastError as exc:
                raise P2PTransferError(str(exc)) from exc
            for i, off in items:
                key, dt, shape, nb, _ = metas[i]
                out.append((key, buf[off:off + int(nb)].view(_dtype(dt)).view(tuple(shape))))
        return out

    def pull(self, index: str | Path | Mapping[str, Any], version: int, names: set[str] | None = None,
             retries: int = 1) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
        """Pull, check and assemble version ``version``: every piece of the tensors in ``names`` from its owner.

        Args:
            index: the version's index (:func:`index_path` or its dict).
            version: the policy version.
            names: Hugging Face names to rebuild (the tensors this engine serves); None: all.
            retries: re-pulls of a trainer rank's pieces whose CRC-32 differs, per rank (>= 0).

        Returns:
            ``([(hf_name, tensor)] sorted, whole tensors), {"bytes", "pieces", "ranks", "pull_s", "retries"}``.

        Raises:
            ValueError: ``retries`` is not an int >= 0.
            P2PError: version not held, unknown piece, CRC-32 still wrong after ``retries`` (nothing returned).
            P2PTransferError: a rank gone, a transfer stopped or timed out (the groups are closed: make a new
                puller).
        """
        from moe_rl.weights.regions import assemble

        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"PiecePuller.pull: retries={retries!r} must be an int >= 0 (re-pulls after a CRC-32 "
                             "mismatch)")
        if self.closed is not None:
            raise P2PTransferError(f"PiecePuller.pull: the p2p groups are closed after an earlier failure "
                                   f"({self.closed[:200]}); join again (WeightSyncExtension.init_p2p)")
        idx = read_index(index, version)
        if "delta" in idx:
            raise P2PError(f"PiecePuller.pull: version {version} is delta-encoded; pull it with pull_delta (the "
                           "engine's update_weights_from_p2p does)")
        plan = self.plan(idx, names)
        pieces, rep = self._pull(plan, version, retries)
        weights = assemble(pieces, names)
        return weights, rep

    def pull_delta(self, index: str | Path | Mapping[str, Any], version: int, retries: int = 1) -> dict[int, Any]:
        """Pull every trainer rank's :class:`moe_rl.weights.delta.DeltaUpdate` of a delta-encoded version.

        Returns:
            ``{trainer rank: DeltaUpdate}`` (ranks with no pieces left out); ``self.last_pull`` holds the pull's
            ``{"bytes", "pieces", "ranks", "pull_s", "retries"}``.

        Raises:
            P2PError: not a delta index, version not held, CRC-32 still wrong (nothing returned).
            P2PTransferError: as :meth:`pull`.
            moe_rl.weights.delta.DeltaPayloadError: an update's buffers disagree with its header.
        """
        from moe_rl.weights.delta import DeltaUpdate

        if self.closed is not None:
            raise P2PTransferError(f"PiecePuller.pull_delta: the p2p groups are closed after an earlier failure "
                                   f"({self.closed[:200]}); join again (WeightSyncExtension.init_p2p)")
        idx = read_index(index, version)
        if "delta" not in idx:
            raise P2PError(f"PiecePuller.pull_delta: version {version}'s index is not delta-encoded; use pull")
        plan = self.plan(idx, None)
        pieces, rep = self._pull(plan, version, retries, by_rank=True)
        self.last_pull = rep
        return {r: DeltaUpdate.from_tensors(h, dict(pieces[r])) for r, h in enumerate(idx["delta"]) if h is not None}

    def _pull(self, plan: list[list[list[Any]]], version: int, retries: int, by_rank: bool = False,
              ) -> tuple[Any, dict[str, Any]]:
        """Request ``plan`` from every trainer rank concurrently, CRC-32s checked (re-pulled up to ``retries``
        times); ``([(key, tensor)] or, by_rank, one such list per rank, stats)``."""
        from moe_rl.weights.filesystem import _crc

        t0 = time.perf_counter()
        retried = [0] * len(plan)

        def one(r: int) -> list[tuple[str, Any]]:
            want = plan[r]
            if not want:
                return []
            got = dict(self._request(r, version, want))
            for attempt in range(retries + 1):
                bad = [m for m in want if m[4] >= 0 and _crc(got[m[0]]) != m[4]]
                if not bad:
                    return [(m[0], got[m[0]]) for m in want]
                if attempt == retries:
                    m = bad[0]
                    raise P2PError(f"piece {m[0]!r} of version {version} from trainer rank {r} has CRC-32 "
                                   f"{_crc(got[m[0]]):#010x}, the index says {m[4]:#010x} ({len(bad)} pieces bad after "
                                   f"{retries} re-pulls); nothing loaded")
                retried[r] += 1
                got.update(self._request(r, version, bad))
            raise AssertionError("unreachable")

        results: list[Any] = [None] * len(plan)
        errors: list[BaseException] = []
        with ThreadPoolExecutor(len(plan)) as pool:
            futures = {pool.submit(one, r): r for r in range(len(plan))}
            for f, r in futures.items():
                try:
                    results[r] = f.result()
                except Exception as exc:  # noqa: BLE001 - every rank's error is reported
                    errors.append(exc)
        if errors:
            transfer = [e for e in errors if isinstance(e, P2PTransferError)]
            msg = "; ".join(f"{type(e).__name__}: {e}" for e in errors)
            if transfer:
                self.close(msg)
                raise P2PTransferError(f"pull of version {version} failed ({msg}); nothing loaded; the p2p groups are "
                                       "closed (join again)") from transfer[0]
            raise P2PError(f"pull of version {version} failed ({msg}); nothing loaded") from errors[0]
        pieces = [it for res in results for it in res]
        pull_s = time.perf_counter() - t0
        return results if by_rank else pieces, {"bytes": sum(int(m[3]) for ms in plan for m in ms),
                                                "pieces": len(pieces), "ranks": len(plan), "pull_s": pull_s,
                                                "retries": sum(retried)}

    def close(self, why: str = "closed") -> None:
        """Leave the groups."""
        self.closed = why
        self.groups, self._stores = [], []
