"""Start and stop a Mooncake Store master plus its HTTP metadata server, bound to loopback.

A Mooncake Store deployment has three parts (Mooncake ``docs/source/design/mooncake-store.md``):

- the **master** (``mooncake_master``): owns the object metadata, segment allocation, leases and eviction,
  and answers the clients' RPCs on ``rpc_port``;
- a **metadata server** the clients' transfer engines use to find each other (here the package's aiohttp
  ``mooncake.http_metadata_server``, on ``metadata_port``);
- the **clients** (:class:`moe_rl.inference.mooncake.StoreClient`), which both read/write objects and
  contribute memory (their global segment) that holds other clients' objects.

Everything here binds to ``host`` (default ``127.0.0.1``). The master's built-in HTTP metadata server
(``--enable_http_metadata_server``) is NOT used: in mooncake 0.3.13 it listens on ``0.0.0.0`` whatever
``--http_metadata_server_host`` says; the separate Python server honours
``--host``. The master's RPC and metrics servers honour ``--rpc_address``/``--metrics_host``.

Both processes run in their own process group (``start_new_session=True``) and are stopped by group id
(``moe_rl.procs.stop_group``). Logs go to ``<log_dir>/master.log`` and ``<log_dir>/metadata.log``.

Requirements: ``pip install 'moe_rl[mooncake]'`` (the ``mooncake-transfer-engine-non-cuda`` wheel, or the
CUDA wheel on GPU hosts) and the system library ``libibverbs.so.1`` (Debian/Ubuntu: ``apt-get install
libibverbs1``), which every Mooncake binary links even when only TCP is used.
"""

from __future__ import annotations

import ctypes
import importlib.util
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from moe_rl.config import BaseConfig
from moe_rl.inference.mooncake._common import INSTALL_HINT
from moe_rl.procs import stop_group, tail

__all__ = ["MooncakeMaster", "MooncakeMasterConfig", "mooncake_binary", "require_mooncake"]


def require_mooncake() -> Path:
    """Check that Mooncake can run here and return the ``mooncake`` package folder.

    Looks the package up without importing it, then loads ``libibverbs.so.1`` (which ``mooncake_master``
    and ``mooncake/store.so`` link even for TCP).

    Raises:
        ImportError: the ``mooncake`` package is not installed, or ``libibverbs.so.1`` cannot be loaded; the
            message says how to install both.
    """
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the Mooncake Python package (module 'mooncake') is not installed: {INSTALL_HINT}")
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as exc:
        raise ImportError(
            f"Mooncake needs the system library libibverbs.so.1, which cannot be loaded ({exc}): {INSTALL_HINT}"
        ) from None
    return Path(list(spec.submodule_search_locations)[0])


def mooncake_binary(name: str = "mooncake_master") -> Path:
    """Path of a binary shipped inside the mooncake wheel (``mooncake_master``, ``mooncake_client``).

    Raises:
        ImportError: Mooncake is not usable here (see :func:`require_mooncake`).
        FileNotFoundError: the wheel does not ship ``name``.
    """
    path = require_mooncake() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the installed mooncake wheel lacks '{name}': {INSTALL_HINT}")
    if not os.access(path, os.X_OK):  # wheels may drop the executable bit (mooncake.cli fixes it the same way)
        path.chmod(path.stat().st_mode | 0o111)
    return path


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class _EarlyExit(RuntimeError):
    """A server process exited before listening (bad flag, port taken)."""


