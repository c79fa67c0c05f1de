"""Delta encoding as a weight-transport option: each trainer rank sends only the elements of its pieces whose bits
changed since the version it published last, and each engine worker rebuilds the version exactly on a host copy.

The codec is :mod:`moe_rl.weights.delta` (bit-pattern deltas, per-tensor and per-version checksums, periodic full
versions). This module is the seam between it and the transports:

- **Config** (:class:`DeltaConfig`, ``trainer.weight_delta`` in the CPU job, ``weights.delta`` in a cluster run):
  ``enabled`` and ``full_every`` (a full version every ``full_every`` updates; the first one is always full).
  The ``filesystem`` transport writes a delta as ``rank_<r>.delta.safetensors`` (buffers, header in the metadata;
  :class:`moe_rl.weights.filesystem.ShardedFilesystemPublisher`); the ``broadcast`` transport sends the header in
  its bucket plan and the buffers (:meth:`~moe_rl.weights.delta.DeltaUpdate.to_tensors`) in its buckets; the
  ``p2p`` transport holds the buffers for the workers to pull and writes the headers into its piece index.
- **Trainer side** (:class:`RankDeltaEncoder`, one per trainer rank): encodes this rank's pieces
  (``{piece key: tensor}``, :mod:`moe_rl.weights.regions`) against the pieces it published last. Each rank encodes
  independently (no collective): a version may be full on one rank and a delta on another. A publication that
  fails after encoding resets the encoder (the next version is full), and an engine that could not apply a delta
  asks for a full version through :func:`request_full` (the file ``<weights root>/delta_full_request.json``); every
  rank honours each request once, on its next publication (counted in ``RankDeltaEncoder.full_requests``).
- **Engine side** (:class:`EngineDeltaState`, one per engine worker): one
  :class:`~moe_rl.weights.delta.DeltaDecoder` per trainer rank over a host copy of that rank's pieces (vLLM's own
  parameters are fused and repacked, so a delta cannot be applied to them: it is applied to the published tensors
  and the result handed to the model's ``load_weights``). :meth:`EngineDeltaState.advance` takes every rank's
  update of the requested version, follows each rank's chain of bases back to the version it holds (a watcher that
  jumped over versions still applies every delta in between, read from the transport), checks every base before
  touching anything, applies the chain (each tensor's and each version's checksum verified), and rolls every rank
  back bit for bit if anything fails. Only then does the caller load the tensors: the **load units** (a decoder
  layer's attention or MLP block, or one top-level module: :func:`load_unit`) that contain a changed tensor, whole,
  because vLLM's in-place reload processes a layer from the weights it was given and a partially fed fused layer
  (``qkv_proj``, ``gate_up_proj``, the stacked experts) would keep uninitialised elements. When the model was last
  loaded by anything else than this state (another transport, a path reload), every tensor is loaded.

Guarantees: a receiver never drifts (every applied tensor and version is checksummed against the trainer's), never
holds a mix of two versions (the host copy is rolled back whole on any error, and the model is only loaded from a
committed host copy), and a wrong base is refused by name (:class:`~moe_rl.weights.delta.DeltaBaseError`; the
worker then asks for a full version).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from moe_rl.config import BaseConfig

__all__ = ["DELTA_REQUEST", "DeltaConfig", "EngineDeltaState", "RankDeltaEncoder", "full_update", "load_unit",
           "read_full_request", "request_full", "update_summary"]

DELTA_REQUEST = "delta_full_request.json"
MAX_CHAIN = 256  # deltas applied in one advance at most (a watcher further behind needs a full version)


class DeltaConfig(BaseConfig):
    """Delta encoding of weight versions (``trainer.weight_delta`` / ``weights.delta``)."""

    enabled: bool = False
    """Send only the changed elements of each trainer rank's pieces (exact, bit patterns), with a full version
    every ``full_every`` updates. Supported by the ``filesystem``, ``broadcast`` and ``p2p`` transports."""
    full_every: int = Field(10, ge=1)
    """A full version every ``full_every`` updates (the first update is full; ``1``: every version full). An engine
    that holds no base (it started late, or a delta failed) waits at most this many versions, or asks for a full
    one (:func:`request_full`)."""


# ------------------------------------------------------------------------------------------------- full requests
def request_full(root: str | Path, version: int, reason: str) -> Path:
    """Ask every trainer rank to publish its next version in full (engine side; atomic replace of one small file).

    Args:
        root: the run's ``weights/`` folder.
        version: the version the engine could not apply.
        reason: why (the error message), recorded in the file.

    Returns:
        The request file's path.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(root) / DELTA_REQUEST
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps({"id": uuid.uuid4().hex, "version": int(version), "reason": str(reason)[:500],
                               "time": time.time()}))
    os.replace(tmp, path)
    return path


