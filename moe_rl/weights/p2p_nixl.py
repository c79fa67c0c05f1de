"""NIXL backend of the ``p2p`` weight transport (``trainer.p2p.backend = "nixl"``): engine workers READ the pieces
they need straight out of the trainer ranks' registered host snapshots; the trainer takes no part in a pull.

Selected explicitly (the default backend is ``"gloo"``, :mod:`moe_rl.weights.p2p`); NIXL is imported only then, and
a missing package is an ``ImportError`` saying how to install it (``pip install 'moe_rl[nixl]'``).

Trainer side (:class:`NixlPieceServer`, a :class:`moe_rl.weights.p2p.PieceServer` without a serving thread): one
NIXL agent (UCX backend) per trainer rank and ``keep_versions`` snapshot *slots*, each one contiguous ``uint8`` host
buffer registered with the agent once (registered again only when a version needs more bytes than the slot has,
which bumps the registration generation and republishes the agent metadata). ``snapshot`` copies the version's
pieces into the slot of the version it evicts, 64-byte aligned after a 64-byte header whose first 8 bytes are the
slot's *version tag* (int64), and publishes, in the rank's TCPStore (prefix ``moe_rl_p2p_nixl``)::

    md/<gen>      the agent's metadata (bytes) for registration generation <gen>
    held          {"<version>": slot} of the versions held now (overwritten, never deleted: a read never blocks)
    slot/<s>      {"version", "gen", "agent", "tag": address, "pieces": {key: [address, nbytes]}} of slot s

Engine side (:class:`NixlPiecePuller`, a :class:`moe_rl.weights.p2p.PiecePuller`): one agent per worker, each trainer
rank's agent added from ``md/<gen>`` (re-added when the generation changes), one registered receive buffer per trainer
rank (reallocated and registered again only when a pull needs more bytes). A request is one ``READ`` transfer of
exactly the planned pieces into the receive buffer, then a second ``READ`` of the slot's version tag. The CRC-32
checks, re-pulls and assembly are the gloo path's (:meth:`PiecePuller._pull`).

Version guarantee (the gloo path's: a pull returns the bytes of the version asked for or an error, never bytes of
another version; there the server copies from a held snapshot that is never written again). Here a slot *is*
rewritten ``keep_versions`` versions later, while an engine may still be reading it, so the slot is a seqlock: the
trainer stores the tag ``-1`` before it writes a slot and the new version after the last byte; the engine reads the
tag after its data READ completed and accepts the data only if the tag still equals the version it asked for. A
writer that started before the tag READ has stored ``-1`` (x86 stores are ordered: total store order), so a torn or
newer slot is always detected and reported like an evicted version (:class:`moe_rl.weights.p2p.P2PError`, "does not
hold version", nothing loaded). The CRC-32s are an independent second check.

Faults: a version not held (evicted, never published here), an unknown piece -> :class:`P2PError` naming it; a slot
rewritten during the read -> :class:`P2PError`; a transfer that fails or exceeds ``timeout_s``, a trainer rank's
store gone -> :class:`moe_rl.weights.p2p.P2PTransferError` (the puller is closed).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from moe_rl.weights.p2p import P2PError, P2PPublisher, P2PTransferError, PiecePuller, PieceServer

__all__ = ["NixlP2PPublisher", "NixlPiecePuller", "NixlPieceServer", "import_nixl", "open_puller", "p2p_publisher",
           "store_is_nixl"]

_NPREFIX = "moe_rl_p2p_nixl"
_HEADER = 64
_ALIGN = 64
_INSTALL = ("pip install 'moe_rl[nixl]' (pins nixl==1.5.2 and nixl-cu12==1.5.1, which run on CPU hosts too), or set "
            "trainer.p2p.backend='gloo'")


def import_nixl() -> tuple[Any, Any, Any]:
    """``(nixl_agent, nixl_agent_config, nixl_thread_sync_t)`` from ``nixl._api``.

    Raises:
        ImportError: NIXL is not installed (the message says how to install it).
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise ImportError(f"trainer.p2p.backend='nixl' needs the NIXL Python package, which is not importable "
                          f"({exc}): {_INSTALL}") from exc
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def _agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and a progress thread, safe to call from several threads.

    On a host without InfiniBand devices (no ``/sys/class/infiniband`` entries) UCX's ``ib``/``rdmacm`` modules are
    not loaded (``UCX_MODULES=^ib,rdmacm`` unless ``UCX_MODULES`` is set): the libnl bundled with the
    ``nixl-cu12`` 1.5.1 wheel crashes the process at exit (SIGSEGV in its destructor) once they are loaded there.
    """
    nixl_agent, nixl_agent_config, sync = import_nixl()
    ib = "/sys/class/infiniband"
    if not (os.path.isdir(ib) and os.listdir(ib)):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"],
                                               sync_mode=sync.NIXL_THREAD_SYNC_STRICT))
    if "UCX" not in agent.backends:
        raise ImportError(f"NIXL is installed but its UCX plugin is missing (plugins: {agent.plugin_list}): {_INSTALL}")
    return agent


def _offsets(nbytes: list[int], start: int = 0) -> tuple[list[int], int]:
    """64-byte aligned offsets of consecutive regions from ``start``; ``(offsets, end)``."""
    out, used = [], start
    for n in nbytes:
        used = -(-used // _ALIGN) * _ALIGN
        out.append(used)
        used += int(n)
    return out, used


def store_is_nixl(host: str, port: int, timeout_s: float = 30.0) -> bool:
    """True when the trainer rank's p2p TCPStore at ``host:port`` belongs to a :class:`NixlPieceServer`."""
    import torch.distributed as dist

    st = dist.TCPStore(str(host), int(port), None, False, datetime.timedelta(seconds=timeout_s))
    return bool(st.check([f"{_NPREFIX}/backend"]))