class MooncakeMasterConfig(BaseConfig):
    """Settings of a loopback Mooncake Store master and its HTTP metadata server."""

    host: str = "127.0.0.1"
    """Address both servers bind to and clients connect to. Keep loopback unless engines run on other hosts."""
    rpc_port: int = Field(0, ge=0, le=65535)
    """Master RPC port (``--rpc_port``); 0 picks a free port."""
    metadata_port: int = Field(0, ge=0, le=65535)
    """HTTP metadata server port; 0 picks a free port."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Master metrics/admin HTTP port (``--metrics_port``); 0 picks a free port."""
    default_kv_lease_ttl_ms: int = Field(10_000, ge=1)
    """Lease (ms) an object gets on every get/exist; a leased object cannot be removed or evicted.
    Must be > 0: ``--default_kv_lease_ttl=0`` makes every get fail with LEASE_EXPIRED (feasibility §5)."""
    eviction_high_watermark_ratio: float = Field(0.9, gt=0.0, le=1.0)
    """Memory-use fraction above which the master evicts (approximate LRU; pinned objects are never evicted)."""
    client_ttl_s: int = Field(10, ge=1)
    """Seconds without a heartbeat after which the master drops a client and unmounts its segment."""
    startup_timeout_s: float = Field(30.0, gt=0)
    """How long :meth:`MooncakeMaster.start` waits for both servers to accept connections."""
    log_dir: str | None = None
    """Folder for ``master.log`` and ``metadata.log``; None: a fresh temporary folder."""
    extra_args: list[str] = Field(default_factory=list)
    """Further ``mooncake_master`` flags, e.g. ``["--enable_offload=true"]`` (see ``mooncake_master --help``)."""

    @field_validator("host")
    @classmethod
    def _ip(cls, value: str) -> str:
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            raise ValueError(f"must be an IPv4 address such as 127.0.0.1 (got {value!r})") from None
        return value


