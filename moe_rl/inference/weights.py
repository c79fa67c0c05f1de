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

__all__ = ["WeightPublisher", "version_dir", "is_published", "latest_published"]

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

        Raises:
            ValueError: ``version`` is negative or already published.
        """
        from safetensors.torch import save_file

        if version < 0:
            raise ValueError(f"version={version} must be >= 0")
        final = version_dir(self.root, version)
        if (final / MARKER).exists():
            raise ValueError(f"version {version} is already published at {final}; versions are immutable")
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
