"""An ordered chain of weight transports that falls back, counts every fallback, and loses no version.

::

    chain = FallbackWeightTransport([MooncakeWeightTransport(client, "glm"),
                                     FilesystemWeightTransport(root, hf_config)])
    chain.publish(state_dict, version)      # trainer: first transport that succeeds holds the version
    source, weights = chain.load(version)   # engine side: same order, first transport that holds it

Publishing tries the transports in order. A transport that raises a *transport* error (``StoreError``,
``MissingKeyError``, ``OSError``, ``RuntimeError``, ``TimeoutError``) is counted as failed for that version
and the next one is tried (counted as a fallback there); a caller error (``ValueError``/``TypeError``: bad
input, a conflicting republication) is raised at once. After a failure a transport is skipped (counted in
``skipped``) for ``retry_after_s`` seconds, so a dead Mooncake master costs one failed attempt, not one per
version. If every transport fails, publish raises: a version is either held by some transport or the
caller is told.

Loading asks each transport in order whether it holds the version (a transport that cannot answer is
counted in ``load_errors`` and passed over) and loads it from the first one that does. Both sides use the
same order, so a version published anywhere in the chain is found.

The filesystem transport is ``moe_rl.weights.filesystem.WeightPublisher`` (one HF checkpoint folder per
version with a ``STABLE`` marker), so a vLLM engine can also load a fallen-back version by path
(``VllmClient.update_weights``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moe_rl.inference.mooncake.store import MissingKeyError, StoreError

__all__ = ["FallbackWeightTransport", "FilesystemWeightTransport", "TransportStats", "WeightTransport"]

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (StoreError, MissingKeyError, OSError, RuntimeError, TimeoutError)
"""Exceptions that mean "this transport cannot do it now" (the chain moves on); others propagate."""


class WeightTransport(Protocol):
    """What the chain needs from a transport."""

    name: str

    def publish(self, state_dict: Mapping[str, Any], version: int) -> dict[str, Any]: ...

    def is_published(self, version: int) -> bool: ...

    def load(self, version: int) -> list[tuple[str, Any]]: ...


class FilesystemWeightTransport:
    """Versions as HF checkpoint folders ``<root>/step_<v>/`` (``moe_rl.weights.filesystem.WeightPublisher``).

    Args:
        root: shared folder, visible to the trainer and the engines.
        hf_config: the ``config.json`` dict written beside the weights.
        extra_files: files copied into every version folder (tokenizer files).
    """

    name = "filesystem"

    def __init__(self, root: str | Path, hf_config: dict, extra_files: list[str | Path] | None = None) -> None:
        from moe_rl.weights.filesystem import WeightPublisher

        self.root = Path(root)
        self.publisher = WeightPublisher(root, hf_config, extra_files)

    def publish(self, state_dict: Mapping[str, Any], version: int) -> dict[str, Any]:
        """Write ``step_<version>`` (safetensors + config + STABLE); ValueError if already published."""
        t0 = time.perf_counter()
        path = self.publisher.publish(dict(state_dict), version)
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        return {"transport": self.name, "version": version, "tensors": len(state_dict), "bytes": nbytes,
                "path": str(path), "seconds": time.perf_counter() - t0}

    def is_published(self, version: int) -> bool:
        from moe_rl.weights.filesystem import is_published

        return is_published(self.root, version)

    def path(self, version: int) -> Path:
        """The checkpoint folder of ``version`` (for ``VllmClient.update_weights``)."""
        from moe_rl.weights.filesystem import version_dir

        return version_dir(self.root, version)

    def load(self, version: int) -> list[tuple[str, Any]]:
        """``[(hf_name, tensor)]`` of a published version (file order).

        Raises:
            LookupError: ``version`` has no ``STABLE`` marker.
        """
        from safetensors.torch import load_file

        if not self.is_published(version):
            raise LookupError(f"weights version {version} is not published under {self.root} (no STABLE marker)")
        return list(load_file(str(self.path(version) / "model.safetensors")).items())


@dataclass
class TransportStats:
    """Counters of one transport in a :class:`FallbackWeightTransport`.

    Attributes:
        published: versions this transport holds (written by it).
        failed: publish attempts that raised a transport error.
        fallbacks: versions it took over after an earlier transport failed or was skipped.
        skipped: publish attempts passed over while it was cooling down after a failure.
        loaded: versions loaded from it.
        load_errors: times it could not say whether it holds a version (or failed to deliver it).
        last_error: ``"<ExceptionType>: message"`` of its last failure, or None.
        versions: the versions it holds, in publication order.
    """

    published: int = 0
    failed: int = 0
    fallbacks: int = 0
    skipped: int = 0
    loaded: int = 0
    load_errors: int = 0
    last_error: str | None = None
    versions: list[int] = field(default_factory=list)


class FallbackWeightTransport:
    """Publish/load through the first transport that works (see the module docstring).

    Args:
        transports: in preference order, e.g. ``[MooncakeWeightTransport(...), FilesystemWeightTransport(...)]``.
        retry_after_s: after a failure, skip that transport's publishes for this many seconds (0: always retry).

    Raises:
        ValueError: no transports, or two with the same ``name``.
    """

    def __init__(self, transports: Sequence[WeightTransport], *, retry_after_s: float = 30.0) -> None:
        names = [t.name for t in transports]
        if not transports or len(set(names)) != len(names):
            raise ValueError(f"FallbackWeightTransport: transports={names} must be non-empty with distinct names")
        if retry_after_s < 0:
            raise ValueError(f"FallbackWeightTransport: retry_after_s={retry_after_s} must be >= 0")
        self.transports = list(transports)
        self.retry_after_s = retry_after_s
        self.stats: dict[str, TransportStats] = {n: TransportStats() for n in names}
        self._down_until: dict[str, float] = {}
        self.where: dict[int, str] = {}
        """Version -> name of the transport that holds it (publisher side)."""

    def publish(self, state_dict: Mapping[str, Any], version: int) -> dict[str, Any]:
        """Publish ``version`` through the first transport that succeeds.

        Returns:
            that transport's report plus ``"attempts"``: ``[{"transport", "error" | "skipped"}]`` for the ones
            passed over.

        Raises:
            RuntimeError: every transport failed or was skipped (the message lists each one's error).
            ValueError, TypeError: bad input (from the first transport tried).
        """
        attempts: list[dict[str, Any]] = []
        now = time.monotonic()
        for t in self.transports:
            st = self.stats[t.name]
            if self._down_until.get(t.name, 0.0) > now and t is not self.transports[-1]:
                st.skipped += 1
                attempts.append({"transport": t.name, "skipped": f"down after: {st.last_error}"})
                continue
            try:
                report = t.publish(state_dict, version)
            except TRANSPORT_ERRORS as exc:
                st.failed += 1
                st.last_error = f"{type(exc).__name__}: {exc}"
                self._down_until[t.name] = time.monotonic() + self.retry_after_s
                attempts.append({"transport": t.name, "error": st.last_error})
                continue
            self._down_until.pop(t.name, None)
            st.published += 1
            st.versions.append(version)
            if attempts:
                st.fallbacks += 1
            self.where[version] = t.name
            return {**report, "attempts": attempts}
        raise RuntimeError(
            f"weights version {version} could not be published by any transport: "
            + "; ".join(f"{a['transport']}: {a.get('error') or a.get('skipped')}" for a in attempts)
        )

    def locate(self, version: int) -> str | None:
        """Name of the first transport (in order) that holds ``version``, or None. Transports that cannot
        answer are counted in ``load_errors`` and passed over."""
        for t in self.transports:
            try:
                if t.is_published(version):
                    return t.name
            except TRANSPORT_ERRORS as exc:
                st = self.stats[t.name]
                st.load_errors += 1
                st.last_error = f"{type(exc).__name__}: {exc}"
        return None

    def load(self, version: int) -> tuple[str, list[tuple[str, Any]]]:
        """``(transport name, [(hf_name, tensor)])`` of ``version`` from the first transport that holds it.

        A transport that holds it but fails to deliver (e.g. the master died in between) is counted in
        ``load_errors`` and the next one is tried.

        Raises:
            LookupError: no transport holds ``version`` (the message lists what each one said).
        """
        said = []
        for t in self.transports:
            st = self.stats[t.name]
            try:
                if not t.is_published(version):
                    said.append(f"{t.name}: not published")
                    continue
                weights = t.load(version)
            except (*TRANSPORT_ERRORS, LookupError) as exc:  # LookupError: removed between the two calls
                st.load_errors += 1
                st.last_error = f"{type(exc).__name__}: {exc}"
                said.append(f"{t.name}: {st.last_error}")
                continue
            st.loaded += 1
            return t.name, weights
        raise LookupError(f"weights version {version} is not available from any transport: " + "; ".join(said))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per transport: its counters (for logs and metrics)."""
        return {name: vars(st).copy() for name, st in self.stats.items()}
