"""Trainer parallelism of :class:`GlmMoeForCausalLM` (GLM-4.5/4.6/4.7): expert parallelism for the MoE layers,
ring or Ulysses context parallelism for the GQA attention, optional activation checkpointing, FSDP2 for
everything, composed from the generic appliers of :mod:`moe_rl.distributed.parallelize` (whose module docstring
gives the layout, the order of application and the gradient reduction).

Shape legend:
    B    sequences (rows) on this rank's data shard
    Sl   tokens per row held by this CP rank (the full row is cp * Sl tokens)
"""

from __future__ import annotations

from typing import Unpack

from torch import nn

from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import ParallelizeOptions, ParallelizeSettings, apply_cp
from moe_rl.models.common.parallelize import parallelize_decoder
from moe_rl.models.glm4_moe.config import GlmMoeConfig

__all__ = ["parallelize_glm4_moe"]

_CP_ATTENTION_NEEDS = ("project_qkv", "o_proj", "num_heads", "head_dim")


def _gqa_context_parallel(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh, opts: ParallelizeSettings) -> None:
    for layer in model.layers:
        missing = [n for n in _CP_ATTENTION_NEEDS if not hasattr(layer.self_attn, n)]
        if missing:
            raise TypeError(
                f"layer {layer.layer_idx}: expected GlmMoeAttention, got {type(layer.self_attn).__name__} "
                f"(lacks {missing}, which context-parallel attention calls)"
            )
    apply_cp([layer.self_attn for layer in model.layers], dims, mesh, opts.cp_method)


def parallelize_glm4_moe(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh,
                         **options: Unpack[ParallelizeOptions]) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a GLM-4.5 model in place (also
    ``model.parallelize(...)`` and :func:`moe_rl.distributed.parallelize.parallelize_model`).

    :func:`moe_rl.models.common.parallelize.parallelize_decoder` applies EP, CP, AC and FSDP2 in that order (a tied
    embedding is one parameter of the root group); CP (:func:`~moe_rl.distributed.parallelize.apply_cp`) makes every
    :class:`GlmMoeAttention` compute on its ``Sl`` tokens with ring or Ulysses attention over ``mesh["cp"]``.
    ``token_logprobs`` (the trainer's chunked head) is registered as an FSDP forward method.

    Args:
        model: the full :class:`GlmMoeForCausalLM` (CPU, its device, or meta; see
            :func:`moe_rl.distributed.parallelize.parallelize_model` for the meta-device sequence).
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        cp_method: ``"ring"`` (:func:`moe_rl.attention.ring_attention`, the default) or ``"ulysses"``; used when
            cp > 1.
        options: the other :class:`moe_rl.distributed.parallelize.ParallelizeOptions`.

    Returns:
        ``model``, modified in place, called as :func:`moe_rl.distributed.parallelize.parallelize_model` describes.

    Raises:
        TypeError: ``model`` is not a ``GlmMoeForCausalLM`` (its ``config`` is not a ``GlmMoeConfig``), a layer's
            attention lacks what context-parallel attention calls (``project_qkv``, ``o_proj``, ``num_heads``,
            ``head_dim``: a ``GlmMoeAttention`` has them), or wrong argument types.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` other than ring / ulysses.
    """
    return parallelize_decoder(
        model, dims, mesh, options, where="parallelize_glm4_moe", config_cls=GlmMoeConfig,
        model_name="GlmMoeForCausalLM", cp_methods=("ring", "ulysses"), apply_context_parallel=_gqa_context_parallel,
        other_family="; GlmMoeDsaForCausalLM has moe_rl.models.glm_moe_dsa.parallelize.parallelize_glm_moe_dsa",
    )
