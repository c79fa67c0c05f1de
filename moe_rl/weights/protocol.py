"""What every weight transport provides: a trainer-side :class:`Publisher` and an engine-side :class:`Loader`.

Trainer side: every trainer rank calls ``publisher.publish(model, version)`` after its optimizer step (a collective
over the trainer ranks for the sharded transports; a plain state dict is accepted on a single rank). A publisher
takes the model's sharded DTensors as they are and never gathers the full model on one rank; each rank ships its
own pieces (:mod:`moe_rl.weights.regions`). It returns :class:`UpdateStats`, and rank 0 announces the version
(:mod:`moe_rl.weights.announce`).

Engine side: a :class:`Loader` delivers a whole version as ``[(hf_name, tensor)]`` or raises; only then are the
tensors swapped into the engine (``moe_rl.weights.engine.WeightSyncExtension``), so an engine never serves a mix
of two versions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Loader", "Publisher", "UpdateStats"]


@dataclass
class UpdateStats:
    """One publication, as seen by one trainer rank.

    Attributes:
        version: the policy version.
        transport: ``"filesystem"``, ``"broadcast"``, ``"p2p"`` or ``"mooncake"``.
        blocking_s: seconds this rank spent inside ``publish`` (the trainer's blocking time for this update: the
            next step cannot start before it returns).
        bytes: bytes this rank wrote or sent.
        bytes_total: bytes of the whole version (all ranks; filled on rank 0, else 0).
        tensors: pieces (or tensors) this rank published.
        extra: transport-specific numbers (paths, buckets, per-phase seconds).
    """

    version: int
    transport: str
    blocking_s: float = 0.0
    bytes: int = 0
    bytes_total: int = 0
    tensors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Publisher(Protocol):
    """Trainer side of a transport (one instance per trainer rank)."""

    name: str

    def publish(self, model_or_state: Any, version: int) -> UpdateStats:
        """Publish ``version`` (a model with sharded DTensors, or ``{hf_name: tensor}`` on one rank)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Loader(Protocol):
    """Engine side of a transport: a complete, verified version or an exception (nothing partial)."""

    name: str

    def load(self, version: int) -> list[tuple[str, Any]]: ...
