"""The ``filesystem`` weight transport: one folder per policy version on a filesystem the trainer and engines share.

Two layouts, both assembled under ``step_<v>.tmp``, renamed into place, then completed by the ``STABLE`` marker
(written last: a reader that sees ``STABLE`` sees complete files; prime-rl's filesystem broadcast uses the same
marker convention):

- sharded (:class:`ShardedFilesystemPublisher`, what the trainer publishes): every trainer rank writes only its
  own pieces (:mod:`moe_rl.weights.regions`) into ``rank_<r>-<k>.safetensors``; rank 0 then writes the index::

      <root>/step_<v>/rank_00000-00001.safetensors ...   pieces, keys "<hf name>@<offset>@<full shape>"
      <root>/step_<v>/shards.json      {"format", "version", "files": {file: bytes},
                                        "tensors": {hf name: {"dtype", "shape", "pieces": [[file, key, crc32]]}}}
      <root>/step_<v>/config.json, tokenizer files, STABLE

  An engine reads only the tensors it serves (:func:`read_sharded`: file sizes and CRC-32s checked, pieces
  assembled, nothing returned unless the whole requested set is complete).
- Hugging Face (:class:`WeightPublisher`, :class:`ShardedVersionWriter`): ``model*.safetensors`` (+ index) with
  whole tensors, loadable by any engine as a checkpoint (version 0, FP8 streaming, the Mooncake fallback).

Old versions are removed by the orchestrator once the engine serves a newer one
(``OrchestratorConfig.keep_weight_versions``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from moe_rl.config import BaseConfig
from moe_rl.weights.protocol import UpdateStats

__all__ = ["DELTA_HEADER_KEY", "SHARD_INDEX", "FilesystemTransportConfig", "ShardedFilesystemPublisher",
           "ShardedVersionWriter", "WeightPublisher", "is_delta_folder", "is_published", "is_sharded",
           "latest_published", "read_delta_version", "read_sharded", "version_dir"]

SHARD_INDEX = "shards.json"
DELTA_HEADER_KEY = "moe_rl.delta"
SHARD_FORMAT = "moe_rl.weights.shards/1"

MARKER = "STABLE"


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"step_{version}"


def is_published(root: str | Path, version: int) -> bool:
    """True once ``step_<version>/STABLE`` exists."""
    return (version_dir(root, version) / MARKER).exists()


def latest_published(root: str | Path) -> int | None:
    """Highest version with a ``STABLE`` marker, or ``None``."""
    best = None
    root = Path(root)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        if d.name.startswith("step_") and d.name[5:].isdigit() and (d / MARKER).exists():
            v = int(d.name[5:])
            best = v if best is None or v > best else best
    return best


def _check_increasing(root: str | Path, version: int) -> None:
    """Versions only go up: refuse ``version`` unless it exceeds every version already published under ``root``.

    The folder is the durable record of what engines may have loaded, so this also holds across a trainer
    restart, a failover to another trainer process and a resume from a checkpoint (a publisher whose in-memory
    counter restarted at 0 or 1 is refused instead of relabelling older weights with a lower version).
    """
    latest = latest_published(root)
    if latest is not None and version < latest:
        raise ValueError(
            f"version={version} is below the latest published version {latest} under {root}: versions must "
            f"strictly increase across restarts, failover and resume; publish {latest + 1} or later (continue the "
            "counter from latest_published(root), never from an in-memory counter that restarted)"
        )


def _claim_version(root: str | Path, version: int) -> tuple[Path, Path]:
    """The checks every writer makes before writing ``version`` under ``root``; returns ``(final, tmp)``, the
    version folder and the ``.tmp`` folder it is assembled in (neither is created here).

    Raises:
        ValueError: ``version`` is negative, already published, or below the latest published version.
    """
    if version < 0:
        raise ValueError(f"version={version} must be >= 0")
    final = version_dir(root, version)
    if (final / MARKER).exists():
        raise ValueError(f"version {version} is already published at {final}; versions are immutable")
    _check_increasing(root, version)
    return final, final.with_name(final.name + ".tmp")


def _fresh_dir(path: Path) -> None:
    """Create ``path`` empty (a leftover of a writer that failed is removed first)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _publish_folder(tmp: Path, final: Path, version: int, hf_config: dict, extra_files: list[Path]) -> None:
    """Complete an assembled version: write ``config.json`` and copy ``extra_files`` into ``tmp``, rename it to
    ``final`` (replacing an unpublished leftover) and write the ``STABLE`` marker last."""
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    for f in extra_files:
        shutil.copy2(f, tmp / f.name)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    (final / MARKER).write_text(json.dumps({"version": version}))


