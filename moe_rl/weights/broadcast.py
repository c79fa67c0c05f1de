"""Weight updates over a torch.distributed broadcast group: the trainer (rank 0) sends, every engine worker receives.

The group is created beside, never through, the default process group of either side: the trainer hosts a
``torch.distributed.TCPStore`` and both sides construct a ``ProcessGroupGloo`` on it directly (CPU), or vLLM's
``StatelessProcessGroup`` + ``PyNcclCommunicator`` (GPU, ``backend="nccl"``). Neither calls
``init_process_group``, so the trainer's FSDP/EP groups and vLLM's own TP/PP groups are untouched. The NCCL
path follows vLLM's recipe: ``examples/offline_inference/rlhf_utils.py`` (``stateless_init_process_group``,
``WorkerExtension.init_weight_update_group`` / ``update_weight``) and, in vllm 0.32,
``vllm/distributed/weight_transfer/nccl_common.py`` (``worker_init_process_group``: worker rank =
``dp_index * (tp * pp) + rank + rank_offset``). It is imported lazily and is NOT exercised by the tests here
(no GPU); the gloo path is, against a real vLLM CPU server.

Wire format of one update (every message is a ``broadcast`` from rank 0)::

    1. header length   int64 [1]
    2. header          uint8 [header_len]   JSON: {"protocol", "version", "buckets": [[{name, dtype, shape,
                                            offset, nbytes}, ...], ...], "bucket_nbytes": [...]}
    3. bucket i        uint8 [bucket_nbytes[i]]  the raw bytes of its tensors, each at a 16-byte aligned offset

Every worker receives every tensor (full HF checkpoint names; vLLM's loader keeps the worker's TP shard), as
in vLLM's own NCCL example. A bucket holds consecutive tensors up to ``bucket_bytes`` (a larger tensor gets a
bucket of its own), so the sender holds one packed bucket at a time and a receiver streams buckets into the
engine's weight loader (``WeightSyncExtension._apply_weights(weights_iterator=...)``). Tensors travel as raw
bytes in their own dtype (fp32, bf16, float8_e4m3fn from ``moe_rl.weights.fp8``, ...): bit-exact.

Handshake (the HTTP ``/collective_rpc`` call returns only when the worker method returns, so every RPC must
run concurrently with the trainer's side of the same step; :func:`connect_engines` and
:func:`broadcast_weights` do exactly that)::

    trainer                                    engine worker (via VllmClient RPC)
    WeightBroadcaster(host, port)  -- TCPStore listening (non-blocking)
    connect()  ........ concurrently ........  init_weight_broadcast(host, port, rank_offset, world_size)
       both construct the gloo group; returns when all world_size ranks joined (or timeout_s passed)
    send(tensors, v) ... concurrently .......  update_weights_from_broadcast(v)
       header, then buckets; the worker loads while receiving, then records version v

Timeouts: every collective (group construction, header, each bucket) fails after ``timeout_s`` instead of
hanging; a peer that died fails at once ("Connection closed by peer"). Both surface as
:class:`WeightBroadcastError` naming the step. A failed collective leaves the group unusable, so both sides
drop it: build a new ``WeightBroadcaster`` and run :func:`connect_engines` again. A transfer that fails
part-way leaves the engine's weights partially updated (they are streamed into the model): the worker says so
in its error and keeps its old ``weight_version``; reload a version from a path (or re-send it on a new group). While the RPC runs the engine takes no
model step, so issue the update only when the trainer's tensors are ready (in-flight requests resume
afterwards; see ``VllmClient.pause``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from moe_rl.config import BaseConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "BroadcastPlan",
    "BroadcastTransportConfig",
    "ShardedBroadcastPublisher",
    "BroadcastReceiver",
    "TensorMeta",
    "WeightBroadcastError",
    "WeightBroadcaster",
    "broadcast_weights",
    "connect_engines",
    "plan_buckets",
    "read_group_file",
    "share_endpoints",
]

PROTOCOL = 1
"""Wire-format version carried in every header; a receiver refuses another one."""

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Default bound on one packed bucket (bytes): the extra memory each side holds during a transfer."""

