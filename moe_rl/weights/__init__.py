"""Weight sync, trainer -> inference engines: one protocol, one announcement, one module per transport.

- ``protocol.py``: ``Publisher`` (trainer side, ``publish(model_or_state, version) -> UpdateStats``; sharded
  DTensors in, never a full gather on one rank), ``Loader`` (engine side), ``UpdateStats``.
- ``announce.py``: the one "version v is ready" file per version and the orchestrator's ``AnnouncementWatcher``.
- ``regions.py``: the pieces of the Hugging Face checkpoint each trainer rank owns, and their assembly.
- Transports, each with its config: ``filesystem.py`` (every rank writes its own shards + an index, ``STABLE``
  marker), ``broadcast.py`` (torch.distributed groups trainer rank -> engine workers, gloo or NCCL, bucketed),
  ``p2p.py`` (engine workers pull their pieces from the owning trainer ranks; gloo point-to-point),
  ``mooncake.py`` (Mooncake Store, one shard per trainer rank, the run's store); ``fallback.py`` (an ordered
  chain that falls back and counts); ``fp8.py`` (128x128 block FP8 on the wire); ``streaming.py`` (one tensor at a
  time into a Hugging Face folder, for FP8 engines).
- ``publisher.py``: ``make_weight_publisher``, the trainer process's publisher for ``trainer.weight_transport``.
- ``engine.py``: ``WeightSyncExtension``, the vLLM worker extension with one load per transport (assemble, then
  swap); ``push.py``: pause -> update -> resume on several engines with a version-skew check.
- ``delta.py``: exact delta encoding of a version against the previous one (changed elements only, periodic full
  versions, per-tensor and per-version checksums; ``DeltaEncoder`` / ``DeltaDecoder``); ``delta_sync.py``: that
  codec as an option of the ``filesystem``, ``broadcast`` and ``p2p`` transports (``DeltaConfig``, the trainer rank's
  ``RankDeltaEncoder``, the engine worker's host copy ``EngineDeltaState``).
- ``sync_model.py``: a time model of one update per transport (``SyncLayout``, ``LinkParams``, ``SyncOptions``
  -> ``SyncEstimate``; see ``docs/weight-sync-model.md``).

See ``docs/weights.md``. Importing this package imports neither torch nor vllm: each name loads its own submodule
on first use.
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "AnnouncementError": "announce",
    "AnnouncementWatcher": "announce",
    "BroadcastTransportConfig": "broadcast",
    "DeltaConfig": "delta_sync",
    "DeltaDecoder": "delta",
    "DeltaEncoder": "delta",
    "DeltaError": "delta",
    "DeltaUpdate": "delta",
    "EngineDeltaState": "delta_sync",
    "FallbackWeightTransport": "fallback",
    "FilesystemTransportConfig": "filesystem",
    "FilesystemWeightTransport": "fallback",
    "LinkParams": "sync_model",
    "Loader": "protocol",
    "P2PPublisher": "p2p",
    "P2PTransportConfig": "p2p",
    "MooncakeTransportConfig": "mooncake",
    "MooncakeWeightTransport": "mooncake",
    "Piece": "regions",
    "Publisher": "protocol",
    "RankDeltaEncoder": "delta_sync",
    "RunStore": "mooncake",
    "RunWeightPublisher": "publisher",
    "ShardedBroadcastPublisher": "broadcast",
    "ShardedFilesystemPublisher": "filesystem",
    "SyncEstimate": "sync_model",
    "SyncLayout": "sync_model",
    "SyncOptions": "sync_model",
    "UpdateStats": "protocol",
    "WeightBroadcaster": "broadcast",
    "WeightPublisher": "filesystem",
    "assemble": "regions",
    "local_pieces": "regions",
    "make_weight_publisher": "publisher",
    "push_weights": "push",
    "read_sharded": "filesystem",
    "write_announcement": "announce",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
