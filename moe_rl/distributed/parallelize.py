"""Generic trainer parallelism of a :class:`ParallelDims` layout: the appliers a model family's ``parallelize``
function composes (``moe_rl.models.glm4_moe.parallelize``, ``moe_rl.models.glm_moe_dsa.parallelize``; torchtitan
keeps one ``parallelize.py`` per model family over a generic ``distributed`` package the same way). This module imports
no model family: the family selects the modules (decoder layers, attention blocks, expert modules, FSDP groups)
and passes them in; :func:`parallelize_model` dispatches to the model's own ``parallelize`` method.

Shape legend:
    B    sequences (rows) on this rank's data shard
    S    tokens per row of the full sequence (padded to a multiple of 2*cp for zigzag)
    Sl   tokens per row held by this CP rank, S = cp * Sl
    H    query heads, Hkv key/value heads, Dh head dim
    E    routed experts, L = E / ep local experts per EP rank

Appliers: :func:`check_parallel_inputs`, :func:`apply_ep`, :func:`apply_cp` (ring / Ulysses GQA attention),
:func:`apply_ac`, :func:`apply_fsdp`; and :func:`shard_for_context_parallel`, :func:`mixed_precision_policy`,
:func:`clip_grad_norm_`.

Order of application (torchtitan ``models/deepseek_v3/infra/parallelize.py``: EP, then activation checkpointing,
then FSDP; the facts carry over, the code is ours)::

    1. EP   every MoE block -> ExpertParallelMoE over mesh["ep"]; its expert weights become DTensors
            Shard(0) on mesh["ep"] with the global shape [E, ...] (so a checkpoint reshards to any ep); the
            experts are a LocalExperts module called by the block, so FSDP2's hooks on them run
    2. CP   every attention computes on its Sl tokens: q/k/v ``[B, Sl, H, Dh]`` go through ring_attention or
            ulysses_attention over mesh["cp"] as B batched rows (each row its own causal sequence of S tokens,
            token indices = the absolute positions the caller passes, see :func:`shard_for_context_parallel`;
            cost B * S^2 / cp per rank, one mask for all rows, one message per hop / all-to-all for all rows)
            glm_moe_dsa (MLA + DSA): ring / Ulysses do not fit (MQA-mode MLA has one latent KV head, and the
            top-k needs every key's indexer score), so the model's ``cp_group`` is set and every layer runs
            :func:`moe_rl.attention.dsa_cp_attention` (all-gather CP of the latent KV and indexer keys;
            prime-rl v0.6.0 / slime ``--allgather-cp``); ``cp_method`` is ``"dsa_allgather"``
    3. AC   each decoder layer is wrapped with torch's ``checkpoint_wrapper`` (full recompute)
    4. FSDP fully_shard(experts, mesh efsdp [+ dp_replicate]); fully_shard(layer, mesh dp_shard_cp [+ dp_replicate])
            per decoder layer; fully_shard(model) for embed_tokens, norm and lm_head. A tied embedding /
            lm_head weight is one parameter in the root group: sharded once, its gradient is the sum of both
            uses (verl-project/verl PR #7835). glm_moe_dsa MTP layers: one group per layer of the modules its
            ``forward`` runs (input_layernorm, self_attn, post_attention_layernorm, mlp); enorm, hnorm, eh_proj
            and shared_head are used by ``mtp_logits`` outside that forward, so they stay in the root group,
            and ``forward_full`` is registered as an FSDP forward method of the root. Both models'
            ``token_logprobs`` (the trainer's chunked head, :mod:`moe_rl.models.common.head`) is registered too.

Gradient reduction: every parameter's gradient is the **mean over all data ranks** ``dp_replicate * dp_shard * cp``
of the per-rank gradients (FSDP's default for dense parameters; the expert groups reduce over efsdp only, so
their divide factor is set to the same ``dp_replicate * dp_shard * cp``, torchtitan's convention). A per-rank loss
``world * (sum of this rank's token losses) / (global token count)`` therefore gives the gradient of the
global token mean. On gloo (no ``PREMUL_SUM``) the reductions run as SUM followed by one division
(``set_force_sum_reduction_for_comms``). torch 2.13 divides twice when a shard group has one rank (efsdp = 1)
and the reduction is SUM-then-divide; the expert divide factor is then sqrt(world) (see the code; the
``hsdp_dp2_ep2`` test fails if torch changes this).

Mixed precision (``mp_policy``, e.g. :func:`mixed_precision_policy` of ``trainer.dtype = "bfloat16"``): every
``fully_shard`` group above (experts, decoder and MTP layers, root) gets the same policy, so FSDP2 keeps the sharded
parameters in their own dtype (fp32 masters, hence fp32 AdamW state), all-gathers and computes with ``param_dtype``
copies, and casts each gradient to ``reduce_dtype`` before the reduce-scatter (fp32: the reduction never runs in
bf16, and gloo needs no bf16 reduction). Buffers are not cast (the router's fp32 score-correction bias stays fp32).
Numerics that stay fp32 under bf16 parameters are each model's own: router logits (``F.linear`` on fp32 casts),
the MoE combine, RMSNorm statistics, the DSA indexer's scores and head weights, the attention softmax accumulators,
and the LM head's logits (cast to fp32 before the log-softmax, chunked or not). A single process uses the same
path on a 1-rank mesh (``ParallelDims(dp_shard=1)``), so its numerics are those of the parallel run.

Meta-device construction (the sequence of verl-project/verl PR #7835) works: build under ``torch.device("meta")``, call
:func:`parallelize_model` (or the family's function), then ``model.to_empty(device=...)`` and load a full state dict; FSDP2 swaps its DTensor
parameters in place, so a tied embedding stays one parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypedDict, Unpack

import torch
from torch import Tensor, nn

from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "CPShard",
    "ContextParallelAttention",
    "ParallelizeOptions",
    "ParallelizeSettings",
    "apply_ac",
    "apply_cp",
    "apply_ep",
    "apply_fsdp",
    "check_parallel_inputs",
    "clip_grad_norm_",
    "mixed_precision_policy",
    "parallelize_model",
    "parallelize_settings",
    "shard_for_context_parallel",
]

CPMethod = Literal["ring", "ulysses", "dsa_allgather"]


class ParallelizeOptions(TypedDict, total=False):
    """The keyword options of :func:`parallelize_model`, passed on unchanged to the model family's ``parallelize``
    (which sets the defaults and raises TypeError on any other keyword).

    Attributes:
        activation_checkpointing: recompute each decoder layer (and MTP layer) in backward; default False.
        mp_policy: FSDP2 mixed precision for every ``fully_shard`` group (``None``, the default: the parameters'
            dtype throughout); :func:`mixed_precision_policy` builds the trainer's (bf16 compute, fp32 reduction).
        cp_method: attention under CP (``None``, the default: the family's default; ``"ring"`` / ``"ulysses"`` for
            GQA, ``"dsa_allgather"`` for MLA + DSA). Used when cp > 1.
        reshard_after_forward: FSDP2's option for the decoder layers and the experts; default True.
        force_sum_reduction: reduce gradients with SUM and divide afterwards (needed on gloo, which lacks
            ``PREMUL_SUM``); default None: True on ``"cpu"`` meshes.
    """

    activation_checkpointing: bool
    mp_policy: MixedPrecisionPolicy | None
    cp_method: CPMethod | None
    reshard_after_forward: bool
    force_sum_reduction: bool | None


class ParallelizeSettings(NamedTuple):
    """:class:`ParallelizeOptions` with every default filled in: what a family's ``parallelize`` reads (from
    :func:`parallelize_settings`, which puts the family's default in ``cp_method``)."""

    activation_checkpointing: bool = False
    mp_policy: MixedPrecisionPolicy | None = None
    cp_method: CPMethod | None = None
    reshard_after_forward: bool = True
    force_sum_reduction: bool | None = None


