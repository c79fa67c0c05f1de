"""The ``mooncake`` weight transport: trainer -> Mooncake Store -> vLLM worker, its config and the run's store.

Layout of one published version (keys from :mod:`moe_rl.inference.mooncake.keys`)::

    moe_rl|k1|weights|<model>|v<version>|<dtype>|<shard>|<hf_name>|p<i>     raw tensor bytes, chunk i
    moe_rl|k1|weights|<model>|v<version>|json|<shard>|__manifest__|p0         manifest, written LAST

A tensor's bytes are its contiguous little-endian storage (``tensor.view(uint8)``), split into chunks of at
most ``StoreClient.max_object_bytes``. The manifest lists, per tensor in publication order: HF name, dtype,
shape, byte size, number of chunks and the CRC-32 (``zlib.crc32``) of the bytes. It is the completion marker
(as ``STABLE`` is for the filesystem transport, ``moe_rl.weights.filesystem``): a reader that finds no manifest
treats the version as not published, and :meth:`MooncakeWeightTransport.load` fetches and checks every
tensor before handing out any, so an engine never applies half a version.

All objects are hard-pinned (never evicted); :meth:`MooncakeWeightTransport.publish` removes versions older
than the ``keep_versions`` newest it published. The objects live in the segments of the clients that hold
memory (``global_segment_bytes`` > 0, normally the trainer's client): closing that client drops them.

Bytes are copied as-is, so bf16, fp32, fp8 (``float8_e4m3fn``) and integer tensors round-trip bit-exactly.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from moe_rl.config import BaseConfig
from moe_rl.inference.mooncake.keys import StoreKey
from moe_rl.inference.mooncake.master import MooncakeMaster, MooncakeMasterConfig
from moe_rl.inference.mooncake.store import MissingKeyError, StoreClient, StoreClientConfig, StoreError

__all__ = ["MANIFEST_NAME", "MooncakeTransportConfig", "MooncakeWeightTransport", "RunStore", "StoreSource",
           "VersionNotFoundError", "tensor_bytes", "update_engine_weights"]

MANIFEST_NAME = "__manifest__"
MANIFEST_FORMAT = "moe_rl.weights/1"


class VersionNotFoundError(LookupError):
    """No complete copy of a weight version (no manifest: never published, unfinished, or removed)."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: Any) -> memoryview:
    """The contiguous storage bytes of a CPU tensor, ``[nbytes] uint8`` as a memoryview (no copy when the
    tensor is already contiguous)."""
    import torch

    t = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


