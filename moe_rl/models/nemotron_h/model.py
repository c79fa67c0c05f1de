"""Nemotron-H / Nemotron-3 (``nemotron_h``) hybrid Mamba-2 / attention / MoE language model, written with ``moe_rl``
modules.

Shape legend:
    B   batch (rows)
    S   sequence length
    D   hidden size
    H   query heads; Hkv key/value heads; Dh head_dim
    V   vocabulary
    L   layers (``len(hybrid_override_pattern)``)
    K   experts per token

Architecture (Hugging Face ``transformers/models/nemotron_h/modeling_nemotron_h.py``; Nemotron-H, arXiv
2504.03624; Nemotron 3 Nano, arXiv 2512.20848)::

    h = embeddings(ids)                        # no padding row
    for layer in layers:                       # one mixer per layer, pre-norm residual
        h = h + layer.mixer(layer.norm(h))     # mixer by pattern character:
                                               #   M  Mamba-2 (moe_rl.ssm.Mamba2Mixer)
                                               #   *  causal GQA attention, no positional encoding
                                               #   -  relu2 MLP
                                               #   E  latent MoE (moe_rl.models.nemotron_h.moe)
    logits = lm_head(norm_f(h))                # returned in fp32

Parameter names are transformers' in-memory names without the ``model.`` prefix (``embeddings``,
``layers.{i}.norm``, ``layers.{i}.mixer.*``, ``norm_f``, ``lm_head``); checkpoints prefix ``backbone.`` and store
one tensor per expert (:mod:`moe_rl.models.nemotron_h.state_dict`). Multi-token-prediction layers are not part of
this model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_rl.models.common.decoder import MoeCausalLMMixin, RMSNorm, causal_lm_inputs, packed_causal_sdpa
from moe_rl.models.nemotron_h.config import NemotronHConfig
from moe_rl.models.nemotron_h.moe import NemotronHMLP, NemotronHMoE, ReluSquaredExperts
from moe_rl.moe import ExpertsBackend
from moe_rl.ssm import GatedRMSNorm, Mamba2Mixer, Mamba2MixerConfig

if TYPE_CHECKING:
    from moe_rl.distributed.parallel_dims import ParallelDims, ParallelMesh

__all__ = ["NemotronHAttention", "NemotronHBlock", "NemotronHForCausalLM", "NemotronHRMSNorm", "parameter_counts"]


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm with the weight applied in fp32 before the cast back (transformers' ``NemotronHRMSNorm`` order; the
    GLM :class:`RMSNorm` casts first, which rounds differently in bf16). ``[..., D] -> [..., D]`` in x's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class NemotronHAttention(nn.Module):
    """Causal grouped-query attention without positional encoding (SDPA, scale ``Dh**-0.5``).

    Parameters: ``q_proj [H*Dh, D]``, ``k_proj``/``v_proj [Hkv*Dh, D]``, ``o_proj [D, H*Dh]``, no biases.
    ``forward(x [B, S, D], cu_seqlens=None, *, positions=None, cp_group=None, cp_method=None) -> [B, S, D]``; with
    ``cu_seqlens`` (``B = 1``, ``[N + 1]`` boundaries of N packed sequences) attention is causal within each
    sequence only. Under context parallelism (``cp_group`` set) ``S`` is this rank's ``Sl`` tokens of every row,
    ``positions`` (``[Sl]`` or ``[B, Sl]`` int64) their absolute positions in the row of ``cp * Sl`` tokens, and
    the keys/values of the other ranks are reached with :func:`moe_rl.attention.ring_attention` (``cp_method
    "ring"``) or :func:`moe_rl.attention.ulysses_attention` (``"ulysses"``) over ``cp_group``; without positional
    encoding the positions only build the causal mask.
    """

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x_BSD: Tensor, cu_seqlens: list[int] | None = None, *, positions: Tensor | None = None,
                cp_group: dist.ProcessGroup | None = None, cp_method: str | None = None) -> Tensor:
        batch, seq, _ = x_BSD.shape
        if cp_group is not None:
            return self._context_parallel(x_BSD, positions, cp_group, cp_method)
        q = self.q_proj(x_BSD).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = packed_causal_sdpa(q, k, v, cu_seqlens)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))

    def _context_parallel(self, x_BSD: Tensor, positions: Tensor | None, cp_group: dist.ProcessGroup,
                          cp_method: str | None) -> Tensor:
        """Ring / Ulysses attention of this rank's ``Sl`` tokens of every row over ``cp_group`` (each row one causal
        sequence of ``cp * Sl`` tokens, the token indices its ``positions``)."""
        from moe_rl.attention import ring_attention, ulysses_attention

        if cp_method not in ("ring", "ulysses"):
            raise ValueError(f"cp_method={cp_method!r}: NemotronHAttention under context parallelism supports 'ring' "
                             "or 'ulysses'")
        batch, seq, _ = x_BSD.shape
        if positions is None or positions.dim() not in (1, 2) or positions.shape[-1] != seq:
            got = None if positions is None else tuple(positions.shape)
            raise ValueError(f"context-parallel attention needs positions [Sl] or [B, Sl] with Sl={seq}, got {got}")
        q = self.q_proj(x_BSD).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSD).view(batch, seq, self.num_kv_heads, self.head_dim)
        token_idx = positions.to(device=x_BSD.device, dtype=torch.int64)
        if token_idx.dim() == 2:
            token_idx = token_idx.expand(batch, seq)
        full = seq * dist.get_world_size(cp_group)
        cu = torch.tensor([0, full], device=x_BSD.device, dtype=torch.int64)
        fn = ring_attention if cp_method == "ring" else ulysses_attention
        out = fn(q, k, v, token_idx=token_idx, cu_seqlens=cu, causal=True, scale=self.head_dim**-0.5,
                 group=cp_group).out  # [B, Sl, H, Dh]
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


class NemotronHBlock(nn.Module):
    """One layer: ``h + mixer(norm(h))`` with the mixer of its pattern character (module docstring).

    Attributes: ``kind`` (``"mamba"``, ``"attention"``, ``"mlp"``, ``"moe"``), ``is_moe``, ``norm``, ``mixer``.
    """

    def __init__(self, cfg: NemotronHConfig, layer_idx: int, experts_backend: ExpertsBackend) -> None:
        super().__init__()
        self.layer_idx, self.kind = layer_idx, cfg.layer_kind(layer_idx)
        self.is_moe = self.kind == "moe"
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if self.kind == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(Mamba2MixerConfig.from_hf(cfg))
        elif self.kind == "attention":
            self.mixer = NemotronHAttention(cfg)
        elif self.kind == "mlp":
            self.mixer = NemotronHMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        else:
            self.mixer = NemotronHMoE(cfg, experts_backend)

    def forward(self, h_BSD: Tensor, replay_ids_BSK: Tensor | None = None,
                cu_seqlens: list[int] | None = None, *, positions: Tensor | None = None,
                cp_group: dist.ProcessGroup | None = None, cp_method: str | None = None) -> Tensor:
        """``h [B, S, D] -> [B, S, D]``. ``replay_ids_BSK`` is used by MoE layers only; ``cu_seqlens`` (packed
        ``B = 1`` row) restarts the attention and the Mamba-2 state at every sequence boundary. Under context
        parallelism (``cp_group``; contiguous layout, see :meth:`NemotronHForCausalLM.hidden_states`) the attention
        runs ``cp_method`` with the absolute ``positions`` and the Mamba-2 mixer passes its conv halo and recurrent
        state between the ranks of ``cp_group`` (:func:`moe_rl.ssm.ssd_scan_cp`)."""
        x = self.norm(h_BSD)
        if self.kind == "moe":
            return h_BSD + self.mixer(x, replay_ids=replay_ids_BSK)
        if self.kind == "attention":
            return h_BSD + self.mixer(x, cu_seqlens=cu_seqlens, positions=positions, cp_group=cp_group,
                                      cp_method=cp_method)
        if self.kind == "mamba" and cu_seqlens is not None:  # each packed sequence starts from a zero state
            return h_BSD + torch.cat([self.mixer(x[:, a:b]) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:],
                                                                             strict=True) if b > a], dim=1)
        if self.kind == "mamba":
            return h_BSD + self.mixer(x, group=cp_group)
        return h_BSD + self.mixer(x)


def _check_contiguous_positions(positions: Tensor | None, batch: int, seq: int, group: dist.ProcessGroup) -> None:
    """Refuse CP ``positions`` that are not this rank's contiguous slice ``r * S .. r * S + S - 1`` (every row)."""
    if positions is None or positions.dim() not in (1, 2) or positions.shape[-1] != seq or (
            positions.dim() == 2 and positions.shape[0] not in (1, batch)):
        got = None if positions is None else tuple(positions.shape)
        raise ValueError(f"context-parallel forward needs positions [S] or [B, S] with S={seq}, B={batch} (the "
                         f"absolute positions of this rank's columns), got {got}; pass the positions of "
                         "moe_rl.distributed.parallelize.shard_for_context_parallel(..., layout='contiguous')")
    rank = dist.get_rank(group)
    want = rank * seq + torch.arange(seq, device=positions.device, dtype=torch.int64)
    if not bool((positions.to(torch.int64) == want).all()):
        raise ValueError(f"positions on CP rank {rank} are not the contiguous slice {rank * seq}..{rank * seq + seq - 1}"
                         ": Nemotron-H's Mamba-2 layers pass the recurrent state from CP rank r to rank r + 1, so the "
                         "sequence must be split in order; shard with shard_for_context_parallel(..., "
                         "layout='contiguous') (NemotronHForCausalLM.cp_layout), not zigzag")