class WeightPublisher:
    """Write versioned HF-format checkpoints atomically.

    Args:
        root: directory holding ``step_<v>`` subdirectories.
        hf_config: the ``config.json`` dict written beside the weights.
        extra_files: files copied into every version directory (e.g. tokenizer files), by path.
    """

    def __init__(self, root: str | Path, hf_config: dict, extra_files: list[str | Path] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hf_config = hf_config
        self.extra_files = [Path(p) for p in (extra_files or [])]

    def publish(self, hf_state_dict: dict[str, torch.Tensor], version: int) -> Path:
        """Write ``hf_state_dict`` as version ``version`` and return its directory.

        Versions strictly increase: a version at or below the latest one published under the root (a restarted or
        failed-over trainer whose counter went back) is refused, so engines never see a version label decrease.

        Raises:
            ValueError: ``version`` is negative, already published, or below the latest published version.
        """
        from safetensors.torch import save_file

        final, tmp = _claim_version(self.root, version)
        _fresh_dir(tmp)
        tensors = {k: v.detach().contiguous() for k, v in hf_state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(version)})
        _publish_folder(tmp, final, version, self.hf_config, self.extra_files)
        return final


class ShardedVersionWriter:
    """Write one version folder tensor by tensor, in safetensors shards of at most ``max_shard_bytes``, so the writer
    never holds more than one shard (a 744B-parameter model cannot be assembled in one host's memory).

    Layout: ``model-00001.safetensors``, ... plus ``model.safetensors.index.json`` (``weight_map``, ``total_size``:
    the Hugging Face sharded-checkpoint index), ``config.json`` and ``extra_files``; assembled under
    ``step_<v>.tmp``, renamed into place, ``STABLE`` written last (as :class:`WeightPublisher`).

    Args:
        root: directory holding ``step_<v>`` subdirectories.
        version: the version to write (>= 0, not yet published).
        hf_config: the ``config.json`` dict.
        extra_files: files copied into the folder (tokenizer files).
        max_shard_bytes: a shard is written once it holds at least this many bytes (>= 1).

    Raises:
        ValueError: ``version`` negative, already published or below the latest published version (versions
            strictly increase), ``max_shard_bytes < 1``, a tensor name added twice. A writer that fails before
            :meth:`finish` publishes nothing: the version gets no ``STABLE`` marker and the latest stays as it was.
    """

    def __init__(self, root: str | Path, version: int, hf_config: dict, extra_files: list[str | Path] | None = None,
                 max_shard_bytes: int = 4 << 30) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.final, self.tmp = _claim_version(root, version)
        self.version = version
        self.hf_config = hf_config
        self.extra_files = [Path(p) for p in (extra_files or [])]
        self.max_shard_bytes = max_shard_bytes
        _fresh_dir(self.tmp)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.shards = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (moved to CPU, contiguous) under HF name ``name``; writes a shard when full."""
        if name in self.weight_map or name in self._buf:
            raise ValueError(f"tensor {name!r} added twice to version {self.version}")
        t = tensor.detach().to("cpu").contiguous()
        self._buf[name] = t
        self._buf_bytes += t.numel() * t.element_size()
        if self._buf_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buf:
            return
        self.shards += 1
        fname = f"model-{self.shards:05d}.safetensors"
        save_file(self._buf, str(self.tmp / fname), metadata={"format": "pt", "version": str(self.version)})
        for k in self._buf:
            self.weight_map[k] = fname
        self.total_bytes += self._buf_bytes
        self._buf, self._buf_bytes = {}, 0

    def finish(self) -> Path:
        """Write the last shard, the index, the config and the extra files; publish the folder. Returns it."""
        self._flush()
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _publish_folder(self.tmp, self.final, self.version, self.hf_config, self.extra_files)
        return self.final


# ---------------------------------------------------------------------------------------------------- sharded
class FilesystemTransportConfig(BaseConfig):
    """``trainer.filesystem``: the sharded folder every trainer rank writes its own pieces into."""

    max_file_bytes: int = Field(4 << 30, ge=1)
    """A rank starts a new ``rank_<r>-<k>.safetensors`` file once the current one holds this many bytes."""
    checksums: bool = True
    """Record a CRC-32 per piece (``zlib.crc32``, about 1 GB/s per rank); the engine checks them before loading."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


