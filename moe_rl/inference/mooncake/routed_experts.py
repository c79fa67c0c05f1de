"""Routed-experts records (router replay, R3) through the Mooncake Store, as opaque bytes keyed by rollout.

The inference side puts one :class:`moe_rl.replay.indices.RoutedExperts` record per rollout (``[S, L, K]``
expert ids, encoded with ``TokenIndices.to_bytes``, bit-packed by default); the trainer gets them back by
rollout id when it assembles the batch. Key (:mod:`moe_rl.inference.mooncake.keys`)::

    moe_rl|k1|routed_experts|<model>|v<policy version>|mrix1|<shard>|<rollout id>|p0

``mrix1`` names the codec (``MRIX`` wire format version 1). The policy version that generated the rollout
is part of the key, so rollout ids may repeat across versions. Objects are not pinned: they are evictable
cache entries; the trainer removes them after use (:meth:`RoutedExpertsStore.remove`), and a record the
master evicted first is reported as missing (``MissingKeyError``), never as something else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from moe_rl.inference.mooncake.keys import StoreKey
from moe_rl.inference.mooncake.store import PutReport, StoreClient
from moe_rl.replay.indices import TokenIndices

__all__ = ["CODEC", "RoutedExpertsStore"]

CODEC = "mrix1"


class RoutedExpertsStore:
    """Put/get routed-experts records by rollout id.

    Args:
        client: a connected :class:`StoreClient`.
        model: model id used in the keys.
        shard: ``"<rank>of<world>"`` when several engines record disjoint layer ranges (default whole model).
        packed: bit-pack the ids (``ceil(log2 E)`` bits each) instead of raw ``uint8``/``int16``.
    """

    def __init__(self, client: StoreClient, model: str, *, shard: str = "0of1", packed: bool = True) -> None:
        self.client = client
        self.model = model
        self.shard = shard
        self.packed = packed
        self.key("probe", 0)  # validates model and shard

    def key(self, rollout_id: str, version: int) -> StoreKey:
        """The key of one rollout's record (ValueError if ``rollout_id`` holds ``|`` or whitespace)."""
        return StoreKey(kind="routed_experts", model=self.model, dtype=CODEC, name=rollout_id, version=version,
                        shard=self.shard)

    def put_step(self, records: Mapping[str, TokenIndices], *, version: int) -> PutReport:
        """Store the records of a whole step (rollout id -> record) in one batched put; idempotent for a
        rollout re-sent with the same record, ValueError for a different one.

        Raises:
            TypeError: a value is not a ``TokenIndices`` record.
            ValueError: conflicting record, or an encoded record larger than ``client.max_object_bytes``.
            StoreError: Mooncake error (e.g. -900 master unreachable).
        """
        items = []
        for rid, rec in records.items():
            if not isinstance(rec, TokenIndices):
                raise TypeError(f"put_step: records[{rid!r}] has type {type(rec).__name__}; expected RoutedExperts")
            items.append((self.key(rid, version), rec.to_bytes(packed=self.packed)))
        return self.client.put_batch(items)

    def put(self, rollout_id: str, record: TokenIndices, *, version: int) -> PutReport:
        """Store one rollout's record (see :meth:`put_step`)."""
        return self.put_step({rollout_id: record}, version=version)

    def get_step(self, rollout_ids: Iterable[str], *, version: int) -> dict[str, TokenIndices]:
        """The records of these rollouts (one batched get), decoded and validated.

        Raises:
            MissingKeyError: some records are absent (its ``keys`` name them all).
            ValueError: a payload does not decode (corrupt or foreign bytes).
            StoreError: Mooncake error.
        """
        ids = list(rollout_ids)
        blobs = self.client.get_batch([self.key(r, version) for r in ids])
        return {rid: TokenIndices.from_bytes(b) for rid, b in zip(ids, blobs, strict=True)}

    def get(self, rollout_id: str, *, version: int) -> TokenIndices:
        """One rollout's record (see :meth:`get_step`)."""
        return self.get_step([rollout_id], version=version)[rollout_id]

    def remove(self, rollout_ids: Iterable[str], *, version: int) -> int:
        """Remove these rollouts' records (after the trainer consumed them); returns how many existed.
        Leases from the trainer's own get are overridden."""
        return sum(self.client.remove(self.key(r, version), force=True) for r in rollout_ids)