def parallelize_settings(where: str, options: dict[str, Any],
                         cp_default: CPMethod | None = None) -> ParallelizeSettings:
    """The :class:`ParallelizeSettings` of a ``parallelize`` call's keyword options (defaults for the absent ones).

    Args:
        where: the function, e.g. ``"parallelize_glm4_moe"``; starts the error message.
        options: the call's ``**options``.
        cp_default: the family's ``cp_method`` for an absent or None one (None: leave it None).

    Raises:
        TypeError: an option that is not a :class:`ParallelizeOptions` field (a misspelt one would otherwise be
            ignored).
    """
    unknown = sorted(set(options) - set(ParallelizeSettings._fields))
    if unknown:
        raise TypeError(f"{where}: unexpected keyword arguments {unknown}; the options are "
                        f"{sorted(ParallelizeSettings._fields)} (moe_rl.distributed.parallelize.ParallelizeOptions)")
    settings = ParallelizeSettings(**options)
    return settings._replace(cp_method=cp_default) if settings.cp_method is None else settings


class CPShard(NamedTuple):
    """One CP rank's part of a batch (from :func:`shard_for_context_parallel`)."""

    local: Tensor
    """``[B, Sl, ...]`` this rank's columns of the input (padding filled with ``pad_value``)."""
    positions: Tensor
    """``[Sl]`` int64 absolute positions of those columns (pass as ``model(..., positions=...)``)."""
    valid: Tensor
    """``[Sl]`` bool, False for padding columns (mask them out of the loss)."""