def open_puller(endpoints: list[list[Any]], rank: int, world_size: int, *, timeout_s: float = 300.0) -> PiecePuller:
    """The puller matching the trainer's ``trainer.p2p.backend``: a :class:`NixlPiecePuller` when trainer rank 0's
    store was made by a :class:`NixlPieceServer`, else the gloo :class:`moe_rl.weights.p2p.PiecePuller` (arguments and
    errors as theirs; NIXL is imported only in the first case).

    Raises:
        ValueError: empty ``endpoints`` (and as the pullers).
        ImportError: the trainer serves over NIXL and NIXL is not installed here.
    """
    if not endpoints:
        raise ValueError("open_puller: endpoints=[]; pass one [host, port] per trainer rank (p2p_group.json)")
    h, p = endpoints[0]
    cls = NixlPiecePuller if store_is_nixl(h, p, timeout_s) else PiecePuller
    return cls(endpoints, rank, world_size, timeout_s=timeout_s)


# ---------------------------------------------------------------------------------------------------- trainer
class NixlPieceServer(PieceServer):
    """One trainer rank's held versions in NIXL-registered host slots (see the module docstring).

    Same arguments, methods and errors as :class:`moe_rl.weights.p2p.PieceServer` (``bucket_bytes`` unused: a READ
    moves the planned regions at once); there is no serving thread (``connected`` is set at once).

    Raises:
        ImportError: NIXL is not installed.
    """

    backend = "nixl"

    def __init__(self, host: str, world_size: int, *, port: int = 0, timeout_s: float = 300.0,
                 keep_versions: int = 2, bucket_bytes: int = 64 << 20, rank: int = 0) -> None:
        import torch.distributed as dist

        self.agent = _agent(f"moe_rl_p2p_trainer{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        self.agent_name = self.agent.name
        self._slots: list[dict[str, Any]] = []  # {"buf": uint8 tensor, "reg": reg descs, "version": int | None}
        self._slot_of: dict[int, int] = {}
        self._snap_lock = threading.Lock()
        self.gen = 0
        self.stats_nixl: dict[str, float] = {"registrations": 0, "register_s": 0.0}
        """Slot registrations so far and the seconds they took."""
        super().__init__(host, world_size, port=port, timeout_s=timeout_s, keep_versions=keep_versions,
                         bucket_bytes=bucket_bytes, rank=rank)
        self._ns = dist.PrefixStore(_NPREFIX, self._store)
        self._store.set(f"{_NPREFIX}/backend", "nixl")
        self._ns.set(f"md/{self.gen}", self.agent.get_agent_metadata())
        self._ns.set("held", "{}")

    def _publish_held(self) -> None:
        """``held`` in the store (call with ``_lock`` held)."""
        self._ns.set("held", json.dumps({str(v): s for v, s in self._slot_of.items()}))

    def _run(self) -> None:  # nothing to serve: the engines read the registered slots themselves
        self.connected.set()

    def _slot_for(self, version: int, nbytes: int) -> int:
        """The slot version ``version`` goes to (a free one, else the oldest held version's, evicted here), grown
        and registered again when smaller than ``nbytes``."""
        import torch

        with self._lock:
            if len(self._held) >= self.keep_versions:
                old, _ = self._held.popitem(last=False)
                s = self._slot_of.pop(old)
                self._publish_held()
            else:
                used = set(self._slot_of.values())
                s = next((i for i in range(len(self._slots)) if i not in used), len(self._slots))
                if s == len(self._slots):
                    self._slots.append({"buf": None, "reg": None})
        slot = self._slots[s]
        if slot["buf"] is None or slot["buf"].numel() < nbytes:
            t0 = time.perf_counter()
            if slot["buf"] is not None:  # a reader of the old buffer fails its tag check (or its transfer)
                slot["buf"][:8].view(torch.int64)[0] = -1
                self.agent.deregister_memory(slot["reg"])
            buf = torch.zeros(-(-nbytes // _ALIGN) * _ALIGN, dtype=torch.uint8)
            buf[:8].view(torch.int64)[0] = -1
            slot["reg"] = self.agent.register_memory(buf)
            slot["buf"] = buf
            self.gen += 1
            self._ns.set(f"md/{self.gen}", self.agent.get_agent_metadata())
            self.stats_nixl["registrations"] += 1
            self.stats_nixl["register_s"] += time.perf_counter() - t0
        return s

    def snapshot(self, version: int, pieces: list[Any]) -> tuple[list[list[Any]], list[Any]]:
        """Copy ``pieces`` into a registered slot and publish its descriptors as ``version`` (see the module
        docstring); the oldest held version beyond ``keep_versions - 1`` is evicted first (its slot reused).

        Returns / Raises: as :meth:`moe_rl.weights.p2p.PieceServer.snapshot` (the tensors are views of the slot:
        unchanged until the slot is reused, ``keep_versions`` versions later).
        """
        import torch

        with self._snap_lock:
            with self._lock:
                if self._held and version <= next(reversed(self._held)):
                    raise ValueError(f"PieceServer.hold: version={version} must exceed the latest held version "
                                     f"{next(reversed(self._held))}; versions strictly increase")
            keys = [p.key for p in pieces]
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise ValueError(f"PieceServer.hold: piece {dup!r} given twice for version {version}")
            srcs = [p.tensor.detach() for p in pieces]
            nbytes = [t.numel() * t.element_size() for t in srcs]
            offs, end = _offsets(nbytes, _HEADER)
            s = self._slot_for(version, end)
            buf = self._slots[s]["buf"]
            tag = buf[:8].view(torch.int64)
            tag[0] = -1  # seqlock: readers of the evicted version reject what they read from now on
            snap: dict[str, Any] = OrderedDict()
            metas: list[list[Any]] = []
            base = buf.data_ptr()
            where: dict[str, list[int]] = {}
            for p, t, off, nb in zip(pieces, srcs, offs, nbytes, strict=True):
                dst = buf[off:off + nb].view(t.dtype).view(t.shape)
                dst.copy_(t)
                snap[p.key] = dst
                where[p.key] = [base + off, nb]
                metas.append([p.key, str(t.dtype).removeprefix("torch."), list(t.shape), nb, -1])
            tag[0] = version  # after the last byte: the slot holds `version`
            self._ns.set(f"slot/{s}", json.dumps({"version": version, "gen": self.gen, "agent": self.agent_name,
                                                  "tag": base, "pieces": where}))
            with self._lock:
                self._held[version] = snap
                self._slot_of[version] = s
                self._publish_held()
        return metas, list(snap.values())

    def close(self) -> None:
        """Drop the held versions, deregister the slots and destroy the agent (its progress thread is joined here,
        not during interpreter shutdown, where it aborts the process); idempotent."""
        super().close()
        with self._snap_lock:
            for slot in self._slots:
                if slot.get("reg") is not None:
                    slot["buf"][:8].view(__import__("torch").int64)[0] = -1
                    self.agent.deregister_memory(slot["reg"])
                    slot["reg"] = None
            self._slot_of.clear()
            agent, self.agent = self.agent, None
        del agent
        gc.collect()


class NixlP2PPublisher(P2PPublisher):
    """:class:`moe_rl.weights.p2p.P2PPublisher` whose held versions live in a :class:`NixlPieceServer` (``config.backend``
    must be ``"nixl"``); same arguments, methods and errors, plus ImportError when NIXL is not installed."""

    server_class = NixlPieceServer


def p2p_publisher(weights_root: Any, config: Any = None, **kwargs: Any) -> P2PPublisher:
    """The ``p2p`` trainer side of ``config.backend`` (a :class:`moe_rl.weights.p2p.P2PTransportConfig`; None: the
    defaults, gloo): :class:`NixlP2PPublisher` for ``"nixl"``, else :class:`moe_rl.weights.p2p.P2PPublisher`
    (``kwargs``: ``mcfg``, ``dtype``, ``delta``, passed on).

    Raises:
        ImportError: ``"nixl"`` selected and NIXL not installed (the message says how to install it).
    """
    cls = NixlP2PPublisher if config is not None and config.backend == "nixl" else P2PPublisher
    return cls(weights_root, config, **kwargs)


# ---------------------------------------------------------------------------------------------------- engine
class NixlPiecePuller(PiecePuller):
    """Engine-worker side over NIXL: same arguments, methods and errors as
    :class:`moe_rl.weights.p2p.PiecePuller`; joins no group (it connects to each trainer rank's TCPStore for the
    agent metadata and the per-version descriptors).

    Raises:
        ImportError: NIXL is not installed.
        ValueError: as :class:`PiecePuller`.
        P2PTransferError: a trainer rank's store or agent metadata not reachable within ``timeout_s``.
    """

    backend = "nixl"

    def __init__(self, endpoints: list[list[Any]], rank: int, world_size: int, *, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self._check_args(endpoints, rank, world_size, timeout_s)
        t0 = time.perf_counter()
        self.agent = _agent(f"moe_rl_p2p_engine{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        td = datetime.timedelta(seconds=timeout_s)
        try:
            self._stores = [dist.PrefixStore(_NPREFIX, dist.TCPStore(str(h), int(p), None, False, td))
                            for h, p in endpoints]
        except Exception as exc:  # noqa: BLE001 - the trainer rank's store is not there
            raise P2PTransferError(f"NixlPiecePuller: a trainer rank's p2p store ({endpoints}) is not reachable "
                                   f"within timeout_s={timeout_s}: {type(exc).__name__}: {exc}") from exc
        self.groups = [f"nixl:{h}:{p}" for h, p in endpoints]  # one per trainer rank (PiecePuller.plan counts them)
        self._remote: list[tuple[int, str] | None] = [None] * len(endpoints)
        self._recv: list[dict[str, Any] | None] = [None] * len(endpoints)
        self.stats: dict[str, float] = {"registrations": 0, "reads": 0, "read_s": 0.0}
        """Receive-buffer registrations, READ transfers and the seconds spent in them (tag reads included)."""
        self.init_s = time.perf_counter() - t0
        self.closed: str | None = None

    def _agent_for(self, r: int, gen: int) -> str:
        """Trainer rank ``r``'s agent, added (again, when its registration generation changed)."""
        have = self._remote[r]
        if have is not None and have[0] == gen:
            return have[1]
        ps = self._stores[r]
        ps.wait([f"md/{gen}"], datetime.timedelta(seconds=self.timeout_s))
        if have is not None:
            self.agent.remove_remote_agent(have[1])
        name = self.agent.add_remote_agent(ps.get(f"md/{gen}"))
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remote[r] = (gen, name)
        return name

    def _buffer(self, r: int, keys: list[str], nbytes: list[int]) -> tuple[Any, list[int]]:
        """Trainer rank ``r``'s receive buffer and the offsets of ``keys`` in it: the layout of the last full request
        when it has every key (a re-pull rewrites only its pieces), else a new layout (the buffer grown and
        registered again when too small)."""
        import torch

        rb = self._recv[r]
        if rb is not None and all(k in rb["at"] for k in keys):
            return rb["buf"], [rb["at"][k] for k in keys]
        offs, end = _offsets(nbytes, _ALIGN)  # the first 64 bytes: the version tag's landing place
        if rb is None or rb["buf"].numel() < end:
            if rb is not None:
                self.agent.deregister_memory(rb["reg"])
            buf = torch.empty(-(-end // _ALIGN) * _ALIGN, dtype=torch.uint8)
            rb = {"buf": buf, "reg": self.agent.register_memory(buf)}
            self.stats["registrations"] += 1
            self._recv[r] = rb
        rb["at"] = dict(zip(keys, offs, strict=True))
        return rb["buf"], offs

    def _read(self, name: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]], what: str,
              ) -> None:
        """One READ transfer ``remote -> local`` from agent ``name``, waited for (at most ``timeout_s``)."""
        if not local:
            return
        t0 = time.perf_counter()
        h = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                       self.agent.get_xfer_descs(remote, "DRAM"), name)
        try:
            state = self.agent.transfer(h)
            end = time.monotonic() + self.timeout_s
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > end:
                    raise P2PTransferError(f"{what}: the READ did not finish within timeout_s={self.timeout_s}")
                if pause:
                    time.sleep(pause)
                pause = min(0.001, pause * 2 or 2e-5)
                state = self.agent.check_xfer_state(h)
            if state != "DONE":
                raise P2PTransferError(f"{what}: the READ failed (NIXL state {state!r}): the trainer rank is gone or "
                                       "its memory was deregistered")
        finally:
            h.release()
        self.stats["reads"] += 1
        self.stats["read_s"] += time.perf_counter() - t0

    def _request(self, r: int, version: int, metas: list[list[Any]]) -> list[tuple[str, Any]]:
        """READ ``metas`` of ``version`` from trainer rank ``r``'s slot, then its version tag; ``[(key, tensor)]``
        (views of this rank's receive buffer, valid until the next request to the rank)."""
        import torch

        from moe_rl.weights.broadcast import _dtype

        ps = self._stores[r]
        try:
            held = json.loads(ps.get("held"))
            desc = json.loads(ps.get(f"slot/{held[str(version)]}")) if str(version) in held else None
        except Exception as exc:  # noqa: BLE001 - the store is the trainer rank's: it is gone
            raise P2PTransferError(f"trainer rank {r} did not answer the request for version {version} "
                                   f"({type(exc).__name__}: {exc}): the rank is gone") from exc
        if desc is None or int(desc["version"]) != version:
            raise P2PError(f"trainer rank {r} does not hold version {version} (it holds {sorted(map(int, held))}; "
                           "keep_versions reached, or never published): load a newer version")
        missing = [m[0] for m in metas if m[0] not in desc["pieces"]]
        if missing:
            raise P2PError(f"trainer rank {r} has no piece {missing[0]!r} of version {version} ({len(missing)} "
                           "unknown): the index and the trainer disagree")
        wrong = [m[0] for m in metas if int(desc["pieces"][m[0]][1]) != int(m[3])]
        if wrong:
            raise P2PError(f"trainer rank {r} holds piece {wrong[0]!r} of version {version} with "
                           f"{desc['pieces'][wrong[0]][1]} bytes, the index says another size: the index and the "
                           "trainer disagree")
        try:
            name = self._agent_for(r, int(desc["gen"]))
        except Exception as exc:  # noqa: BLE001 - metadata missing or not loadable
            raise P2PTransferError(f"trainer rank {r}'s NIXL agent metadata (generation {desc['gen']}) could not be "
                                   f"loaded: {type(exc).__name__}: {exc}") from exc
        keys = [m[0] for m in metas]
        nbytes = [int(m[3]) for m in metas]
        buf, offs = self._buffer(r, keys, nbytes)
        base = buf.data_ptr()
        loc = [(base + o, n, 0) for o, n in zip(offs, nbytes, strict=True) if n]
        rem = [(int(desc["pieces"][k][0]), n, 0) for k, n in zip(keys, nbytes, strict=True) if n]
        what = f"version {version} from trainer rank {r}"
        self._read(name, loc, rem, what)
        self._read(name, [(base, 8, 0)], [(int(desc["tag"]), 8, 0)], f"the version tag of {what}")
        tag = int(buf[:8].view(torch.int64)[0])
        if tag != version:
            raise P2PError(f"trainer rank {r} does not hold version {version} any more: its slot was rewritten while "
                           f"it was read (tag now {tag}; keep_versions reached): load a newer version")
        return [(m[0], buf[o:o + int(m[3])].view(_dtype(m[1])).view(tuple(m[2])))
                for m, o in zip(metas, offs, strict=True)]

    def _pull(self, plan: list[list[list[Any]]], version: int, retries: int, by_rank: bool = False,
              ) -> tuple[Any, dict[str, Any]]:
        res, rep = super()._pull(plan, version, retries, by_rank)
        if by_rank:  # the pieces outlive this pull (delta updates): copies, not views of the receive buffers
            res = [[(k, t.clone()) for k, t in items] for items in res]
        return res, rep

    def close(self, why: str = "closed") -> None:
        """Forget the trainer ranks; the receive buffers are deregistered."""
        self.closed = why
        for rb in getattr(self, "_recv", []):
            if rb is not None:
                try:
                    self.agent.deregister_memory(rb["reg"])
                except Exception:  # noqa: BLE001, S110 - best effort on a failed agent
                    pass
        self._recv = [None] * len(self._recv)
        self.groups, self._stores = [], []