_ALIGN = 16  # byte alignment of each tensor inside a bucket (a uint8 slice can be viewed as any dtype)

Backend = Literal["gloo", "nccl"]


class WeightBroadcastError(RuntimeError):
    """A broadcast-group step failed: group construction, header or a bucket (timeout, dead peer, mismatch)."""


# ---------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in its bucket: ``nbytes`` raw bytes at byte ``offset``, viewed as ``dtype[shape]``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BroadcastPlan:
    """The header of one update: the policy ``version`` and the tensors of each bucket, in send order."""

    version: int
    buckets: list[list[TensorMeta]]
    bucket_nbytes: list[int]
    protocol: int = PROTOCOL
    delta: str | None = None
    """With delta encoding: the :class:`moe_rl.weights.delta.DeltaUpdate` header (JSON) whose buffers the buckets
    carry (:meth:`DeltaUpdate.to_tensors`); None: the tensors are pieces or whole tensors."""

    @property
    def num_tensors(self) -> int:
        return sum(len(b) for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)

    def to_bytes(self) -> bytes:
        d = {
            "protocol": self.protocol, "version": self.version, "bucket_nbytes": self.bucket_nbytes,
            "buckets": [[[m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in b] for b in self.buckets],
        }
        if self.delta is not None:
            d["delta"] = self.delta
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> BroadcastPlan:
        d = json.loads(raw.decode())
        if d.get("protocol") != PROTOCOL:
            raise WeightBroadcastError(
                f"broadcast header protocol={d.get('protocol')!r}, this side speaks {PROTOCOL}: trainer and engine "
                "run different moe_rl versions; install the same version on both"
            )
        buckets = [[TensorMeta(n, dt, tuple(s), o, nb) for n, dt, s, o, nb in b] for b in d["buckets"]]
        return cls(version=int(d["version"]), buckets=buckets, bucket_nbytes=[int(x) for x in d["bucket_nbytes"]],
                   delta=d.get("delta"))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightBroadcastError(f"broadcast header names dtype {name!r}, which this torch does not have")
    return dt


def plan_buckets(
    named_tensors: Sequence[tuple[str, torch.Tensor]], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> BroadcastPlan:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (one larger tensor: a bucket alone).

    Args:
        named_tensors: ``[(hf_name, tensor), ...]``, any dtype and shape; names unique.
        version: policy version the tensors are (>= 0).
        bucket_bytes: bound on a bucket's packed size in bytes (>= 1).

    Returns:
        The plan; each tensor's ``offset`` is 16-byte aligned inside its bucket.

    Raises:
        ValueError: a name repeats, ``version < 0`` or ``bucket_bytes < 1``.
        TypeError: an entry is not a ``(str, torch.Tensor)`` pair.
    """
    import torch

    if bucket_bytes < 1:
        raise ValueError(f"plan_buckets: bucket_bytes={bucket_bytes} must be >= 1 byte")
    if int(version) < 0:
        raise ValueError(f"plan_buckets: version={version} must be >= 0")
    buckets: list[list[TensorMeta]] = []
    sizes: list[int] = []
    seen: set[str] = set()
    cur: list[TensorMeta] = []
    used = 0
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):  # fmt: skip
            raise TypeError(f"plan_buckets: entry {item!r:.80} is not a (name: str, tensor: torch.Tensor) pair")
        name, t = item
        if name in seen:
            raise ValueError(f"plan_buckets: tensor name {name!r} appears twice; names must be unique")
        seen.add(name)
        nbytes = t.numel() * t.element_size()
        offset = -(-used // _ALIGN) * _ALIGN
        if cur and offset + nbytes > bucket_bytes:
            buckets.append(cur)
            sizes.append(used)
            cur, used, offset = [], 0, 0
        cur.append(TensorMeta(name, _dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        used = offset + nbytes
    if cur:
        buckets.append(cur)
        sizes.append(used)
    return BroadcastPlan(version=int(version), buckets=buckets, bucket_nbytes=sizes)


# ---------------------------------------------------------------------------------------------------- group
class _Group:
    """A broadcast group of ``world_size`` ranks on a TCPStore rendezvous, outside the default group."""

    def __init__(self, backend: Backend, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 store: Any = None, device: Any = None):  # fmt: skip
        import torch

        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.timeout_s = timeout_s
        self.store: Any = store
        where = f"{backend} group at {host}:{port} as rank {rank} of {world_size}"
        try:
            if backend == "gloo":
                import torch.distributed as dist

                td = datetime.timedelta(seconds=timeout_s)
                if store is None:
                    store = dist.TCPStore(host, port, world_size, False, td)
                self.store = store  # the rendezvous store (the p2p transport's request channel uses it too)
                self._pg = dist.ProcessGroupGloo(dist.PrefixStore("moe_rl_weights", store), rank, world_size, td)
                self.device = torch.device("cpu")
            elif backend == "nccl":
                # vLLM's recipe (vllm/distributed/weight_transfer/nccl_common.py stateless_init_process_group):
                # a StatelessProcessGroup for the rendezvous, then a PyNcclCommunicator on it. Untested here.
                from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
                from vllm.distributed.utils import StatelessProcessGroup

                dev = device if device is not None else torch.cuda.current_device()
                spg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                                   store_timeout=int(timeout_s))  # fmt: skip
                self._comm = PyNcclCommunicator(spg, device=dev)
                self.device = torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
            else:
                raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        except ValueError:
            raise
        except Exception as exc:
            raise WeightBroadcastError(
                f"could not join the {where} within timeout_s={timeout_s} s: {exc}. Every rank must join at the "
                "same time: the trainer's connect() and each engine's init_weight_broadcast RPC concurrently "
                "(moe_rl.weights.broadcast.connect_engines)"
            ) from exc

    def p2p(self, op: Literal["send", "recv"], t: torch.Tensor, peer: int, tag: int, what: str) -> None:
        """Point-to-point ``send`` to / ``recv`` from rank ``peer`` with ``tag`` (gloo only: the ``p2p``
        transport's stand-in for RDMA; waits at most ``timeout_s``).

        Raises:
            NotImplementedError: ``backend="nccl"`` (the GPU path of a pull transport is NIXL or Mooncake's
                TransferEngine, not this group).
            WeightBroadcastError: the peer died, the transfer timed out or sizes disagree (``what`` names it).
        """
        if self.backend != "gloo":
            raise NotImplementedError(f"_Group.p2p: backend={self.backend!r}; point-to-point pulls run on gloo only")
        try:
            work = (self._pg.send if op == "send" else self._pg.recv)([t], peer, tag)
            work.wait()
        except Exception as exc:
            raise WeightBroadcastError(
                f"point-to-point {op} failed at {what} (rank {self.rank} <-> {peer} of {self.world_size}, gloo, "
                f"timeout_s={self.timeout_s}): {exc}. The peer died or stopped mid-transfer"
            ) from exc

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        try:
            if self.backend == "gloo":
                import torch.distributed as dist

                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                self._pg.broadcast([t], opts).wait()
            else:
                import torch

                self._comm.broadcast(t, src=0, stream=torch.cuda.current_stream())
                torch.cuda.current_stream().synchronize()
        except Exception as exc:
            raise WeightBroadcastError(
                f"weight broadcast failed at {what} (rank {self.rank} of {self.world_size}, {self.backend}, "
                f"timeout_s={self.timeout_s}): {exc}. A peer died or did not take part in this step; each update "
                "needs the trainer's send() and every engine's update_weights_from_broadcast concurrently"
            ) from exc


# ---------------------------------------------------------------------------------------------------- trainer
class WeightBroadcaster:
    """Trainer side (rank 0): hosts the rendezvous and broadcasts versions of the weights to every engine worker.

    Args:
        master_addr: address the engine workers reach the trainer at (the TCPStore listens there).
        port: TCPStore port; 0 picks a free one (read :attr:`port` and pass it to the workers).
        world_size: 1 + the number of engine workers (all engines, all their TP/PP/DP workers).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; vLLM's StatelessProcessGroup +
            PyNcclCommunicator, needs vllm on the trainer; not tested in this repo).
        timeout_s: bound in seconds on joining the group and on every collective.
        bucket_bytes: bound on one packed bucket (bytes).

    Raises:
        ValueError: ``world_size < 2``, ``timeout_s <= 0`` or an unknown ``backend``.
    """

    def __init__(self, master_addr: str, port: int, world_size: int, *, backend: Backend = "gloo",
                 timeout_s: float = 120.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES):  # fmt: skip
        if world_size < 2:
            raise ValueError(f"WeightBroadcaster: world_size={world_size} must be >= 2 (the trainer + >= 1 worker)")
        if not timeout_s > 0:
            raise ValueError(f"WeightBroadcaster: timeout_s={timeout_s} must be > 0 seconds")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"WeightBroadcaster: backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        if bucket_bytes < 1:
            raise ValueError(f"WeightBroadcaster: bucket_bytes={bucket_bytes} must be >= 1 byte")
        self.master_addr, self.world_size, self.backend = master_addr, world_size, backend
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self._store: Any = None
        if backend == "gloo":
            import torch.distributed as dist

            self._store = dist.TCPStore(master_addr, port, world_size, True, datetime.timedelta(seconds=timeout_s),
                                        wait_for_workers=False)  # fmt: skip
            self.port = int(self._store.port)
        else:
            if port == 0:
                raise ValueError("WeightBroadcaster: backend='nccl' needs an explicit port (vLLM's "
                                 "StatelessProcessGroup binds it); pass a free port")  # fmt: skip
            self.port = port
        self._group: _Group | None = None
        self._broken: str | None = None
        self.stats: dict[str, float] = {"updates": 0, "bytes": 0, "send_s": 0.0, "failures": 0}
        """Totals over this broadcaster's life: updates sent, bytes sent, seconds sending, failed sends."""

    def connect(self) -> float:
        """Join the group as rank 0; blocks until every worker joined (``init_weight_broadcast``) or timeout.

        Returns:
            Seconds it took.

        Raises:
            WeightBroadcastError: not all ``world_size`` ranks joined within ``timeout_s``.
        """
        t0 = time.perf_counter()
        self._group = _Group(self.backend, self.master_addr, self.port, 0, self.world_size, self.timeout_s,
                             store=self._store)  # fmt: skip
        return time.perf_counter() - t0

    def send(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int, delta: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Broadcast one version of the weights (header, then each bucket); blocks until all is sent.

        Args:
            named_tensors: ``{hf_name: tensor}`` or ``[(hf_name, tensor), ...]`` in HF checkpoint naming and any
                dtype (the engine's loader converts); CPU tensors for gloo, CUDA for nccl (others are copied).
            version: the policy version (>= 0); each worker checks it equals the version its RPC was given.
            delta: the :class:`moe_rl.weights.delta.DeltaUpdate` header when ``named_tensors`` are its buffers
                (sent in the plan; ``bytes`` then includes it).

        Returns:
            ``{"version", "tensors", "buckets", "bytes", "send_s", "gbps"}``.

        Raises:
            RuntimeError: :meth:`connect` was not called.
            WeightBroadcastError: a peer died or timed out (the message names the bucket).
        """
        import torch

        if self._broken is not None:
            raise WeightBroadcastError(
                f"WeightBroadcaster.send: the group broke earlier ({self._broken:.200}); a failed collective leaves "
                "it unusable: create a new WeightBroadcaster and run connect_engines again"
            )
        if self._group is None:
            raise RuntimeError("WeightBroadcaster.send: call connect() first (concurrently with the engines' "
                               "init_weight_broadcast; see connect_engines)")  # fmt: skip
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        plan = plan_buckets(items, version, self.bucket_bytes)
        if delta is not None:
            plan = dataclasses.replace(plan, delta=delta)
        tensors = dict(items)
        g = self._group
        t0 = time.perf_counter()
        try:
            raw = plan.to_bytes()
            g.broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=g.device), "header length")
            g.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(g.device), "header")
            for i, (metas, nbytes) in enumerate(zip(plan.buckets, plan.bucket_nbytes, strict=True)):
                buf = torch.empty(nbytes, dtype=torch.uint8, device=g.device)
                for m in metas:
                    src = tensors[m.name].detach().contiguous().reshape(-1).view(torch.uint8)
                    buf[m.offset:m.offset + m.nbytes].copy_(src)
                g.broadcast(buf, f"bucket {i + 1}/{len(plan.buckets)} ({len(metas)} tensors, {nbytes} bytes, "
                                 f"first {metas[0].name!r}) of version {version}")  # fmt: skip
        except BaseException as exc:
            # Any failure after the plan (a collective, or packing a tensor once the header is out) leaves the
            # receivers mid-update: the group is out of step and must not be reused.
            self.stats["failures"] += 1
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        dt = time.perf_counter() - t0
        self.stats["updates"] += 1
        sent = plan.total_bytes + (len(delta.encode()) if delta is not None else 0)
        self.stats["bytes"] += sent
        self.stats["send_s"] += dt
        return {"version": plan.version, "tensors": plan.num_tensors, "buckets": len(plan.buckets),
                "bytes": sent, "send_s": dt, "gbps": plan.total_bytes / max(dt, 1e-9) / 1e9}

    def close(self) -> None:
        """Drop the group and stop hosting the rendezvous (the workers should ``close_weight_broadcast``)."""
        self._group = None
        self._store = None


# ---------------------------------------------------------------------------------------------------- worker
@dataclass
class _Stream:
    """Receiving one update: yields ``(name, tensor)`` bucket by bucket; counts what arrived."""

    group: _Group
    plan: BroadcastPlan
    received_buckets: int = 0
    yielded: int = 0
    recv_s: float = 0.0
    _done: bool = field(default=False, repr=False)

    def _recv(self, i: int) -> Any:
        import torch

        t0 = time.perf_counter()
        buf = torch.empty(self.plan.bucket_nbytes[i], dtype=torch.uint8, device=self.group.device)
        metas = self.plan.buckets[i]
        self.group.broadcast(buf, f"bucket {i + 1}/{len(self.plan.buckets)} ({len(metas)} tensors, "
                                  f"first {metas[0].name!r}) of version {self.plan.version}")  # fmt: skip
        self.received_buckets += 1
        self.recv_s += time.perf_counter() - t0
        return buf

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, metas in enumerate(self.plan.buckets):
            buf = self._recv(i)  # a fresh buffer per bucket: the loader may keep views until a layer completes
            for m in metas:
                t = buf[m.offset:m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)
                self.yielded += 1
                yield m.name, t
        self._done = True

    def drain(self) -> int:
        """Receive (and drop) the buckets not received yet, keeping the group in step; returns how many."""
        n = 0
        while self.received_buckets < len(self.plan.buckets):
            self._recv(self.received_buckets)
            n += 1
        return n


class BroadcastReceiver:
    """Worker side of the group (rank ``rank`` > 0): receives the updates a :class:`WeightBroadcaster` sends.

    Used by ``WeightSyncExtension.init_weight_broadcast`` / ``update_weights_from_broadcast``; also usable
    directly by any process (tests, non-vLLM consumers).

    Args:
        master_addr, port: the trainer's rendezvous (``WeightBroadcaster.master_addr`` / ``.port``).
        rank: this worker's rank, 1..world_size-1.
        world_size: as the trainer's.
        backend: as the trainer's.
        timeout_s: bound in seconds on joining and on every collective.
        device: CUDA device for ``nccl`` (default: current); ignored for gloo.

    Raises:
        ValueError: ``rank`` not in ``1..world_size-1``.
        WeightBroadcastError: the group could not be joined within ``timeout_s``.
    """

    def __init__(self, master_addr: str, port: int, rank: int, world_size: int, *, backend: Backend = "gloo",
                 timeout_s: float = 120.0, device: Any = None):  # fmt: skip
        if not 1 <= rank < world_size:
            raise ValueError(f"BroadcastReceiver: rank={rank} must be in 1..world_size-1={world_size - 1} "
                             "(rank 0 is the trainer); check rank_offset and world_size")  # fmt: skip
        if not timeout_s > 0:
            raise ValueError(f"BroadcastReceiver: timeout_s={timeout_s} must be > 0 seconds")
        t0 = time.perf_counter()
        self.group = _Group(backend, master_addr, int(port), rank, world_size, timeout_s, device=device)
        self.init_s = time.perf_counter() - t0
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def receive_header(self) -> BroadcastPlan:
        """Receive the next update's header (blocks until the trainer sends, at most ``timeout_s``)."""
        import torch

        g = self.group
        n = torch.zeros(1, dtype=torch.int64, device=g.device)
        g.broadcast(n, "header length")
        raw = torch.empty(int(n.item()), dtype=torch.uint8, device=g.device)
        g.broadcast(raw, "header")
        return BroadcastPlan.from_bytes(raw.cpu().numpy().tobytes())

    def stream(self, plan: BroadcastPlan) -> _Stream:
        """An iterable of ``(name, tensor)`` that receives ``plan``'s buckets as it is consumed; ``drain()`` it
        on early exit. The tensors are views of per-bucket buffers, in the sender's dtype and shape."""
        return _Stream(self.group, plan)

    def receive_all(self) -> tuple[int, dict[str, Any]]:
        """Receive one whole update: ``(version, {name: tensor})`` (holds every tensor: tests, small models)."""
        plan = self.receive_header()
        return plan.version, {name: t for name, t in self.stream(plan)}


# ---------------------------------------------------------------------------------------------------- orchestration
async def connect_engines(broadcaster: WeightBroadcaster, clients: Sequence[Any],
                          workers_per_engine: int | Sequence[int] = 1) -> dict[str, Any]:  # fmt: skip
    """Form the group: ``broadcaster.connect()`` (in a thread) concurrently with every engine's
    ``init_weight_broadcast`` RPC. Engine ``i``'s workers get ranks ``rank_offset_i + 0..workers_i-1`` with
    ``rank_offset_i = 1 + sum(workers of the engines before it)``.

    Args:
        broadcaster: not yet connected; ``world_size`` must be ``1 + total workers``.
        clients: objects with ``init_weight_broadcast(master_addr, port, rank_offset, world_size, backend,
            timeout_s)`` (``VllmClient``).
        workers_per_engine: workers of each engine (TP x PP x DP), one int for all or one per client.

    Returns:
        ``{"connect_s", "engines": [each client's result]}``.

    Raises:
        ValueError: ``world_size`` does not match the workers.
        WeightBroadcastError: any side failed (all failures are listed).
    """
    counts = [workers_per_engine] * len(clients) if isinstance(workers_per_engine, int) else list(workers_per_engine)
    if len(counts) != len(clients) or 1 + sum(counts) != broadcaster.world_size:
        raise ValueError(f"connect_engines: broadcaster.world_size={broadcaster.world_size} must be 1 + the "
                         f"engines' workers {counts} = {1 + sum(counts)}; build the broadcaster with that")  # fmt: skip
    offsets = [1 + sum(counts[:i]) for i in range(len(clients))]
    rpcs = [c.init_weight_broadcast(broadcaster.master_addr, broadcaster.port, off, broadcaster.world_size,
                                    backend=broadcaster.backend, timeout_s=broadcaster.timeout_s)
            for c, off in zip(clients, offsets, strict=True)]  # fmt: skip
    results = await asyncio.gather(asyncio.to_thread(broadcaster.connect), *rpcs, return_exceptions=True)
    _raise_failures("connect_engines", results)
    return {"connect_s": results[0], "engines": list(results[1:])}


async def broadcast_weights(broadcaster: WeightBroadcaster, clients: Sequence[Any],
                            named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                            version: int) -> dict[str, Any]:  # fmt: skip
    """One update: ``broadcaster.send`` (in a thread) concurrently with every engine's
    ``update_weights_from_broadcast(version)`` RPC.

    Returns:
        ``{"send": broadcaster.send's result, "engines": [each client's result], "update_s"}``.

    Raises:
        ValueError, TypeError: ``plan_buckets`` rejects the tensors or version (checked before any engine RPC).
        WeightBroadcastError: any side failed (all failures are listed; engines whose RPC failed may hold
            partially updated weights: re-send the version).
    """
    t0 = time.perf_counter()
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    # Bad input (a repeated name, a non-tensor, a negative version) fails here, before any engine is asked to
    # receive: otherwise each engine's RPC would wait timeout_s for a header that never comes and drop the group.
    plan_buckets(items, version, broadcaster.bucket_bytes)
    rpcs = [c.update_weights_from_broadcast(version) for c in clients]
    results = await asyncio.gather(asyncio.to_thread(broadcaster.send, items, version), *rpcs,
                                   return_exceptions=True)  # fmt: skip
    _raise_failures(f"broadcast_weights(version={version})", results)
    return {"send": results[0], "engines": list(results[1:]), "update_s": time.perf_counter() - t0}


def _raise_failures(what: str, results: list[Any]) -> None:
    failures = [(("trainer" if i == 0 else f"engine {i - 1}"), r) for i, r in enumerate(results)
                if isinstance(r, BaseException)]  # fmt: skip
    if failures:
        msg = "; ".join(f"{who}: {type(e).__name__}: {e}" for who, e in failures)
        raise WeightBroadcastError(f"{what} failed on {len(failures)} of {len(results)} sides: {msg}") from \
            failures[0][1]


# ---------------------------------------------------------------------------------------------------- sharded
GROUP_FILE = "broadcast_group.json"
"""``<weights>/announce/broadcast_group.json``: ``{"endpoints": [[host, port], ...], "world_size", "backend",
"timeout_s"}``, one endpoint per trainer rank, written by trainer rank 0 once every rank listens."""


class BroadcastTransportConfig(BaseConfig):
    """``trainer.broadcast``: one torch.distributed group per trainer rank, that rank + every engine worker."""

    host: str = "127.0.0.1"
    """Address the engine workers reach the trainer ranks at (each rank's TCPStore listens there)."""
    engine_workers: int = Field(1, ge=1)
    """Engine workers receiving (all engines' TP x PP x DP workers; the CPU job runs one engine with one)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors, vLLM's PyNccl; not exercised on CPU)."""
    timeout_s: float = Field(300.0, gt=0.0)
    """Bound on joining the groups and on every collective (a dead peer fails at once)."""
    bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1)
    """Bound on one packed bucket (the extra memory each side holds per group during a transfer)."""


def group_file(weights_root: str | Path) -> Path:
    return Path(weights_root) / "announce" / GROUP_FILE


def read_group_file(weights_root: str | Path, path: str | Path | None = None) -> dict[str, Any] | None:
    """The trainer's broadcast endpoints (or those of the file ``path``), or None before trainer rank 0 wrote
    them."""
    try:
        return json.loads(Path(path or group_file(weights_root)).read_text())
    except FileNotFoundError:
        return None


def share_endpoints(path: Path, host: str, port: int, **fields: Any) -> list[list[Any]]:
    """Every trainer rank's ``[host, port]`` (a collective over the default group when it is initialized); trainer
    rank 0 writes ``{"endpoints": [...], **fields}`` to ``path`` atomically (the engines join one group per
    endpoint). Shared by the ``broadcast`` and ``p2p`` transports.

    Returns:
        ``[[host, port], ...]`` in trainer-rank order.
    """
    import torch.distributed as dist

    on = dist.is_initialized()
    endpoints: list[Any] = [None] * (dist.get_world_size() if on else 1)
    if on:
        dist.all_gather_object(endpoints, [host, int(port)])
    else:
        endpoints = [[host, int(port)]]
    if not on or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"endpoints": endpoints, **fields}))
        os.replace(tmp, path)
    return endpoints