def is_sharded(path: str | Path) -> bool:
    """True when the version folder ``path`` has the sharded layout (``shards.json``)."""
    return (Path(path) / SHARD_INDEX).exists()


class ShardedFilesystemPublisher:
    """Trainer side of the ``filesystem`` transport (one instance per trainer rank; ``publish`` is a collective).

    Args:
        root: the run's ``weights/`` folder (shared by every trainer rank and every engine).
        hf_config: the ``config.json`` dict written beside the weights (rank 0).
        extra_files: files copied into every version folder (tokenizer files; rank 0).
        mcfg: the model's config (needed to publish a model; not for a plain state dict).
        dtype: dtype of the published tensors (fp32-kept names stay fp32, :func:`moe_rl.models.hf_io.keeps_fp32`).
        config: :class:`FilesystemTransportConfig`.

    Every rank must see the same ``root`` (a shared filesystem); rank 0 checks nothing the others do not check too,
    so a refused version raises on every rank before anything is written.
    """

    name = "filesystem"

    def __init__(self, root: str | Path, hf_config: dict, extra_files: list[str | Path] | None = None, *,
                 mcfg: Any = None, dtype: torch.dtype = torch.bfloat16,
                 config: FilesystemTransportConfig | None = None, delta: Any = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hf_config = hf_config
        self.extra_files = [Path(p) for p in (extra_files or [])]
        self.mcfg = mcfg
        self.dtype = dtype
        self.config = config or FilesystemTransportConfig()
        self.delta = None  # this rank's RankDeltaEncoder when delta encoding is on
        if delta is not None and delta.enabled:
            from moe_rl.weights.delta_sync import RankDeltaEncoder

            self.delta = RankDeltaEncoder(self.root, delta)

    def _pieces(self, model_or_state: Any, world: int):
        from moe_rl.weights.regions import Piece, local_pieces

        if isinstance(model_or_state, list):  # pieces already cut (the run publisher reuses them)
            if not all(isinstance(p, Piece) for p in model_or_state):
                raise TypeError("ShardedFilesystemPublisher.publish: a list must hold moe_rl.weights.regions.Piece")
            return iter(model_or_state)
        if isinstance(model_or_state, torch.nn.Module):
            if self.mcfg is None:
                raise ValueError("ShardedFilesystemPublisher.publish: a model needs mcfg (its config) to map its "
                                 "parameters to checkpoint names; pass mcfg= to the constructor")
            return local_pieces(model_or_state, self.mcfg, self.dtype)
        if not isinstance(model_or_state, dict):
            raise TypeError(f"ShardedFilesystemPublisher.publish: model_or_state has type "
                            f"{type(model_or_state).__name__}; pass the model or a dict of HF name -> tensor")
        if world > 1:
            raise ValueError(f"ShardedFilesystemPublisher.publish: a plain state dict with world size {world} would "
                             "be written by every rank; pass the (sharded) model instead")
        return (Piece(k, tuple(v.shape), (0,) * v.dim(), v.detach().to("cpu").contiguous())
                for k, v in model_or_state.items())

    def publish(self, model_or_state: Any, version: int) -> UpdateStats:
        """Write this rank's pieces of ``version``; rank 0 completes the folder (index, config, ``STABLE``).

        With delta encoding (``delta=``), the rank encodes its pieces against the ones it published last
        (:class:`moe_rl.weights.delta_sync.RankDeltaEncoder`): a full update is written as usual, a delta as one
        file ``rank_<r>.delta.safetensors`` (the update's buffers, its header in the metadata); the index records
        per rank ``{"kind": "full" | "delta", "checksum", "base_version", "files"}`` under ``"delta"``.

        Returns:
            :class:`UpdateStats` (``bytes``: this rank's, what it wrote: a delta's buffers and header;
            ``bytes_total`` on rank 0; ``extra["path"]``; with delta encoding ``extra["delta"]``:
            :func:`moe_rl.weights.delta_sync.update_summary` of this rank's update).

        Raises:
            ValueError: ``version`` negative, already published or below the latest published version; the pieces
                do not tile the checkpoint's tensors (rank 0, nothing published).
        """
        try:
            return self._publish(model_or_state, version)
        except BaseException:
            if self.delta is not None:
                self.delta.failed()  # engines may lack this version: the next one goes in full
            raise

    def _publish(self, model_or_state: Any, version: int) -> UpdateStats:
        import torch.distributed as dist

        t0 = time.perf_counter()
        on = dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        final, tmp = _claim_version(self.root, version)
        if rank == 0:
            _fresh_dir(tmp)
        if on:
            dist.barrier()
        entries: list[tuple[str, str, str, list[int], int]] = []  # (file, key, dtype, shape, crc)
        files: dict[str, int] = {}
        buf: dict[str, torch.Tensor] = {}
        used = 0
        nbytes = 0

        def flush() -> None:
            nonlocal buf, used
            if not buf:
                return
            from safetensors.torch import save_file

            fname = f"rank_{rank:05d}-{len([f for f in files]) + 1:05d}.safetensors"
            save_file(buf, str(tmp / fname), metadata={"format": "pt", "version": str(version)})
            files[fname] = (tmp / fname).stat().st_size
            for i in range(len(entries) - len(buf), len(entries)):
                entries[i] = (fname, *entries[i][1:])
            buf, used = {}, 0

        pieces = self._pieces(model_or_state, world)
        delta_info: dict[str, Any] | None = None
        summary: dict[str, Any] | None = None
        if self.delta is not None:
            from moe_rl.weights.delta_sync import update_summary as update_summary_of

            pieces = list(pieces)
            update = self.delta.encode(pieces, version)
            if update is not None and not update.is_full:
                hbytes, delta_info = self._write_delta(update, tmp, rank, version, entries, files)
                summary = update_summary_of(update, hbytes)
                nbytes = summary["wire_bytes"]
                pieces = []
            elif update is not None:
                summary = update_summary_of(update)
                delta_info = {"kind": "full", "checksum": f"{update.checksum:016x}", "base_version": None}
        for p in pieces:
            buf[p.key] = p.tensor
            entries.append(("", p.key, str(p.tensor.dtype).removeprefix("torch."), list(p.tensor.shape),
                            _crc(p.tensor) if self.config.checksums else -1))
            used += p.nbytes
            nbytes += p.nbytes
            if used >= self.config.max_file_bytes:
                flush()
        flush()
        if delta_info is not None:
            delta_info.update(files=sorted(files), rank=rank)
        gathered: list[Any] = [None] * world
        if on:
            dist.gather_object((entries, files, delta_info), gathered if rank == 0 else None, dst=0)
        else:
            gathered = [(entries, files, delta_info)]
        stats = UpdateStats(version=version, transport=self.name, bytes=nbytes, tensors=len(entries),
                            extra={"path": str(final), "rank": rank})
        if summary is not None:
            stats.extra["delta"] = {**summary, **self.delta.stats()}
        if rank == 0:
            try:
                total = self._finish(gathered, tmp, final, version)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            stats.bytes_total = total
        stats.blocking_s = time.perf_counter() - t0
        return stats

    @staticmethod
    def _write_delta(update: Any, tmp: Path, rank: int, version: int, entries: list, files: dict[str, int],
                     ) -> tuple[int, dict[str, Any]]:
        """Write this rank's delta ``update`` as ``rank_<r>.delta.safetensors``; list every piece it covers in
        ``entries`` (CRC -1: the delta's checksums cover them). Returns ``(header bytes, index entry)``."""
        from safetensors.torch import save_file

        header, tensors = update.to_tensors()
        fname = f"rank_{rank:05d}.delta.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / fname),
                  metadata={"format": "pt", "version": str(version), DELTA_HEADER_KEY: header})
        files[fname] = (tmp / fname).stat().st_size
        for p in update.patches:
            entries.append((fname, p.name, str(p.dtype).removeprefix("torch."), list(p.shape), -1))
        return len(header.encode()), {"kind": "delta", "checksum": f"{update.checksum:016x}",
                                      "base_version": update.base_version, "file": fname}

    def _finish(self, gathered: list[Any], tmp: Path, final: Path, version: int) -> int:
        """Rank 0: check the pieces tile every tensor, write the index, config and extra files, publish."""
        from moe_rl.weights.regions import parse_piece_key

        tensors: dict[str, dict[str, Any]] = {}
        count: dict[str, int] = {}
        all_files: dict[str, int] = {}
        delta = {str(info["rank"]): info for _, _, info in gathered if info is not None}
        for entries, files, _ in gathered:
            all_files.update(files)
            for fname, key, dtype, shape, crc in entries:
                name, _, full = parse_piece_key(key)
                t = tensors.setdefault(name, {"dtype": dtype, "shape": list(full), "pieces": []})
                if t["dtype"] != dtype or t["shape"] != list(full):
                    raise ValueError(f"version {version}: pieces of {name!r} disagree on dtype/shape "
                                     f"({t['dtype']}{t['shape']} vs {dtype}{list(full)})")
                t["pieces"].append([fname, key, crc])
                n = 1
                for s in shape:
                    n *= s
                count[name] = count.get(name, 0) + n
        for name, t in tensors.items():
            need = 1
            for s in t["shape"]:
                need *= s
            if count[name] != need:
                raise ValueError(f"version {version}: the trainer ranks' pieces of {name!r} hold {count[name]} of "
                                 f"its {need} elements; a rank's shards are missing or published twice")
        index = {"format": SHARD_FORMAT, "version": version, "files": all_files,
                 "tensors": dict(sorted(tensors.items()))}
        if delta:
            index["delta"] = {"ranks": delta}
        (tmp / SHARD_INDEX).write_text(json.dumps(index))
        _publish_folder(tmp, final, version, self.hf_config, self.extra_files)
        return sum(all_files.values())

    def close(self) -> None:
        """Nothing to release."""


