"""The trainer process's publisher: one per trainer rank, ``publish(model, version)`` after every optimizer step.

``trainer.weight_transport`` picks the transport; every rank publishes only its own pieces
(:mod:`moe_rl.weights.regions`) and rank 0 announces the version (:mod:`moe_rl.weights.announce`):

- ``"filesystem"`` (default): :class:`moe_rl.weights.filesystem.ShardedFilesystemPublisher`, one folder
  ``weights/step_<v>/`` per version with every rank's shards, an index and a ``STABLE`` marker; announced with
  ``layout = "sharded"``; the engine reads it with ``WeightSyncExtension.load_sharded``.
- ``"broadcast"``: :class:`moe_rl.weights.broadcast.ShardedBroadcastPublisher`: rank 0 announces the version, then
  every rank sends its pieces over its own group to the engine workers (the orchestrator's watcher issues the
  engine's receive when it sees the announcement). The call returns once the bytes arrived; the engine loads
  after. The final version is also written as a sharded folder (the run's output checkpoint).
- ``"p2p"``: :class:`moe_rl.weights.p2p.P2PPublisher`: every rank snapshots its pieces (the trainer's whole
  blocking time, no collective) and serves them from a thread; the CRC-32s, the piece index
  ``announce/p2p_<v>.json`` (rank 0, once every rank's part arrived) and the announcement follow on each rank's
  index thread; the engine workers pull what they need from the owning ranks (the orchestrator's watcher
  issues ``update_weights_from_p2p``). The final version is also written as a sharded folder.
- ``"mooncake"``: the run's Mooncake store (started by the launcher, :class:`moe_rl.weights.mooncake.RunStore`),
  one shard per trainer rank (``"<r>of<W>"``; sharded puts). When the store fails on any rank (master gone, store
  full) the version goes to the sharded folder instead, on every rank, and the fallback is counted; after a
  failure the store is skipped for ``trainer.mooncake.retry_after_s`` (rank 0 decides, every rank follows). The
  final version is also written to the folder. Each rank keeps its pieces of the latest store version until the
  next one, so a version the store lost before the engine loaded it is written to the folder on the
  orchestrator's request (:meth:`RunWeightPublisher.serve_requests`, a collective). On a single rank with a plain
  state dict the store and an HF folder form a :class:`moe_rl.weights.fallback.FallbackWeightTransport` chain.

Every publication returns :class:`moe_rl.weights.protocol.UpdateStats` (trainer blocking seconds, bytes).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from moe_rl.weights.protocol import UpdateStats

__all__ = ["RunWeightPublisher", "make_weight_publisher"]

Mode = Literal["filesystem", "broadcast", "mooncake", "p2p"]


def _dist() -> tuple[bool, int, int]:
    import torch.distributed as dist

    on = dist.is_initialized()
    return on, (dist.get_rank() if on else 0), (dist.get_world_size() if on else 1)


class RunWeightPublisher:
    """One trainer rank's publisher (build it with :func:`make_weight_publisher`); ``publish`` is a collective over
    the trainer ranks when there are several.

    Args:
        mode: ``"filesystem"``, ``"broadcast"``, ``"mooncake"`` or ``"p2p"``.
        weights_root: the run's ``weights/`` folder.
        filesystem: the single-rank Hugging Face folder transport (``FilesystemWeightTransport``; the mooncake
            chain's fallback on one rank), or None.
        chain: the single-rank ``FallbackWeightTransport`` (mooncake mode, one rank, state dicts), else None.
        final_version: the last version of the run (also written to the folder in broadcast/mooncake mode).
        store_client: this rank's ``StoreClient`` (closed by :meth:`close`), or None.
        setup_error: why the store could not be joined (mooncake mode; every version then falls back).
        sharded: this rank's ``ShardedFilesystemPublisher`` (sharded folders; every mode with a model).
        broadcast: this rank's ``ShardedBroadcastPublisher`` (broadcast mode).
        p2p: this rank's ``P2PPublisher`` (p2p mode).
        p2p_background: p2p mode: ``publish`` returns right after the snapshot and rank 0 announces from its index
            thread once the index is written (:func:`make_weight_publisher` sets it); False: ``publish`` returns
            after the announcement.
        store: this rank's ``MooncakeWeightTransport`` with shard ``"<rank>of<world>"`` (mooncake mode, sharded).
        retry_after_s: mooncake mode: skip the store this long after a failure.
        mcfg, dtype: the model's config and the published dtype (to cut a model into pieces).
    """

    def __init__(self, mode: Mode, weights_root: Path, filesystem: Any = None, chain: Any = None,
                 final_version: int | None = None, store_client: Any = None, setup_error: str | None = None, *,
                 sharded: Any = None, broadcast: Any = None, store: Any = None, retry_after_s: float = 30.0,
                 mcfg: Any = None, dtype: Any = None, p2p: Any = None, p2p_background: bool = False) -> None:
        self.mode = mode
        self.weights_root = Path(weights_root)
        self.filesystem = filesystem
        self.chain = chain
        self.final_version = final_version
        self.store_client = store_client
        self.setup_error = setup_error
        self.sharded = sharded
        self.broadcast = broadcast
        self.p2p = p2p
        self.p2p_background = p2p_background
        self.store = store
        self.retry_after_s = retry_after_s
        self.mcfg, self.dtype = mcfg, dtype
        self._cutter: Any = None
        self.sources: dict[int, str] = {}
        self.republished: list[int] = []
        self._held: tuple[int, Any] | None = None
        self.final_copies: list[int] = []
        self.last: dict[str, Any] = {}
        from moe_rl.weights.fallback import TransportStats

        # sharded store mode: the counters FallbackWeightTransport keeps for the single-rank chain
        self._tstats = {"mooncake": TransportStats(), "filesystem": TransportStats()}
        self._store_down_until = 0.0
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ helpers
    def _pieces(self, model_or_state: Any) -> list[Any]:
        import torch

        from moe_rl.weights.regions import Piece, PieceCutter

        if isinstance(model_or_state, list):  # already cut (a fallback or republish of the same pieces)
            return model_or_state
        if isinstance(model_or_state, torch.nn.Module):
            if self.mcfg is None:
                raise ValueError("RunWeightPublisher.publish: a model needs mcfg (make_weight_publisher(mcfg=...))")
            if self._cutter is None:  # the cut is planned once and reused while the model's layout is unchanged
                self._cutter = PieceCutter(self.mcfg, self.dtype)
            return self._cutter(model_or_state)
        return [Piece(k, tuple(v.shape), (0,) * v.dim(), v.detach().to("cpu").contiguous())
                for k, v in model_or_state.items()]

    def _announce(self, version: int, source: str, stats: UpdateStats, **kw: Any) -> None:
        from moe_rl.weights.announce import write_announcement

        write_announcement(self.weights_root, version, source, stats={**stats.as_dict(), **self.stats()}, **kw)

    # ------------------------------------------------------------------ publish
    def publish(self, model_or_state: Any, version: int) -> UpdateStats:
        """Publish ``version`` of ``model_or_state`` (the sharded model on every trainer rank, or ``{hf_name:
        tensor}`` on a single rank) and, on rank 0, announce it.

        Returns:
            This rank's :class:`UpdateStats` (``blocking_s``: the whole call, any fallback included, and the
            announcement where the call writes it: every mode but p2p with ``p2p_background``, where rank 0's index
            thread announces after the call; ``extra["source"]``: the transport that holds the version).

        Raises:
            ValueError: ``version`` already published (versions are immutable) or negative.
            RuntimeError: no transport could publish it (the message lists every error).
            WeightBroadcastError: broadcast mode, an engine worker died or timed out.
            P2PError: p2p mode, this rank's server stopped or an earlier version's index job failed.
        """
        t0 = time.perf_counter()
        if self.mode == "filesystem":
            st = self._publish_folder(model_or_state, version)
        elif self.mode == "broadcast":
            st = self._publish_broadcast(model_or_state, version)
        elif self.mode == "p2p":
            st = self._publish_p2p(model_or_state, version)
        elif self.chain is not None and not _dist()[0] and not _is_module(model_or_state):
            st = self._publish_chain(model_or_state, version)
        else:
            st = self._publish_store_sharded(model_or_state, version)
        st.blocking_s = time.perf_counter() - t0
        self.sources[version] = st.extra["source"]
        self.last = {"version": version, "source": st.extra["source"], "seconds": st.blocking_s,
                     "bytes": st.bytes, "attempts": st.extra.get("attempts", [])}
        self.history.append(st.as_dict())
        return st

    def _publish_folder(self, model_or_state: Any, version: int, announce: bool = True) -> UpdateStats:
        st = self.sharded.publish(self._pieces(model_or_state), version)
        st.extra["source"] = "filesystem"
        if announce and _dist()[1] == 0:
            self._announce(version, "filesystem", st, filesystem_copy=True, path=st.extra["path"], layout="sharded")
        return st

    def _publish_broadcast(self, model_or_state: Any, version: int) -> UpdateStats:
        pieces = self._pieces(model_or_state)
        if _dist()[1] == 0:  # first: the orchestrator issues the engine's receive when it sees this
            self._announce(version, "broadcast", UpdateStats(version, "broadcast"),
                           filesystem_copy=version == self.final_version)
        st = self.broadcast.publish(pieces, version)
        st.extra["source"] = "broadcast"
        if version == self.final_version:  # the run's output checkpoint
            self.sharded.publish(pieces, version)
            self.final_copies.append(version)
        return st

    def _publish_p2p(self, model_or_state: Any, version: int) -> UpdateStats:
        """Every rank snapshots its pieces for the engines to pull; rank 0 (after the index) announces: from its
        index thread once every rank's part arrived (``p2p_background``), else before returning."""
        from moe_rl.weights.filesystem import version_dir

        pieces = self._pieces(model_or_state)
        final = version == self.final_version
        if final:  # the run's output checkpoint, complete before the announcement that names it
            self.sharded.publish(pieces, version)
            self.final_copies.append(version)
        kw = dict(filesystem_copy=final, path=str(version_dir(self.weights_root, version)) if final else None,
                  layout="sharded" if final else None)

        def announce(st: UpdateStats) -> None:
            self._announce(version, "p2p", st, **kw)

        if self.p2p_background:
            st = self.p2p.publish(pieces, version, on_ready=announce if _dist()[1] == 0 else (lambda _st: None))
        else:
            st = self.p2p.publish(pieces, version)
            if _dist()[1] == 0:
                announce(st)
        st.extra["source"] = "p2p"
        return st

    def _publish_chain(self, hf_state_dict: dict[str, Any], version: int) -> UpdateStats:
        """One rank, a plain state dict: the store, else the Hugging Face folder (``FallbackWeightTransport``)."""
        report = self.chain.publish(hf_state_dict, version)
        source = report["transport"]
        fs_copy = source == "filesystem"
        if version == self.final_version and not fs_copy:
            self.filesystem.publish(hf_state_dict, version)  # the run's output checkpoint
            self.final_copies.append(version)
            fs_copy = True
        # held until the next version: the engine may ask for it again (serve_requests)
        self._held = None if fs_copy else (version, hf_state_dict)
        st = UpdateStats(version, "mooncake", bytes=int(report.get("bytes", 0)),
                         bytes_total=int(report.get("bytes", 0)), tensors=int(report.get("tensors", 0)),
                         extra={"source": source, "attempts": report.get("attempts", []),
                                "removed_store_versions": report.get("removed_versions", [])})
        self._announce(version, source, st, filesystem_copy=fs_copy,
                       path=str(self.filesystem.path(version)) if fs_copy else None, layout="hf" if fs_copy else None)
        return st

    def _publish_store_sharded(self, model_or_state: Any, version: int) -> UpdateStats:
        """Every rank puts its pieces as shard ``<rank>of<world>``; any failure sends the version to the sharded
        folder on every rank (the ranks agree through two small collectives)."""
        from moe_rl.weights.fallback import TRANSPORT_ERRORS

        on, rank, world = _dist()
        pieces = self._pieces(model_or_state)
        use_store = self.store is not None and time.monotonic() >= self._store_down_until
        use_store = _bcast_flag(use_store, on)
        ok, error = False, None
        if use_store:
            try:
                self.store.publish({p.key: p.tensor for p in pieces}, version)
                ok = True
            except TRANSPORT_ERRORS as exc:
                error = f"{type(exc).__name__}: {exc}"
            ok = _all_true(ok, on)
        shards = ",".join(f"{r}of{world}" for r in range(world))
        mc, fs = self._tstats["mooncake"], self._tstats["filesystem"]
        if ok:
            mc.published += 1
            mc.versions.append(version)
            fs_copy = version == self.final_version
            st = UpdateStats(version, "mooncake", bytes=sum(p.nbytes for p in pieces), tensors=len(pieces),
                             extra={"source": "mooncake", "shards": shards})
            if fs_copy:
                self.sharded.publish(pieces, version)
                self.final_copies.append(version)
            self._held = None if fs_copy else (version, pieces)
            if rank == 0:
                self._announce(version, "mooncake", st, filesystem_copy=fs_copy, shards=shards,
                               path=str(self.sharded.root / f"step_{version}") if fs_copy else None,
                               layout="sharded" if fs_copy else None)
            return st
        if use_store:
            mc.failed += 1
            mc.last_error = error or "the store failed on another trainer rank"
            self._store_down_until = time.monotonic() + self.retry_after_s
            if self.store is not None:
                self.store._remove_unfinished(version)  # this rank's pieces of a version without every manifest
        else:
            mc.skipped += 1
            mc.last_error = mc.last_error or self.setup_error
        st = self._publish_folder(pieces, version)
        fs.published += 1
        fs.fallbacks += 1
        fs.versions.append(version)
        st.extra["attempts"] = [{"transport": "mooncake", "error": error or "failed on another trainer rank"}
                                if use_store else {"transport": "mooncake", "skipped": "down after a failure"}]
        self._held = None
        return st

    # ------------------------------------------------------------------ republish on request
    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank in mooncake mode (where :meth:`serve_requests` is a collective, so every
        rank must leave the batch-wait loop at the same iteration); ``flag`` unchanged otherwise."""
        return _bcast_flag(flag, _dist()[0]) if self.mode == "mooncake" else bool(flag)

    def serve_requests(self) -> int | None:
        """Mooncake mode: if the orchestrator asked for the latest store version again (``announce/request_<v>
        .json``; the engine could not load it from the store), write it to the folder, re-announce it as
        ``filesystem`` and return ``v``; else None. Call it while waiting for the next batch, on every rank (with
        several ranks it is a collective: rank 0 decides). Requests for older versions are left alone.

        Raises:
            OSError: the folder could not be written.
        """
        from moe_rl.weights.announce import request_path, write_announcement

        if self.mode != "mooncake":
            return None
        on, rank, _ = _dist()
        held = self._held
        want = held is not None and (rank != 0 or request_path(self.weights_root, held[0]).exists())
        if on:
            want = _bcast_flag(want, on)
        if not want or held is None:
            return None
        version, data = held
        if isinstance(data, list):  # sharded pieces
            st = self.sharded.publish(data, version)
            path, layout = st.extra["path"], "sharded"
        else:
            self.filesystem.publish(data, version)
            path, layout = str(self.filesystem.path(version)), "hf"
        self._held = None
        self.republished.append(version)
        if rank == 0:
            write_announcement(self.weights_root, version, "filesystem", filesystem_copy=True, path=path,
                               layout=layout, stats=self.stats(), replace=True)
            request_path(self.weights_root, version).unlink(missing_ok=True)
        return version

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict[str, Any]:
        """Counters so far: ``mode``; ``versions_by_source``; ``publish_fallbacks`` (versions that did not go to
        the preferred transport); per-transport counters (``transports``, single-rank mooncake chain);
        ``final_filesystem_copies``; ``republished``; ``setup_error``; ``last`` (the latest publication)."""
        by_source: dict[str, int] = {}
        for s in list(self.sources.values()):  # a copy: p2p mode announces (and so calls this) from another thread
            by_source[s] = by_source.get(s, 0) + 1
        out: dict[str, Any] = {"mode": self.mode, "versions_by_source": by_source, "last": dict(self.last)}
        if self.mode == "mooncake":
            out.update(publish_fallbacks=sum(s != "mooncake" for s in self.sources.values()),
                       transports=(self.chain.summary() if self.chain is not None
                                   else {n: vars(t).copy() for n, t in self._tstats.items()}),
                       final_filesystem_copies=list(self.final_copies), republished=list(self.republished),
                       setup_error=self.setup_error, store_gc_failures=self._gc_failures())
        else:
            out["publish_fallbacks"] = 0
            out["final_filesystem_copies"] = list(self.final_copies)
        return out

    def _gc_failures(self) -> int:
        """Failed removals of old store versions (their objects stay pinned until the store stops)."""
        if self.store is not None:
            return int(self.store.gc_failures)
        first = self.chain.transports[0] if self.chain is not None else None
        return int(first.gc_failures) if first is not None and first.name == "mooncake" else 0

    def close(self) -> None:
        """Leave the store / the broadcast groups / stop serving p2p pulls; idempotent."""
        if self.broadcast is not None:
            self.broadcast.close()
        if self.p2p is not None:
            self.p2p.close()
        if self.store_client is not None:
            client, self.store_client = self.store_client, None
            client.close()


def _is_module(x: Any) -> bool:
    import torch

    return isinstance(x, torch.nn.Module)


def _bcast_flag(flag: bool, on: bool) -> bool:
    """Rank 0's ``flag`` on every rank."""
    if not on:
        return bool(flag)
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.broadcast(t, src=0)
    return bool(t.item())


