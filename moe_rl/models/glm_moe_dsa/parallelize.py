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

from typing import Unpack

from torch import nn

from moe_rl.attention.mla import MultiheadLatentAttention
from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import ParallelizeOptions, ParallelizeSettings
from moe_rl.models.common.parallelize import parallelize_decoder
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

__all__ = ["parallelize_glm_moe_dsa"]


def _dsa_allgather(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh, opts: ParallelizeSettings) -> None:
    for layer in [*model.layers, *model.mtp_layers]:
        attn = layer.self_attn
        if not (isinstance(attn, MultiheadLatentAttention) and attn.is_dsa):
            raise TypeError(
                f"layer {layer.layer_idx}: context parallelism of GlmMoeDsaForCausalLM needs DSA attention "
                f"(MultiheadLatentAttention with index_topk), got {type(attn).__name__}"
            )
    model.cp_group = mesh["cp"].get_group()  # every layer runs dsa_cp_attention over it


def parallelize_glm_moe_dsa(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh,
                            **options: Unpack[ParallelizeOptions]) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a GLM-5 model in place (also ``model.parallelize(...)``
    and :func:`moe_rl.distributed.parallelize.parallelize_model`).

    Args:
        model: the full :class:`GlmMoeDsaForCausalLM` (CPU, its device, or meta). ``forward``,
            ``forward_full`` (with MTP logits) and ``token_logprobs`` are FSDP entry points.
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        cp_method: ``"dsa_allgather"`` (the default and only choice); used when cp > 1.
        options: the other :class:`moe_rl.distributed.parallelize.ParallelizeOptions`.

    Returns:
        ``model``, modified in place, called as :func:`moe_rl.distributed.parallelize.parallelize_model` describes.

    Raises:
        TypeError: ``model`` is not a ``GlmMoeDsaForCausalLM`` (its ``config`` is not a ``GlmMoeDsaConfig``), a layer without DSA attention under cp > 1, or
            wrong argument types.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` other than ``"dsa_allgather"``.
    """
    return parallelize_decoder(
        model, dims, mesh, options, where="parallelize_glm_moe_dsa", config_cls=GlmMoeDsaConfig,
        model_name="GlmMoeDsaForCausalLM", cp_methods=("dsa_allgather",), apply_context_parallel=_dsa_allgather,
        cp_note=" (MLA + DSA: one shared latent KV head; the top-k needs every key)",
        mtp_layers=getattr(model, "mtp_layers", ()),
        forward_methods=("forward_full", "token_logprobs"),
        other_family="; GlmMoeForCausalLM has moe_rl.models.glm4_moe.parallelize.parallelize_glm4_moe",
    )