class MooncakeWeightTransport:
    """Publish and load HF-named state dicts, one immutable version at a time, through a Mooncake Store.

    Args:
        client: a connected :class:`StoreClient` (the trainer's one lends memory: ``global_segment_bytes``).
        model: model id used in the keys (no ``|`` or whitespace).
        shard: which part of the model this publisher owns, ``"<rank>of<world>"`` (``"0of1"``: all of it).
        keep_versions: after publishing version v, versions this transport published before, other than the
            ``keep_versions`` newest, are removed (>= 1).
        pin: hard-pin the objects (default; Mooncake never evicts them).

    Raises:
        ValueError: ``keep_versions < 1`` or an invalid ``model``/``shard`` (see ``StoreKey``).
    """

    name = "mooncake"

    def __init__(self, client: StoreClient, model: str, *, shard: str = "0of1", keep_versions: int = 2,
                 pin: bool = True) -> None:
        if keep_versions < 1:
            raise ValueError(f"MooncakeWeightTransport: keep_versions={keep_versions} must be >= 1")
        self.client = client
        self.model = model
        self.shard = shard
        self.keep_versions = keep_versions
        self.pin = pin
        self._manifest_key(0)  # validates model and shard
        self._published: list[int] = []
        self.gc_failures = 0
        """Removals that failed: of old versions (their objects stay pinned until removed by hand) or of the
        tensors of a publication that failed before its manifest."""

    # ------------------------------------------------------------------ keys
    def _manifest_key(self, version: int) -> StoreKey:
        return StoreKey(kind="weights", model=self.model, dtype="json", name=MANIFEST_NAME, version=version,
                        shard=self.shard)

    def _tensor_key(self, version: int, name: str, dtype: str, part: int) -> StoreKey:
        return StoreKey(kind="weights", model=self.model, dtype=dtype, name=name, version=version, shard=self.shard,
                        part=part)

    # ------------------------------------------------------------------ publish
    def publish(self, state_dict: Mapping[str, Any], version: int) -> dict[str, Any]:
        """Write every tensor of ``state_dict`` under ``version``, then the manifest.

        Idempotent: publishing the same tensors again is a no-op; different tensors under a published version
        raise ValueError (versions are immutable).

        Args:
            state_dict: HF checkpoint names -> CPU tensors (any dtype, any shape).
            version: policy version, int >= 0.

        Returns:
            ``{"transport": "mooncake", "version", "tensors", "bytes", "objects" (newly written),
            "seconds", "removed_versions"}``.

        Raises:
            ValueError: an empty state dict, a bad name, a conflicting earlier publication of ``version``.
            StoreError: Mooncake failed (e.g. -900: the master is gone); the manifest is not written, so
                the version stays unpublished (call again, or fall back to another transport).
        """
        import torch

        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"publish: version={version!r} must be an int >= 0")
        if not state_dict:
            raise ValueError("publish: state_dict is empty; nothing to publish")
        t0 = time.perf_counter()
        chunk = self.client.max_object_bytes
        entries = []
        items: list[tuple[StoreKey, memoryview]] = []
        total = 0
        for name, tensor in state_dict.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"publish: state_dict[{name!r}] has type {type(tensor).__name__}; expected a tensor")
            data = tensor_bytes(tensor)
            dtype = _dtype_name(tensor.dtype)
            parts = -(-data.nbytes // chunk)  # 0 for a zero-element tensor: described by the manifest alone
            for i in range(parts):
                items.append((self._tensor_key(version, name, dtype, i), data[i * chunk : (i + 1) * chunk]))
            entries.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "nbytes": data.nbytes,
                            "parts": parts, "crc32": zlib.crc32(data)})
            total += data.nbytes
        manifest = {"format": MANIFEST_FORMAT, "model": self.model, "version": version, "shard": self.shard,
                    "total_bytes": total, "chunk_bytes": chunk, "tensors": entries}
        try:
            report = self.client.put_batch(items, pin=self.pin)
            report_m = self.client.put(self._manifest_key(version), json.dumps(manifest).encode(), pin=self.pin)
        except StoreError:
            self._remove_unfinished(version)
            raise
        if version not in self._published:
            self._published.append(version)
        removed = self._collect_garbage()
        return {"transport": self.name, "version": version, "tensors": len(entries), "bytes": total,
                "objects": report.written + report_m.written, "seconds": time.perf_counter() - t0,
                "removed_versions": removed}

    def _collect_garbage(self) -> list[int]:
        keep = sorted(self._published)[-self.keep_versions :]
        removed = []
        for v in sorted(set(self._published) - set(keep)):
            try:
                self.remove_version(v)
            except StoreError:
                self.gc_failures += 1
                continue
            self._published.remove(v)
            removed.append(v)
        return removed

    def _remove_unfinished(self, version: int) -> None:
        """Best effort after a failed publish: drop the pinned tensors of a version that has no manifest (they
        would never be evicted). Nothing to do when the master is gone (it lost them anyway)."""
        try:
            if not self.is_published(version):
                self.remove_version(version)
        except StoreError:
            self.gc_failures += 1

    def remove_version(self, version: int) -> int:
        """Remove ``version`` of this shard: the manifest first (readers then see it as absent), then its tensors.
        Returns the number of objects removed. Leases are overridden (``force=True``).

        Raises:
            StoreError: Mooncake error code.
        """
        n = int(self.client.remove(self._manifest_key(version), force=True))
        prefix = self._manifest_key(version).to_str().split("|")[:5]  # moe_rl|k1|weights|model|v<version>
        pattern = "^" + r"\|".join(re.escape(p) for p in prefix) + r"\|[^|]*\|" + re.escape(self.shard) + r"\|"
        return n + self.client.remove_regex(pattern, force=True)

    # ------------------------------------------------------------------ load
    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of ``version``.

        Raises:
            VersionNotFoundError: no manifest (never published, unfinished, or removed).
            StoreError: the store could not be reached.
        """
        try:
            raw = self.client.get(self._manifest_key(version))
        except MissingKeyError:
            raise VersionNotFoundError(
                f"weights version {version} of model {self.model!r} (shard {self.shard}) is not in the Mooncake "
                "store: no manifest (never published, publication unfinished, or removed as an old version)"
            ) from None
        manifest = json.loads(raw)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest of version {version}: format {manifest.get('format')!r} != {MANIFEST_FORMAT!r}")
        return manifest

    def is_published(self, version: int) -> bool:
        """True once the manifest of ``version`` exists (StoreError if the store cannot say)."""
        return self.client.exists(self._manifest_key(version))

    def load(self, version: int) -> list[tuple[str, Any]]:
        """Fetch and verify every tensor of ``version``; returns ``[(hf_name, tensor)]`` in publication order.

        Nothing is returned unless every tensor arrived with the manifest's byte size and CRC-32, so a caller
        never applies half a version. Memory: one host copy of the shard.

        Raises:
            VersionNotFoundError: the version has no manifest.
            ValueError: a tensor's bytes do not match the manifest (size or CRC-32): the store is corrupt.
            MissingKeyError: the manifest exists but a tensor chunk is gone (removed or evicted meanwhile).
            StoreError: the store could not be reached.
        """
        import torch

        manifest = self.manifest(version)
        chunk = int(manifest["chunk_bytes"])
        if chunk > self.client.max_object_bytes:
            raise ValueError(
                f"weights version {version} was published in chunks of {chunk} bytes, more than this client's "
                f"max_object_bytes={self.client.max_object_bytes}; give the reading StoreClient local_buffer_bytes "
                f">= {2 * chunk}"
            )
        keys, sizes = [], []
        for e in manifest["tensors"]:
            for i in range(e["parts"]):
                keys.append(self._tensor_key(version, e["name"], e["dtype"], i))
                sizes.append(min(chunk, e["nbytes"] - i * chunk))
        blobs = self._fetch(keys, sizes)
        out = []
        pos = 0
        for e in manifest["tensors"]:
            data = b"".join(blobs[pos : pos + e["parts"]]) if e["parts"] != 1 else blobs[pos]
            pos += e["parts"]
            if len(data) != e["nbytes"] or zlib.crc32(data) != e["crc32"]:
                raise ValueError(
                    f"weights version {version}: tensor {e['name']!r} arrived with {len(data)} bytes, CRC-32 "
                    f"{zlib.crc32(data):#010x}; the manifest says {e['nbytes']} bytes, CRC-32 {e['crc32']:#010x}"
                )
            dtype = getattr(torch, e["dtype"])
            if e["nbytes"] == 0:
                t = torch.empty(e["shape"], dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(e["shape"])
            out.append((e["name"], t))
        return out

    def _fetch(self, keys: list[StoreKey], sizes: list[int]) -> list[bytes]:
        """``get_batch`` in groups whose chunks fit ``max_object_bytes`` together."""
        budget = self.client.max_object_bytes
        out: list[bytes] = []
        group: list[StoreKey] = []
        used = 0
        for k, n in zip(keys, sizes, strict=True):
            if group and used + n > budget:
                out += self.client.get_batch(group)
                group, used = [], 0
            group.append(k)
            used += n
        if group:
            out += self.client.get_batch(group)
        return out


# ---------------------------------------------------------------------------------------------------- run store
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

    def client_config(self, global_segment_bytes: int = 0) -> StoreClientConfig:
        """The ``StoreClientConfig`` of a client of this store lending ``global_segment_bytes`` (0: none).

        Raises:
            ValueError: a port is still 0 (the launcher fills them after starting the master).
        """
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


# ---------------------------------------------------------------------------------------------------- engine side
async def update_engine_weights(
    client: Any,
    version: int,
    *,
    store_config: StoreClientConfig,
    model: str,
    shard: str = "0of1",
    fallback_root: str | Path | None = None,
) -> dict[str, Any]:
    """Load ``version`` into the server behind ``client`` (a ``VllmClient``): from the store, else from the
    filesystem copy ``<fallback_root>/step_<version>`` (sharded or Hugging Face layout) when the store does not
    have it or cannot be reached.

    Args:
        client: ``moe_rl.inference.VllmClient`` of the server.
        version: weight version.
        store_config: the store the trainer published to (the worker joins it as a pure reader).
        model, shard: as given to ``MooncakeWeightTransport`` when publishing (``shard``: several joined by ``,``
            for sharded puts, one per trainer rank).
        fallback_root: the ``FilesystemWeightTransport`` root; None: no fallback.

    Returns:
        the worker's report (``version``, ``reload_s``, ...) plus ``"source"`` (``"mooncake"`` or
        ``"filesystem"``) and, after a fallback, ``"mooncake_error"`` (the store's error text).

    Raises:
        moe_rl.inference.VllmRequestError: the store load failed and there is no published filesystem copy
            (the message quotes the worker's error), or the path reload failed.
    """
    from moe_rl.weights.filesystem import is_published, is_sharded, version_dir

    try:
        out = await client.update_weights_from_mooncake(store_config.model_dump(), model, int(version), shard)
        out.setdefault("source", "mooncake")
        return out
    except Exception as exc:  # the server answers 500 with the worker's exception text
        if fallback_root is None or not is_published(fallback_root, version):
            raise
        path = version_dir(fallback_root, version)
        if is_sharded(path):
            out = await client.load_sharded(str(path), int(version))
        else:
            out = await client.update_weights(str(path), int(version))
        out["source"] = "filesystem"
        out["mooncake_error"] = f"{type(exc).__name__}: {exc}"
        return out