def shard_for_context_parallel(
    x_BS: Tensor,
    cp: int,
    cp_rank: int,
    *,
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    pad_value: int = 0,
) -> CPShard:
    """This CP rank's columns of a ``[B, S, ...]`` tensor (ids, labels, masks, routed experts ``[B, S, L, K]`` for
    router replay), with their absolute positions. Every per-token input must go through this with the same
    ``cp`` and ``layout`` so each token keeps its own row (for routed experts pass ``pad_value=-1``, the pad
    sentinel, so padding columns get spread pad routing and no loss).

    The sequence dimension is cut by :func:`moe_rl.attention.make_shard_plan` (zigzag balances causal work) and
    padded at the end to a multiple of ``2 * cp`` (zigzag) or ``cp``; padding columns come after every real token,
    so under the causal mask they change no real token's output.

    Raises:
        ValueError: ``x_BS`` has fewer than 2 dims, or bad ``cp`` / ``cp_rank`` / ``layout`` (from ``make_shard_plan``).
    """
    from moe_rl.attention.layout import make_shard_plan

    if x_BS.dim() < 2:
        raise ValueError(f"x_BS must be [B, S, ...], got shape {tuple(x_BS.shape)}")
    plan = make_shard_plan(int(x_BS.shape[1]), cp, layout)
    local = plan.shard(x_BS, cp_rank, dim=1, pad_value=pad_value)
    return CPShard(local, plan.local_token_idx(cp_rank, x_BS.device), plan.valid(cp_rank).to(x_BS.device))


class ContextParallelAttention(nn.Module):
    """Marker base for GQA attention instances converted by :func:`apply_cp` (their class is swapped to a subclass of
    both, so parameter names and the module tree stay the same). The attention provides ``project_qkv(x, cos, sin)
    -> q [B, H, Sl, Dh], k, v [B, Hkv, Sl, Dh]``, ``o_proj``, ``num_heads`` and ``head_dim`` (``GlmMoeAttention``
    does)."""

    cp_group: object
    cp_size: int
    cp_method: CPMethod

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None) -> Tensor:
        """Causal GQA on this rank's ``Sl`` tokens of every row; keys/values of the other CP ranks are reached
        through ``cp_method``.

        Args:
            x_BSD: ``[B, Sl, D]`` hidden states of this rank's tokens.
            cos, sin: rotary tables of the *absolute* positions (``[Sl, R]`` or ``[B, Sl, R]``).
            positions: ``[Sl]`` or ``[B, Sl]`` int64 absolute positions in ``[0, cp * Sl)`` (as returned by
                :func:`shard_for_context_parallel`); every row is one causal sequence of ``cp * Sl`` tokens.

        Returns:
            ``[B, Sl, D]``, x's dtype.

        Raises:
            ValueError: ``positions`` is missing or its shape does not match ``x_BSD``.
        """
        from moe_rl.attention import ring_attention, ulysses_attention

        batch, seq, _ = x_BSD.shape
        if positions is None or positions.shape[-1] != seq or positions.dim() not in (1, 2):
            got = None if positions is None else tuple(positions.shape)
            raise ValueError(
                f"context-parallel attention needs positions [Sl] or [B, Sl] with Sl={seq} (the absolute positions "
                f"of this rank's tokens), got {got}; pass model(ids, positions=shard.positions) with the positions "
                "from moe_rl.distributed.parallelize.shard_for_context_parallel"
            )
        q, k, v = self.project_qkv(x_BSD, cos, sin)  # [B, H(kv), Sl, Dh]
        # batched rows: each row is its own causal sequence of cp * Sl tokens, the token indices are the
        # positions (shared [Sl] or per row [B, Sl]); cost B * Sl * cp * Sl, not (B * Sl) * (B * cp * Sl)
        full = seq * self.cp_size
        token_idx = positions.to(device=x_BSD.device, dtype=torch.int64)
        if token_idx.dim() == 2:
            token_idx = token_idx.expand(batch, seq)
        cu_seqlens = torch.tensor([0, full], device=x_BSD.device, dtype=torch.int64)
        fn = ring_attention if self.cp_method == "ring" else ulysses_attention
        out = fn(
            q.transpose(1, 2),  # [B, Sl, H, Dh]
            k.transpose(1, 2),
            v.transpose(1, 2),
            token_idx=token_idx,
            cu_seqlens=cu_seqlens,
            causal=True,
            scale=self.head_dim**-0.5,
            group=self.cp_group,
        ).out
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


