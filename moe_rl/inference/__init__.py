"""Inference engines: a vLLM (CPU build) server launcher, its worker extension and an async client.

- ``VllmServerConfig`` / ``VllmServer``: start, health-check and stop ``python -m
  vllm.entrypoints.openai.api_server`` with the settings this project needs (``vllm_server.py``).
- ``VllmClient`` / ``Completion``: token-id completions with sampler logprobs and prefix-cache hit counts,
  in-place weight updates, weight version, prefix-cache reset (``client.py``).
- ``moe_rl.inference.vllm_worker_ext.EngineExtension``: the methods the server's worker gains (in-place reload,
  weight version, token versions, routed-experts capture); the servers run its subclass
  ``moe_rl.weights.engine.WeightSyncExtension`` (one load per weight transport). Imported only by vLLM.
- ``InferenceClient`` / ``GenerateOptions`` (``protocol.py``): what the orchestrator needs from any engine and
  ``generate``'s keyword options; ``VersionSkewMonitor`` (``version_skew.py``).
- Mooncake Store building blocks (``mooncake/``: master, keys, store client, routed-experts payloads). The weight
  transports themselves live in ``moe_rl.weights``.
- ``RequestRouter`` / ``RoutedClient`` (``router.py``, ``routed_client.py``): engine choice by load, queue depth
  and expected prefix-cache reuse, sticky sessions.
- ``ProxiedClient`` (``proxied_client.py``): generation through a prefill/decode proxy, weight updates and the other
  engine-wide calls to every replica (disaggregated cluster runs).

Importing this package imports neither vllm nor torch: each name loads its own submodule on first use.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "Completion": "client",
    "EngineCallError": "proxied_client",
    "GenerateOptions": "protocol",
    "InferenceClient": "protocol",
    "PrefixCacheResetError": "protocol",
    "ProxiedClient": "proxied_client",
    "RequestRouter": "router",
    "RoutedClient": "routed_client",
    "RouterConfig": "router",
    "VllmClient": "client",
    "VllmRequestError": "client",
    "VllmServer": "vllm_server",
    "VllmServerConfig": "vllm_server",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
