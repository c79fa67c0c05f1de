"""Conversion between our GLM-4.5 state dict and the Hugging Face checkpoint format, plus save/load.

Hugging Face on-disk names (``model.safetensors`` of ``Glm4MoeForCausalLM``, what transformers 5.19's
``save_pretrained`` writes and what both ``from_pretrained`` and vLLM's ``Glm4MoeForCausalLM`` loader read)
against ours, for a dense layer ``i`` and an MoE layer ``j``::

    HF on disk                                              ours
    model.embed_tokens.weight                               embed_tokens.weight
    model.layers.{i}.input_layernorm.weight                 layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}   layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}
    model.layers.{i}.self_attn.o_proj.weight                layers.{i}.self_attn.o_proj.weight
    model.layers.{i}.self_attn.{q,k}_norm.weight            layers.{i}.self_attn.{q,k}_norm.weight  (use_qk_norm)
    model.layers.{i}.post_attention_layernorm.weight        layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight         layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{j}.mlp.gate.weight                        layers.{j}.mlp.router.weight
    model.layers.{j}.mlp.gate.e_score_correction_bias       layers.{j}.mlp.router.e_score_correction_bias
    model.layers.{j}.mlp.experts.{e}.gate_proj.weight [F,D] layers.{j}.mlp.experts.gate_up_proj[e, :F]
    model.layers.{j}.mlp.experts.{e}.up_proj.weight   [F,D] layers.{j}.mlp.experts.gate_up_proj[e, F:]
    model.layers.{j}.mlp.experts.{e}.down_proj.weight [D,F] layers.{j}.mlp.experts.down_proj[e]
    model.layers.{j}.mlp.shared_experts.{gate,up,down}_proj.weight   layers.{j}.mlp.shared_experts.<same>
    model.norm.weight                                       norm.weight
    lm_head.weight                                          lm_head.weight   (absent on disk when tied)

transformers 5 keeps the experts fused in memory (``model.layers.{j}.mlp.experts.gate_up_proj``
``[E, 2F, D]`` and ``...experts.down_proj`` ``[E, D, F]``, our layout) and converts to the per-expert names
only when saving/loading; :func:`from_hf_state_dict` accepts both spellings. Checkpoint MTP layers
(``model.layers.{n}`` with ``n >= num_hidden_layers``, e.g. layer 46 of GLM-4.5-Air) are dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from moe_rl.models.common.state_dict import (
    HF_LAYER_RE,
    STATE_DICT_API,
    checked_hf_names,
    checked_sources,
    decoder_keys,
    decoder_layer_keys,
    from_hf_tensors,
    load_checkpoint,
    names_on_disk,
    save_checkpoint,
)
from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.hf_io import HFBlock

__all__ = list(STATE_DICT_API)

_KEY_FIELDS = "num_hidden_layers, first_k_dense_replace, attention_bias, use_qk_norm, n_shared_experts"


def _layer_keys(cfg: GlmMoeConfig, layer_idx: int) -> list[str]:
    attention = []
    for proj in ("q_proj", "k_proj", "v_proj"):
        attention.append(f"self_attn.{proj}.weight")
        if cfg.attention_bias:
            attention.append(f"self_attn.{proj}.bias")
    attention.append("self_attn.o_proj.weight")
    if cfg.use_qk_norm:
        attention += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return decoder_layer_keys(cfg, layer_idx, attention)


def _our_keys(cfg: GlmMoeConfig) -> list[str]:
    return decoder_keys(cfg, lambda i: _layer_keys(cfg, i))


def hf_key_names(cfg: GlmMoeConfig) -> list[str]:
    """The Hugging Face on-disk tensor names a checkpoint of ``cfg`` contains (no MTP layers)."""
    return names_on_disk(cfg, _our_keys(cfg))


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: GlmMoeConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face on-disk names (per-expert tensors).

    Args:
        state_dict: ``GlmMoeForCausalLM.state_dict()`` (``torch.compile``/checkpoint-wrapper prefixes are
            stripped). Plain tensors on any device; gather DTensors first.
        cfg: the config the state dict was built with.

    Returns:
        ``{hf_name: tensor}``. Per-expert tensors are views into the stacked weights (no copy); other
        tensors are the inputs themselves. ``lm_head.weight`` is omitted when ``tie_word_embeddings``.

    Raises:
        ValueError: the key set or a stacked expert shape does not match ``cfg``.
    """
    return checked_hf_names(state_dict, cfg, lambda sd: _our_keys(cfg), _KEY_FIELDS)


