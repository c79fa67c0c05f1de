"""The engine side of every weight transport: the vLLM worker extension the servers run.

``VllmServer`` starts vLLM with ``--worker-extension-cls moe_rl.weights.engine.WeightSyncExtension``; vLLM mixes the
class into its worker, so ``self`` is the worker. It extends :class:`moe_rl.inference.vllm_worker_ext.EngineExtension`
(in-place reload with the CPU MoE repack, the weight version, per-token versions, routed-experts capture) with one
load per transport, each called by name through ``POST /collective_rpc`` (``VllmClient``):

- ``load_sharded(path, version)``: the ``filesystem`` transport's sharded folder (:func:`moe_rl.weights.filesystem.read_sharded`);
- ``init_weight_broadcast`` / ``init_sharded_broadcast`` + ``update_weights_from_broadcast(version)``: the ``broadcast``
  transport (one group per sending trainer rank, received concurrently, :mod:`moe_rl.weights.broadcast`);
- ``init_p2p`` + ``update_weights_from_p2p(index, version)``: the ``p2p`` transport (pull the pieces from the
  trainer ranks that own them, :mod:`moe_rl.weights.p2p`);
- ``update_weights_from_mooncake``: the ``mooncake`` transport (:mod:`moe_rl.weights.mooncake`).

Assemble, then swap: every load first receives or reads the whole version into host memory (one host copy of the
served weights), checks it (sizes, CRC-32s, every tensor covered once by its pieces, the header's version), and only
then hands it to vLLM's in-place ``reload_weights`` (``EngineExtension._apply_weights``). A transfer that fails
(trainer died, truncated shard, timeout) therefore leaves the engine on its previous version, whole; the error says
so. While an RPC runs the engine takes no model step: the RPC's wall time is the engine's pause.

This module is imported only by vLLM's worker process (and tests): vllm and torch are imported inside the methods.
"""

from __future__ import annotations

import time
from typing import Any

from moe_rl.inference.vllm_worker_ext import EngineExtension, _check_version

__all__ = ["WeightSyncExtension"]


