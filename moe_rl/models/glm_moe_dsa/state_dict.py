"""Conversion between our GLM-5 (``glm_moe_dsa``) state dict and the Hugging Face checkpoint format, plus save/load.

The names are those of :mod:`moe_rl.models.common.state_dict` (``model.safetensors`` of ``GlmMoeDsaForCausalLM``;
ours without ``model.``, router ``mlp.router`` for ``mlp.gate``, stacked experts), with the GLM-5 attention and
MTP layers, for a decoder layer ``i`` and MTP depth ``m``::

    HF on disk                                                  ours
    model.layers.{i}.self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight (+ .bias of
        q_a_proj, kv_a_proj_with_mqa, o_proj with attention_bias)  layers.{i}.self_attn.<same>
    model.layers.{i}.self_attn.{q_a_layernorm, kv_a_layernorm}.weight                   layers.{i}.self_attn.<same>
    model.layers.{i}.self_attn.indexer.{wq_b, wk, weights_proj}.weight, .k_norm.{weight, bias}   (indexer
        layers only: indexer_types "full")                      layers.{i}.self_attn.indexer.<same>
    model.layers.{L+m}.<a MoE layer's names>                    mtp_layers.{m}.<same>
    model.layers.{L+m}.{enorm, hnorm, shared_head.norm}.weight, .eh_proj.weight   mtp_layers.{m}.<same>

The MTP names follow DeepSeek-V3 / GLM checkpoints (vLLM ``DeepSeekMTP``); the head matrix is shared with
``lm_head`` (a checkpoint's ``model.layers.{L+m}.shared_head.head.weight`` or ``.embed_tokens.weight`` copy is
ignored on load). transformers' ``GlmMoeDsaForCausalLM`` has no MTP module and ignores ``model.layers.78.*`` on
load; build our model with ``with_mtp=False`` to match a state dict without MTP layers. transformers 5 keeps the
experts fused in memory (``...mlp.experts.gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``: our layout) and
converts to per-expert names when saving; :func:`from_hf_state_dict` accepts both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from moe_rl.models.common import state_dict as common
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
from moe_rl.models.hf_io import HFBlock

__all__ = list(common.STATE_DICT_API)

_KEY_FIELDS = (
    "num_hidden_layers, first_k_dense_replace, indexer_types, attention_bias, n_shared_experts, "
    "num_nextn_predict_layers / with_mtp"
)
_MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_MTP_IGNORED = ("shared_head.head.weight", "embed_tokens.weight")  # copies of the shared head / embedding


def _layer_keys(cfg: GlmMoeDsaConfig, layer_idx: int) -> list[str]:
    attention = common.mla_attention_keys(cfg.attention_bias)
    if cfg.has_indexer(layer_idx):
        attention += [
            f"self_attn.indexer.{k}"
            for k in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
        ]
    keys = common.decoder_layer_keys(cfg, layer_idx, attention)
    return keys + list(_MTP_ONLY) if layer_idx >= cfg.num_hidden_layers else keys


def _our_keys(cfg: GlmMoeDsaConfig, with_mtp: bool) -> list[str]:
    keys = common.decoder_keys(cfg, lambda i: _layer_keys(cfg, i))
    for m in range(cfg.num_nextn_predict_layers if with_mtp else 0):
        keys += [f"mtp_layers.{m}.{k}" for k in _layer_keys(cfg, cfg.num_hidden_layers + m)]
    return keys


def _has_mtp_keys(sd: dict[str, Tensor]) -> bool:
    return any(k.startswith("mtp_layers.") for k in sd)


def hf_key_names(cfg: GlmMoeDsaConfig, *, with_mtp: bool = False) -> list[str]:
    """The Hugging Face on-disk tensor names of a ``cfg`` checkpoint (with the MTP layers when ``with_mtp``;
    transformers itself writes none)."""
    return common.names_on_disk(cfg, _our_keys(cfg, with_mtp))


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: GlmMoeDsaConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face on-disk names (per-expert tensors; MTP layers as ``model.layers.{L+m}``).

    Args:
        state_dict: ``GlmMoeDsaForCausalLM.state_dict()`` (wrapper prefixes stripped), full tensors; with or
            without the MTP layers (``mtp_layers.*``), which must then be complete.
        cfg: the config the model was built with.

    Returns:
        ``{hf_name: tensor}`` (per-expert tensors are views; ``lm_head.weight`` omitted when tied).

    Raises:
        ValueError: the key set or a stacked expert shape does not match ``cfg``.
    """
    return common.checked_hf_names(state_dict, cfg, lambda sd: _our_keys(cfg, _has_mtp_keys(sd)), _KEY_FIELDS)