_CP_CLASSES: dict[type, type] = {}


def _cp_class(cls: type) -> type:
    """The subclass of ``(ContextParallelAttention, cls)`` an attention instance is switched to (one per class)."""
    if cls not in _CP_CLASSES:
        _CP_CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (ContextParallelAttention, cls), {})
    return _CP_CLASSES[cls]


def check_parallel_inputs(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh,
                          mp_policy: MixedPrecisionPolicy | None = None, *, embedding: str = "embed_tokens") -> None:
    """The checks every family's ``parallelize`` runs first.

    ``model`` is a causal-LM decoder with ``config.n_routed_experts``, ``config.tie_word_embeddings``, an input
    embedding module named ``embedding`` (``"embed_tokens"``, the GLM and DeepSeek-V3 families; Nemotron-H:
    ``"embeddings"``) and ``lm_head``.

    Raises:
        TypeError: ``dims`` / ``mesh`` / ``mp_policy`` of the wrong type.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, or a broken
            embedding tie (verl-project/verl PR #7835).
    """
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"dims must be a ParallelDims, got {type(dims).__name__}")
    if not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be the ParallelMesh of dims.build_mesh(...), got {type(mesh).__name__}")
    if mesh.dims != dims:
        raise ValueError(
            f"mesh was built for {mesh.dims!r} but dims is {dims!r}; build it with dims.build_mesh()"
        )
    cfg = model.config
    if dims.ep > 1 and cfg.n_routed_experts % dims.ep:
        raise ValueError(
            f"ep={dims.ep} must divide n_routed_experts={cfg.n_routed_experts} (each EP rank holds "
            "n_routed_experts / ep experts); change ep"
        )
    if cfg.tie_word_embeddings and model.lm_head.weight is not getattr(model, embedding).weight:
        raise ValueError(
            f"config.tie_word_embeddings=True but lm_head.weight is not {embedding}.weight (the tie was broken, "
            "e.g. by to_empty() after meta-device init: verl-project/verl PR #7835); re-tie with "
            f"`model.lm_head.weight = model.{embedding}.weight` before parallelizing"
        )
    if mp_policy is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                            f"{type(mp_policy).__name__}; build one with mixed_precision_policy('bfloat16')")