def _maybe_assemble(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Whole tensors from piece-keyed items (``moe_rl.weights.regions``; checkpoint names never hold ``@``); items
    with plain names pass unchanged."""
    pieces = [it for it in items if "@" in it[0]]
    if not pieces:
        return items
    from moe_rl.weights.regions import assemble

    return [it for it in items if "@" not in it[0]] + assemble(pieces)


class WeightSyncExtension(EngineExtension):
    """The worker extension the servers run: :class:`EngineExtension` plus one load per weight transport."""

    # ------------------------------------------------------------------ filesystem (sharded folders)
    def load_sharded(self, path: str, version: int | str) -> dict[str, Any]:
        """Read the sharded version folder ``path`` (every tensor this engine serves), check it, then load it.

        Args:
            path: ``<weights>/step_<v>`` written by ``ShardedFilesystemPublisher``, as seen by the engine.
            version: the policy version (a string of digits is accepted).

        Returns:
            ``_apply_weights``'s report plus ``"source": "filesystem"``, ``"read_s"`` (read + check + assemble),
            ``"bytes"``, ``"tensors"``, ``"path"``.

        Raises:
            LookupError: no ``STABLE`` marker.
            ValueError: a truncated or corrupt shard, a bad version, or a ``path`` outside the engine's weights root
                (``MOE_RL_WEIGHTS_ROOT``), or a file in it that is a symlink leading outside the root (nothing loaded:
                the engine keeps its previous version).
        """
        from moe_rl.inference.control_plane import confine_weight_files, confine_weights_path
        from moe_rl.weights.filesystem import read_sharded

        new_version = _check_version("load_sharded", version)
        local = confine_weights_path(path, "load_sharded: path")  # under MOE_RL_WEIGHTS_ROOT when set
        confine_weight_files(local, "load_sharded: path")  # every shard, the index and the marker too
        from moe_rl.weights.filesystem import is_delta_folder

        if is_delta_folder(local):
            return self._load_sharded_delta(local, path, new_version)
        t0 = time.perf_counter()
        weights = read_sharded(local)  # TP=1 on CPU: the engine serves every tensor; vLLM's loader slices for TP>1
        read_s = time.perf_counter() - t0
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        out.update(source="filesystem", read_s=read_s, path=path, tensors=len(weights),
                   bytes=sum(t.numel() * t.element_size() for _, t in weights))
        return out

    def _load_sharded_delta(self, local: str, path: str, new_version: int) -> dict[str, Any]:
        """A delta-encoded sharded folder (:mod:`moe_rl.weights.delta_sync`): advance this worker's host copy of the
        published pieces to ``new_version`` (following each trainer rank's chain of bases through the older folders
        still on disk), then load the changed load units (every tensor when the model was last loaded otherwise).

        A wrong or missing base (this worker holds no base: it started late, a delta failed, the base folder is
        gone) raises :class:`moe_rl.weights.delta.DeltaBaseError`, a corrupt delta ``DeltaChecksumError`` /
        ``DeltaPayloadError`` (the host copy is rolled back bit for bit); both write a full-version request for
        the trainer (:func:`moe_rl.weights.delta_sync.request_full`). A truncated file raises ``ValueError`` before
        anything is read. The model is loaded only from a committed host copy.

        Returns:
            ``_apply_weights``'s report plus ``"source": "filesystem"``, ``"read_s"`` (read + check + apply to the
            host copy + assemble), ``"path"``, ``"tensors"`` (loaded), ``"bytes"`` (read: the deltas' buffers and
            any full ranks' pieces) and ``"delta"``: ``{"versions", "changed", "wire_bytes", "raw_bytes",
            "full_ranks", "tensors_total", "refused", "full_requested"}``.
        """
        from pathlib import Path

        from moe_rl.inference.control_plane import confine_weight_files, confine_weights_path
        from moe_rl.weights.delta import DeltaError
        from moe_rl.weights.delta_sync import EngineDeltaState, request_full
        from moe_rl.weights.filesystem import read_delta_version, version_dir

        state = getattr(self, "_moe_rl_delta", None)
        if state is None:
            state = self._moe_rl_delta = EngineDeltaState()
        root = Path(local).parent

        def fetch(v: int) -> Any:
            folder = local if v == new_version else confine_weights_path(str(version_dir(root, v)),
                                                                         "load_sharded: base version")
            if v != new_version:
                confine_weight_files(folder, "load_sharded: base version")
            return read_delta_version(folder)

        t0 = time.perf_counter()
        try:
            rep = state.advance(new_version, fetch)
        except DeltaError as exc:  # wrong base, corrupt or malformed delta: the host copy is as it was
            try:
                request_full(root, new_version, str(exc))
                note = "a full version was requested from the trainer"
            except OSError as oserr:
                note = f"the full-version request could not be written ({oserr})"
            raise type(exc)(f"load_sharded: {exc} [{note}; the engine keeps version {self.weight_version()}]") \
                from exc
        names = state.to_load(rep["changed_names"], self.weight_version())
        weights = state.weights(names)
        read_s = time.perf_counter() - t0
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        state.model_version = new_version
        out.update(source="filesystem", read_s=read_s, path=path, tensors=len(weights),
                   bytes=rep["wire_bytes"],
                   delta={"versions": rep["versions"], "changed": rep["changed"], "wire_bytes": rep["wire_bytes"],
                          "raw_bytes": rep["raw_bytes"], "full_ranks": rep["full_ranks"],
                          "tensors_total": len(state.names()), "refused": state.refused})
        return out

    # ------------------------------------------------------------------ broadcast
    # moe_rl.weights.broadcast: each sending trainer rank is rank 0 of its own group; every worker joins each group
    # as rank_offset + its rank among the engine's workers. Each RPC blocks until the trainer's side of the same
    # step runs, so the client issues it concurrently (broadcast.connect_engines / broadcast_weights, or the
    # orchestrator's watcher with the trainer's ShardedBroadcastPublisher).
    def init_weight_broadcast(
        self,
        master_addr: str,
        port: int | str,
        rank_offset: int | str,
        world_size: int | str,
        backend: str = "gloo",
        timeout_s: float | str = 120.0,
    ) -> dict[str, Any]:
        """Join the trainer's weight broadcast group (replacing a previous one).

        This worker's rank is ``dp_index * (tp * pp) + rank_in_dp + rank_offset``, as vLLM's own NCCL weight
        transfer computes it (``vllm/distributed/weight_transfer/nccl_common.py::worker_init_process_group``).
        The group is built on a TCPStore at ``master_addr:port`` with a directly constructed ``ProcessGroupGloo``
        (``backend="gloo"``) or vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (``"nccl"``); vLLM's
        own process groups are not touched.

        Returns:
            ``{"rank", "world_size", "backend", "init_s"}``.

        Raises:
            ValueError: the computed rank is outside ``1..world_size-1``, or a bad backend/timeout.
            WeightBroadcastError: not every rank joined within ``timeout_s`` seconds.
        """
        from moe_rl.weights.broadcast import BroadcastReceiver

        pc = self.vllm_config.parallel_config
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        rank = dp_index * int(pc.world_size) + int(pc.rank) + int(rank_offset)
        self._moe_rl_broadcast = None
        rx = BroadcastReceiver(str(master_addr), int(port), rank, int(world_size), backend=backend,  # type: ignore[arg-type]
                               timeout_s=float(timeout_s))  # fmt: skip
        self._moe_rl_broadcast = [rx]
        return {"rank": rank, "world_size": int(world_size), "backend": backend, "init_s": rx.init_s}

    def init_sharded_broadcast(self, endpoints: list[list[Any]], rank_offset: int | str, world_size: int | str,
                               backend: str = "gloo", timeout_s: float | str = 120.0) -> dict[str, Any]:
        """Join one broadcast group per sending trainer rank (``endpoints``: ``[[host, port], ...]`` in trainer-rank
        order, from ``weights/announce/broadcast_group.json``), replacing previous groups.

        Returns:
            ``{"rank", "world_size", "backend", "groups", "init_s"}``.

        Raises:
            ValueError: empty ``endpoints`` or a bad rank. WeightBroadcastError: a group could not be joined.
        """
        from moe_rl.weights.broadcast import BroadcastReceiver

        if not endpoints:
            raise ValueError("init_sharded_broadcast: endpoints=[] ; pass one [host, port] per sending trainer rank")
        pc = self.vllm_config.parallel_config
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        rank = dp_index * int(pc.world_size) + int(pc.rank) + int(rank_offset)
        self._moe_rl_broadcast = None
        t0 = time.perf_counter()
        rxs = [BroadcastReceiver(str(h), int(p), rank, int(world_size), backend=backend,  # type: ignore[arg-type]
                                 timeout_s=float(timeout_s)) for h, p in endpoints]
        self._moe_rl_broadcast = rxs
        return {"rank": rank, "world_size": int(world_size), "backend": backend, "groups": len(rxs),
                "init_s": time.perf_counter() - t0}

    def update_weights_from_broadcast(self, version: int | str) -> dict[str, Any]:
        """Receive one version from every group (concurrently, one thread per group), check it, then load it.

        Each group's sender sends a header (with the version) and its buckets; the tensors are full checkpoint
        tensors or pieces (``moe_rl.weights.regions``), assembled once everything arrived.

        Args:
            version: the policy version; must equal the version in every header.

        Returns:
            ``_apply_weights``'s report plus ``"source": "broadcast"``, ``"tensors"``, ``"bytes"``, ``"buckets"``,
            ``"groups"``, ``"recv_s"`` (until the last byte arrived, which includes waiting for the trainer).

        Raises:
            RuntimeError: no group (call ``init_weight_broadcast`` / ``init_sharded_broadcast`` first).
            ValueError: a header's version differs (every bucket is received and dropped; weights unchanged).
            WeightBroadcastError: a transfer failed (peer died, timeout): weights unchanged, the groups are closed
                (form new ones).
        """
        from concurrent.futures import ThreadPoolExecutor

        from moe_rl.weights.broadcast import WeightBroadcastError

        new_version = _check_version("update_weights_from_broadcast", version)
        rxs = getattr(self, "_moe_rl_broadcast", None)
        if not rxs:
            raise RuntimeError("update_weights_from_broadcast: no broadcast group; call init_weight_broadcast first")
        t0 = time.perf_counter()

        def one(rx: Any) -> tuple[Any, list[tuple[str, Any]]]:
            plan = rx.receive_header()
            return plan, list(rx.stream(plan))

        with ThreadPoolExecutor(len(rxs)) as pool:
            futures = [pool.submit(one, rx) for rx in rxs]
            results, errors = [], []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as exc:  # noqa: BLE001 - every group's error is reported
                    errors.append(exc)
        recv_s = time.perf_counter() - t0
        if errors:
            self._moe_rl_broadcast = None  # a failed collective leaves the group unusable
            raise WeightBroadcastError(
                f"{errors[0]} [worker: version {new_version} not received from {len(errors)} of {len(rxs)} groups; "
                f"weights unchanged; the group is closed (all {len(rxs)}; nothing is loaded before the whole version "
                "arrived): form new ones (new WeightBroadcaster + connect_engines)]"
            ) from errors[0]
        wrong = sorted({p.version for p, _ in results if p.version != new_version})
        if wrong:
            raise ValueError(
                f"update_weights_from_broadcast: the trainer sent version {', '.join(map(str, wrong))} but this RPC "
                f"says {new_version}; pass the same version to the sender and the RPC (received and dropped; nothing "
                "loaded)"
            )
        if any(p.delta is not None for p, _ in results):
            return self._apply_broadcast_delta(results, new_version, recv_s)
        items = [it for _, got in results for it in got]
        weights = _maybe_assemble(items)
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        out.update(source="broadcast", tensors=len(weights), groups=len(rxs), recv_s=recv_s,
                   bytes=sum(p.total_bytes for p, _ in results), buckets=sum(len(p.buckets) for p, _ in results))
        return out

    def _apply_broadcast_delta(self, results: list[Any], new_version: int, recv_s: float) -> dict[str, Any]:
        """Delta-encoded broadcast (:mod:`moe_rl.weights.delta_sync`): group ``r`` carried trainer rank ``r``'s
        :class:`~moe_rl.weights.delta.DeltaUpdate` (header in the plan, buffers in the buckets; a rank with no
        pieces sends an empty plan). Every version is sent once, in order, so there is no chain to follow: a wrong
        base or a corrupt update raises (``DeltaError``; the host copy rolled back, the model untouched)."""
        from moe_rl.weights.delta import DeltaUpdate
        from moe_rl.weights.delta_sync import EngineDeltaState

        ups = {}
        for rank, (plan, got) in enumerate(results):
            if plan.delta is None:
                if plan.num_tensors:
                    raise ValueError(f"update_weights_from_broadcast: version {new_version} is delta-encoded on some "
                                     f"trainer ranks but group {rank} sent {plan.num_tensors} plain tensors: the "
                                     "trainer ranks disagree on weight_delta; nothing loaded")
                continue
            ups[rank] = DeltaUpdate.from_tensors(plan.delta, dict(got))
        state = getattr(self, "_moe_rl_delta", None)
        if state is None:
            state = self._moe_rl_delta = EngineDeltaState()

        def fetch(v: int) -> Any:
            if v != new_version:
                raise LookupError(f"the broadcast sends each version once; version {v} was not received here")
            return ups

        t0 = time.perf_counter()
        rep = state.advance(new_version, fetch)
        weights = state.weights(state.to_load(rep["changed_names"], self.weight_version()))
        apply_s = time.perf_counter() - t0
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        state.model_version = new_version
        out.update(source="broadcast", tensors=len(weights), groups=len(results), recv_s=recv_s, apply_s=apply_s,
                   bytes=sum(p.total_bytes + len(p.delta.encode()) for p, _ in results if p.delta is not None),
                   buckets=sum(len(p.buckets) for p, _ in results),
                   delta={"versions": rep["versions"], "changed": rep["changed"], "wire_bytes": rep["wire_bytes"],
                          "raw_bytes": rep["raw_bytes"], "full_ranks": rep["full_ranks"],
                          "tensors_total": len(state.names()), "refused": state.refused})
        return out

    def close_weight_broadcast(self) -> bool:
        """Leave the broadcast groups; returns whether there were any."""
        had = bool(getattr(self, "_moe_rl_broadcast", None))
        self._moe_rl_broadcast = None
        return had

    # ------------------------------------------------------------------ p2p (pull from the owning trainer ranks)
    def init_p2p(self, endpoints: list[list[Any]], rank_offset: int | str, world_size: int | str,
                 timeout_s: float | str = 300.0) -> dict[str, Any]:
        """Join one p2p group per trainer rank (``endpoints``: ``[[host, port], ...]`` in trainer-rank order, from
        ``weights/announce/p2p_group.json``), replacing earlier ones; this worker's rank is computed as in
        :meth:`init_sharded_broadcast`. Returns once every group is formed (each trainer rank's server thread
        forms its group when all workers joined; the trainer does not wait).

        Returns:
            ``{"rank", "world_size", "groups", "init_s"}``.

        Raises:
            ValueError: empty ``endpoints`` or a bad rank. P2PTransferError: a group could not be joined.
        """
        from moe_rl.weights.p2p_nixl import open_puller

        pc = self.vllm_config.parallel_config
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        rank = dp_index * int(pc.world_size) + int(pc.rank) + int(rank_offset)
        self._moe_rl_p2p = None
        puller = open_puller(endpoints, rank, int(world_size), timeout_s=float(timeout_s))  # gloo or NIXL: the trainer's
        self._moe_rl_p2p = puller
        return {"rank": rank, "world_size": int(world_size), "groups": len(puller.groups), "init_s": puller.init_s}

    def update_weights_from_p2p(self, index: str, version: int | str) -> dict[str, Any]:
        """Pull version ``version`` from the trainer ranks that own its pieces, check, assemble, then load it.

        Args:
            index: the version's piece index (``weights/announce/p2p_<v>.json``, as seen by the engine).
            version: the policy version.

        Returns:
            ``_apply_weights``'s report plus ``"source": "p2p"``, ``"tensors"``, ``"bytes"``, ``"pull_s"``
            (request + transfer + CRC-32 checks), ``"retries"`` (re-pulled ranks after a CRC-32 mismatch).

        Raises:
            RuntimeError: no groups (call :meth:`init_p2p` first).
            P2PError: the version is not held any more, or a CRC-32 stayed wrong (weights unchanged).
            P2PTransferError: a trainer rank is gone or a transfer stopped (weights unchanged; groups closed).
        """
        new_version = _check_version("update_weights_from_p2p", version)
        puller = getattr(self, "_moe_rl_p2p", None)
        if puller is None:
            raise RuntimeError("update_weights_from_p2p: no p2p groups; call init_p2p first")
        from moe_rl.inference.control_plane import confine_weights_path

        if not isinstance(index, dict):  # a path (not the index itself): under MOE_RL_WEIGHTS_ROOT when set
            index = confine_weights_path(index, "update_weights_from_p2p: index")
        from moe_rl.weights.p2p import read_index

        if "delta" in read_index(index, new_version):
            return self._apply_p2p_delta(puller, index, new_version)
        # TP=1 on CPU: the engine serves every tensor; vLLM's loader slices for TP>1
        weights, rep = puller.pull(index, new_version)
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        out.update(source="p2p", tensors=len(weights), bytes=rep["bytes"], pull_s=rep["pull_s"],
                   retries=rep["retries"], groups=rep["ranks"])
        return out

    def _apply_p2p_delta(self, puller: Any, index: Any, new_version: int) -> dict[str, Any]:
        """Delta-encoded p2p version (:mod:`moe_rl.weights.delta_sync`): pull every trainer rank's update (its
        buffers, CRC-32s checked), follow each rank's chain of bases through the versions the trainer ranks still
        hold (``p2p_<v>.json`` beside ``index``), advance the host copy, then load the changed load units. A wrong
        or missing base or a corrupt update raises ``DeltaError`` (nothing loaded) and requests a full version."""
        from pathlib import Path

        from moe_rl.inference.control_plane import confine_weights_path
        from moe_rl.weights.delta import DeltaError
        from moe_rl.weights.delta_sync import EngineDeltaState, request_full
        from moe_rl.weights.p2p import P2PError, P2PTransferError

        state = getattr(self, "_moe_rl_delta", None)
        if state is None:
            state = self._moe_rl_delta = EngineDeltaState()
        pulled = {"bytes": 0, "pull_s": 0.0, "retries": 0, "ranks": 0}

        def fetch(v: int) -> Any:
            if v == new_version:
                src = index
            elif isinstance(index, dict):
                raise LookupError(f"version {v}: only the index of version {new_version} was given")
            else:
                src = confine_weights_path(str(Path(index).with_name(f"p2p_{v}.json")),
                                           "update_weights_from_p2p: base index")
            try:
                ups = puller.pull_delta(src, v)
            except P2PTransferError:
                raise
            except P2PError as exc:  # not held any more / no index: the chain cannot be followed
                if v == new_version:
                    raise
                raise LookupError(str(exc)) from exc
            for k in ("bytes", "pull_s", "retries"):
                pulled[k] += puller.last_pull[k]
            pulled["ranks"] = puller.last_pull["ranks"]
            return ups

        t0 = time.perf_counter()
        try:
            rep = state.advance(new_version, fetch)
        except DeltaError as exc:  # the host copy is as it was
            note = "no full version could be requested (the index was passed inline)"
            if not isinstance(index, dict):
                try:
                    request_full(Path(index).parent.parent, new_version, str(exc))
                    note = "a full version was requested from the trainer"
                except OSError as oserr:
                    note = f"the full-version request could not be written ({oserr})"
            raise type(exc)(f"update_weights_from_p2p: {exc} [{note}; the engine keeps version "
                            f"{self.weight_version()}]") from exc
        weights = state.weights(state.to_load(rep["changed_names"], self.weight_version()))
        apply_s = time.perf_counter() - t0
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        state.model_version = new_version
        out.update(source="p2p", tensors=len(weights), bytes=pulled["bytes"], pull_s=pulled["pull_s"],
                   retries=pulled["retries"], groups=pulled["ranks"], apply_s=apply_s,
                   delta={"versions": rep["versions"], "changed": rep["changed"], "wire_bytes": rep["wire_bytes"],
                          "raw_bytes": rep["raw_bytes"], "full_ranks": rep["full_ranks"],
                          "tensors_total": len(state.names()), "refused": state.refused})
        return out

    # ------------------------------------------------------------------ mooncake
    def update_weights_from_mooncake(
        self, store_config: dict[str, Any], model: str, version: int | str, shard: str = "0of1"
    ) -> dict[str, Any]:
        """Load weights ``version`` of ``model`` from a Mooncake Store and apply them in place.

        Fetches every tensor of the version and checks it against the manifest (byte size, CRC-32) before
        applying any (``moe_rl.inference.mooncake.MooncakeWeightTransport.load``), then applies them through
        ``_apply_weights`` (same CPU MoE repack as ``reload_and_repack``). The worker joins the store once as a
        pure reader (``global_segment_bytes=0``) and keeps that client for later calls.

        Args:
            store_config: ``StoreClientConfig`` fields as a dict (``master_address``, ``metadata_url``, ...).
            model: model id used in the keys when the version was published.
            version: the weight version (a string of digits is accepted).
            shard: the publisher's shard, ``"<rank>of<world>"``, or several joined by ``,`` (sharded puts: one
                shard per trainer rank, their pieces assembled after every shard was fetched and checked).

        Returns:
            ``_apply_weights``'s dict plus ``"source": "mooncake"``, ``"bytes"`` and ``"fetch_s"``.

        Raises:
            ValueError: bad version, or a tensor that does not match its manifest (nothing applied).
            moe_rl.weights.mooncake.VersionNotFoundError: the version is not in the store (nothing applied).
            moe_rl.inference.mooncake.StoreError: the store could not be reached (nothing applied).
        """
        from moe_rl.inference.mooncake.store import StoreClient, StoreClientConfig
        from moe_rl.weights.mooncake import MooncakeWeightTransport

        new_version = _check_version("update_weights_from_mooncake", version)
        cfg = StoreClientConfig(**{**dict(store_config), "global_segment_bytes": 0})
        client = getattr(self, "_moe_rl_store", None)
        if client is None or client.config != cfg:
            if client is not None:
                client.close()
            self._moe_rl_store = None
            client = self._moe_rl_store = StoreClient(cfg)
        t0 = time.perf_counter()
        items = [it for sh in str(shard).split(",") for it in
                 MooncakeWeightTransport(client, model, shard=sh).load(new_version)]
        weights = _maybe_assemble(items)  # sharded puts: every trainer rank's pieces, assembled
        fetch_s = time.perf_counter() - t0
        out = self._apply_weights(new_version, weights_iterator=iter(weights))
        out.update(source="mooncake", fetch_s=fetch_s, bytes=sum(t.numel() * t.element_size() for _, t in weights))
        return out
