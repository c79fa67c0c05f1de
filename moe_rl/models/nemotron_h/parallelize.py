"""Trainer parallelism of :class:`~moe_rl.models.nemotron_h.NemotronHForCausalLM` (Nemotron-H / Nemotron-3 hybrid):
expert parallelism for the latent MoE layers, context parallelism for the Mamba-2 and attention layers, optional
activation checkpointing, FSDP2 for everything, composed from the generic appliers of
:mod:`moe_rl.distributed.parallelize` (whose module docstring gives the order of application and the gradient
reduction).

Shape legend:
    B    sequences (rows) on this rank's data shard
    S    tokens per row of the full sequence (padded to a multiple of cp)
    Sl   tokens per row held by this CP rank, S = cp * Sl

Layout, in the order applied::

    1. EP   every MoE layer's mixer -> NemotronHExpertParallelMoE over mesh["ep"] (its own block: the generic
            ExpertParallelMoE holds gated SwiGLU experts, these are ungated squared-ReLU experts behind latent
            projections); the expert stacks up_proj [E, F, L] / down_proj [E, L, F] become DTensors Shard(0) on
            the EP mesh with their global shapes; the token-slots travel in the latent width L
    2. CP   the model's cp_group / cp_method are set; every row is split into cp *contiguous* slices, rank r
            holding positions [r Sl, (r + 1) Sl) (shard_for_context_parallel(..., layout="contiguous"),
            NemotronHForCausalLM.cp_layout):
              Mamba-2 layers  conv halo (the previous rank's last conv_kernel - 1 inputs) and recurrent state
                              passed from rank r to r + 1 (moe_rl.ssm.ssd_scan_cp: one all-gather of
                              (log-decay, end state) pairs per layer, independent of Sl)
              attention       ring or Ulysses attention over mesh["cp"] with the absolute positions as token
                              indices (no rotary embedding: the positions only build the causal mask)
              MLP / MoE       per token, unchanged
            Why contiguous and not zigzag: the state-passing scan composes each rank's slice as one affine map of
            the state, applied in rank order, so a rank must hold one unbroken stretch of the sequence; zigzag
            gives each rank two distant chunks and would need a second state pass and a halo per chunk. The price
            is causal-attention imbalance (rank r does ~ (2 r + 1) / cp^2 of the attention work); the attention
            layers are a small fraction of a Nemotron-H stack.
    3. AC   each layer is wrapped with torch's checkpoint_wrapper (full recompute)
    4. FSDP fully_shard(experts, efsdp mesh) per MoE layer (ep > 1); fully_shard(layer, dp_shard_cp) per layer;
            fully_shard(model) for embeddings, norm_f and lm_head; token_logprobs registered as a forward method

Not supported under CP: packed rows (``cu_seqlens``; the state would have to restart inside a row).
"""

from __future__ import annotations

from typing import Unpack

from torch import nn

from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import (
    ParallelizeOptions,
    apply_ac,
    apply_ep,
    apply_fsdp,
    check_parallel_inputs,
    parallelize_settings,
)
from moe_rl.models.nemotron_h.config import NemotronHConfig

__all__ = ["apply_nemotron_h_ep", "parallelize_nemotron_h"]

_CP_METHODS = ("ring", "ulysses")


def apply_nemotron_h_ep(layers: nn.ModuleList, dims: ParallelDims, mesh: ParallelMesh) -> list[nn.Module]:
    """Expert parallelism of every MoE layer (``layer.is_moe``): its ``mixer`` becomes a
    :class:`moe_rl.models.nemotron_h.ep.NemotronHExpertParallelMoE` over ``mesh["ep"]`` when ``dims.ep > 1``,
    whose expert stacks are DTensors ``Shard(0)`` on the EP mesh with the global ``[E, ...]`` shapes.

    Returns:
        The expert modules (one per MoE layer, in order) for
        :func:`moe_rl.distributed.parallelize.apply_fsdp`'s expert groups.
    """
    from moe_rl.models.nemotron_h.ep import NemotronHExpertParallelMoE

    return apply_ep(layers, dims, mesh, block_attr="mixer", ep_block=NemotronHExpertParallelMoE,
                    expert_params=("up_proj", "down_proj"))


def parallelize_nemotron_h(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh,
                           **options: Unpack[ParallelizeOptions]) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a Nemotron-H model in place (also
    ``model.parallelize(...)`` and :func:`moe_rl.distributed.parallelize.parallelize_model`); the module docstring
    gives the layout.

    Args:
        model: the full :class:`~moe_rl.models.nemotron_h.NemotronHForCausalLM` (CPU, its device, or meta: see
            :func:`moe_rl.distributed.parallelize.parallelize_model` for the meta-device sequence).
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        cp_method: attention under CP, ``"ring"`` (:func:`moe_rl.attention.ring_attention`, the default) or
            ``"ulysses"`` (:func:`moe_rl.attention.ulysses_attention`); used when cp > 1. The Mamba-2 layers always
            pass their state (:func:`moe_rl.ssm.ssd_scan_cp`).
        options: the other :class:`moe_rl.distributed.parallelize.ParallelizeOptions` (activation checkpointing,
            FSDP2 mixed precision, ``reshard_after_forward``, ``force_sum_reduction``).

    Returns:
        ``model`` (modified in place): call it with this rank's rows and, when cp > 1, this rank's contiguous
        columns and their absolute ``positions``
        (``shard_for_context_parallel(x, cp, cp_rank, layout=model.cp_layout)``; ``replay_ids`` with
        ``pad_value=-1``); each CP rank must hold at least ``conv_kernel - 1`` columns.

    Raises:
        TypeError: ``model`` is not a ``NemotronHForCausalLM`` (its ``config`` is not a ``NemotronHConfig``), an
            option that is not a ``ParallelizeOptions`` field, or wrong argument types.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` other than ring / ulysses.
    """
    if not isinstance(getattr(model, "config", None), NemotronHConfig):
        raise TypeError(f"model must be a NemotronHForCausalLM, got {type(model).__name__}")
    opts = parallelize_settings("parallelize_nemotron_h", options, cp_default=_CP_METHODS[0])
    check_parallel_inputs(model, dims, mesh, opts.mp_policy, embedding="embeddings")
    if opts.cp_method not in _CP_METHODS:
        raise ValueError(f"cp_method={opts.cp_method!r}: NemotronHForCausalLM supports 'ring' or 'ulysses' context "
                         "parallelism for its GQA attention (its Mamba-2 layers pass the state between CP ranks "
                         "either way); pass one of them or None (ring)")
    experts = apply_nemotron_h_ep(model.layers, dims, mesh)
    if dims.cp > 1:
        model.cp_group = mesh["cp"].get_group()
        model.cp_method = opts.cp_method
    if opts.activation_checkpointing:
        apply_ac(model.layers)
    apply_fsdp(model, dims, mesh, layers=list(model.layers), expert_modules=experts,
               n_routed_experts=model.config.n_routed_experts, mp_policy=opts.mp_policy,
               reshard_after_forward=opts.reshard_after_forward, force_sum_reduction=opts.force_sum_reduction,
               forward_methods=("token_logprobs",))
    return model
