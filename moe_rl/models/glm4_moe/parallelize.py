"""Trainer parallelism of :class:`GlmMoeForCausalLM` (GLM-4.5/4.6/4.7): expert parallelism for the MoE layers,
ring or Ulysses context parallelism for the GQA attention, optional activation checkpointing, FSDP2 for
everything, composed from the generic appliers of :mod:`moe_rl.distributed.parallelize` (whose module docstring
gives the layout, the order of application and the gradient reduction).

Shape legend:
    B    sequences (rows) on this rank's data shard
    Sl   tokens per row held by this CP rank (the full row is cp * Sl tokens)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from torch import nn

from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import apply_ac, apply_cp, apply_ep, apply_fsdp, check_parallel_inputs
from moe_rl.models.glm4_moe.config import GlmMoeConfig

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["parallelize_glm4_moe"]

_CP_ATTENTION_NEEDS = ("project_qkv", "o_proj", "num_heads", "head_dim")


def parallelize_glm4_moe(
    model: nn.Module,
    dims: ParallelDims,
    mesh: ParallelMesh,
    *,
    activation_checkpointing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    cp_method: Literal["ring", "ulysses"] | None = None,
    reshard_after_forward: bool = True,
    force_sum_reduction: bool | None = None,
) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a GLM-4.5 model in place (also
    ``model.parallelize(...)`` and :func:`moe_rl.distributed.parallelize.parallelize_model`).

    1. EP (:func:`~moe_rl.distributed.parallelize.apply_ep`) on every MoE decoder layer;
    2. CP (:func:`~moe_rl.distributed.parallelize.apply_cp`): every :class:`GlmMoeAttention` computes on its
       ``Sl`` tokens with ring or Ulysses attention over ``mesh["cp"]``;
    3. AC (:func:`~moe_rl.distributed.parallelize.apply_ac`) on every decoder layer;
    4. FSDP2 (:func:`~moe_rl.distributed.parallelize.apply_fsdp`): experts, one group per decoder layer, the root
       (embedding, final norm, LM head; a tied embedding is one parameter there); ``token_logprobs`` (the
       trainer's chunked head) is registered as an FSDP forward method.

    Args:
        model: the full :class:`GlmMoeForCausalLM` (CPU, its device, or meta; see
            :func:`moe_rl.distributed.parallelize.parallelize_model` for the meta-device sequence).
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        activation_checkpointing: recompute each decoder layer in backward.
        mp_policy: FSDP2 mixed precision for every group (``None``: the parameters' dtype throughout).
        cp_method: ``"ring"`` (:func:`moe_rl.attention.ring_attention`, the default) or ``"ulysses"``; used when
            cp > 1.
        reshard_after_forward: FSDP2's option for the decoder layers and the experts.
        force_sum_reduction: reduce gradients with SUM and divide afterwards; default True on ``"cpu"`` meshes.

    Returns:
        ``model`` (modified in place): call it with this rank's rows and, when cp > 1, this rank's columns and their
        absolute ``positions`` (:func:`moe_rl.distributed.parallelize.shard_for_context_parallel`).

    Raises:
        TypeError: ``model`` is not a ``GlmMoeForCausalLM`` (its ``config`` is not a ``GlmMoeConfig``), a layer's
            attention lacks what context-parallel attention calls (``project_qkv``, ``o_proj``, ``num_heads``,
            ``head_dim``: a ``GlmMoeAttention`` has them), or wrong argument types.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` other than ring / ulysses.
    """
    # the model's class is not imported here (model.py imports this module for GlmMoeForCausalLM.parallelize)
    if not isinstance(getattr(model, "config", None), GlmMoeConfig):
        raise TypeError(f"model must be a GlmMoeForCausalLM, got {type(model).__name__}; GlmMoeDsaForCausalLM "
                        "has moe_rl.models.glm_moe_dsa.parallelize.parallelize_glm_moe_dsa")
    cp_method = "ring" if cp_method is None else cp_method
    check_parallel_inputs(model, dims, mesh, mp_policy)
    if cp_method not in ("ring", "ulysses"):
        raise ValueError(f"cp_method={cp_method!r} is not supported; use 'ring' or 'ulysses'")

    experts = apply_ep(model.layers, dims, mesh)
    if dims.cp > 1:
        for layer in model.layers:
            missing = [n for n in _CP_ATTENTION_NEEDS if not hasattr(layer.self_attn, n)]
            if missing:
                raise TypeError(
                    f"layer {layer.layer_idx}: expected GlmMoeAttention, got {type(layer.self_attn).__name__} "
                    f"(lacks {missing}, which context-parallel attention calls)"
                )
        apply_cp([layer.self_attn for layer in model.layers], dims, mesh, cp_method)
    if activation_checkpointing:
        apply_ac(model.layers)
    apply_fsdp(model, dims, mesh, layers=list(model.layers), expert_modules=experts,
               n_routed_experts=model.config.n_routed_experts, mp_policy=mp_policy,
               reshard_after_forward=reshard_after_forward, force_sum_reduction=force_sum_reduction,
               forward_methods=("token_logprobs",))
    return model
