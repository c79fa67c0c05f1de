"""Mooncake Store building blocks: a loopback master, a checked client, weight transport with a
filesystem fallback, and routed-experts payloads.

- ``MooncakeMaster`` / ``MooncakeMasterConfig``: start/stop ``mooncake_master`` + HTTP metadata server
  (``master.py``).
- ``StoreKey``: the key scheme (model, version or cache_salt, dtype, shard, name, part) (``keys.py``).
- ``StoreClient`` / ``StoreClientConfig``: put/get bytes and tensors, idempotent batch puts, errors instead
  of return codes (``store.py``).
- ``MooncakeWeightTransport``: versioned state dicts with a manifest written last (``weights.py``).
- ``FallbackWeightTransport`` / ``FilesystemWeightTransport``: fall back and count (``fallback.py``).
- ``RoutedExpertsStore``: R3 records by rollout id (``routed_experts.py``).
- ``update_engine_weights``: make vLLM servers load a version from the store (``engine.py``).

Importing this package imports neither ``mooncake`` nor ``torch``; they are loaded when a client starts.
Needs ``pip install 'moe_rl[mooncake]'`` and ``apt-get install libibverbs1``.
"""

from moe_rl.inference.mooncake.engine import update_engine_weights
from moe_rl.inference.mooncake.fallback import (
    FallbackWeightTransport,
    FilesystemWeightTransport,
    TransportStats,
)
from moe_rl.inference.mooncake.keys import StoreKey, parse_shard, shard_id
from moe_rl.inference.mooncake.master import MooncakeMaster, MooncakeMasterConfig, require_mooncake
from moe_rl.inference.mooncake.store import (
    MissingKeyError,
    PutReport,
    StoreClient,
    StoreClientConfig,
    StoreError,
)
from moe_rl.inference.mooncake.weights import MooncakeWeightTransport, VersionNotFoundError

__all__ = [
    "FallbackWeightTransport",
    "FilesystemWeightTransport",
    "MissingKeyError",
    "MooncakeMaster",
    "MooncakeMasterConfig",
    "MooncakeWeightTransport",
    "PutReport",
    "StoreClient",
    "StoreClientConfig",
    "StoreError",
    "StoreKey",
    "TransportStats",
    "VersionNotFoundError",
    "parse_shard",
    "require_mooncake",
    "shard_id",
    "update_engine_weights",
]