def hf_sources(shapes: dict[str, tuple[int, ...]], cfg: GlmMoeDsaConfig) -> dict[str, list[HFBlock]]:
    """Where each of our tensors lives in a Hugging Face checkpoint (the names of :func:`to_hf_state_dict`, as
    regions, for loading a shard of a tensor without reading the rest; see :mod:`moe_rl.models.sharded_load`).

    Args:
        shapes: ``{our key: global shape}`` of the whole state dict (wrapper prefixes stripped), with or
            without the MTP layers (``mtp_layers.*``), which must then be complete.
        cfg: the config.

    Returns:
        ``{our key: [HFBlock, ...]}``; the blocks of a key tile its global tensor. A tied ``lm_head.weight``
        reads ``model.embed_tokens.weight``; MTP layers read ``model.layers.{L + m}.*``.

    Raises:
        ValueError: the key set or a stacked expert shape does not match ``cfg``.
    """
    return common.checked_sources(shapes, cfg, lambda sd: _our_keys(cfg, _has_mtp_keys(sd)), _KEY_FIELDS)


def hf_key_ignored(key: str, cfg: GlmMoeDsaConfig, *, with_mtp: bool) -> bool:
    """True for checkpoint tensors :func:`from_hf_state_dict` drops: ``lm_head.weight`` when tied, the MTP
    layers' copies of the head / embedding (``model.layers.{L + m}.shared_head.head.weight``,
    ``.embed_tokens.weight``), and every MTP-layer tensor when ``with_mtp`` is False."""
    if key == "lm_head.weight":
        return cfg.tie_word_embeddings
    m = common.HF_LAYER_RE.match(key)
    if m is None:
        return False
    layer, rest = int(m.group(1)), m.group(2)
    lo, hi = cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return lo <= layer < hi and (not with_mtp or rest in _MTP_IGNORED)


def from_hf_state_dict(
    hf_state_dict: dict[str, Tensor], cfg: GlmMoeDsaConfig, *, with_mtp: bool | None = None
) -> dict[str, Tensor]:
    """Hugging Face names -> our state dict (inverse of :func:`to_hf_state_dict`; the round trip is exact).

    Accepts per-expert on-disk names and transformers 5's fused in-memory names.

    Args:
        hf_state_dict: HF-named tensors.
        cfg: the config.
        with_mtp: keep the MTP layers (``model.layers.{n}``, ``n >= num_hidden_layers``) as ``mtp_layers.*``
            (True: required), drop them (False), or None: keep them when the checkpoint has any.

    Returns:
        ``{our_name: tensor}`` for ``GlmMoeDsaForCausalLM(cfg, with_mtp=...).load_state_dict(..., strict=True)``.

    Raises:
        ValueError: missing/unexpected keys for ``cfg``, or an expert tensor of the wrong shape.
    """
    if with_mtp is None:
        with_mtp = any(
            (m := common.HF_LAYER_RE.match(k)) is not None and int(m.group(1)) >= cfg.num_hidden_layers
            for k in hf_state_dict
        )
    return common.from_hf_tensors(
        hf_state_dict, cfg, family="glm_moe_dsa",
        layer_prefix=common.mtp_layer_prefix(cfg, with_mtp=with_mtp, ignored=_MTP_IGNORED),
        our_keys=_our_keys(cfg, with_mtp), fields=_KEY_FIELDS,
    )


def save_hf_checkpoint(
    model_or_state_dict: nn.Module | dict[str, Tensor],
    cfg: GlmMoeDsaConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Hugging Face ``glm_moe_dsa`` checkpoint directory: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (HF names; MTP layers included when the model has them). The correction bias and
    ``indexer.weights_proj`` stay fp32 (transformers keeps both in fp32); other tensors are cast to ``dtype``.

    Raises:
        TypeError: a tensor is a sharded DTensor (gather a full state dict first).
        ValueError: the state dict does not match ``cfg``.
    """
    return common.save_checkpoint(model_or_state_dict, lambda sd: to_hf_state_dict(sd, cfg), cfg, out_dir, dtype)


def load_hf_state_dict(
    path: str | Path, cfg: GlmMoeDsaConfig | None = None, *, with_mtp: bool | None = None
) -> dict[str, Tensor]:
    """Read a Hugging Face ``glm_moe_dsa`` checkpoint directory (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``) into our names; ``cfg`` defaults to ``path/config.json``.

    Raises:
        FileNotFoundError: no weights file. ValueError: the tensors do not match the config.
    """
    return common.load_checkpoint(path, cfg, GlmMoeDsaConfig, lambda sd, c: from_hf_state_dict(sd, c, with_mtp=with_mtp))
