"""Mooncake Store building blocks: a loopback master, a checked client and routed-experts payloads (the weight
transport over the store is ``moe_rl.weights.mooncake``).

- ``MooncakeMaster`` / ``MooncakeMasterConfig``: start/stop ``mooncake_master`` + HTTP metadata server
  (``master.py``).
- ``StoreKey``: the key scheme (model, version or cache_salt, dtype, shard, name, part) (``keys.py``).
- ``StoreClient`` / ``StoreClientConfig``: put/get bytes and tensors, idempotent batch puts, errors instead
  of return codes (``store.py``).
- ``RoutedExpertsStore``: R3 records by rollout id (``routed_experts.py``).
- ``kv_connector.MooncakeKVTier``: a vLLM KV connector keeping prefix KV blocks in the store (loaded by vLLM via
  ``kv_connector_module_path``; not exported here because it imports vLLM).

Importing this package imports neither ``mooncake`` nor ``torch`` (each name loads its own submodule on first
use; ``mooncake`` is loaded when a client starts). Needs ``pip install 'moe_rl[mooncake]'`` and ``apt-get install
libibverbs1``.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "MissingKeyError": "store",
    "MooncakeMaster": "master",
    "MooncakeMasterConfig": "master",
    "PutReport": "store",
    "StoreClient": "store",
    "StoreClientConfig": "store",
    "StoreError": "store",
    "StoreKey": "keys",
    "parse_shard": "keys",
    "require_mooncake": "master",
    "shard_id": "keys",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