def read_full_request(root: str | Path) -> dict[str, Any] | None:
    """The current full-version request under ``root`` (``{"id", "version", "reason", "time"}``), or None."""
    try:
        return json.loads((Path(root) / DELTA_REQUEST).read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------- trainer side
def update_summary(update: Any, header_bytes: int = 0) -> dict[str, Any]:
    """What one rank's :class:`~moe_rl.weights.delta.DeltaUpdate` moves: ``{"full", "base_version", "changed",
    "elements", "wire_bytes"`` (buffers + ``header_bytes``), ``"header_bytes"``, ``"raw_bytes"`` (a full send of
    the same pieces)}."""
    return {"full": update.is_full, "base_version": update.base_version, "changed": int(update.changed),
            "elements": sum(p.numel for p in update.patches), "wire_bytes": int(update.wire_bytes) + header_bytes,
            "header_bytes": int(header_bytes), "raw_bytes": int(update.raw_bytes)}


class RankDeltaEncoder:
    """One trainer rank's encoder: :meth:`encode` this rank's pieces of each version against the previous one.

    Args:
        root: the run's ``weights/`` folder (where engines leave :func:`request_full` requests), or None.
        config: :class:`DeltaConfig` (``enabled`` must be true).

    Raises:
        ValueError: ``config.enabled`` is false (build no encoder then).
    """

    def __init__(self, root: str | Path | None, config: DeltaConfig) -> None:
        from moe_rl.weights.delta import DeltaEncoder

        if not config.enabled:
            raise ValueError("RankDeltaEncoder: config.enabled = false; build the encoder only when delta encoding "
                             "is on (weights.delta.enabled / trainer.weight_delta.enabled = true)")
        self.root = None if root is None else Path(root)
        self.config = config
        self.encoder = DeltaEncoder(full_every=config.full_every, copy_base=True)
        self.full_requests = 0
        self.resets = 0
        # a request that predates this encoder is not for it (its first version is full anyway)
        req = read_full_request(self.root) if self.root is not None else None
        self._seen_request = None if req is None else req.get("id")

    def encode(self, pieces: Iterable[Any], version: int) -> Any:
        """Encode this rank's ``pieces`` (:class:`~moe_rl.weights.regions.Piece`, or ``(piece key, tensor)``
        pairs) as ``version``.

        Returns:
            The :class:`~moe_rl.weights.delta.DeltaUpdate` keyed by piece key (full: the first version, every
            ``full_every``-th, after :meth:`failed`, or after a new :func:`request_full`).

        Raises:
            ValueError: ``version`` does not increase, or there are no pieces (a rank with no pieces publishes an
                empty update: pass ``[]`` and get ``None``).
        """
        state = dict(p if isinstance(p, tuple) else (p.key, p.tensor) for p in pieces)
        if self.root is not None:
            req = read_full_request(self.root)
            if req is not None and req.get("id") != self._seen_request:
                self._seen_request = req.get("id")
                self.full_requests += 1
                self.encoder.reset()
        if not state:
            return None
        return self.encoder.encode(state, version)

    def failed(self) -> None:
        """The encoded version was not published: the next version goes in full (engines may lack this one)."""
        self.resets += 1
        self.encoder.reset()

    def stats(self) -> dict[str, int]:
        return {"full_requests": self.full_requests, "resets": self.resets}


# ------------------------------------------------------------------------------------------------- engine side
def full_update(items: Iterable[tuple[str, Any]], version: int, checksum: int | None = None) -> Any:
    """A full :class:`~moe_rl.weights.delta.DeltaUpdate` of ``items`` (``(piece key, tensor)``) as ``version``.

    Args:
        items: the pieces as read (CPU tensors; their buffers are shared, not copied).
        version: the version.
        checksum: the sender's version checksum; the decoder verifies the produced state against it. None: the
            checksum of ``items`` themselves (nothing to verify against).
    """
    from moe_rl.weights.delta import DeltaUpdate, encode_tensor, version_checksum

    patches = tuple(encode_tensor(k, t) for k, t in items)
    own = version_checksum({p.name: (p.dtype, p.shape, p.checksum) for p in patches})
    return DeltaUpdate(int(version), None, None, own if checksum is None else int(checksum), patches, ())


def load_unit(name: str) -> str:
    """The group of Hugging Face tensors an engine loads together (a superset of one vLLM layer's inputs):
    ``"<prefix>.layers.<i>.<block>"`` inside a decoder layer (``self_attn``, ``mlp``, ``input_layernorm``, ...),
    else the module that owns the tensor (``"model.embed_tokens"``, ``"lm_head"``)."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 3])
    return ".".join(parts[:-1]) or name


class EngineDeltaState:
    """One engine worker's host copy of the published pieces, per trainer rank, and the decoders that advance it.

    Memory: one host copy of every piece the engine serves, plus, while :meth:`advance` runs, the undo log of the
    applied updates and, when the caller assembles them, the tensors to load.
    """

    def __init__(self) -> None:
        self.decoders: dict[int, Any] = {}
        self.model_version: int | None = None  # the engine version last loaded from this host copy
        self.applied = 0
        self.refused = 0

    @property
    def version(self) -> int | None:
        """The version every rank's host copy holds, or None (no state, or ranks disagree)."""
        vs = {d.version for d in self.decoders.values()}
        return vs.pop() if len(vs) == 1 else None

    def invalidate(self) -> None:
        """Forget every host copy (the next version must be full on every rank)."""
        self.decoders.clear()
        self.model_version = None

    def advance(self, version: int, fetch: Callable[[int], Mapping[int, Any]]) -> dict[str, Any]:
        """Bring every rank's host copy to ``version``: nothing changes unless every rank's chain applies.

        Args:
            version: the version to reach.
            fetch: ``fetch(v) -> {trainer rank: DeltaUpdate}`` of version ``v``, read and checked by the transport
                (called for ``version`` and, when a rank's delta is based on a version this state does not hold, for
                that base, and so on back to a held version or a full update).

        Returns:
            ``{"versions": [applied versions, oldest first], "changed_names": set of Hugging Face names whose bits
            changed (every name of a full update), "wire_bytes", "raw_bytes", "changed", "full_ranks"}``.

        Raises:
            DeltaBaseError: a rank's chain does not reach a version this state holds (engine started late, a
                failed update, the base is gone or was another publication): nothing changed.
            DeltaChecksumError, DeltaPayloadError: an update is corrupt: every rank rolled back, nothing changed.
            ValueError: the ranks of ``version`` differ from the held ones without a full update.
        """
        from moe_rl.weights.delta import DeltaBaseError, DeltaDecoder, DeltaError
        from moe_rl.weights.regions import parse_piece_key

        fetched: dict[int, Mapping[int, Any]] = {version: fetch(version)}
        top = fetched[version]
        if not top:
            raise ValueError(f"EngineDeltaState.advance: version {version} has no trainer rank's update")
        chains: dict[int, list[Any]] = {}
        for rank, upd in top.items():
            dec = self.decoders.get(rank)
            held = None if dec is None else dec.version
            if held == version:  # already applied (an earlier model load failed after it): nothing to apply
                if dec.checksum != upd.checksum:
                    self.refused += 1
                    raise DeltaBaseError(f"version {version}: this engine's host copy of trainer rank {rank}'s "
                                         f"pieces is version {version} with checksum {dec.checksum:016x}, the "
                                         f"published one has {upd.checksum:016x}: nothing applied; request a full "
                                         "version")
                chains[rank] = []
                continue
            chain = [upd]
            while not chain[0].is_full and chain[0].base_version != held:
                base = chain[0].base_version
                if base is None or len(chain) >= MAX_CHAIN or (held is not None and base < held):
                    break
                if base not in fetched:
                    try:
                        fetched[base] = fetch(base)
                    except (LookupError, OSError) as exc:
                        self.refused += 1
                        raise DeltaBaseError(
                            f"version {version}: trainer rank {rank}'s delta chain needs version {base}, which "
                            f"cannot be read ({type(exc).__name__}: {exc}); this engine holds "
                            f"{'no version' if held is None else f'version {held}'}: wait for or request a full "
                            "version") from exc
                if rank not in fetched[base]:
                    break
                chain.insert(0, fetched[base][rank])
            first = chain[0]
            if not first.is_full and (dec is None or first.base_version != held
                                      or first.base_checksum != dec.checksum):
                self.refused += 1
                raise DeltaBaseError(
                    f"version {version}: trainer rank {rank}'s update is a delta whose chain starts at base version "
                    f"{first.base_version}, this engine holds "
                    f"{'no version' if held is None else f'version {held} (checksum {dec.checksum:016x})'}"
                    f" of that rank's pieces: nothing applied; wait for or request a full version")
            chains[rank] = chain
        gone = set(self.decoders) - set(chains)
        if gone and not all(c[0].is_full for c in chains.values()):
            self.refused += 1
            raise ValueError(f"version {version}: trainer ranks {sorted(gone)} published nothing, the engine holds "
                             "their pieces, and the other ranks sent deltas: the trainer layout changed without a "
                             "full version; nothing applied")
        changed: set[str] = set()
        versions: set[int] = set()
        out = {"wire_bytes": 0, "raw_bytes": 0, "changed": 0, "full_ranks": 0}
        used: list[Any] = []
        try:
            for rank, chain in sorted(chains.items()):
                dec = self.decoders.get(rank)
                if dec is None:
                    dec = DeltaDecoder({})
                    self.decoders[rank] = dec
                used.append(dec)
                for upd in chain:
                    dec.apply(upd, staged=True)
                    versions.add(upd.version)
                    out["wire_bytes"] += upd.wire_bytes
                    out["raw_bytes"] += upd.raw_bytes
                    out["changed"] += upd.changed
                    out["full_ranks"] += upd.is_full
                    for p in upd.patches:
                        if p.encoding != "unchanged":
                            changed.add(parse_piece_key(p.name)[0])
        except DeltaError:
            for dec in used:
                dec.rollback()
            self.decoders = {r: d for r, d in self.decoders.items() if d.version is not None}
            raise
        except BaseException:
            self.invalidate()  # not a refused payload: do not trust the host copy any more
            raise
        for dec in used:
            dec.commit()
        for rank in gone:
            del self.decoders[rank]
        self.applied += 1
        return {"versions": sorted(versions), "changed_names": changed, **out}

    def names(self) -> set[str]:
        """Hugging Face names of every held piece."""
        from moe_rl.weights.regions import parse_piece_key

        return {parse_piece_key(k)[0] for d in self.decoders.values() for k in d.state}

    def weights(self, names: set[str] | None = None) -> list[tuple[str, Any]]:
        """``[(hf name, whole tensor)]`` assembled from the host copy (``names``: only these; None: all).

        Raises:
            ValueError: the pieces do not tile a tensor (``moe_rl.weights.regions.assemble``).
        """
        from moe_rl.weights.regions import assemble

        items = ((k, t) for d in self.decoders.values() for k, t in d.state.items())
        return assemble(items, names)

    def to_load(self, changed: set[str], engine_version: int) -> set[str]:
        """The names to hand to the model: every name of a load unit with a changed name when the model was last
        loaded from this host copy (``engine_version == model_version``), else every name."""
        every = self.names()
        if self.model_version is None or engine_version != self.model_version:
            return every
        units = {load_unit(n) for n in changed}
        return {n for n in every if load_unit(n) in units}