def apply_ep(
    layers: Iterable[nn.Module],
    dims: ParallelDims,
    mesh: ParallelMesh,
    *,
    block_attr: str = "mlp",
    ep_block: type[nn.Module] | None = None,
    expert_params: tuple[str, ...] = ("gate_up_proj", "down_proj"),
) -> list[nn.Module]:
    """Step 1, expert parallelism: every MoE layer's block becomes an :class:`moe_rl.moe.ep.ExpertParallelMoE`
    (or ``ep_block``) over ``mesh["ep"]`` when ``dims.ep > 1``; its expert weights become DTensors ``Shard(0)`` on the
    EP mesh with the global shape ``[E, ...]``.

    Args:
        layers: decoder layers with ``is_moe`` (bool) and the MoE block as attribute ``block_attr`` when ``is_moe``.
        dims: the layout.
        mesh: ``dims.build_mesh(...)``.
        block_attr: the layer attribute holding the MoE block (default ``"mlp"``, an :class:`moe_rl.moe.MoE`).
        ep_block: the expert-parallel block class, built with ``ep_block.from_full(block, group=ep_group)`` and
            holding this rank's experts as ``.experts`` (default :class:`moe_rl.moe.ep.ExpertParallelMoE`).
        expert_params: the names of the ``[E_local, ...]`` expert weight stacks of ``ep_block(...).experts``.

    Returns:
        The expert modules (one per MoE layer, in order) for :func:`apply_fsdp`'s expert groups: the EP block's
        local experts, or the block's own ``experts`` when ``ep == 1``.

    Raises:
        TypeError: ``block_attr`` is not a str.
        ValueError: an MoE layer has no attribute ``block_attr``, or its ``block_attr`` has no ``experts``; the
            message names the layer and its child modules. Checked on every layer before any is changed.
    """
    from torch.distributed.tensor import DTensor, Shard

    if ep_block is None:
        from moe_rl.moe.ep import ExpertParallelMoE

        ep_block = ExpertParallelMoE

    if not isinstance(block_attr, str):
        raise TypeError(f"apply_ep: block_attr={block_attr!r} has type {type(block_attr).__name__}; pass the name (a str) "
                        "of the layer attribute that holds the MoE block, e.g. 'mlp'")
    moe_layers = [layer for layer in layers if layer.is_moe]
    for i, layer in enumerate(moe_layers):
        block = getattr(layer, block_attr, None)
        if block is None or not hasattr(block, "experts"):
            children = [name for name, _ in layer.named_children()]
            with_experts = [name for name, child in layer.named_children() if hasattr(child, "experts")]
            what = ("has no such attribute" if block is None
                    else f"is a {type(block).__name__}, which has no 'experts' (not an MoE block)")
            raise ValueError(
                f"apply_ep: block_attr={block_attr!r}: MoE layer {i} ({type(layer).__name__}) {what}; its child "
                f"modules are {children}, of which {with_experts} hold 'experts'. Pass the name of the attribute "
                f"holding the MoE block as block_attr (e.g. block_attr={(with_experts or ['mlp'])[0]!r})"
            )

    expert_modules: list[nn.Module] = []
    for layer in moe_layers:
        if dims.ep > 1:
            ep_mesh = mesh["ep"]
            ep_moe = ep_block.from_full(getattr(layer, block_attr), group=ep_mesh.get_group())
            for name in expert_params:
                local = getattr(ep_moe.experts, name).detach()
                setattr(ep_moe.experts, name,
                        nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
            setattr(layer, block_attr, ep_moe)
        expert_modules.append(getattr(layer, block_attr).experts)
    return expert_modules


def apply_cp(attentions: Iterable[nn.Module], dims: ParallelDims, mesh: ParallelMesh,
             method: Literal["ring", "ulysses"]) -> None:
    """Step 2, context parallelism of GQA attention: each module's class is switched to a subclass of
    :class:`ContextParallelAttention` and its own class, computing on this rank's ``Sl`` tokens with
    :func:`moe_rl.attention.ring_attention` or :func:`moe_rl.attention.ulysses_attention` over ``mesh["cp"]``
    (no-op when ``dims.cp == 1``).

    Args:
        attentions: the attention modules (see :class:`ContextParallelAttention` for what they provide; the family
            checks their type).
        dims: the layout.
        mesh: ``dims.build_mesh(...)``.
        method: ``"ring"`` or ``"ulysses"``.

    Raises:
        ValueError: another ``method``.
    """
    if method not in ("ring", "ulysses"):
        raise ValueError(f"cp_method={method!r} is not supported; use 'ring' or 'ulysses'")
    if dims.cp == 1:
        return
    cp_group = mesh["cp"].get_group()
    for attn in attentions:
        attn.__class__ = _cp_class(type(attn))
        attn.cp_group, attn.cp_size, attn.cp_method = cp_group, dims.cp, method


def apply_ac(layers: nn.ModuleList) -> None:
    """Step 3, activation checkpointing: every entry of ``layers`` is replaced in place by torch's
    ``checkpoint_wrapper`` of it (full recompute in backward; before FSDP, as torchtitan). Attributes of a layer
    stay reachable through the wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_fsdp(
    model: nn.Module,
    dims: ParallelDims,
    mesh: ParallelMesh,
    *,
    layers: Sequence[nn.Module],
    expert_modules: Sequence[nn.Module] = (),
    n_routed_experts: int = 0,
    groups: Sequence[Sequence[nn.Module]] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    force_sum_reduction: bool | None = None,
    forward_methods: Sequence[str] = (),
) -> None:
    """Step 4, FSDP2 with the gradient reduction of the module docstring: ``fully_shard(experts, mesh efsdp
    [+ dp_replicate])`` per expert module (``ep > 1``), ``fully_shard(layer, mesh dp_shard_cp [+ dp_replicate])`` per
    layer, one ``fully_shard`` per group of modules, then ``fully_shard(model)`` for the rest (the root group).

    Args:
        model: the root module.
        dims: the layout.
        mesh: ``dims.build_mesh(...)``.
        layers: the modules sharded one group each (decoder layers, checkpoint-wrapped or not).
        expert_modules: from :func:`apply_ep`; sharded over the efsdp mesh when ``dims.ep > 1`` (``Shard(0)``, or
            ``Shard(1)`` when efsdp does not divide the local expert count, as torchtitan).
        n_routed_experts: E, to size the local expert count ``E / ep`` (needed when ``dims.ep > 1``).
        groups: lists of modules sharded as one communication group each (e.g. the modules an MTP layer's forward
            runs).
        mp_policy: FSDP2 mixed precision for every group (``None``: parameters' dtype throughout).
        reshard_after_forward: FSDP2's option for the layers, groups and experts.
        force_sum_reduction: reduce with SUM then divide (gloo has no ``PREMUL_SUM``); default True on ``"cpu"``.
        forward_methods: methods of ``model`` besides ``forward`` that run the sharded model
            (``register_fsdp_forward_method``), registered in this order.

    Raises:
        ValueError: ``dims.ep > 1`` with ``n_routed_experts`` not a positive multiple of ``ep``.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import Shard

    force_sum = mesh.device_type == "cpu" if force_sum_reduction is None else force_sum_reduction
    fsdp_kw: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
    factor = float(dims.dp_size)
    states = []
    if dims.ep > 1:
        if n_routed_experts < dims.ep or n_routed_experts % dims.ep:
            raise ValueError(f"n_routed_experts={n_routed_experts} must be a positive multiple of ep={dims.ep} "
                             "(pass the model's config.n_routed_experts)")
        local_experts = n_routed_experts // dims.ep
        efsdp = dims.efsdp_size
        shard_dim = 0 if local_experts % efsdp == 0 else 1  # torchtitan: Shard(1) when efsdp > local experts
        # torch 2.13 FSDP2 (_fsdp_collectives.foreach_reduce) divides twice when the shard group has one rank
        # and the reduction is SUM-then-divide: once in the skipped reduce-scatter's copy (by the divide factor)
        # and once after it (post-divide by the same factor). Pass sqrt(factor) there so the total is factor;
        # the hsdp_dp2_ep2 test scenario (efsdp = 1) fails if torch changes this.
        expert_factor = math.sqrt(factor) if (efsdp == 1 and force_sum) else factor
        for experts in expert_modules:
            st = fully_shard(
                experts,
                mesh=mesh.efsdp_mesh,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=lambda _p, d=shard_dim: Shard(d),
                **fsdp_kw,
            )
            states.append((st, expert_factor))
    for layer in layers:
        st = fully_shard(layer, mesh=mesh.fsdp_mesh, reshard_after_forward=reshard_after_forward, **fsdp_kw)
        states.append((st, factor))
    for group in groups:  # one communication group of several modules
        st = fully_shard(list(group), mesh=mesh.fsdp_mesh, reshard_after_forward=reshard_after_forward, **fsdp_kw)
        states.append((st[0], factor))
    states.append((fully_shard(model, mesh=mesh.fsdp_mesh, **fsdp_kw), factor))
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    for st, f in states:
        if force_sum:
            st.set_force_sum_reduction_for_comms(True)
        st.set_gradient_divide_factor(f)


def parallelize_model(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh,
                      **options: Unpack[ParallelizeOptions]) -> nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 in place with the model family's own ``parallelize``
    (``model.parallelize(dims, mesh, ...)``: :func:`moe_rl.models.glm4_moe.parallelize.parallelize_glm4_moe` for
    ``GlmMoeForCausalLM``, :func:`moe_rl.models.glm_moe_dsa.parallelize.parallelize_glm_moe_dsa` for
    ``GlmMoeDsaForCausalLM``, :func:`moe_rl.models.deepseek_v3.parallelize.parallelize_deepseek_v3` for
    ``DeepseekV3ForCausalLM``, :func:`moe_rl.models.nemotron_h.parallelize.parallelize_nemotron_h` for
    ``NemotronHForCausalLM``); see the module docstring for the layout.

    Every rank must build the same full model (same weights) before the call, or the model on the meta device
    (then ``model.to_empty(device=...)`` afterwards and load the weights, e.g. with
    ``torch.distributed.checkpoint.state_dict.set_model_state_dict(..., full_state_dict=True)``: the tied
    embedding stays one parameter through ``to_empty`` because FSDP2's DTensor parameters are swapped in place).
    Afterwards each rank holds its shards. Parameter names stay those of the unsharded model
    (``checkpoint_wrapper``'s prefix is removed from state dicts by torch), and expert weights have their global
    shape ``[E, ...]``, so a ``torch.distributed.checkpoint`` save of one layout loads into any other.

    Args:
        model: the full model (CPU, its device, or meta) of a family that provides ``parallelize``.
        dims: the layout; ``mesh`` must be ``dims.build_mesh(...)``.
        mesh: the meshes.
        options: :class:`ParallelizeOptions` (``activation_checkpointing``, ``mp_policy``, ``cp_method``,
            ``reshard_after_forward``, ``force_sum_reduction``).

    Returns:
        ``model`` (modified in place). Call it with this rank's batch rows (data shard) and, when cp > 1, this
        rank's columns and their absolute ``positions`` (:func:`shard_for_context_parallel`).

    Raises:
        TypeError: ``model`` has no ``parallelize`` method, an option that is not a :class:`ParallelizeOptions`
            field, or wrong argument types.
        ValueError: ``mesh`` built for other dims, ``ep`` does not divide ``n_routed_experts``, a broken
            embedding tie, or a ``cp_method`` the model's attention does not support.
    """
    method: Callable[..., nn.Module] | None = getattr(model, "parallelize", None)
    if not callable(method):
        raise TypeError(
            f"model must provide parallelize(dims, mesh, ...) (GlmMoeForCausalLM, GlmMoeDsaForCausalLM), got "
            f"{type(model).__name__}; give the model family a parallelize function built from "
            "moe_rl.distributed.parallelize's appliers"
        )
    parallelize_settings("parallelize_model", options)  # refuse a misspelt option before the family runs
    return method(dims, mesh, **options)


def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 mixed-precision policy of a trainer ``dtype`` (``trainer.dtype``).

    Args:
        dtype: ``"float32"`` (no policy: parameters, activations and gradient reduction in fp32) or
            ``"bfloat16"`` (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``:
            bf16 all-gathered parameters and activations in forward/backward, gradients cast to fp32 before the
            reduce-scatter/all-reduce, the sharded fp32 parameters stay the master weights; torchtitan's default
            ``mixed_precision_param = "bfloat16"``, ``mixed_precision_reduce = "float32"``).

    Returns:
        The policy, or ``None`` for ``"float32"``.

    Raises:
        ValueError: any other ``dtype``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "float32":
        return None
    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"trainer dtype={dtype!r} is not supported; use 'float32' or 'bfloat16' (bf16 parameters and "
                     "activations with fp32 master weights and fp32 gradient reduction)")


def clip_grad_norm_(parameters, max_norm: float, dims: ParallelDims, norm_type: float = 2.0) -> Tensor:
    """Clip the gradients of a parallelized model (:func:`parallelize_model`) by their global norm; returns the norm (a plain
    fp32 scalar tensor, equal on every rank).

    With ``ep > 1`` the expert gradients live on the ``(efsdp, ep)`` mesh and the others on ``dp_shard_cp``;
    ``torch.nn.utils.clip_grad_norm_`` cannot combine DTensors of two meshes, so this calls torchtitan's
    ``torchtitan.distributed.utils.clip_grad_norm_(..., ep_enabled=True)``, which reduces each group's norm on its
    own mesh and combines them (``(n_ep^p + n_dense^p)^(1/p)``).

    Args:
        parameters: the model's parameters (gradients set).
        max_norm: clip threshold.
        dims: the layout the model was parallelized with.
        norm_type: p of the p-norm (``inf`` allowed).
    """
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

    norm = titan_clip(list(parameters), max_norm, norm_type=norm_type, ep_enabled=dims.ep > 1)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