def read_sharded(path: str | Path, names: set[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Load a sharded version folder: only the tensors in ``names`` (None: all), each checked and assembled.

    Args:
        path: ``<root>/step_<v>`` written by :class:`ShardedFilesystemPublisher`.
        names: Hugging Face names the engine serves.

    Returns:
        ``[(hf_name, tensor)]`` sorted by name (whole tensors, in the published dtypes).

    Raises:
        LookupError: no ``STABLE`` marker (not published, or still being written).
        ValueError: the index names a shard file that is not a plain name in the folder (a path, ``..``), a file's
            size differs from the index (truncated or rewritten shard), a piece's CRC-32 differs,
            a requested name is not in the version, or the pieces do not tile a tensor. Nothing is returned.
        OSError: a file cannot be read.
    """
    from safetensors import safe_open

    from moe_rl.weights.regions import assemble

    path = Path(path)
    if not (path / MARKER).exists():
        raise LookupError(f"read_sharded: {path} has no {MARKER} marker: the version is not published (or is "
                          "still being written); wait for its announcement")
    index = json.loads((path / SHARD_INDEX).read_text())
    if index.get("format") != SHARD_FORMAT:
        raise ValueError(f"read_sharded: {path / SHARD_INDEX} has format {index.get('format')!r}, expected "
                         f"{SHARD_FORMAT!r}; the trainer and engine run different moe_rl versions")
    deltas = sorted(int(r) for r, info in (index.get("delta") or {}).get("ranks", {}).items()
                    if info.get("kind") == "delta")
    if deltas:
        raise ValueError(f"read_sharded: {path} is delta-encoded (trainer ranks {deltas} sent only the elements "
                         "changed since their previous version): it is not a checkpoint on its own; load it with "
                         "WeightSyncExtension.load_sharded (which holds the base) or use a full version")
    want = set(index["tensors"]) if names is None else set(names)
    unknown = want - set(index["tensors"])
    if unknown:
        raise ValueError(f"read_sharded: {len(unknown)} requested tensors are not in {path} "
                         f"(e.g. {sorted(unknown)[:3]}); the engine serves a different model")
    by_file: dict[str, list[tuple[str, int]]] = {}
    for name in want:
        for fname, key, crc in index["tensors"][name]["pieces"]:
            if not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname or "\\" in fname \
                    or "\x00" in fname:
                raise ValueError(f"read_sharded: {path / SHARD_INDEX} names the shard file {fname!r}; shard files "
                                 "are plain names inside the version folder (no path separators, no '..'); the "
                                 "index is corrupt or forged: republish the version")
            by_file.setdefault(fname, []).append((key, crc))
    for fname in by_file:
        size = (path / fname).stat().st_size
        if size != index["files"][fname]:
            raise ValueError(f"read_sharded: {path / fname} has {size} bytes, the index says "
                             f"{index['files'][fname]}: the shard is truncated or was rewritten; nothing loaded "
                             "(republish the version or load a newer one)")

    def pieces():
        for fname, keys in sorted(by_file.items()):
            with safe_open(str(path / fname), framework="pt") as f:
                for key, crc in keys:
                    t = f.get_tensor(key)
                    if crc >= 0 and _crc(t) != crc:
                        raise ValueError(f"read_sharded: piece {key!r} in {path / fname} has CRC-32 {_crc(t):#010x}, "
                                         f"the index says {crc:#010x}: the shard is corrupt; nothing loaded")
                    yield key, t

    return assemble(pieces(), want)


def is_delta_folder(path: str | Path) -> bool:
    """True when the sharded version folder ``path`` was written with delta encoding (its index has ``"delta"``,
    whether this version is full or a delta on each rank)."""
    try:
        index = json.loads((Path(path) / SHARD_INDEX).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and "delta" in index


def _plain_name(path: Path, fname: Any) -> str:
    if not isinstance(fname, str) or fname in ("", ".", "..") or any(c in fname for c in "/\\\x00"):
        raise ValueError(f"read_delta_version: {path / SHARD_INDEX} names the file {fname!r}; files are plain names "
                         "inside the version folder: the index is corrupt or forged; republish the version")
    return fname


def read_delta_version(path: str | Path) -> dict[int, Any]:
    """Read every trainer rank's update of a delta-encoded version folder (engine side), checked, nothing applied.

    A rank whose entry is ``"full"`` gives a full :class:`~moe_rl.weights.delta.DeltaUpdate` of its pieces (read from
    its shards, CRC-32s checked, carrying the trainer's version checksum); a ``"delta"`` rank gives the update parsed
    from ``rank_<r>.delta.safetensors`` (header from the file's metadata).

    Args:
        path: ``<root>/step_<v>`` written by :class:`ShardedFilesystemPublisher` with delta encoding.

    Returns:
        ``{trainer rank: DeltaUpdate}`` (keys: piece keys, :mod:`moe_rl.weights.regions`).

    Raises:
        LookupError: no ``STABLE`` marker (not published, still being written, or removed).
        ValueError: not a delta-encoded folder, a file whose size differs from the index (truncated or rewritten),
            a piece whose CRC-32 differs, a plain-name violation.
        moe_rl.weights.delta.DeltaPayloadError: a delta file that cannot be parsed or disagrees with its header or
            with the index (version, base).
    """
    from safetensors import safe_open

    from moe_rl.weights.delta import DeltaPayloadError, DeltaUpdate
    from moe_rl.weights.delta_sync import full_update

    path = Path(path)
    if not (path / MARKER).exists():
        raise LookupError(f"read_delta_version: {path} has no {MARKER} marker: the version is not published, still "
                          "being written, or was removed")
    index = json.loads((path / SHARD_INDEX).read_text())
    if index.get("format") != SHARD_FORMAT or "delta" not in index:
        raise ValueError(f"read_delta_version: {path / SHARD_INDEX} is not a delta-encoded index (format "
                         f"{index.get('format')!r}, delta section {'present' if 'delta' in index else 'absent'}); "
                         "load it with read_sharded")
    version = int(index["version"])
    for fname, size in index["files"].items():
        got = (path / _plain_name(path, fname)).stat().st_size
        if got != size:
            raise ValueError(f"read_delta_version: {path / fname} has {got} bytes, the index says {size}: the file "
                             "is truncated or was rewritten; nothing applied (republish the version or wait for a "
                             "newer one)")
    pieces_of: dict[str, list[tuple[str, int]]] = {}
    for t in index["tensors"].values():
        for fname, key, crc in t["pieces"]:
            pieces_of.setdefault(fname, []).append((key, crc))
    out: dict[int, Any] = {}
    for r, info in index["delta"]["ranks"].items():
        rank = int(r)
        checksum = int(info["checksum"], 16)
        if info["kind"] == "full":
            items = []
            for fname in info["files"]:
                with safe_open(str(path / _plain_name(path, fname)), framework="pt") as f:
                    for key, crc in pieces_of.get(fname, []):
                        t = f.get_tensor(key)
                        if crc >= 0 and _crc(t) != crc:
                            raise ValueError(f"read_delta_version: piece {key!r} in {path / fname} has CRC-32 "
                                             f"{_crc(t):#010x}, the index says {crc:#010x}: the shard is corrupt; "
                                             "nothing applied")
                        items.append((key, t))
            out[rank] = full_update(items, version, checksum)
            continue
        fname = _plain_name(path, info["file"])
        try:
            with safe_open(str(path / fname), framework="pt") as f:
                header = (f.metadata() or {}).get(DELTA_HEADER_KEY)
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types on a damaged file
            raise DeltaPayloadError(f"read_delta_version: {path / fname} cannot be read as safetensors "
                                    f"({type(exc).__name__}: {exc}): corrupt delta file; nothing applied") from exc
        if header is None:
            raise DeltaPayloadError(f"read_delta_version: {path / fname} has no {DELTA_HEADER_KEY!r} header")
        update = DeltaUpdate.from_tensors(header, tensors)
        if (update.version, update.base_version, update.checksum) != (version, info["base_version"], checksum):
            raise DeltaPayloadError(
                f"read_delta_version: {path / fname} holds the delta {update.base_version} -> {update.version} "
                f"(checksum {update.checksum:016x}), the index says {info['base_version']} -> {version} (checksum "
                f"{checksum:016x}): the file belongs to another publication; nothing applied")
        out[rank] = update
    return out
