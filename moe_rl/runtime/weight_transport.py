"""Run-level weight transport glue: announcements of published versions, and the launcher's Mooncake store.

With ``trainer.weight_transport = "mooncake"`` a policy version goes trainer -> Mooncake Store -> vLLM worker,
falling back to the filesystem folder ``weights/step_<v>/`` (``moe_rl.inference.mooncake.FallbackWeightTransport``).
A version in the store has no ``STABLE`` marker on disk, so the trainer's rank 0 *announces* every version it
published, after the publication completed::

    <weights>/announce/step_<v>.json   {"version": v, "source": "mooncake" | "filesystem",
                                        "filesystem_copy": bool, "transport_stats": {...}}

written atomically (``step_<v>.json.tmp`` then ``os.replace``), so a reader that sees the file sees all of it
and the version it names is complete in ``source``. The orchestrator's weight watcher polls these files
(``Orchestrator._weight_watcher``) instead of the ``STABLE`` markers.

A version announced in the store can be lost before the engine loads it (the master died: a restarted or dead
master knows no objects). If no newer version is announced the run would stall (the trainer waits for a batch
that waits for a newer engine version), so the watcher asks for the version again::

    <weights>/announce/request_<v>.json   {"version": v, "reason": "..."}

and the trainer's rank 0, which still holds version v while it waits for the next batch, writes it to the
folder and re-announces it with ``"source": "filesystem"`` (``RunWeightPublisher.serve_requests``).

:class:`RunStore` is what the launcher (``moe_rl.entrypoints.rl.run_rl``) starts before the engine and the trainer:
a loopback :class:`moe_rl.inference.mooncake.MooncakeMaster` plus one :class:`StoreClient` that lends
``segment_bytes`` of the launcher's memory to the store. The objects live in that segment, so they outlive the
trainer process (the final version stays loadable after the trainer exits); the trainer writes and the vLLM
worker reads as clients that lend no memory.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from moe_rl.config import BaseConfig
from moe_rl.inference.mooncake.master import MooncakeMasterConfig

if TYPE_CHECKING:
    from moe_rl.inference.mooncake import MooncakeMaster, StoreClient, StoreClientConfig

__all__ = ["ANNOUNCE_DIR", "MooncakeTransportConfig", "RunStore", "StoreSource", "announce_path", "is_announced",
           "read_announcement", "request_path", "write_announcement", "write_republish_request"]

ANNOUNCE_DIR = "announce"
SOURCES = ("mooncake", "filesystem")
MiB = 1 << 20


class MooncakeTransportConfig(BaseConfig):
    """``trainer.mooncake``: the run's Mooncake store, used when ``trainer.weight_transport = "mooncake"``."""

    master: MooncakeMasterConfig = MooncakeMasterConfig()
    """Loopback master + metadata server the launcher starts (ports 0: free ports, which the launcher writes into
    the run's ``config.json`` for the trainer)."""
    segment_bytes: int = Field(256 * MiB, ge=MiB)
    """Memory the launcher lends to the store; it holds the pinned versions (at least ``keep_versions`` x the
    model's bytes in ``inference.dtype``; a full store refuses puts and the trainer falls back to the filesystem)."""
    local_buffer_bytes: int = Field(64 * MiB, ge=MiB)
    """Transfer buffer of every client (trainer, launcher, vLLM worker); tensors are split into chunks of half of
    it (``MooncakeWeightTransport``)."""
    keep_versions: int = Field(2, ge=1)
    """Store versions kept after each publication (older ones are removed; ``MooncakeWeightTransport``)."""
    retry_after_s: float = Field(30.0, ge=0.0)
    """After a failed store publication, publish to the filesystem for this long before trying the store again
    (``FallbackWeightTransport``)."""

    def client_config(self, global_segment_bytes: int = 0) -> Any:
        """The ``StoreClientConfig`` of a client of this store lending ``global_segment_bytes`` (0: none).

        Raises:
            ValueError: a port is still 0 (the launcher fills them after starting the master).
        """
        from moe_rl.inference.mooncake.store import StoreClientConfig

        m = self.master
        if not (m.rpc_port and m.metadata_port):
            raise ValueError(
                f"trainer.mooncake.master.rpc_port={m.rpc_port} / metadata_port={m.metadata_port}: a client needs the "
                "ports of a running master; moe-rl rl writes them into the run's config.json after starting it"
            )
        return StoreClientConfig(master_address=f"{m.host}:{m.rpc_port}",
                                 metadata_url=f"http://{m.host}:{m.metadata_port}/metadata",
                                 local_hostname=m.host, global_segment_bytes=global_segment_bytes,
                                 local_buffer_bytes=self.local_buffer_bytes)



def announce_path(weights_root: str | Path, version: int) -> Path:
    """``<weights_root>/announce/step_<version>.json``."""
    return Path(weights_root) / ANNOUNCE_DIR / f"step_{version}.json"