class ShardedBroadcastPublisher:
    """Trainer side of the ``broadcast`` transport (one per trainer rank): each rank sends only its own pieces
    (:mod:`moe_rl.weights.regions`) over its own group ``{this rank, every engine worker}``; no rank gathers.

    Construction is a collective over the trainer ranks: each rank hosts a TCPStore, rank 0 writes
    ``weights/announce/broadcast_group.json`` with every rank's endpoint, then every rank joins its group
    (:meth:`WeightBroadcaster.connect`), which returns once the engine workers joined
    (``WeightSyncExtension.init_sharded_broadcast``, issued by the orchestrator's watcher when the file appears).

    Args:
        weights_root: the run's ``weights/`` folder (for the group file).
        config: :class:`BroadcastTransportConfig`.
        mcfg: the model's config (to name the pieces).
        dtype: dtype on the wire (fp32-kept names stay fp32).

    Raises:
        WeightBroadcastError: the engines did not join within ``config.timeout_s``.
    """

    name = "broadcast"

    def __init__(self, weights_root: str | Path, config: BroadcastTransportConfig, *, mcfg: Any = None,
                 dtype: Any = None, delta: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self.config, self.mcfg = config, mcfg
        self.delta = None  # this rank's RankDeltaEncoder when delta encoding is on
        if delta is not None and delta.enabled:
            from moe_rl.weights.delta_sync import RankDeltaEncoder

            self.delta = RankDeltaEncoder(weights_root, delta)
        self.dtype = dtype if dtype is not None else torch.bfloat16
        on = dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        port = 0 if config.backend == "gloo" else _free_port(config.host)
        self.sender = WeightBroadcaster(config.host, port, 1 + config.engine_workers, backend=config.backend,
                                        timeout_s=config.timeout_s, bucket_bytes=config.bucket_bytes)
        self.endpoints = share_endpoints(group_file(weights_root), config.host, self.sender.port,
                                         world_size=1 + config.engine_workers, backend=config.backend,
                                         timeout_s=config.timeout_s)
        self.connect_s = self.sender.connect()

    def publish(self, model_or_state: Any, version: int) -> Any:
        """Send this rank's pieces of ``version`` (blocks until the engine workers received them, not loaded).

        Returns:
            :class:`moe_rl.weights.protocol.UpdateStats` (``bytes``: this rank's; ``extra``: buckets, send_s).

        Raises:
            WeightBroadcastError: an engine worker died or timed out (the group is unusable afterwards).
        """
        import torch

        from moe_rl.weights.protocol import UpdateStats
        from moe_rl.weights.regions import Piece, local_pieces

        t0 = time.perf_counter()
        if isinstance(model_or_state, torch.nn.Module):
            if self.mcfg is None:
                raise ValueError("ShardedBroadcastPublisher.publish: a model needs mcfg= to name its pieces")
            items = [(p.key, p.tensor) for p in local_pieces(model_or_state, self.mcfg, self.dtype)]
        elif isinstance(model_or_state, list) and all(isinstance(p, Piece) for p in model_or_state):
            items = [(p.key, p.tensor) for p in model_or_state]  # pieces already cut (the run publisher's)
        elif isinstance(model_or_state, Mapping) and self.world == 1:
            items = list(model_or_state.items())
        else:
            raise TypeError("ShardedBroadcastPublisher.publish: pass the (sharded) model, a list of "
                            "moe_rl.weights.regions.Piece, or a dict of HF name -> tensor on a single rank (got "
                            f"{type(model_or_state).__name__} on {self.world} ranks)")
        summary = None
        if self.delta is None:
            rep = self.sender.send(items, version)
        else:
            from moe_rl.weights.delta_sync import update_summary

            try:
                from moe_rl.weights.regions import piece_key

                # plain names (a single rank's state dict) become whole-tensor piece keys: the engine assembles
                keyed = [(k if "@" in k else piece_key(k, (0,) * t.dim(), tuple(t.shape)), t) for k, t in items]
                update = self.delta.encode(keyed, version)
                if update is None:  # no pieces on this rank: an empty plan keeps the group in step
                    rep = self.sender.send([], version)
                else:
                    header, tensors = update.to_tensors()
                    rep = self.sender.send(list(tensors.items()), version, delta=header)
                    summary = {**update_summary(update, len(header.encode())), **self.delta.stats()}
            except BaseException:
                self.delta.failed()  # the engines may lack this version: the next one goes in full
                raise
        st = UpdateStats(version=version, transport=self.name, blocking_s=time.perf_counter() - t0,
                         bytes=rep["bytes"], tensors=rep["tensors"],
                         extra={"buckets": rep["buckets"], "send_s": rep["send_s"], "rank": self.rank})
        if summary is not None:
            st.extra["delta"] = summary
        return st

    def close(self) -> None:
        self.sender.close()


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
