"""Weight publication from the trainer to the inference engines over a shared filesystem.

Layout (one directory per policy version, Hugging Face checkpoint names so an engine loads it as-is)::

    <root>/step_<v>/model.safetensors
    <root>/step_<v>/config.json
    <root>/step_<v>/STABLE           # completion marker, written last

A version directory is assembled under ``step_<v>.tmp`` and renamed into place, then ``STABLE`` is
written: a reader that sees ``STABLE`` sees complete files (prime-rl's filesystem broadcast uses the same
marker convention).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["ShardedVersionWriter", "WeightPublisher", "version_dir", "is_published", "latest_published"]

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

        if version < 0:
            raise ValueError(f"version={version} must be >= 0")
        final = version_dir(self.root, version)
        if (final / MARKER).exists():
            raise ValueError(f"version {version} is already published at {final}; versions are immutable")
        _check_increasing(self.root, version)
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        tensors = {k: v.detach().contiguous() for k, v in hf_state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(version)})
        (tmp / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        for f in self.extra_files:
            shutil.copy2(f, tmp / f.name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = final / MARKER
        marker.write_text(json.dumps({"version": version}))
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
        if version < 0:
            raise ValueError(f"version={version} must be >= 0")
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.final = version_dir(root, version)
        if (self.final / MARKER).exists():
            raise ValueError(f"version {version} is already published at {self.final}; versions are immutable")
        _check_increasing(root, version)
        self.version = version
        self.hf_config = hf_config
        self.extra_files = [Path(p) for p in (extra_files or [])]
        self.max_shard_bytes = max_shard_bytes
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
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
        (self.tmp / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        for f in self.extra_files:
            shutil.copy2(f, self.tmp / f.name)
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        (self.final / MARKER).write_text(json.dumps({"version": self.version}))
        return self.final
