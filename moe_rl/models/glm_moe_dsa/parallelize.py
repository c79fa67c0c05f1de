"""Trainer parallelism of :class:`GlmMoeDsaForCausalLM` (GLM-5/5.1: MLA + DSA attention, MTP layers): expert
parallelism for the MoE layers, all-gather context parallelism for the DSA attention, optional activation
checkpointing, FSDP2 for everything, composed from the generic appliers of :mod:`moe_rl.distributed.parallelize`
(whose module docstring gives the layout, the order of application and the gradient reduction).

Shape legend:
    Sl   tokens per row held by this CP rank (the full row is cp * Sl tokens)

Context parallelism: ring / Ulysses do not fit MLA + DSA (MQA-mode MLA has one latent KV head, and the top-k needs
every key's indexer score), so the model's ``cp_group`` is set and every layer runs
:func:`moe_rl.attention.dsa_cp_attention` (all-gather CP of the latent KV and indexer keys; prime-rl v0.6.0 /
slime ``--allgather-cp``); ``cp_method`` is ``"dsa_allgather"``.

MTP layers get EP, AC and FSDP like the decoder layers; their FSDP group holds the modules the layer's ``forward``
runs (input_layernorm, self_attn, post_attention_layernorm, mlp); enorm, hnorm, eh_proj and shared_head are used
by ``mtp_logits`` outside that forward, so they stay in the root group, and ``forward_full`` is registered as an
FSDP forward method of the root (before ``token_logprobs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from torch import nn

from moe_rl.attention.mla import MultiheadLatentAttention
from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import apply_ac, apply_ep, apply_fsdp, check_parallel_inputs
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["parallelize_glm_moe_dsa"]


def parallelize_glm_moe_dsa(
    model: nn.Module,
    dims: ParallelDims,
    mesh: ParallelMesh,
    *,
    activation_checkpointing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    cp_method: Literal["dsa_allgather"] | None = None,
    reshard_after_forward: bool = True,
    force_sum_reduction: bool | None = None,
) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a GLM-5 model in place (also ``model.parallelize(...)``
    and :func:`moe_rl.distributed.parallelize.parallelize_model`).

    Args:
        model: the full :class:`GlmMoeDsaForCausalLM` (CPU, its device, or meta). ``forward``,
            ``forward_full`` (with MTP logits) and ``token_logprobs`` are FSDP entry points.
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        activation_checkpointing: recompute each decoder layer and MTP layer in backward.
        mp_policy: FSDP2 mixed precision for every group (``None``: the parameters' dtype throughout).
        cp_method: ``"dsa_allgather"`` (the default and only choice); used when cp > 1.
        reshard_after_forward: FSDP2's option for the decoder layers and the experts.
        force_sum_reduction: reduce gradients with SUM and divide afterwards; default True on ``"cpu"`` meshes.

    Returns:
        ``model`` (modified in place): call it with this rank's rows and, when cp > 1, this rank's columns and their
        absolute ``positions`` (:func:`moe_rl.distributed.parallelize.shard_for_context_parallel`).

    Raises:
        TypeError: ``model`` is not a ``GlmMoeDsaForCausalLM`` (its ``config`` is not a ``GlmMoeDsaConfig``), a layer without DSA attention under cp > 1, or
            wrong argument types.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` other than ``"dsa_allgather"``.
    """
    # the model's class is not imported here (model.py imports this module for GlmMoeDsaForCausalLM.parallelize)
    if not isinstance(getattr(model, "config", None), GlmMoeDsaConfig):
        raise TypeError(f"model must be a GlmMoeDsaForCausalLM, got {type(model).__name__}; GlmMoeForCausalLM has "
                        "moe_rl.models.glm4_moe.parallelize.parallelize_glm4_moe")
    cp_method = "dsa_allgather" if cp_method is None else cp_method
    check_parallel_inputs(model, dims, mesh, mp_policy)
    if cp_method != "dsa_allgather":
        raise ValueError(
            f"cp_method={cp_method!r}: GlmMoeDsaForCausalLM (MLA + DSA) supports only 'dsa_allgather' context "
            "parallelism (one shared latent KV head; the top-k needs every key); pass cp_method=None or "
            "'dsa_allgather'"
        )
    mtp_layers = list(model.mtp_layers)  # the unwrapped layers (their FSDP groups are built from them)

    experts = apply_ep([*model.layers, *mtp_layers], dims, mesh)
    if dims.cp > 1:
        for layer in [*model.layers, *mtp_layers]:
            attn = layer.self_attn
            if not (isinstance(attn, MultiheadLatentAttention) and attn.is_dsa):
                raise TypeError(
                    f"layer {layer.layer_idx}: context parallelism of GlmMoeDsaForCausalLM needs DSA attention "
                    f"(MultiheadLatentAttention with index_topk), got {type(attn).__name__}"
                )
        model.cp_group = mesh["cp"].get_group()  # every layer runs dsa_cp_attention over it
    if activation_checkpointing:
        apply_ac(model.layers)
        apply_ac(model.mtp_layers)  # mtp_logits reaches enorm, eh_proj, ... through the wrapper
    groups = [[lyr.input_layernorm, lyr.self_attn, lyr.post_attention_layernorm, lyr.mlp] for lyr in mtp_layers]
    apply_fsdp(model, dims, mesh, layers=list(model.layers), expert_modules=experts,
               n_routed_experts=model.config.n_routed_experts, groups=groups, mp_policy=mp_policy,
               reshard_after_forward=reshard_after_forward, force_sum_reduction=force_sum_reduction,
               forward_methods=("forward_full", "token_logprobs"))
    return model
