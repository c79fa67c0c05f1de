"""Decoder pieces shared by the GLM model families (``glm4_moe``, ``glm_moe_dsa``).

Shape legend:
    B   batch
    S   sequence length
    D   hidden size
    L   decoder layers (``num_hidden_layers``)
    K   routed experts per token (``num_experts_per_tok``)

:class:`RMSNorm` and :func:`glm_mlp` are the blocks both families build their layers from;
:class:`MoeCausalLMMixin` gives a causal LM its deterministic ``init_weights`` and ``set_experts_backend``;
:func:`as_per_layer` and :func:`split_replay_ids` turn the replay inputs into one entry per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from moe_rl.moe import ExpertsBackend, GroupedExperts, MoE, SwiGLUMLP, TopKRouter

__all__ = ["MoeCausalLMMixin", "RMSNorm", "as_per_layer", "glm_mlp", "split_replay_ids"]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (Hugging Face ``Glm4MoeRMSNorm`` order).

    Args:
        dim: normalized (last) dimension.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def glm_mlp(cfg: Any, layer_idx: int, experts_backend: ExpertsBackend) -> nn.Module:
    """The feed-forward block of GLM layer ``layer_idx``: a dense :class:`moe_rl.moe.SwiGLUMLP` of width
    ``intermediate_size`` for the first ``first_k_dense_replace`` layers, else an :class:`moe_rl.moe.MoE` with the
    GLM router (sigmoid scores, noaux_tc ``e_score_correction_bias``, group-limited top-k, normalisation, routed
    scaling) and shared experts. ``cfg`` is any config with Hugging Face GLM field names (``GlmMoeConfig``,
    ``GlmMoeDsaConfig``)."""
    if not cfg.is_moe_layer(layer_idx):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
    return MoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts,
        score_func="sigmoid",
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        use_correction_bias=True,
        backend=experts_backend,
    )


def as_per_layer(x: Any, n: int, name: str, what: str) -> list[Tensor | None] | None:
    """One entry per layer from a per-layer list/tuple (``None`` when ``x`` is None), or ``None`` when ``x`` is a
    single stacked tensor (the caller checks and splits that layout).

    Args:
        x: None, a list/tuple of ``n`` tensors-or-None, or a tensor.
        n: the number of decoder layers.
        name: the argument's name, for errors.
        what: the shape of one layer's tensor, for errors (e.g. ``"[B, S, K]"``).

    Raises:
        ValueError: a list of the wrong length.
        TypeError: ``x`` is neither None, a list/tuple nor a tensor.
    """
    if x is None:
        return [None] * n
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise ValueError(
                f"{name} is a list of {len(x)} per-layer tensors but the model has {n} decoder "
                f"layers; pass one {what} tensor (or None) per layer"
            )
        return list(x)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor or a list of per-layer tensors, got {type(x).__name__}")
    return None


def split_replay_ids(
    replay_ids: Tensor | Sequence[Tensor | None] | None, num_layers: int, batch: int, seq: int, top_k: int
) -> list[Tensor | None]:
    """Routed experts to replay, one ``[B, S, K]`` entry (or None) per decoder layer.

    Args:
        replay_ids: None; ``[B, S, L, K]`` integer expert ids (vLLM's ``routed_experts`` layout, dense layers'
            slices ignored by the caller); or a list of L ``[B, S, K]`` tensors / None.
        num_layers: L. batch, seq: B and S of the input ids. top_k: K.

    Returns:
        L entries: views ``replay_ids[:, :, i]`` of a stacked tensor, or the list's own entries.

    Raises:
        ValueError: a list of the wrong length, or a stacked tensor whose shape is not ``[B, S, L, K]``.
        TypeError: ``replay_ids`` is neither None, a list nor a tensor.
    """
    per_layer = as_per_layer(replay_ids, num_layers, "replay_ids", "[B, S, K]")
    if per_layer is not None:
        return per_layer
    expected = (batch, seq, num_layers, top_k)
    if tuple(replay_ids.shape) != expected:
        raise ValueError(
            f"replay_ids has shape {tuple(replay_ids.shape)} but the model expects [B, S, L, K] = {expected}"
        )
    return [replay_ids[:, :, i] for i in range(num_layers)]


class MoeCausalLMMixin:
    """``init_weights`` and ``set_experts_backend`` of a GLM-style causal LM (an ``nn.Module`` with ``config``
    (``initializer_range``, ``tie_word_embeddings``), ``lm_head`` and decoder layers that carry ``is_moe`` and,
    when MoE, ``mlp.experts``).

    Subclasses list their norm classes in ``_unit_norms`` (weights set to one) and override
    :meth:`_moe_capable_layers` when they have layers besides ``self.layers`` (e.g. MTP layers).
    """

    _unit_norms: tuple[type[nn.Module], ...] = (RMSNorm,)

    def _moe_capable_layers(self) -> list[nn.Module]:
        return list(self.layers)  # type: ignore[attr-defined]

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialize every parameter and buffer, in module order, from the torch RNG: normal(0,
        ``initializer_range``) for every matrix, embedding, router and expert stack; zero biases and correction
        bias; unit norms; default ``nn.LayerNorm``; zero pad-token embedding row. A tied ``lm_head`` is skipped
        (its matrix is the embedding, drawn as one)."""
        std = self.config.initializer_range  # type: ignore[attr-defined]
        tied = self.config.tie_word_embeddings  # type: ignore[attr-defined]
        for module in self.modules():  # type: ignore[attr-defined]
            if isinstance(module, nn.Linear):
                if tied and module is self.lm_head:  # type: ignore[attr-defined]
                    continue  # the matrix is embed_tokens.weight, drawn as an embedding
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, self._unit_norms):
                module.weight.fill_(1.0)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, (TopKRouter, GroupedExperts)):
                module.init_weights(std)

    def set_experts_backend(self, backend: ExpertsBackend) -> None:
        """Switch every MoE layer's routed-expert backend (``"loop"`` or ``"grouped_mm"``).

        Raises:
            ValueError: another ``backend``.
        """
        if backend not in ("loop", "grouped_mm"):
            raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
        for layer in self._moe_capable_layers():
            if layer.is_moe:
                layer.mlp.experts.backend = backend