class NemotronHForCausalLM(MoeCausalLMMixin, nn.Module):
    """Nemotron-H hybrid causal LM: ``[B, S]`` int64 ids -> ``[B, S, V]`` fp32 logits (``forward``), chunked
    ``token_logprobs`` (:class:`moe_rl.models.common.decoder.MoeCausalLMMixin`).

    Attributes:
        embeddings: ``[V, D]`` (no padding row, as transformers).
        layers: ``nn.ModuleList`` of :class:`NemotronHBlock`.
        norm_f: final RMSNorm.
        lm_head: ``[V, D]``, tied to ``embeddings`` when the config sets tie_word_embeddings.

    Args:
        cfg: the architecture.
        experts_backend: routed-expert compute, ``"loop"`` or ``"grouped_mm"`` (:meth:`set_experts_backend`).

    Initialization (:meth:`init_weights`) is deterministic given the torch RNG state.
    """

    _unit_norms = (RMSNorm, GatedRMSNorm)
    cp_layout = "contiguous"
    """The sequence layout context parallelism needs (``shard_for_context_parallel(..., layout=cp_layout)``): the
    Mamba-2 recurrence runs in sequence order across the CP ranks, so rank ``r`` holds the ``r``-th contiguous
    slice of every row."""

    def __init__(self, cfg: NemotronHConfig, *, experts_backend: ExpertsBackend = "loop") -> None:
        super().__init__()
        self.config = cfg
        self.cp_group: dist.ProcessGroup | None = None  # set by parallelize (context parallelism)
        self.cp_method: str | None = None
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, experts_backend) for i in range(cfg.num_hidden_layers))
        self.norm_f = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialize from the torch RNG, in module order: normal(0, ``initializer_range``) for every matrix,
        embedding, router and expert stack; zero biases and correction biases; unit norms; the conv's default
        init; Mamba-2's ``A_log``/``D``/``dt_bias`` (:meth:`moe_rl.ssm.Mamba2Mixer.reset_ssm_parameters`). A no-op
        on the meta device."""
        if self.lm_head.weight.device.type != "meta":
            super().init_weights()

    def _init_module(self, module: nn.Module, std: float) -> None:
        """The shared rules, plus the conv's default init, the squared-ReLU expert stacks and Mamba-2's SSM
        parameters."""
        if isinstance(module, nn.Conv1d):
            module.reset_parameters()
        elif isinstance(module, ReluSquaredExperts):
            module.init_weights(std)
        elif isinstance(module, Mamba2Mixer):
            module.reset_ssm_parameters()
        else:
            super()._init_module(module, std)

    def set_experts_backend(self, backend: ExpertsBackend) -> None:
        """Switch every MoE layer's routed-expert backend (``"loop"`` or ``"grouped_mm"``); other: ValueError."""
        if backend not in ("loop", "grouped_mm"):
            raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
        for layer in self.layers:
            if layer.is_moe:
                layer.mixer.experts.backend = backend

    def parallelize(self, dims: ParallelDims, mesh: ParallelMesh, **options: Any) -> NemotronHForCausalLM:
        """Apply EP, CP, activation checkpointing and FSDP2 in place with
        :func:`moe_rl.models.nemotron_h.parallelize.parallelize_nemotron_h` (``options``: its keyword arguments);
        returns ``self``. The generic :func:`moe_rl.distributed.parallelize.parallelize_model` calls this."""
        from moe_rl.models.nemotron_h.parallelize import parallelize_nemotron_h

        return parallelize_nemotron_h(self, dims, mesh, **options)

    def hidden_states(self, input_ids: Tensor, *, replay_ids: Tensor | list[Tensor | None] | None = None,
                      cu_seqlens: Tensor | list[int] | None = None, positions: Tensor | None = None) -> Tensor:
        """Final-normed hidden states ``[B, S, D]`` (the input of ``lm_head``).

        Args:
            input_ids: ``[B, S]`` int64 token ids.
            replay_ids: optional ``[B, S, L, K]`` integer routed-expert ids per token and layer (vLLM's
                ``routed_experts`` layout; non-MoE layers' slices are ignored) to replay in every MoE layer (R3),
                or a list of L per-layer ``[B, S, K]`` tensors (None where not replayed). Sentinel rows (-1 pad
                fill, -2 own routing) as in :func:`moe_rl.moe.router.topk_route`.
            cu_seqlens: optional packed input: ``[N + 1]`` ints ``0 = c_0 <= ... <= c_N = S``, the boundaries of N
                sequences in the one row of ``input_ids [1, S]``; attention and the Mamba-2 state restart at each
                boundary, so every sequence gets the hidden states it would get alone. Not under context
                parallelism.
            positions: under context parallelism only (``self.cp_group`` set by :meth:`parallelize`), required
                there: ``[S]`` or ``[B, S]`` int64 absolute positions of this rank's ``S`` columns in rows of
                ``cp * S`` tokens, which must be the contiguous layout (rank ``r`` holds positions ``r * S ..
                r * S + S - 1``: ``shard_for_context_parallel(x, cp, r, layout="contiguous")``,
                :attr:`cp_layout`), because the Mamba-2 layers pass their state from rank ``r`` to rank ``r + 1``.

        Raises:
            ValueError: ``input_ids`` not 2-D, ``replay_ids`` of the wrong shape, or bad ``cu_seqlens``;
                ``positions`` without context parallelism; under it, ``positions`` missing, of the wrong shape or
                not contiguous, or ``cu_seqlens`` given.
        """
        cfg = self.config
        batch, seq, per_layer, cu = causal_lm_inputs(cfg, input_ids, replay_ids, cu_seqlens)
        cp = {}
        if self.cp_group is None:
            if positions is not None:
                raise ValueError("positions is only for context parallelism (the absolute positions of this CP rank's "
                                 "columns); this model has no cp_group, so every row is positions 0..S-1: drop "
                                 "positions")
        else:
            if cu is not None:
                raise ValueError("cu_seqlens (packed sequences) is not supported under context parallelism: the "
                                 "Mamba-2 state passed between CP ranks cannot restart inside a row; pass one "
                                 "sequence per row (padded) instead")
            _check_contiguous_positions(positions, batch, seq, self.cp_group)
            cp = dict(positions=positions, cp_group=self.cp_group, cp_method=self.cp_method)
        h_BSD = self.embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            h_BSD = layer(h_BSD, per_layer[i] if layer.is_moe else None, cu, **cp)
        return self.norm_f(h_BSD)


def parameter_counts(model: NemotronHForCausalLM) -> dict[str, int]:
    """Parameter counts of a model (any device, the meta device included).

    Returns:
        ``total``: every parameter (a tied head counted once). ``active``: the parameters one token uses,
        without the input embedding (a row lookup, not a matmul; NVIDIA's convention for the published active
        counts): ``total - (E - K) / E * routed-expert parameters - embeddings``. ``active_with_embeddings``:
        ``active`` plus the embedding.
    """
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for layer in model.layers if layer.is_moe for p in layer.mixer.experts.parameters())
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    with_emb = total - routed * (E - K) // E
    emb = 0 if cfg.tie_word_embeddings else model.embeddings.weight.numel()
    return {"total": total, "active": with_emb - emb, "active_with_embeddings": with_emb}

