"""The one "version v is ready" signal between the trainer and the orchestrator, and its watcher.

Whatever the transport, the trainer's rank 0 announces every version once its publication completed (for the
``broadcast`` transport: once every trainer rank is ready to send it, the engines' receive is what completes it)::

    <weights>/announce/step_<v>.json   {"version": v, "source": "filesystem" | "broadcast" | "mooncake" | "p2p",
                                        "filesystem_copy": bool, "path": str | null,
                                        "layout": "hf" | "sharded" | null, "shards": str | null, "stats": {...}}

written atomically (``step_<v>.json.tmp`` then ``os.replace``), so a reader that sees the file sees all of it.
``source`` names the transport that holds the version; ``filesystem_copy`` says a folder ``<weights>/step_<v>/``
(completion marker ``STABLE``) holds it too; ``path`` is that folder when there is one and ``layout`` its layout;
``shards`` lists the Mooncake shards (one per trainer rank) of a store version; ``stats`` is the
publisher's :class:`moe_rl.weights.protocol.UpdateStats` of this version (trainer blocking seconds, bytes).

The orchestrator polls these files with :class:`AnnouncementWatcher` (``moe_rl.runtime.orchestrator``): it jumps
to the newest announced version for transports that keep a version (filesystem, mooncake, p2p: the trainer ranks
hold the last ``trainer.p2p.keep_versions``, the piece index is ``announce/p2p_<v>.json``), and takes every
version in order for the ``broadcast`` transport (each version is sent once; an engine that skipped one would
leave the trainer's send waiting).

A version announced in the Mooncake store can be lost before the engine loads it (the master died). The watcher
then asks for the version again::

    <weights>/announce/request_<v>.json   {"version": v, "reason": "..."}

and the trainer's rank 0, which still holds version v, writes it to the folder and re-announces it with
``"source": "filesystem"`` (``RunWeightPublisher.serve_requests``; the only announcement that replaces another).
Any other second announcement of a version is refused (:class:`AnnouncementError`): versions are immutable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

__all__ = ["ANNOUNCE_DIR", "SOURCES", "AnnouncementError", "AnnouncementWatcher", "announce_path", "is_announced",
           "read_announcement", "request_path", "write_announcement", "write_republish_request"]

ANNOUNCE_DIR = "announce"
SOURCES = ("filesystem", "broadcast", "mooncake", "p2p")
Source = Literal["filesystem", "broadcast", "mooncake", "p2p"]


class AnnouncementError(ValueError):
    """A version announced twice (versions are immutable), or an announcement file that cannot be read."""


def announce_path(weights_root: str | Path, version: int) -> Path:
    """``<weights_root>/announce/step_<version>.json``."""
    return Path(weights_root) / ANNOUNCE_DIR / f"step_{version}.json"


def _atomic_write(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def write_announcement(weights_root: str | Path, version: int, source: Source, *, filesystem_copy: bool = False,
                       path: str | Path | None = None, layout: Literal["hf", "sharded"] | None = None,
                       shards: str | None = None, stats: dict[str, Any] | None = None,
                       replace: bool = False) -> Path:
    """Announce that ``version`` is ready in ``source`` (atomic: tmp file + ``os.replace``).

    Args:
        weights_root: the run's weights folder.
        version: policy version, int >= 0.
        source: the transport that holds the version (one of :data:`SOURCES`).
        filesystem_copy: True when ``weights_root/step_<version>`` (with ``STABLE``) exists as well.
        path: the version's folder when there is one (filesystem source or copy).
        layout: that folder's layout: ``"hf"`` (whole tensors, a checkpoint any engine loads) or ``"sharded"``
            (every trainer rank's pieces + ``shards.json``, ``moe_rl.weights.filesystem.read_sharded``).
        shards: the Mooncake shards holding the version (``"0of2,1of2"``: one per trainer rank).
        stats: the publisher's numbers for this version (``UpdateStats.as_dict()``) and counters.
        replace: allow replacing an earlier announcement of ``version`` (only the republish-on-request path).

    Returns:
        The announcement file.

    Raises:
        ValueError: ``source`` unknown, or ``version`` not an int >= 0.
        AnnouncementError: ``version`` was announced before and ``replace`` is False.
    """
    if source not in SOURCES:
        raise ValueError(f"write_announcement: source={source!r} must be one of {SOURCES}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"write_announcement: version={version!r} must be an int >= 0")
    out = announce_path(weights_root, version)
    if not replace and out.exists():
        raise AnnouncementError(
            f"write_announcement: version {version} is already announced ({out}: {out.read_text()[:200]}); "
            "versions are immutable: publish the next version instead (a republish on the orchestrator's request "
            "passes replace=True)"
        )
    _atomic_write(out, {"version": version, "source": source, "filesystem_copy": bool(filesystem_copy),
                        "path": None if path is None else str(path), "layout": layout, "shards": shards,
                        "stats": stats or {}})
    return out


def is_announced(weights_root: str | Path, version: int) -> bool:
    """True once ``version``'s announcement exists (cheap: one ``stat``)."""
    return announce_path(weights_root, version).exists()


def read_announcement(weights_root: str | Path, version: int) -> dict[str, Any] | None:
    """The announcement of ``version``, or None if there is none yet.

    Raises:
        AnnouncementError: the file is not a valid announcement of ``version``.
    """
    p = announce_path(weights_root, version)
    try:
        ann = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise AnnouncementError(f"announcement {p} is not JSON ({exc}); it is written atomically, so the file "
                                "was changed by something else: remove it and republish") from exc
    if ann.get("version") != version or ann.get("source") not in SOURCES:
        raise AnnouncementError(f"announcement {p} = {ann!r:.200} is not an announcement of version {version} "
                                f"with a source in {SOURCES}")
    return ann


def request_path(weights_root: str | Path, version: int) -> Path:
    """``<weights_root>/announce/request_<version>.json``: the orchestrator asks the trainer to republish."""
    return Path(weights_root) / ANNOUNCE_DIR / f"request_{version}.json"


def write_republish_request(weights_root: str | Path, version: int, reason: str) -> Path:
    """Ask the trainer to write ``version`` to the filesystem and announce it again (the engine could not load it:
    the store lost it with its master, or removed it). Atomic like :func:`write_announcement`."""
    path = request_path(weights_root, version)
    _atomic_write(path, {"version": version, "reason": reason})
    return path


class AnnouncementWatcher:
    """The orchestrator's view of the announcements: which version to load next.

    Args:
        weights_root: the run's weights folder.
        jump: take the newest of a run of announced versions (True: filesystem and mooncake, where every version
            stays readable), or every version in order (False: broadcast, where each version is sent once).
    """

    def __init__(self, weights_root: str | Path, *, jump: bool = True) -> None:
        self.root = Path(weights_root)
        self.jump = jump

    def next_version(self, served: int) -> int | None:
        """The version to load after ``served``, or None when ``served + 1`` is not announced yet."""
        nxt = served + 1
        if not is_announced(self.root, nxt):
            return None
        if self.jump:
            while is_announced(self.root, nxt + 1):
                nxt += 1
        return nxt

    def read(self, version: int) -> dict[str, Any]:
        """The announcement of an announced ``version``.

        Raises:
            AnnouncementError: it vanished or is malformed.
        """
        ann = read_announcement(self.root, version)
        if ann is None:
            raise AnnouncementError(f"version {version} was announced but {announce_path(self.root, version)} is "
                                    "gone: something removed the run's announcements")
        return ann
