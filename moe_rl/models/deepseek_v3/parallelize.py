"""Trainer parallelism of :class:`~moe_rl.models.deepseek_v3.DeepseekV3ForCausalLM` (DeepSeek-V3 / Kimi-K2):
expert parallelism for the MoE layers, ring or Ulysses context parallelism for the dense MLA attention, optional
activation checkpointing, FSDP2 for everything, composed from the generic appliers of
:mod:`moe_rl.distributed.parallelize` (whose module docstring gives the layout, the order of application and the
gradient reduction).

Shape legend:
    B    sequences (rows) on this rank's data shard
    Sl   tokens per row held by this CP rank (the full row is cp * Sl tokens)
"""

from __future__ import annotations

from typing import Unpack

from torch import nn

from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import ParallelizeOptions, ParallelizeSettings
from moe_rl.models.common.parallelize import parallelize_decoder
from moe_rl.models.deepseek_v3.config import DeepseekV3Config

__all__ = ["parallelize_deepseek_v3"]


def _ring_or_ulysses(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh, opts: ParallelizeSettings) -> None:
    model.cp_group = mesh["cp"].get_group()  # every MLA layer runs its dense form over it
    model.cp_method = opts.cp_method


def parallelize_deepseek_v3(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh,
                            **options: Unpack[ParallelizeOptions]) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a DeepSeek-V3 model in place (also
    ``model.parallelize(...)`` and :func:`moe_rl.distributed.parallelize.parallelize_model`).

    :func:`moe_rl.models.common.parallelize.parallelize_decoder` applies EP, CP, AC and FSDP2 in that order; CP sets
    the model's ``cp_group`` / ``cp_method``, so every MLA layer runs its dense form with
    :func:`moe_rl.attention.ring_attention` or :func:`moe_rl.attention.ulysses_attention` over ``mesh["cp"]``.
    ``token_logprobs`` is registered as an FSDP forward method.

    Args:
        model: the full :class:`~moe_rl.models.deepseek_v3.DeepseekV3ForCausalLM` (CPU, its device, or meta).
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        cp_method: ``"ring"`` (the default) or ``"ulysses"``; used when cp > 1.
        options: the other :class:`moe_rl.distributed.parallelize.ParallelizeOptions` (activation checkpointing,
            FSDP2 mixed precision, ``reshard_after_forward``, ``force_sum_reduction``).

    Returns:
        ``model`` (modified in place): call it with this rank's rows and, when cp > 1, this rank's columns and their
        absolute ``positions`` (:func:`moe_rl.distributed.parallelize.shard_for_context_parallel`).

    Raises:
        TypeError: ``model`` is not a ``DeepseekV3ForCausalLM`` (its ``config`` is not a ``DeepseekV3Config``), or
            wrong argument types or an option that is not a ``ParallelizeOptions`` field.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` other than ring / ulysses.
    """
    return parallelize_decoder(
        model, dims, mesh, options, where="parallelize_deepseek_v3", config_cls=DeepseekV3Config,
        model_name="DeepseekV3ForCausalLM", cp_methods=("ring", "ulysses"),
        apply_context_parallel=_ring_or_ulysses,
    )
