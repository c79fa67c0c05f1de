"""A time model of one weight update, trainer ranks -> inference engine ranks, per transport.

Units: bytes (B), seconds (s), bytes per second (B/s) everywhere; no tensors.

Notation:
    t   a trainer rank; it owns (publishes) ``owned[t]`` bytes of the version
    e   an engine rank (one GPU / worker); it serves ``served[e]`` bytes (the tensors it loads)
    X   ``traffic[t][e]``: bytes engine ``e`` needs from trainer ``t`` (default: ``served[e] * owned[t] / W``,
        every rank owning the same fraction of every tensor, as FSDP row shards do)
    W   ``sum(owned)``: bytes of one whole version
    x   the wire ratio: bytes on the wire per layout byte (1 for bf16 as laid out; ~0.5 for FP8 128x128 blocks
        from bf16; the measured ratio, ~0.03-0.09, for delta updates)
    P   ranks of one broadcast group (the owner + every engine rank)
    a   per-message latency of a link class (alpha); ``B`` its bandwidth per endpoint and direction (1/beta)

The formulas (each transport's function says which it uses):

- **One message** of ``n`` bytes costs ``a + n / B`` (Hockney's model: R. W. Hockney, "The communication challenge
  for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994); ``n`` bytes in buckets of ``b`` bytes
  cost ``ceil(n / b) a + n / B``.
- **Concurrent point-to-point transfers** (``p2p``): when every endpoint moves its bytes at its own link's
  bandwidth, no schedule finishes before the busiest endpoint (or node) has moved its load, and one that keeps
  every busy endpoint saturated finishes then: the makespan of the preemptive open shop is
  ``max(max over machines of their load, max over jobs of their length)`` (T. Gonzalez, S. Sahni, "Open shop
  scheduling to minimize finish time", JACM 23(4), 1976), here with the trainer ranks' send links, the engine
  ranks' receive links and each node's aggregate link as the machines.
- **Pipelined chain broadcast** (NCCL's ring/chain, bucketed): ``m`` bytes cut into ``k`` segments of ``m/k``
  bytes along a chain of ``P`` ranks take ``(P + k - 2)(a + (m/k) / B)`` (J. Pjesivac-Grbovic, T. Angskun,
  G. Bosilca, G. E. Fagg, E. Gabriel, J. J. Dongarra, "Performance analysis of MPI collective operations",
  Cluster Computing 10(2), 2007, the "pipeline" broadcast).
- **Binomial-tree broadcast** (gloo's ``broadcast``, unsegmented): the binomial tree of R. Thakur,
  R. Rabenseifner, W. Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 19(1), 2005,
  with gloo's schedule: a rank posts all its sends at once, as soon as it has the message, without waiting for
  them; transfers in flight on one node share its aggregate bandwidth (:func:`binomial_broadcast_s` simulates
  it event by event).
- **Node aggregate of a broadcast**: every engine rank receives every byte, so a node with ``k`` engine ranks takes
  in (or moves inside it) ``k m`` bytes of an ``m``-byte broadcast, and no broadcast finishes before
  ``k m / node_bw`` (a floor on the chain, and across nodes on each binomial bucket).
- **Filesystem**: each rank writes its own file at ``min(per-writer, aggregate / writers)`` bandwidth plus a
  per-file latency (open, fsync, rename); engines then read what they serve the same way. Write, then read.

The transports, as this package's ``moe_rl.weights`` implements or plans them: ``filesystem`` (every trainer rank
writes its own shard, engines read the tensors they serve), ``broadcast`` (one group per trainer rank: that rank
plus every engine rank; every engine rank receives the whole version, W bytes, and keeps what it serves),
``p2p`` (engine ranks pull exactly ``X[t][e]`` from each owner, concurrently: prime-rl's and miles' design),
``mooncake`` (trainer ranks put their shards into Mooncake Store segments, engines get what they serve: a put,
then a p2p-like get from the segments' hosts).

Trainer blocking time (how long the optimizer step waits): ``filesystem``/``p2p``/``mooncake`` with
``SyncOptions.async_publish`` (default) block only for the staging copy of the rank's own bytes (device ->
pinned host, or the FP8 cast) at ``LinkParams.stage_bw``; without it they block for their whole trainer-side
phase. ``broadcast`` blocks for the whole transfer (the trainer rank is a member of its group's collectives).

Example: :func:`moe_layout` builds the layout of an FSDP trainer and wide-EP engines; :func:`estimate_all`
returns one :class:`SyncEstimate` per transport.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = [
    "TRANSPORTS",
    "LinkParams",
    "SyncEstimate",
    "SyncLayout",
    "SyncOptions",
    "binomial_broadcast_s",
    "chain_broadcast_s",
    "estimate",
    "estimate_all",
    "fp8_wire_ratio",
    "moe_layout",
]

Transport = Literal["filesystem", "broadcast", "p2p", "mooncake"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
INF = math.inf
_FLOAT_MAX = sys.float_info.max  # an int above it cannot be a float


def _check_positive(owner: str, **values: float) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ValueError(f"{owner}: {k} = {v!r} must be a number > 0 (use math.inf for an unbounded bandwidth)")


def _check_nonneg(owner: str, **values: float) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or v == INF:
            raise ValueError(f"{owner}: {k} = {v!r} must be a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class LinkParams:
    """Bandwidths (B/s, per endpoint and direction) and latencies (s per message or file) of the link classes.

    Attributes:
        intra_bw: between two ranks on one node (NVLink; loopback TCP on a CPU machine).
        intra_latency: per message on ``intra``.
        inter_bw: between ranks on two nodes (the rank's RDMA NIC). The default ``inf`` suits a one-node layout
            only: an estimate that moves bytes between nodes (``broadcast``, ``p2p``, ``mooncake``) raises
            ``ValueError`` while it is ``inf``, so a forgotten inter-node bandwidth never makes those bytes free.
        inter_latency: per message on ``inter``.
        node_bw: cap on the bytes per second of all transfers that touch one node, per direction for transfers
            leaving or entering it, once for transfers inside it (the node's NICs together; on a CPU machine the
            cores that run the copies). ``inf``: no cap.
        fs_write_bw: one writer's bandwidth to the shared filesystem.
        fs_read_bw: one reader's bandwidth from it.
        fs_aggregate_write_bw: all writers together (``inf``: no cap).
        fs_aggregate_read_bw: all readers together (``inf``: no cap).
        fs_latency: per file written or read (open, metadata, fsync, rename).
        stage_bw: the trainer's copy of its own bytes into a staging buffer (device -> pinned host, FP8 cast).
        collective_latency: per broadcast call on top of the link latencies (launch, synchronisation).
    """

    intra_bw: float
    intra_latency: float = 0.0
    inter_bw: float = INF
    inter_latency: float = 0.0
    node_bw: float = INF
    fs_write_bw: float = INF
    fs_read_bw: float = INF
    fs_aggregate_write_bw: float = INF
    fs_aggregate_read_bw: float = INF
    fs_latency: float = 0.0
    stage_bw: float = INF
    collective_latency: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("LinkParams", intra_bw=self.intra_bw, inter_bw=self.inter_bw, node_bw=self.node_bw,
                        fs_write_bw=self.fs_write_bw, fs_read_bw=self.fs_read_bw,
                        fs_aggregate_write_bw=self.fs_aggregate_write_bw,
                        fs_aggregate_read_bw=self.fs_aggregate_read_bw, stage_bw=self.stage_bw)
        _check_nonneg("LinkParams", intra_latency=self.intra_latency, inter_latency=self.inter_latency,
                      fs_latency=self.fs_latency, collective_latency=self.collective_latency)


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """How an update is sent.

    Attributes:
        bucket_bytes: message (bucket) size of ``broadcast``/``p2p``/``mooncake``.
        wire_ratio: x, bytes on the wire per layout byte (:func:`fp8_wire_ratio`, a delta's measured ratio).
        broadcast_algorithm: ``"chain"`` (pipelined, NCCL) or ``"binomial"`` (gloo).
        async_publish: the trainer stages its bytes and returns (``filesystem``/``p2p``/``mooncake``).
        files_per_rank: files each trainer rank writes per version (``filesystem``: shard + index).
        announce_s: from "version ready" to the engines starting to read or pull (polling, RPC).
    """

    bucket_bytes: float = 64 * 2**20
    wire_ratio: float = 1.0
    broadcast_algorithm: Literal["chain", "binomial"] = "chain"
    async_publish: bool = True
    files_per_rank: int = 2
    announce_s: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("SyncOptions", bucket_bytes=self.bucket_bytes, wire_ratio=self.wire_ratio)
        _check_nonneg("SyncOptions", announce_s=self.announce_s, wire_ratio=self.wire_ratio)
        if not self.bucket_bytes >= 1:
            raise ValueError(f"SyncOptions: bucket_bytes = {self.bucket_bytes!r} must be >= 1 (bytes per message, e.g. "
                             "64 * 2**20; math.inf: one message)")
        if self.broadcast_algorithm not in ("chain", "binomial"):
            raise ValueError(f"SyncOptions: broadcast_algorithm = {self.broadcast_algorithm!r} must be 'chain' "
                             "(pipelined, NCCL) or 'binomial' (gloo)")
        if isinstance(self.files_per_rank, bool) or not isinstance(self.files_per_rank, int) or self.files_per_rank < 1:
            raise ValueError(f"SyncOptions: files_per_rank = {self.files_per_rank!r} must be an int >= 1")


@dataclass(frozen=True)
class SyncLayout:
    """Who owns and who needs which bytes.

    Args:
        trainer_nodes: ``[T]`` node id of each trainer rank.
        owned: ``[T]`` bytes each trainer rank publishes (its shard of the version, as laid out).
        engine_nodes: ``[E]`` node id of each engine rank (node ids shared with the trainers mean shared nodes).
        served: ``[E]`` bytes each engine rank loads.
        traffic: ``[T][E]`` bytes engine ``e`` needs from trainer ``t``; default ``served[e] * owned[t] / W``.
            An owner's byte may go to many engines (rows need not sum to ``owned``).

    Raises:
        ValueError: empty ranks, lengths that disagree, negative, infinite or nan bytes, an engine that needs more from
            an owner than the owner owns, or a traffic column that does not sum to ``served``.
    """

    trainer_nodes: tuple[int, ...]
    owned: tuple[float, ...]
    engine_nodes: tuple[int, ...]
    served: tuple[float, ...]
    traffic: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        t, e = len(self.trainer_nodes), len(self.engine_nodes)
        if t == 0 or e == 0:
            raise ValueError(f"SyncLayout: needs >= 1 trainer and >= 1 engine rank, got {t} and {e}")
        if len(self.owned) != t or len(self.served) != e:
            raise ValueError(f"SyncLayout: owned has {len(self.owned)} entries for {t} trainer ranks, served "
                             f"{len(self.served)} for {e} engine ranks; give one per rank")
        for name, values in (("owned", self.owned), ("served", self.served)):
            for i, v in enumerate(values):  # finite byte counts (a nan would compare False everywhere below)
                _check_nonneg("SyncLayout", **{f"{name}[{i}]": v})
        for i, row in enumerate(self.traffic or ()):
            for j, v in enumerate(row):
                _check_nonneg("SyncLayout", **{f"traffic[{i}][{j}]": v})
        if min(self.owned) < 0 or min(self.served) < 0 or sum(self.owned) <= 0:
            raise ValueError("SyncLayout: owned/served bytes must be >= 0 and the version must have > 0 bytes")
        if max(self.served) > self.total * (1 + 1e-9):
            raise ValueError(f"SyncLayout: an engine serves {max(self.served):.4g} bytes, more than the version's "
                             f"{self.total:.4g}")
        if self.traffic is not None:
            if len(self.traffic) != t or any(len(row) != e for row in self.traffic):
                raise ValueError(f"SyncLayout: traffic must be [{t}][{e}] (trainer x engine)")
            for j in range(e):
                col = sum(row[j] for row in self.traffic)
                if not math.isclose(col, self.served[j], rel_tol=1e-9, abs_tol=1e-6):
                    raise ValueError(f"SyncLayout: traffic column {j} sums to {col:.6g} bytes, served[{j}] is "
                                     f"{self.served[j]:.6g}; an engine pulls exactly what it serves")
            for i, row in enumerate(self.traffic):
                if min(row) < 0 or max(row) > self.owned[i] * (1 + 1e-9):
                    raise ValueError(f"SyncLayout: traffic row {i} has an entry outside [0, owned[{i}]]")

    @property
    def total(self) -> float:
        """W, bytes of one version."""
        return float(sum(self.owned))

    def x(self, t: int, e: int) -> float:
        """``X[t][e]``: bytes engine ``e`` needs from trainer ``t``."""
        if self.traffic is not None:
            return self.traffic[t][e]
        return self.served[e] * self.owned[t] / self.total


@dataclass(frozen=True)
class SyncEstimate:
    """The model's prediction for one transport.

    Attributes:
        transport: the transport.
        total_s: from the optimizer step's end to every engine holding the version (before its own load work).
        blocking_s: how long the trainer waits (see the module docstring).
        bytes_moved: bytes over all links (each copy counted once per receiver).
        phases: the terms, in seconds (named per transport).
        bottleneck: the term that decided the bandwidth part.
    """

    transport: str
    total_s: float
    blocking_s: float
    bytes_moved: float
    phases: Mapping[str, float] = field(default_factory=dict)
    bottleneck: str = ""


def _require_inter_bw(links: LinkParams, transport: str, nodes: Sequence[int]) -> None:
    """Refuse an estimate that moves bytes between nodes while ``inter_bw`` is ``inf``, the default."""
    if links.inter_bw == INF:
        raise ValueError(
            f"{transport}: the layout moves bytes between nodes {list(nodes)[:8]} but LinkParams.inter_bw = inf (the "
            "default), which would make every inter-node byte free; set LinkParams(inter_bw=...) to one rank's "
            "inter-node bandwidth in B/s per direction (e.g. 50e9 for one 400 Gb/s NIC per GPU)"
        )


def _bw(links: LinkParams, same_node: bool) -> tuple[float, float]:
    return (links.intra_bw, links.intra_latency) if same_node else (links.inter_bw, links.inter_latency)


def _div(n: float, bw: float) -> float:
    return 0.0 if n == 0 else n / bw


def _stage_s(layout: SyncLayout, links: LinkParams, x: float) -> float:
    return max(_div(o * x, links.stage_bw) for o in layout.owned)


def _p2p_phase(sources: Sequence[tuple[int, float]], layout: SyncLayout, links: LinkParams, opts: SyncOptions,
               pairs: Sequence[tuple[int, int, float]], transport: str) -> tuple[float, str, float]:
    """Concurrent transfers ``pairs = [(source s, engine e, bytes)]`` from ``sources[s] = (node, _)``.

    Time = max over (endpoint, link class) of load / bandwidth, over nodes of node load / ``node_bw``
    (Gonzalez & Sahni 1976), plus ``a`` per message at the endpoint that sends or receives the most messages; a
    pair with 0 bytes costs nothing. Returns ``(seconds, bottleneck, bytes)``; raises ``ValueError`` (naming
    ``transport``) for a pair with bytes between two nodes while ``links.inter_bw`` is ``inf``.
    """
    out: dict[tuple[int, bool], float] = {}
    inn: dict[tuple[int, bool], float] = {}
    msgs_out: dict[int, float] = {}
    msgs_in: dict[int, float] = {}
    node_out: dict[int, float] = {}
    node_in: dict[int, float] = {}
    node_local: dict[int, float] = {}
    lat = 0.0
    moved = 0.0
    for s, e, n in pairs:
        if n <= 0:
            continue
        sn, en = sources[s][0], layout.engine_nodes[e]
        same = sn == en
        if not same:
            _require_inter_bw(links, transport, (sn, en))
        bw, a = _bw(links, same)
        out[(s, same)] = out.get((s, same), 0.0) + n / bw
        inn[(e, same)] = inn.get((e, same), 0.0) + n / bw
        m = math.ceil(n / opts.bucket_bytes)
        msgs_out[s] = msgs_out.get(s, 0.0) + m * a
        msgs_in[e] = msgs_in.get(e, 0.0) + m * a
        if same:
            node_local[sn] = node_local.get(sn, 0.0) + n
        else:
            node_out[sn] = node_out.get(sn, 0.0) + n
            node_in[en] = node_in.get(en, 0.0) + n
        moved += n
    terms = {"sender link": max(out.values(), default=0.0), "receiver link": max(inn.values(), default=0.0)}
    if links.node_bw != INF:
        nodes = set(node_out) | set(node_in) | set(node_local)
        terms["node aggregate"] = max(
            (max(node_out.get(k, 0.0), node_in.get(k, 0.0)) + node_local.get(k, 0.0)) / links.node_bw
            for k in nodes) if nodes else 0.0
    bottleneck = max(terms, key=terms.__getitem__)
    lat = max(max(msgs_out.values(), default=0.0), max(msgs_in.values(), default=0.0))
    return terms[bottleneck] + lat, bottleneck, moved


def _filesystem(layout: SyncLayout, links: LinkParams, opts: SyncOptions) -> SyncEstimate:
    x = opts.wire_ratio
    writes = [o * x for o in layout.owned]
    reads = [s * x for s in layout.served]
    t = len(writes)
    w_terms = {"per-writer bandwidth": max(_div(w, links.fs_write_bw) for w in writes),
               "aggregate write bandwidth": _div(sum(writes), links.fs_aggregate_write_bw)}
    r_terms = {"per-reader bandwidth": max(_div(r, links.fs_read_bw) for r in reads),
               "aggregate read bandwidth": _div(sum(reads), links.fs_aggregate_read_bw)}
    write_s = max(w_terms.values()) + opts.files_per_rank * links.fs_latency
    # every trainer rank's file holds a piece of (nearly) every tensor: an engine opens each owner's file it needs
    files_read = [sum(1 for i in range(t) if layout.x(i, e) > 0) for e in range(len(reads))]
    read_s = max(r_terms.values()) + max(files_read) * links.fs_latency
    stage = _stage_s(layout, links, x)
    w_b, r_b = max(w_terms, key=w_terms.__getitem__), max(r_terms, key=r_terms.__getitem__)
    total = stage + write_s + opts.announce_s + read_s
    blocking = stage if opts.async_publish else stage + write_s
    return SyncEstimate("filesystem", total, blocking, sum(writes) + sum(reads),
                        {"stage": stage, "write": write_s, "announce": opts.announce_s, "read": read_s},
                        f"write: {w_b}; read: {r_b}")


def chain_broadcast_s(nbytes: float, ranks: int, bw: float, latency: float, segment_bytes: float) -> float:
    """Pipelined chain broadcast of ``nbytes`` to ``ranks - 1`` receivers in segments of ``segment_bytes``:
    ``(P + k - 2)(a + (m/k) / B)`` with ``k = ceil(m / segment)`` (Pjesivac-Grbovic et al. 2007)."""
    if nbytes <= 0 or ranks < 2:
        return 0.0
    k = max(1, math.ceil(nbytes / segment_bytes))
    return (ranks + k - 2) * (latency + nbytes / k / bw)


def binomial_broadcast_s(nbytes: float, ranks: int, bw: float, latency: float, node_bw: float = INF,
                         sender_bw: float = INF) -> float:
    """Binomial-tree broadcast of one ``nbytes`` message to ``ranks - 1`` receivers, with the schedule of gloo's
    ``broadcast`` (the tree of Thakur, Rabenseifner, Gropp 2005, with non-blocking sends).

    Ranks are numbered from the root (``v = 0``). Rank ``v > 0`` receives from ``v`` with its highest set bit
    cleared; once its receive is complete (the root: at once) it posts, all together and without waiting for
    them, its sends to ``v + 2**i`` for every ``i`` above its highest set bit with ``v + 2**i < P``. After a start
    latency ``a`` each transfer runs at ``min(B, node_bw / n, sender_bw / s)``, with ``n`` transfers in flight and
    ``s`` of them from the same sender: on one node the transfers share the node (``node_bw``; a loopback stream
    is limited to ``B`` but one process can drive several), across nodes a sender's transfers share its link
    (``sender_bw = B``). Simulated event by event, so e.g. ``P = 3`` on one node costs one shared step (the root's
    two sends at once, ``a + 2m / node_bw`` when ``node_bw < 2B``), not two rounds, and ``P = 4`` costs the root's
    two shared sends then rank 1's send to rank 3. Cost: ``P - 1`` events of ``O(P)`` work each, ``O(P^2)`` in all
    (measured on a 2-core CI machine: ``P = 256`` 0.01 s, ``1024`` 0.1 s, ``4096`` 2 s); groups of tens of
    thousands of ranks are beyond its intended use.

    Args:
        nbytes: message size (bytes, finite, >= 0).
        ranks: ``P``, the group size (root included), an int >= 1.
        bw: ``B``, one transfer's bandwidth (bytes/s, > 0; ``math.inf``: unbounded).
        latency: ``a``, one transfer's start latency (s, finite, >= 0).
        node_bw: the aggregate bandwidth the transfers in flight share (bytes/s, > 0; ``math.inf``: none).
        sender_bw: the bandwidth one sender's transfers in flight share (bytes/s, > 0; ``math.inf``: none).

    Returns:
        Seconds until the last receiver has the message (0 for ``nbytes == 0`` or ``ranks == 1``; ``math.inf`` when
        it overflows a float).

    Raises:
        ValueError: an argument outside the ranges above.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"binomial_broadcast_s: ranks = {ranks!r} must be an int >= 1 (the group, root included)")
    for name, v in (("nbytes", nbytes), ("latency", latency)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not (0 <= v <= _FLOAT_MAX):
            raise ValueError(f"binomial_broadcast_s: {name} = {v!r} must be a finite number >= 0")
    _check_positive("binomial_broadcast_s", bw=bw, node_bw=node_bw, sender_bw=sender_bw)
    if nbytes == 0 or ranks == 1:
        return 0.0
    depth = (ranks - 1).bit_length()  # ceil(log2 P)
    sends = {v: [v + 2**i for i in range(v.bit_length(), depth) if v + 2**i < ranks] for v in range(ranks)}
    # a transfer: [sender, receiver, bytes left]; posted transfers wait (a heap by start time) for their latency
    posted: list[tuple[float, int, int]] = [(latency, 0, dst) for dst in sends[0]]
    heapq.heapify(posted)
    active: list[list] = []
    t = done = 0.0
    while posted or active:
        per_sender = Counter(src for src, _, _ in active)
        rates = [min(bw, node_bw / len(active), sender_bw / per_sender[src]) for src, _, _ in active]
        # the first transfer to finish; at that event its bytes are set to exactly 0, so every event makes progress
        t_end, first = INF, -1
        for j, (tr, r) in enumerate(zip(active, rates, strict=True)):
            te = t + (tr[2] / r if r < INF else 0.0)
            if te < t_end:
                t_end, first = te, j
        if active and first < 0:  # the clock overflowed (every finish time is inf): no event can make progress
            return INF
        starts_first = bool(posted) and posted[0][0] <= t_end
        t_new = posted[0][0] if starts_first else t_end
        for j, (tr, r) in enumerate(zip(active, rates, strict=True)):
            if j == first and not starts_first:
                tr[2] = 0.0
            elif t_new > t:  # (no 0 * inf when no time passes)
                tr[2] = max(0.0, tr[2] - (t_new - t) * r)
        t = t_new
        if starts_first:
            _, src, dst = heapq.heappop(posted)
            active.append([src, dst, float(nbytes)])
        for tr in [tr for tr in active if tr[2] == 0.0]:
            active.remove(tr)
            done = t
            for nxt in sends[tr[1]]:
                heapq.heappush(posted, (t + latency, tr[1], nxt))
    return done


def _broadcast_s(sizes: Sequence[float], p: int, k_node: int, one_node: bool, links: LinkParams,
                 opts: SyncOptions, node_bw: float) -> float:
    """Seconds of the broadcasts of ``sizes`` (bytes per owner, on the wire) to ``p - 1`` engine ranks, at most
    ``k_node`` of them on one node, with the node aggregate ``node_bw`` (:func:`_broadcast` says how)."""
    bw, a = _bw(links, one_node)
    if opts.broadcast_algorithm == "chain":
        k = sum(max(1, math.ceil(m / opts.bucket_bytes)) for m in sizes if m > 0)
        total = sum(sizes)
        bcast = chain_broadcast_s(total, p, bw, a, total / k) if k else 0.0
        bcast = max(bcast, _div(k_node * total, node_bw))  # every engine rank of a node takes in all xW bytes
        return bcast + max(math.ceil(m / opts.bucket_bytes) for m in sizes) * links.collective_latency
    bcast = 0.0
    for m in sizes:
        if m <= 0:  # an owner with nothing to send starts no collective
            continue
        k = max(1, math.ceil(m / opts.bucket_bytes))
        if one_node:  # the transfers in flight share the node (simulated)
            step = binomial_broadcast_s(m / k, p, bw, a, node_bw, INF)
        else:  # a sender's transfers share its link; every engine rank of a node takes in the bucket
            step = max(binomial_broadcast_s(m / k, p, bw, a, INF, bw), _div(k_node * m / k, node_bw))
        bcast += k * (step + links.collective_latency)
    return bcast


def _broadcast(layout: SyncLayout, links: LinkParams, opts: SyncOptions) -> SyncEstimate:
    """One group per owner ``{owner, every engine}`` (``P = E + 1``); every engine receives all W bytes.

    ``chain``: the owners' groups run at once and their segments share the engines' links, so the version moves
    as one pipelined chain of ``K = sum_t ceil(x owned[t] / b)`` segments (owners with 0 bytes add none):
    ``(P + K - 2)(a + (xW/K) / B)`` (Pjesivac-Grbovic et al. 2007), plus ``collective_latency`` per bucket of the
    busiest owner. ``B`` is the slowest link class the chain uses (``inter`` once it spans nodes). ``binomial``
    (gloo): each bucket of an owner with bytes is one binomial broadcast (:func:`binomial_broadcast_s`) plus
    ``collective_latency``, buckets and owners one after another (an owner with 0 bytes costs nothing); on one
    node its transfers share the node's aggregate, across nodes a sender's transfers share its link.

    Node aggregate (``LinkParams.node_bw``): every engine rank receives every byte, so a node with ``k`` engine
    ranks takes in (or moves inside it) ``k`` times what is broadcast, whatever the tree or chain: the chain takes
    at least ``k_max xW / node_bw`` and, across nodes, each binomial bucket of ``m`` bytes at least
    ``k_max m / node_bw`` (on one node the simulation shares ``node_bw`` already). The bottleneck is "node
    aggregate" only when this cap made the estimate longer than the links alone.

    Raises:
        ValueError: the broadcast spans nodes while ``links.inter_bw`` is ``inf`` (a forgotten bandwidth).
    """
    x = opts.wire_ratio
    p = len(layout.engine_nodes) + 1
    nodes = set(layout.engine_nodes) | set(layout.trainer_nodes)
    one_node = len(nodes) == 1
    if not one_node:
        _require_inter_bw(links, "broadcast", sorted(nodes))
    k_node = max(Counter(layout.engine_nodes).values())
    sizes = [o * x for o in layout.owned]
    bcast = _broadcast_s(sizes, p, k_node, one_node, links, opts, links.node_bw)
    free = _broadcast_s(sizes, p, k_node, one_node, links, opts, INF) if links.node_bw != INF else bcast
    if bcast > free * (1 + 1e-12):
        bottleneck = ("node aggregate (binomial rounds)" if one_node and opts.broadcast_algorithm == "binomial"
                      else "node aggregate")
    else:
        bottleneck = "intra-node link" if one_node else "inter-node link"
    stage = _stage_s(layout, links, x)
    total = stage + opts.announce_s + bcast
    moved = layout.total * x * len(layout.engine_nodes)
    return SyncEstimate("broadcast", total, total, moved,
                        {"stage": stage, "announce": opts.announce_s, "broadcast": bcast}, bottleneck)


def _p2p(layout: SyncLayout, links: LinkParams, opts: SyncOptions) -> SyncEstimate:
    x = opts.wire_ratio
    sources = [(n, o) for n, o in zip(layout.trainer_nodes, layout.owned, strict=True)]
    pairs = [(t, e, layout.x(t, e) * x) for t in range(len(sources)) for e in range(len(layout.engine_nodes))]
    pull, bottleneck, moved = _p2p_phase(sources, layout, links, opts, pairs, "p2p")
    stage = _stage_s(layout, links, x)
    total = stage + opts.announce_s + pull
    blocking = stage if opts.async_publish else total
    return SyncEstimate("p2p", total, blocking, moved, {"stage": stage, "announce": opts.announce_s, "pull": pull},
                        bottleneck)


def _mooncake(layout: SyncLayout, links: LinkParams, opts: SyncOptions) -> SyncEstimate:
    """Put into segments on the trainer's own node (a host copy at ``stage_bw``), then engines get from the
    segments' nodes like ``p2p`` (each segment host's NICs serve the gets)."""
    x = opts.wire_ratio
    put = _stage_s(layout, links, x)
    sources = [(n, o) for n, o in zip(layout.trainer_nodes, layout.owned, strict=True)]
    pairs = [(t, e, layout.x(t, e) * x) for t in range(len(sources)) for e in range(len(layout.engine_nodes))]
    get, bottleneck, moved = _p2p_phase(sources, layout, links, opts, pairs, "mooncake")
    total = put + opts.announce_s + get
    blocking = put if opts.async_publish else total
    return SyncEstimate("mooncake", total, blocking, moved + layout.total * x,
                        {"put": put, "announce": opts.announce_s, "get": get}, bottleneck)


_MODELS = {"filesystem": _filesystem, "broadcast": _broadcast, "p2p": _p2p, "mooncake": _mooncake}


def estimate(transport: str, layout: SyncLayout, links: LinkParams, options: SyncOptions | None = None,
             ) -> SyncEstimate:
    """Predict one weight update.

    Args:
        transport: ``"filesystem"``, ``"broadcast"``, ``"p2p"`` or ``"mooncake"``.
        layout: :class:`SyncLayout`.
        links: :class:`LinkParams`.
        options: :class:`SyncOptions` (defaults when ``None``).

    Returns:
        :class:`SyncEstimate`.

    Raises:
        ValueError: an unknown transport; a ``broadcast``/``p2p``/``mooncake`` estimate that moves bytes between
            nodes while ``links.inter_bw`` is ``inf`` (set the inter-node bandwidth).
    """
    if transport not in _MODELS:
        raise ValueError(f"estimate: transport = {transport!r} must be one of {TRANSPORTS}")
    return _MODELS[transport](layout, links, options or SyncOptions())


def estimate_all(layout: SyncLayout, links: LinkParams, options: SyncOptions | None = None,
                 ) -> dict[str, SyncEstimate]:
    """:func:`estimate` for every transport, ``{transport: SyncEstimate}`` (raises as :func:`estimate` does)."""
    return {t: estimate(t, layout, links, options) for t in TRANSPORTS}


def fp8_wire_ratio(quantized_fraction: float, block: int = 128, src_bytes: int = 2) -> float:
    """x for FP8 128x128 block weights on the wire (DeepSeek-V3 checkpoint format) from ``src_bytes`` weights:
    quantized elements take 1 byte plus one fp32 scale per ``block x block`` tile, the rest stay as they are.

    Args:
        quantized_fraction: share of the version's bytes (as laid out) in quantized weights, in ``[0, 1]``.
        block: tile edge.
        src_bytes: bytes per element as laid out (2 for bf16).

    Raises:
        ValueError: ``quantized_fraction`` outside ``[0, 1]``, ``block`` or ``src_bytes`` < 1.
    """
    if not 0.0 <= quantized_fraction <= 1.0:
        raise ValueError(f"fp8_wire_ratio: quantized_fraction = {quantized_fraction!r} must be in [0, 1]")
    if block < 1 or src_bytes < 1:
        raise ValueError(f"fp8_wire_ratio: block = {block}, src_bytes = {src_bytes} must be >= 1")
    per_elem = 1.0 + 4.0 / (block * block)
    return quantized_fraction * per_elem / src_bytes + (1.0 - quantized_fraction)


def moe_layout(*, dense_bytes: float, expert_bytes: float, trainer_ranks: int, trainer_ranks_per_node: int,
               engine_groups: Sequence[tuple[int, int]], engine_ranks_per_node: int,
               share_nodes: bool = False) -> SyncLayout:
    """The layout of an FSDP-sharded trainer and wide-EP engine replicas.

    Every trainer rank owns ``1 / trainer_ranks`` of every tensor (FSDP row shards over all trainer ranks). An
    engine replica of ``n`` ranks with expert parallelism ``ep`` gives each rank every dense byte (attention,
    shared experts, embeddings: data-parallel attention replicates them) and ``1 / ep`` of the routed experts.

    Args:
        dense_bytes: bytes of everything but the routed experts, as laid out.
        expert_bytes: bytes of the routed experts, as laid out.
        trainer_ranks: T.
        trainer_ranks_per_node: trainer GPUs per node.
        engine_groups: ``[(ranks, ep)]`` per engine replica.
        engine_ranks_per_node: engine GPUs per node.
        share_nodes: engines on the trainer's nodes (node ids from 0 for both) instead of their own.

    Raises:
        ValueError: non-positive counts, ``ep`` not dividing ``ranks`` exactly or exceeding it.
    """
    for k, v in {"trainer_ranks": trainer_ranks, "trainer_ranks_per_node": trainer_ranks_per_node,
                 "engine_ranks_per_node": engine_ranks_per_node}.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"moe_layout: {k} = {v!r} must be an int >= 1")
    if dense_bytes < 0 or expert_bytes < 0 or dense_bytes + expert_bytes <= 0:
        raise ValueError(f"moe_layout: dense_bytes = {dense_bytes}, expert_bytes = {expert_bytes} must be >= 0 "
                         "with a positive sum")
    if not engine_groups:
        raise ValueError("moe_layout: engine_groups is empty; give [(ranks, ep)] per engine replica")
    w = dense_bytes + expert_bytes
    trainer_nodes = tuple(r // trainer_ranks_per_node for r in range(trainer_ranks))
    first = 0 if share_nodes else trainer_nodes[-1] + 1
    engine_nodes: list[int] = []
    served: list[float] = []
    rank = 0
    for n, ep in engine_groups:
        if not (isinstance(n, int) and isinstance(ep, int) and 1 <= ep <= n and n % ep == 0):
            raise ValueError(f"moe_layout: engine group (ranks={n!r}, ep={ep!r}) needs ints with 1 <= ep <= ranks "
                             "and ranks % ep == 0")
        for _ in range(n):
            engine_nodes.append(first + rank // engine_ranks_per_node)
            served.append(dense_bytes + expert_bytes / ep)
            rank += 1
    return SyncLayout(trainer_nodes, tuple([w / trainer_ranks] * trainer_ranks), tuple(engine_nodes),
                      tuple(served))