def _all_true(flag: bool, on: bool) -> bool:
    """True when ``flag`` holds on every rank."""
    if not on:
        return bool(flag)
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def make_weight_publisher(cfg: Any, weights_root: str | Path, hf_config: dict,
                          extra_files: list[str | Path] | None = None, *, mcfg: Any = None,
                          dtype: Any = None) -> RunWeightPublisher:
    """This rank's publisher for ``cfg.trainer.weight_transport`` (``cfg``: the run's ``RLConfig``, as read from
    ``config.json``). Call it on every trainer rank (broadcast mode: a collective that returns once the engines
    joined the groups).

    In mooncake mode each rank joins the store with ``cfg.trainer.mooncake`` (ports written by the launcher) as a
    client that lends no memory. If it cannot join (master already gone), ``stats()["setup_error"]`` says why and
    every version falls back to the folder, counted.

    Args:
        cfg: the run's ``RLConfig``.
        weights_root: the run's ``weights/`` folder.
        hf_config: the ``config.json`` dict written beside the weights.
        extra_files: files copied into every version folder (tokenizer files).
        mcfg: the model config (``cfg.model`` when None).
        dtype: published dtype (``cfg.inference.dtype`` when None).

    Raises:
        ValueError: mooncake mode with ports still 0 (``config.json`` not written by the launcher).
        WeightBroadcastError: broadcast mode, the engines did not join within ``trainer.broadcast.timeout_s``.
    """
    import torch

    from moe_rl.weights.fallback import FilesystemWeightTransport
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher

    tcfg = cfg.trainer
    mcfg = cfg.model if mcfg is None else mcfg
    dtype = getattr(torch, cfg.inference.dtype) if dtype is None else dtype
    _, rank, world = _dist()
    delta = getattr(tcfg, "weight_delta", None)
    sharded = ShardedFilesystemPublisher(weights_root, hf_config, extra_files, mcfg=mcfg, dtype=dtype,
                                         config=tcfg.filesystem,
                                         delta=delta if tcfg.weight_transport == "filesystem" else None)
    fs = FilesystemWeightTransport(weights_root, hf_config, extra_files)
    common = dict(sharded=sharded, mcfg=mcfg, dtype=dtype, final_version=cfg.max_steps)
    if tcfg.weight_transport == "filesystem":
        return RunWeightPublisher("filesystem", Path(weights_root), fs, **common)
    if tcfg.weight_transport == "broadcast":
        from moe_rl.weights.broadcast import ShardedBroadcastPublisher

        bc = ShardedBroadcastPublisher(weights_root, tcfg.broadcast, mcfg=mcfg, dtype=dtype, delta=delta)
        return RunWeightPublisher("broadcast", Path(weights_root), fs, broadcast=bc, **common)
    if tcfg.weight_transport == "p2p":
        from moe_rl.weights.p2p_nixl import p2p_publisher  # gloo or NIXL, by trainer.p2p.backend

        pp = p2p_publisher(weights_root, tcfg.p2p, mcfg=mcfg, dtype=dtype, delta=delta)
        return RunWeightPublisher("p2p", Path(weights_root), fs, p2p=pp, p2p_background=True, **common)
    mcfg_store = tcfg.mooncake
    client_cfg = mcfg_store.client_config(global_segment_bytes=0)
    client = store = None
    setup_error = None
    try:
        from moe_rl.inference.mooncake.store import StoreClient
        from moe_rl.weights.mooncake import MooncakeWeightTransport

        client = StoreClient(client_cfg)
        store = MooncakeWeightTransport(client, cfg.inference.served_model_name, shard=f"{rank}of{world}",
                                        keep_versions=mcfg_store.keep_versions)
    except (ImportError, RuntimeError, OSError) as exc:  # StoreError is a RuntimeError
        setup_error = f"{type(exc).__name__}: {exc}"
    return RunWeightPublisher("mooncake", Path(weights_root), fs, store_client=client, setup_error=setup_error,
                              store=store, retry_after_s=mcfg_store.retry_after_s, **common)
