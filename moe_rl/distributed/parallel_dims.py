"""Trainer parallelism degrees: data-parallel replicate/shard, context parallel and expert parallel.

Layout (torchtitan's convention, ``torchtitan/distributed/parallel_dims.py``): the world is
``dp_replicate x dp_shard x cp`` GPUs. Non-expert parameters are FSDP-sharded over ``dp_shard x cp`` (the ranks
of one context-parallel group hold different tokens of the same sequences, so they can share a parameter shard)
and replicated over ``dp_replicate`` (HSDP). Expert parallelism *borrows* its ranks from ``dp_shard x cp``: each
MoE layer's experts are split over ``ep`` ranks and the expert shards are FSDP-sharded over the remaining
``dp_shard x cp / ep`` ranks ("efsdp").
"""

from __future__ import annotations

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig

__all__ = ["ParallelDims"]


class ParallelDims(BaseConfig):
    """Parallelism degrees of one training job.

    Raises (at construction):
        ValueError: ``ep`` does not divide ``dp_shard * cp``; the message names the values and the rule.
    """

    dp_replicate: int = Field(1, ge=1)
    """Replicas of the (sharded) model (HSDP outer dimension); gradients are all-reduced across them."""
    dp_shard: int = Field(1, ge=1)
    """FSDP2 shard degree for parameters, gradients and optimizer state."""
    cp: int = Field(1, ge=1)
    """Context-parallel degree: each sequence's tokens are split over this many ranks."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree, borrowed from ``dp_shard x cp``."""

    @model_validator(mode="after")
    def _check(self) -> ParallelDims:
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard*cp = {self.dp_shard}*{self.cp} = {self.dp_shard * self.cp} "
                "(expert parallelism borrows its ranks from the FSDP x CP ranks); change ep or dp_shard"
            )
        return self

    @property
    def world_size(self) -> int:
        """GPUs in the job: ``dp_replicate * dp_shard * cp``."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def fsdp_size(self) -> int:
        """Ranks a non-expert parameter is sharded over: ``dp_shard * cp``."""
        return self.dp_shard * self.cp

    @property
    def efsdp_size(self) -> int:
        """Ranks an expert shard is FSDP-sharded over after EP: ``dp_shard * cp / ep``."""
        return self.fsdp_size // self.ep