class MooncakeMaster:
    """A running ``mooncake_master`` plus HTTP metadata server; a context manager.

    Example::

        with MooncakeMaster() as master:
            with StoreClient(master.client_config()) as store:
                store.put("k", b"payload")

    Args:
        config: the settings; None uses the defaults (loopback, free ports).

    Raises (from :meth:`start`):
        ImportError: Mooncake or libibverbs is missing (the message says how to install them).
        RuntimeError: a server exited or did not listen within ``startup_timeout_s``; the message holds the
            tail of its log.
    """

    def __init__(self, config: MooncakeMasterConfig | None = None) -> None:
        self.config = config or MooncakeMasterConfig()
        self._master: subprocess.Popen | None = None
        self._metadata: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log_dir: Path | None = None
        self.rpc_port = self.config.rpc_port
        self.metadata_port = self.config.metadata_port
        self.metrics_port = self.config.metrics_port

    # ------------------------------------------------------------------ addresses
    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master RPC service (the clients' ``master_server_addr``)."""
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """``http://host:port/metadata``: the clients' ``metadata_server``."""
        return f"http://{self.config.host}:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics`` of the master (Prometheus text)."""
        return f"http://{self.config.host}:{self.metrics_port}/metrics"

    @property
    def master_pid(self) -> int | None:
        return None if self._master is None else self._master.pid

    def master_alive(self) -> bool:
        """True while the master process runs."""
        return self._master is not None and self._master.poll() is None

    def client_config(self, **overrides: Any) -> Any:
        """A :class:`moe_rl.inference.mooncake.StoreClientConfig` pointing at this master (``overrides`` set
        its other fields, e.g. ``global_segment_bytes``)."""
        from moe_rl.inference.mooncake.store import StoreClientConfig

        return StoreClientConfig(
            master_address=self.rpc_address, metadata_url=self.metadata_url, local_hostname=self.config.host,
            **overrides,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MooncakeMaster:
        """Start the metadata server and the master; return once both accept TCP connections."""
        if self._master is not None:
            raise RuntimeError("MooncakeMaster.start: already started; call stop() first")
        master_bin = mooncake_binary("mooncake_master")
        cfg = self.config
        if cfg.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="moe_rl_mooncake_")
            self.log_dir = Path(self._tmp.name)
        else:
            self.log_dir = Path(cfg.log_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
        # Free ports are picked by binding port 0 and closing: another process may take one before our server
        # binds it. The server then exits at once; retry with new ports (only for ports we picked).
        attempts = 1 if (cfg.rpc_port and cfg.metadata_port and cfg.metrics_port) else 3
        for attempt in range(attempts):
            self.rpc_port = cfg.rpc_port or _free_port(cfg.host)
            self.metadata_port = cfg.metadata_port or _free_port(cfg.host)
            self.metrics_port = cfg.metrics_port or _free_port(cfg.host)
            try:
                self._metadata = self._spawn(
                    [sys.executable, "-m", "mooncake.http_metadata_server", "--host", cfg.host,
                     "--port", str(self.metadata_port), "--log-level", "WARNING"],
                    self.log_dir / "metadata.log",
                )
                self._master = self._spawn_master(master_bin)
                self._wait_ready()
                return self
            except _EarlyExit:
                self._stop_processes()
                if attempt == attempts - 1:
                    self.stop()
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _spawn_master(self, master_bin: Path) -> subprocess.Popen:
        cfg = self.config
        assert self.log_dir is not None
        return self._spawn(
            [str(master_bin), f"--rpc_address={cfg.host}", f"--rpc_port={self.rpc_port}",
             f"--metrics_host={cfg.host}", f"--metrics_port={self.metrics_port}",
             f"--default_kv_lease_ttl={cfg.default_kv_lease_ttl_ms}ms",
             f"--eviction_high_watermark_ratio={cfg.eviction_high_watermark_ratio}",
             f"--client_ttl={cfg.client_ttl_s}", "--logtostderr=true", *cfg.extra_args],
            self.log_dir / "master.log",
        )

    def restart_master(self) -> None:
        """Start the master again on the same ports after :meth:`kill` (or a crash); the metadata server is
        kept. The new master knows no objects: everything stored before is gone, and clients reconnect on
        their next call (after their ``unreachable_cooldown_s``).

        Raises:
            RuntimeError: not started, the master is still running, or it did not come back in time.
        """
        if self._master is None or self._metadata is None:
            raise RuntimeError("MooncakeMaster.restart_master: call start() first")
        if self._master.poll() is None:
            raise RuntimeError("MooncakeMaster.restart_master: the master is still running; kill() or stop() it first")
        try:
            self._master = self._spawn_master(mooncake_binary("mooncake_master"))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def _wait_ready(self) -> None:
        assert self._master is not None and self._metadata is not None and self.log_dir is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        pending = {"metadata server": (self._metadata, self.metadata_port, "metadata.log"),
                   "master": (self._master, self.rpc_port, "master.log")}
        while pending:
            for name, (proc, port, log) in list(pending.items()):
                if proc.poll() is not None:
                    raise _EarlyExit(
                        f"Mooncake {name} exited with code {proc.returncode} before listening on "
                        f"{self.config.host}:{port}; last lines of {self.log_dir / log}:\n{tail(self.log_dir / log, 20)}"
                    )
                if _port_open(self.config.host, port):
                    del pending[name]
            if pending and time.monotonic() > deadline:
                name, (_, port, log) = next(iter(pending.items()))
                raise RuntimeError(
                    f"Mooncake {name} did not listen on {self.config.host}:{port} within "
                    f"startup_timeout_s={self.config.startup_timeout_s}; last lines of {self.log_dir / log}:\n"
                    f"{tail(self.log_dir / log, 20)}"
                )
            if pending:
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the master's process group (fault injection: no clean shutdown, all metadata is lost).
        The metadata server keeps running; :meth:`stop` still cleans up."""
        if self._master is None:
            return
        try:
            os.killpg(self._master.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._master.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM both process groups (SIGKILL after ``timeout`` s); idempotent. Keeps a given ``log_dir``."""
        self._stop_processes(timeout)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _stop_processes(self, timeout: float = 10.0) -> None:
        for proc in (self._master, self._metadata):
            if proc is not None:
                stop_group(proc, timeout=timeout)
        self._master = self._metadata = None

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the master log (for error messages)."""
        return "" if self.log_dir is None else tail(self.log_dir / "master.log", n)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
