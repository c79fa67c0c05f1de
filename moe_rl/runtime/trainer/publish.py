"""How the RL trainer's rank 0 publishes each policy version (``trainer.weight_transport``).

- ``"filesystem"`` (default): ``moe_rl.inference.weights.WeightPublisher``, one HF checkpoint folder
  ``weights/step_<v>/`` with a ``STABLE`` marker per version, exactly as before; nothing else is written.
- ``"mooncake"``: ``FallbackWeightTransport([MooncakeWeightTransport, FilesystemWeightTransport])``
  (``moe_rl.inference.mooncake``): the version goes to the run's Mooncake store (started by the launcher,
  ``moe_rl.runtime.weight_transport.RunStore``); when the store fails (master gone, store full) it goes to the
  filesystem folder instead, and the fallback is counted. After each publication an announcement
  ``weights/announce/step_<v>.json`` names the transport that holds ``v`` (the orchestrator polls it).
  The final version (``max_steps``) is also written to the filesystem: it is the run's output checkpoint and
  stays loadable whatever happens to the store. The latest store version stays referenced on rank 0 until the
  next one (one host copy of the weights), so a version the store lost before the engine loaded it can be
  written to the folder on request (:meth:`RunWeightPublisher.serve_requests`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

__all__ = ["RunWeightPublisher", "make_weight_publisher"]



class RunWeightPublisher:
    """Rank 0's publisher: ``publish(hf_state_dict, version)`` and ``stats()`` (the ``weight_transport`` entry of
    ``trainer/step_<n>.json``). Build it with :func:`make_weight_publisher`.

    Args:
        mode: ``"filesystem"`` or ``"mooncake"``.
        weights_root: the run's ``weights/`` folder.
        filesystem: the ``FilesystemWeightTransport`` (both modes).
        chain: the ``FallbackWeightTransport`` (mooncake mode), else None.
        final_version: the last version of the run (also written to the filesystem in mooncake mode).
        store_client: the trainer's ``StoreClient`` (closed by :meth:`close`), or None.
        setup_error: why the store could not be joined (mooncake mode; every version then falls back).
    """

    def __init__(self, mode: Literal["filesystem", "mooncake"], weights_root: Path, filesystem: Any,
                 chain: Any = None, final_version: int | None = None, store_client: Any = None,
                 setup_error: str | None = None) -> None:
        self.mode = mode
        self.weights_root = Path(weights_root)
        self.filesystem = filesystem
        self.chain = chain
        self.final_version = final_version
        self.store_client = store_client
        self.setup_error = setup_error
        self.sources: dict[int, str] = {}
        self.republished: list[int] = []
        self._held: tuple[int, dict[str, Any]] | None = None
        self.final_copies: list[int] = []
        self.last: dict[str, Any] = {}

    def publish(self, hf_state_dict: dict[str, Any], version: int) -> dict[str, Any]:
        """Publish ``hf_state_dict`` (HF names -> CPU tensors in the engine dtype) as ``version``.

        Returns:
            the transport's report (``transport``, ``version``, ``bytes``, ``seconds``, and in mooncake mode
            ``attempts``: the transports passed over, with their errors).

        Raises:
            ValueError: ``version`` already published (versions are immutable) or negative.
            RuntimeError: no transport could publish it (mooncake mode; the message lists every error).
        """
        from moe_rl.runtime.weight_transport import write_announcement

        t0 = time.perf_counter()
        chain = self.chain
        report = (chain if chain is not None else self.filesystem).publish(hf_state_dict, version)
        source = report["transport"]
        fs_copy = source == "filesystem"
        if chain is not None and version == self.final_version and not fs_copy:
            self.filesystem.publish(hf_state_dict, version)  # the run's output checkpoint
            self.final_copies.append(version)
            fs_copy = True
        self.sources[version] = source
        self.last = {"version": version, "source": source, "seconds": time.perf_counter() - t0,
                     "attempts": report.get("attempts", []),
                     "removed_store_versions": report.get("removed_versions", [])}  # keep_versions garbage collection
        if chain is not None:
            # held until the next version: the engine may ask for it again (serve_requests)
            self._held = None if fs_copy else (version, hf_state_dict)
            write_announcement(self.weights_root, version, source, filesystem_copy=fs_copy,
                               transport_stats=self.stats())
        return report

    def serve_requests(self) -> int | None:
        """Mooncake mode: if the orchestrator asked for the latest version again (``announce/request_<v>.json``;
        the engine could not load it from the store), write it to the folder, re-announce it as ``filesystem``
        and return ``v``; else None. Call it while waiting for the next batch (one ``stat`` when idle).
        Requests for older versions are left alone: a newer version supersedes them.

        Raises:
            OSError: the folder could not be written.
        """
        from moe_rl.runtime.weight_transport import request_path, write_announcement

        if self._held is None:
            return None
        version, hf_state_dict = self._held
        req = request_path(self.weights_root, version)
        if not req.exists():
            return None
        self.filesystem.publish(hf_state_dict, version)
        self._held = None
        self.republished.append(version)
        write_announcement(self.weights_root, version, "filesystem", filesystem_copy=True,
                           transport_stats=self.stats())
        req.unlink(missing_ok=True)
        return version

    def stats(self) -> dict[str, Any]:
        """Counters so far: ``mode``; ``versions_by_source``; ``publish_fallbacks`` (versions that did not go to
        the preferred transport, the store in mooncake mode); per-transport counters (``transports``, mooncake
        mode); ``final_filesystem_copies``; ``republished`` (versions written to the folder on the engine's
        request); ``setup_error``; ``last`` (the latest publication)."""
        by_source: dict[str, int] = {}
        for s in self.sources.values():
            by_source[s] = by_source.get(s, 0) + 1
        out: dict[str, Any] = {"mode": self.mode, "versions_by_source": by_source, "last": dict(self.last)}
        if self.mode == "mooncake":
            out.update(publish_fallbacks=sum(s != "mooncake" for s in self.sources.values()),
                       transports=self.chain.summary() if self.chain is not None else {},
                       final_filesystem_copies=list(self.final_copies), republished=list(self.republished),
                       setup_error=self.setup_error,
                       store_gc_failures=self._gc_failures())
        else:
            out["publish_fallbacks"] = 0
        return out

    def _gc_failures(self) -> int:
        """Failed removals of old store versions (their objects stay pinned until the store stops)."""
        first = self.chain.transports[0] if self.chain is not None else None
        return int(first.gc_failures) if first is not None and first.name == "mooncake" else 0

    def close(self) -> None:
        """Leave the store (the trainer lends no memory, so no object is lost); idempotent."""
        if self.store_client is not None:
            client, self.store_client = self.store_client, None
            client.close()


def make_weight_publisher(cfg: Any, weights_root: str | Path, hf_config: dict,
                          extra_files: list[str | Path] | None = None) -> RunWeightPublisher:
    """The publisher for ``cfg.trainer.weight_transport`` (``cfg``: the run's ``RLConfig``, as read from
    ``config.json``).

    In mooncake mode the trainer joins the store with ``cfg.trainer.mooncake`` (ports written by the launcher) as a
    client that lends no memory. If it cannot join (master already gone), the chain holds only the filesystem
    transport and ``stats()["setup_error"]`` says why: the run goes on, every version counted as a fallback.

    Raises:
        ValueError: mooncake mode with ports still 0 (``config.json`` not written by the launcher).
    """
    from moe_rl.inference.mooncake.fallback import FallbackWeightTransport, FilesystemWeightTransport

    tcfg = cfg.trainer
    fs = FilesystemWeightTransport(weights_root, hf_config, extra_files)
    if tcfg.weight_transport == "filesystem":
        return RunWeightPublisher("filesystem", Path(weights_root), fs)
    mcfg = tcfg.mooncake
    client_cfg = mcfg.client_config(global_segment_bytes=0)
    client = None
    setup_error = None
    transports: list[Any] = []
    try:
        from moe_rl.inference.mooncake import MooncakeWeightTransport, StoreClient

        client = StoreClient(client_cfg)
        transports.append(MooncakeWeightTransport(client, cfg.inference.served_model_name,
                                                  keep_versions=mcfg.keep_versions))
    except (ImportError, RuntimeError, OSError) as exc:  # StoreError is a RuntimeError
        setup_error = f"{type(exc).__name__}: {exc}"
    transports.append(fs)
    chain = FallbackWeightTransport(transports, retry_after_s=mcfg.retry_after_s)
    return RunWeightPublisher("mooncake", Path(weights_root), fs, chain=chain, final_version=cfg.max_steps,
                              store_client=client, setup_error=setup_error)
