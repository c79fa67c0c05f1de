"""Mooncake Store as vLLM's tiered KV offload: one master, one ``mooncake_client`` per inference node, and the JSON
file vLLM's ``MooncakeStoreConnector`` reads.

Layout (prime-rl's ``templates/_mooncake_store.sh.j2``)::

    head inference node : mooncake_master -rpc_port 50051 -enable_http_metadata_server (metadata on :8080)
    every inference node: mooncake_client -global_segment_size <DRAM bytes> ...   (owns that node's pool share)
    every vLLM engine   : MOONCAKE_CONFIG_PATH -> {"mode": "standalone-store", "global_segment_size": 0, ...}

In ``standalone-store`` mode the engine contributes no memory (``global_segment_size`` must be 0); the per-node
client process owns the DRAM (and optional SSD) tier, so a block saved by any engine can be loaded by any other over
RDMA. Block keys are model + rank + content hash; ``PYTHONHASHSEED`` must be the same in every engine so prefix
hashes agree across processes (vLLM ``v1/core/kv_cache_utils.py``).

Flag names: ``mooncake_master --helpfull`` and ``mooncake_client --help`` of mooncake-transfer-engine 0.3.13
(gflags: ``-rpc_port``, ``-enable_http_metadata_server``, ``-http_metadata_server_host``,
``-http_metadata_server_port``, ``-default_kv_lease_ttl``, ``-eviction_high_watermark_ratio``, ``-enable_offload``;
client ``-host``, ``-port``, ``-master_server_address``, ``-metadata_server``, ``-protocol``, ``-device_names``,
``-global_segment_size``, ``-local_buffer_size``, ``-enable_offload``). JSON keys: ``MooncakeStoreConfig.from_file``
in vLLM ``vllm/distributed/mooncake_store.py`` (``metadata_server``, ``master_server_address``, ``protocol``,
``device_name``, ``mode``, ``global_segment_size``, ``local_buffer_size``, ``enable_offload``, ``tenant_id``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig

__all__ = ["MooncakeOffloadConfig", "GiB"]

GiB = 1024**3


class MooncakeOffloadConfig(BaseConfig):
    """Tiered KV offload through Mooncake Store (vLLM ``MooncakeStoreConnector``).

    Raises (at construction):
        ValueError: ``enable_ssd_offload`` without ``ssd_path``.
    """

    segment_gib_per_node: float = Field(gt=0)
    """Host DRAM (GiB) each inference node's ``mooncake_client`` contributes to the shared pool
    (``-global_segment_size``)."""
    local_buffer_gib: float = Field(4.0, gt=0)
    """Staging buffer (GiB) of each vLLM engine's store client (JSON ``local_buffer_size``; prime-rl: 4 GiB)."""
    protocol: Literal["rdma", "tcp"] = "rdma"
    """Transfer Engine transport."""
    device_names: str = ""
    """RDMA NICs, comma-separated (e.g. ``mlx5_0,mlx5_1``); empty = auto-detect."""
    master_port: int = Field(50051, ge=1, le=65535)
    """``mooncake_master -rpc_port``."""
    metadata_port: int = Field(8080, ge=1, le=65535)
    """The master's HTTP metadata server port."""
    metrics_port: int = Field(9003, ge=1, le=65535)
    """``mooncake_master -metrics_port``: its HTTP admin server, whose ``GET /health`` answers 200 once the master
    serves; the batch script waits for it before starting the clients (they connect to the master at startup)."""
    client_port: int = Field(50052, ge=1, le=65535)
    """``mooncake_client -port`` (its service port)."""
    lease_ttl_ms: int = Field(3_600_000, ge=1)
    """``-default_kv_lease_ttl``: the default (10 s) lets blocks expire before an agentic trajectory's next turn
    (prime-rl raises it to an hour)."""
    eviction_high_watermark_ratio: float = Field(0.95, gt=0.0, le=1.0)
    """Pool usage that triggers eviction."""
    enable_ssd_offload: bool = False
    """Also spill to the node's SSD (``-enable_offload`` on master and clients)."""
    ssd_path: str | None = None
    """Directory of the SSD tier (``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``), required with ``enable_ssd_offload``."""
    python_hash_seed: int = Field(0, ge=0, le=4294967295)
    """``PYTHONHASHSEED`` of every engine (the same everywhere, so block hashes match)."""
    master_executable: str = "mooncake_master"
    client_executable: str = "mooncake_client"

    @model_validator(mode="after")
    def _check(self) -> MooncakeOffloadConfig:
        if self.enable_ssd_offload and not self.ssd_path:
            raise ValueError("enable_ssd_offload=true needs ssd_path (the SSD tier's directory on every inference node)")
        return self

    def store_json(self, master_host: str) -> dict:
        """The JSON vLLM reads through ``MOONCAKE_CONFIG_PATH`` (standalone-store: the engine adds no memory)."""
        return {
            "metadata_server": f"http://{master_host}:{self.metadata_port}/metadata",
            "master_server_address": f"{master_host}:{self.master_port}",
            "protocol": self.protocol,
            "device_name": self.device_names,
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": int(self.local_buffer_gib * GiB),
            "enable_offload": self.enable_ssd_offload,
        }

    def master_argv(self, host: str) -> list[str]:
        """``mooncake_master`` with the HTTP metadata server, on the head inference node; ``host`` is the address it
        binds (the node's cluster interface, ``${ADDR_<node>}`` in the plan): RPC (``-rpc_address``), metrics/health
        (``-metrics_host``) and the metadata server (``-http_metadata_server_host``, which mooncake 0.3.13 ignores:
        its built-in metadata server listens on every interface). Mooncake has no authentication on any of them."""
        argv = [
            self.master_executable,
            f"-rpc_port={self.master_port}",
            f"-rpc_address={host}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={host}",
            f"-http_metadata_server_port={self.metadata_port}",
            f"-metrics_host={host}",
            f"-metrics_port={self.metrics_port}",
            f"-default_kv_lease_ttl={self.lease_ttl_ms}",
            f"-eviction_high_watermark_ratio={self.eviction_high_watermark_ratio}",
        ]
        if self.enable_ssd_offload:
            argv.append("-enable_offload=true")
        return argv

    def master_health_url(self, host: str) -> str:
        """The master's readiness endpoint (``GET /health`` on its metrics/admin server, 200 when serving)."""
        return f"http://{host}:{self.metrics_port}/health"

    def client_argv(self, host: str, master_host: str) -> list[str]:
        """``mooncake_client`` of one inference node: owns ``segment_gib_per_node`` of its DRAM."""
        argv = [
            self.client_executable,
            f"-host={host}",
            f"-port={self.client_port}",
            f"-master_server_address={master_host}:{self.master_port}",
            f"-metadata_server=http://{master_host}:{self.metadata_port}/metadata",
            f"-protocol={self.protocol}",
            f"-global_segment_size={int(self.segment_gib_per_node * GiB)}",
        ]
        if self.device_names:
            argv.append(f"-device_names={self.device_names}")
        if self.enable_ssd_offload:
            argv.append("-enable_offload=true")
        return argv

    def client_env(self) -> dict[str, str]:
        """Environment of a client (the SSD tier's path when enabled)."""
        return {"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": self.ssd_path} if self.enable_ssd_offload and self.ssd_path else {}
