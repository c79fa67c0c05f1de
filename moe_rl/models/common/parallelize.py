"""The trainer-parallelism plumbing the GLM and DeepSeek-V3 families share (``glm4_moe``, ``glm_moe_dsa``,
``deepseek_v3``): each family's ``parallelize_<family>`` checks its model and its context-parallel attention and
calls :func:`parallelize_decoder`, which composes the generic appliers of :mod:`moe_rl.distributed.parallelize`
(whose module docstring gives the layout, the order of application and the gradient reduction).

Shape legend:
    Sl   tokens per row held by this CP rank (the full row is cp * Sl tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh
from moe_rl.distributed.parallelize import (
    ParallelizeSettings,
    apply_ac,
    apply_ep,
    apply_fsdp,
    check_parallel_inputs,
    parallelize_settings,
)

__all__ = ["parallelize_decoder"]


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    mesh: ParallelMesh,
    options: dict[str, Any],
    *,
    where: str,
    config_cls: type,
    model_name: str,
    cp_methods: tuple[str, ...],
    apply_context_parallel: Callable[[nn.Module, ParallelDims, ParallelMesh, ParallelizeSettings], None],
    other_family: str = "",
    cp_note: str = "",
    mtp_layers: Sequence[nn.Module] = (),
    forward_methods: tuple[str, ...] = ("token_logprobs",),
) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to a causal LM of a family in place, in this order:

    1. EP (:func:`~moe_rl.distributed.parallelize.apply_ep`) on every MoE decoder and MTP layer;
    2. CP when ``dims.cp > 1``: ``apply_context_parallel(model, dims, mesh, settings)`` (the family's attention);
    3. AC (:func:`~moe_rl.distributed.parallelize.apply_ac`) on every decoder layer and MTP layer;
    4. FSDP2 (:func:`~moe_rl.distributed.parallelize.apply_fsdp`): experts, one group per decoder layer, one per
       MTP layer holding the modules its ``forward`` runs (``input_layernorm``, ``self_attn``,
       ``post_attention_layernorm``, ``mlp``), the root (embedding, final norm, LM head and the MTP layers' other
       modules); ``forward_methods`` are registered as FSDP forward methods of the root.

    Args:
        model: the family's causal LM (``config``, ``layers``; CPU, its device, or meta).
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        options: the call's :class:`moe_rl.distributed.parallelize.ParallelizeOptions` keywords.
        where: the family's function name, for errors. config_cls: the family's config class (``model.config``
            must be one). model_name: the model class, for errors. other_family: a hint appended to the type error
            (where the other families' function is). cp_note: why only ``cp_methods``, for the error.
        cp_methods: the ``cp_method`` values the family supports; the first is the default.
        apply_context_parallel: sets up the family's context-parallel attention (called when cp > 1).
        mtp_layers: the model's multi-token-prediction layers (``model.mtp_layers``), if any.
        forward_methods: methods of the root registered as FSDP forward methods.

    Returns:
        ``model``, modified in place.

    Raises:
        TypeError: ``model.config`` is not a ``config_cls``, an option that is not a ``ParallelizeOptions`` field,
            wrong argument types, or from ``apply_context_parallel``.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken embedding
            tie, or a ``cp_method`` not in ``cp_methods``.
    """
    # the model's class is not imported by the families (their model.py imports parallelize.py for .parallelize)
    if not isinstance(getattr(model, "config", None), config_cls):
        raise TypeError(f"model must be a {model_name}, got {type(model).__name__}{other_family}")
    opts = parallelize_settings(where, options, cp_default=cp_methods[0])
    check_parallel_inputs(model, dims, mesh, opts.mp_policy)
    if opts.cp_method not in cp_methods:
        supported = " or ".join(repr(m) for m in cp_methods) if len(cp_methods) > 1 else f"only {cp_methods[0]!r}"
        raise ValueError(
            f"cp_method={opts.cp_method!r}: {model_name} supports {supported} context parallelism{cp_note}; pass one of "
            f"them or None ({cp_methods[0]})"
        )
    mtp_layers = list(mtp_layers)  # the unwrapped layers (their FSDP groups are built from them)
    experts = apply_ep([*model.layers, *mtp_layers], dims, mesh)
    if dims.cp > 1:
        apply_context_parallel(model, dims, mesh, opts)
    if opts.activation_checkpointing:
        apply_ac(model.layers)
        if mtp_layers:
            apply_ac(model.mtp_layers)  # mtp_logits reaches enorm, eh_proj, ... through the wrapper
    groups = [[lyr.input_layernorm, lyr.self_attn, lyr.post_attention_layernorm, lyr.mlp] for lyr in mtp_layers]
    apply_fsdp(model, dims, mesh, layers=list(model.layers), expert_modules=experts,
               n_routed_experts=model.config.n_routed_experts, groups=groups, mp_policy=opts.mp_policy,
               reshard_after_forward=opts.reshard_after_forward, force_sum_reduction=opts.force_sum_reduction,
               forward_methods=forward_methods)
    return model