def write_announcement(weights_root: str | Path, version: int, source: Literal["mooncake", "filesystem"], *,
                       filesystem_copy: bool = False, transport_stats: dict[str, Any] | None = None) -> Path:
    """Announce that ``version`` is complete in ``source`` (atomic: tmp file + ``os.replace``).

    Args:
        weights_root: the run's weights folder.
        version: policy version, int >= 0.
        source: the transport that holds the version.
        filesystem_copy: True when ``weights_root/step_<version>`` (with ``STABLE``) exists as well.
        transport_stats: the publisher's counters at this point (for the record).

    Raises:
        ValueError: ``source`` is not ``"mooncake"``/``"filesystem"``, or ``version`` is not an int >= 0.
    """
    if source not in SOURCES:
        raise ValueError(f"write_announcement: source={source!r} must be one of {SOURCES}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"write_announcement: version={version!r} must be an int >= 0")
    path = announce_path(weights_root, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": version, "source": source, "filesystem_copy": bool(filesystem_copy),
                               "transport_stats": transport_stats or {}}))
    os.replace(tmp, path)
    return path


def is_announced(weights_root: str | Path, version: int) -> bool:
    """True once ``version``'s announcement exists (cheap: one ``stat``)."""
    return announce_path(weights_root, version).exists()


def read_announcement(weights_root: str | Path, version: int) -> dict[str, Any] | None:
    """The announcement of ``version``, or None if there is none yet."""
    try:
        return json.loads(announce_path(weights_root, version).read_text())
    except FileNotFoundError:
        return None


def request_path(weights_root: str | Path, version: int) -> Path:
    """``<weights_root>/announce/request_<version>.json``: the orchestrator asks the trainer to republish."""
    return Path(weights_root) / ANNOUNCE_DIR / f"request_{version}.json"


def write_republish_request(weights_root: str | Path, version: int, reason: str) -> Path:
    """Ask the trainer to write ``version`` to the filesystem and announce it again (the engine could not load it:
    the store lost it with its master, or removed it). Atomic like :func:`write_announcement`."""
    path = request_path(weights_root, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": version, "reason": reason}))
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class StoreSource:
    """Where the engines load store-published versions from (the orchestrator's view of the store).

    Attributes:
        store_config: the store the trainer publishes to (the vLLM worker joins it as a pure reader).
        model: model id in the keys (``MooncakeWeightTransport(model=...)``; the served model name).
        shard: the publisher's shard (``"0of1"``: rank 0 publishes full tensors).
    """

    store_config: StoreClientConfig
    model: str
    shard: str = "0of1"


class RunStore:
    """The launcher's Mooncake store for one run: a loopback master and the client that lends it memory.

    Args:
        config: ``trainer.mooncake`` of the run.
        log_dir: folder for ``master.log``/``metadata.log`` when ``config.master.log_dir`` is None.

    Attributes (after :meth:`start`):
        master: the running :class:`MooncakeMaster`; ``master.master_pid`` is the process a fault test kills.
        resolved: ``config`` with the ports the servers actually bound (write it into the run's ``config.json``:
            the trainer connects with it).

    Raises (from :meth:`start`):
        ImportError: Mooncake or libibverbs is missing (the message says how to install them).
        RuntimeError: the master did not start (the message holds its log tail).
        moe_rl.inference.mooncake.StoreError: the memory-lending client could not join.
    """

    name = "mooncake store"

    def __init__(self, config: MooncakeTransportConfig, log_dir: Path) -> None:
        self.config = config
        self.log_dir = Path(log_dir)
        self.master: MooncakeMaster | None = None
        self.client: StoreClient | None = None
        self.resolved: MooncakeTransportConfig | None = None
        self.close_s: float | None = None

    def start(self) -> RunStore:
        from moe_rl.inference.mooncake import MooncakeMaster, StoreClient

        mcfg = self.config.master
        if mcfg.log_dir is None:
            mcfg = mcfg.model_copy(update={"log_dir": str(self.log_dir)})
        self.master = MooncakeMaster(mcfg).start()
        try:
            ports = {"rpc_port": self.master.rpc_port, "metadata_port": self.master.metadata_port,
                     "metrics_port": self.master.metrics_port}
            self.resolved = self.config.model_copy(update={"master": mcfg.model_copy(update=ports)})
            self.client = StoreClient(self.resolved.client_config(global_segment_bytes=self.config.segment_bytes))
        except BaseException:
            self.stop()
            raise
        return self

    def source(self, model: str) -> StoreSource:
        """The engines' view of this store for keys of ``model``."""
        if self.resolved is None:
            raise RuntimeError("RunStore.source: call start() first")
        return StoreSource(self.resolved.client_config(global_segment_bytes=0), model)

    def master_alive(self) -> bool:
        return self.master is not None and self.master.master_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the memory-lending client (its objects disappear), then stop the master; idempotent. With the
        master already dead, the client's close waits for its unmount RPC to fail (~7 s, measured)."""
        t0 = time.monotonic()
        if self.client is not None:
            client, self.client = self.client, None
            client.close()
        if self.master is not None:
            master, self.master = self.master, None
            master.stop(timeout)
        self.close_s = time.monotonic() - t0