def hf_sources(shapes: dict[str, tuple[int, ...]], cfg: GlmMoeConfig) -> dict[str, list[HFBlock]]:
    """Where each of our tensors lives in a Hugging Face checkpoint (the names of :func:`to_hf_state_dict`, as
    regions, for loading a shard of a tensor without reading the rest; see
    :mod:`moe_rl.models.sharded_load`).

    Args:
        shapes: ``{our key: global shape}`` of the whole state dict (wrapper prefixes are stripped).
        cfg: the config.

    Returns:
        ``{our key: [HFBlock, ...]}``; the blocks of a key tile its global tensor. A tied ``lm_head.weight``
        reads ``model.embed_tokens.weight``.

    Raises:
        ValueError: the key set or a stacked expert shape does not match ``cfg``.
    """
    return checked_sources(shapes, cfg, lambda sd: _our_keys(cfg), _KEY_FIELDS)


def hf_key_ignored(key: str, cfg: GlmMoeConfig) -> bool:
    """True for checkpoint tensors :func:`from_hf_state_dict` drops: MTP layers (``model.layers.{n}``,
    ``n >= num_hidden_layers``) and ``lm_head.weight`` when ``tie_word_embeddings``."""
    if key == "lm_head.weight":
        return cfg.tie_word_embeddings
    m = HF_LAYER_RE.match(key)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def from_hf_state_dict(hf_state_dict: dict[str, Tensor], cfg: GlmMoeConfig) -> dict[str, Tensor]:
    """Hugging Face names -> our state dict (inverse of :func:`to_hf_state_dict`; the round trip is exact).

    Accepts the on-disk per-expert names and transformers 5's in-memory fused names
    (``...mlp.experts.gate_up_proj`` / ``...mlp.experts.down_proj``). MTP layers
    (``model.layers.{n}``, ``n >= num_hidden_layers``) are dropped. With ``tie_word_embeddings``,
    ``lm_head.weight`` is set to the embedding tensor (a checkpoint copy of it, if any, is ignored).

    Returns:
        ``{our_name: tensor}`` ready for ``GlmMoeForCausalLM.load_state_dict(..., strict=True)``. Stacked
        expert weights are new tensors; everything else is the input tensor itself.

    Raises:
        ValueError: keys are missing or unexpected for ``cfg``, or an expert tensor has the wrong shape.
    """
    def layer_prefix(layer: int, rest: str) -> str | None:
        # MTP (next-token prediction) layers are not part of this model
        return f"layers.{layer}." if layer < cfg.num_hidden_layers else None

    return from_hf_tensors(
        hf_state_dict, cfg, family="glm4_moe", layer_prefix=layer_prefix, our_keys=_our_keys(cfg), fields=_KEY_FIELDS
    )


def save_hf_checkpoint(
    model_or_state_dict: nn.Module | dict[str, Tensor],
    cfg: GlmMoeConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Hugging Face ``glm4_moe`` checkpoint directory (plain write; callers handle atomicity).

    Files: ``config.json`` (:meth:`GlmMoeConfig.to_hf_config_dict`), ``generation_config.json``
    (bos/eos/pad ids) and ``model.safetensors`` (HF names, one file). The correction bias stays fp32 (as
    transformers keeps it); other tensors are cast to ``dtype``.

    Args:
        model_or_state_dict: a :class:`GlmMoeForCausalLM` or its state dict (our names, full tensors).
        cfg: the config.
        out_dir: created if missing; existing files of the same names are overwritten.
        dtype: storage dtype, e.g. ``torch.bfloat16``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        TypeError: a tensor is a sharded DTensor (gather the full state dict first, e.g. with
            ``torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=
            StateDictOptions(full_state_dict=True, cpu_offload=True))``).
        ValueError: the state dict does not match ``cfg``.
    """
    return save_checkpoint(model_or_state_dict, lambda sd: to_hf_state_dict(sd, cfg), cfg, out_dir, dtype)


def load_hf_state_dict(path: str | Path, cfg: GlmMoeConfig | None = None) -> dict[str, Tensor]:
    """Read a Hugging Face ``glm4_moe`` checkpoint directory into our names (CPU tensors, stored dtypes).

    Reads ``model.safetensors``, or the shards listed in ``model.safetensors.index.json``.

    Args:
        path: checkpoint directory.
        cfg: the config; read from ``path/config.json`` (:meth:`GlmMoeConfig.from_hf_config_dict`) if None.

    Raises:
        FileNotFoundError: no ``model.safetensors`` (or index) in ``path``.
        ValueError: the tensors do not match the config.
    """
    return load_checkpoint(path, cfg, GlmMoeConfig, from_hf_state_dict)
