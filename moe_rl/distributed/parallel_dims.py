"""Trainer parallelism degrees: data-parallel replicate/shard, context parallel and expert parallel.

Layout (torchtitan's convention, ``torchtitan/distributed/parallel_dims.py``): the world is
``dp_replicate x dp_shard x cp`` GPUs. Non-expert parameters are FSDP-sharded over ``dp_shard x cp`` (the ranks
of one context-parallel group hold different tokens of the same sequences, so they can share a parameter shard)
and replicated over ``dp_replicate`` (HSDP). Expert parallelism *borrows* its ranks from ``dp_shard x cp``: each
MoE layer's experts are split over ``ep`` ranks and the expert shards are FSDP-sharded over the remaining
``dp_shard x cp / ep`` ranks ("efsdp").

Mesh (:meth:`ParallelDims.build_mesh`, torchtitan's "unflatten the world" construction): one 1-D world mesh of
``dp_replicate * dp_shard * cp`` ranks, unflattened into three views over the same ranks (rank order: dp_replicate
outermost, cp innermost)::

    dense : (dp_replicate, dp_shard, cp)       -> "cp" is the context-parallel group
    fsdp  : (dp_replicate, dp_shard_cp)        -> FSDP2 mesh of non-expert parameters (HSDP when dp_replicate > 1)
    sparse: (dp_replicate, efsdp, ep)          -> "ep" is the expert-parallel group (consecutive ranks: inside a
                                                  cp group first, then across dp_shard), "efsdp" shards experts

    e.g. dp_shard=2, cp=2, ep=2 (ranks 0..3): cp groups {0,1} {2,3}; dp_shard_cp {0,1,2,3};
         ep groups {0,1} {2,3}; efsdp groups {0,2} {1,3}.

All views share the world mesh as their root, so FSDP2 can combine an ``efsdp`` mesh with an ``ep`` DTensor mesh
(``DeviceMesh._concatenate``) for the expert parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from moe_rl.config import BaseConfig

if TYPE_CHECKING:  # torch.distributed is imported lazily (``import moe_rl`` stays cheap)
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "ParallelMesh"]

_DENSE = ("dp_replicate", "dp_shard", "cp")
_FSDP = ("dp_replicate", "dp_shard_cp")
_SPARSE = ("dp_replicate", "efsdp", "ep")


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
    def dp_size(self) -> int:
        """Data-parallel ranks a gradient is averaged over: every rank, ``dp_replicate * dp_shard * cp`` (the CP
        ranks of one sequence hold different tokens, so they count as data ranks for the gradient reduction)."""
        return self.world_size

    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """Build the device meshes of this layout (a collective: every rank of the default group calls it).

        Args:
            device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); passed to ``init_device_mesh``.

        Returns:
            :class:`ParallelMesh` whose ``mesh[name]`` is the 1-D mesh of ``dp_replicate``, ``dp_shard``, ``cp``,
            ``dp_shard_cp``, ``efsdp``, ``ep`` or ``world``.

        Raises:
            RuntimeError: ``torch.distributed`` is not initialized.
            ValueError: the default group's size is not ``dp_replicate * dp_shard * cp``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build_mesh needs an initialized default process group; call "
                "torch.distributed.init_process_group first (torchrun sets the environment)"
            )
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(
                f"the job has {world} ranks but dp_replicate*dp_shard*cp = {self.dp_replicate}*{self.dp_shard}*"
                f"{self.cp} = {self.world_size}; the product of the degrees must equal the world size (change "
                "dp_shard or the number of processes)"
            )
        world_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
        dense = world_mesh._unflatten(0, (self.dp_replicate, self.dp_shard, self.cp), _DENSE)
        fsdp = world_mesh._unflatten(0, (self.dp_replicate, self.fsdp_size), _FSDP)
        sparse = world_mesh._unflatten(0, (self.dp_replicate, self.efsdp_size, self.ep), _SPARSE)
        return ParallelMesh(self, device_type, world_mesh, dense, fsdp, sparse)

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


@dataclass(frozen=True, eq=False)
class ParallelMesh:
    """The device meshes of one :class:`ParallelDims` layout (built by :meth:`ParallelDims.build_mesh`).

    Attributes:
        dims: the layout.
        device_type: ``"cpu"`` or ``"cuda"``.
        world: 1-D mesh ``("world",)`` of every rank (the root of the views below).
        dense: ``(dp_replicate, dp_shard, cp)``.
        fsdp: ``(dp_replicate, dp_shard_cp)``.
        sparse: ``(dp_replicate, efsdp, ep)``.
    """

    dims: ParallelDims
    device_type: str
    world: DeviceMesh
    dense: DeviceMesh
    fsdp: DeviceMesh
    sparse: DeviceMesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one named dimension.

        Raises:
            KeyError: ``name`` is not one of the dimension names.
        """
        for view in (self.dense, self.fsdp, self.sparse):
            if name in (view.mesh_dim_names or ()):
                return view[name]
        if name == "world":
            return self.world
        raise KeyError(
            f"mesh dimension {name!r} does not exist; use one of "
            f"{sorted({*_DENSE, *_FSDP, *_SPARSE, 'world'})}"
        )

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2 mesh of non-expert parameters: ``dp_shard_cp`` (1-D), or ``(dp_replicate, dp_shard_cp)`` (HSDP)."""
        return self.fsdp if self.dims.dp_replicate > 1 else self.fsdp["dp_shard_cp"]

    @property
    def efsdp_mesh(self) -> DeviceMesh:
        """FSDP2 mesh of expert parameters: ``efsdp`` (1-D), or ``(dp_replicate, efsdp)`` (HSDP)."""
        return self.sparse["dp_replicate", "efsdp"] if self.dims.dp_replicate > 1 else self.sparse["efsdp"]

    @property
    def data_rank(self) -> int:
        """This rank's batch shard, ``dp_replicate_rank * dp_shard + dp_shard_rank`` in ``[0, dp_replicate *
        dp_shard)``; the ``cp`` ranks of one shard hold the same rows (different columns)."""
        return self.coordinate("dp_replicate") * self.dims.dp_shard + self.coordinate("dp_shard")

    def coordinate(self, name: str) -> int:
        """This rank's index along the named dimension (e.g. its CP rank or its data-parallel batch shard)."""
        return self[name].get_local_rank()
