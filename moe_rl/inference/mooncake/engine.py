"""Engine side: make running vLLM servers load a weight version from the Mooncake Store, with the
filesystem fallback of :class:`moe_rl.inference.mooncake.FallbackWeightTransport`.

The server must run with ``--worker-extension-cls moe_rl.inference.vllm_worker_ext.WeightSyncExtension``
and ``VLLM_SERVER_DEV_MODE=1`` (``VllmServer`` does both); the load itself is
``WeightSyncExtension.update_weights_from_mooncake`` (fetch + manifest check in the worker, then the same
in-place reload + CPU MoE repack as a path reload).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.inference.mooncake.store import StoreClientConfig

__all__ = ["update_engine_weights"]


async def update_engine_weights(
    client: Any,
    version: int,
    *,
    store_config: StoreClientConfig,
    model: str,
    shard: str = "0of1",
    fallback_root: str | Path | None = None,
) -> dict[str, Any]:
    """Load ``version`` into the server behind ``client`` (a ``VllmClient``): from the store, else from the
    filesystem copy ``<fallback_root>/step_<version>`` when the store does not have it or cannot be reached.

    Args:
        client: ``moe_rl.inference.VllmClient`` of the server.
        version: weight version.
        store_config: the store the trainer published to (the worker joins it as a pure reader).
        model, shard: as given to ``MooncakeWeightTransport`` when publishing.
        fallback_root: the ``FilesystemWeightTransport`` root; None: no fallback.

    Returns:
        the worker's report (``version``, ``reload_s``, ...) plus ``"source"`` (``"mooncake"`` or
        ``"filesystem"``) and, after a fallback, ``"mooncake_error"`` (the store's error text).

    Raises:
        moe_rl.inference.VllmRequestError: the store load failed and there is no published filesystem copy
            (the message quotes the worker's error), or the path reload failed.
    """
    from moe_rl.inference.weights import is_published, version_dir

    try:
        out = await client.update_weights_from_mooncake(store_config.model_dump(), model, int(version), shard)
        out.setdefault("source", "mooncake")
        return out
    except Exception as exc:  # the server answers 500 with the worker's exception text
        if fallback_root is None or not is_published(fallback_root, version):
            raise
        out = await client.update_weights(str(version_dir(fallback_root, version)), int(version))
        out["source"] = "filesystem"
        out["mooncake_error"] = f"{type(exc).__name__}: {exc}"
        return out
