"""Conversion between our DeepSeek-V3 / Kimi-K2 (``deepseek_v3``) state dict and the Hugging Face checkpoint format,
plus save/load.

The names are those of :mod:`moe_rl.models.common.state_dict` (``model.safetensors`` of ``DeepseekV3ForCausalLM``;
ours without ``model.``, router ``mlp.router`` for ``mlp.gate``, stacked experts). The attention of every layer is
plain MLA: ``self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight`` (``.bias`` of
``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` with ``attention_bias``) and ``self_attn.{q_a_layernorm,
kv_a_layernorm}.weight``. The checkpoint's MTP layers (``model.layers.{L + m}.*``, ``m <
num_nextn_predict_layers``) are dropped on load (no MTP module, as in transformers); on-disk per-expert and
transformers 5's fused expert names are both accepted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from moe_rl.models.common import state_dict as common
from moe_rl.models.deepseek_v3.config import DeepseekV3Config
from moe_rl.models.hf_io import HFBlock

__all__ = list(common.STATE_DICT_API)

_KEY_FIELDS = "num_hidden_layers, first_k_dense_replace, attention_bias, n_shared_experts, tie_word_embeddings"


def _our_keys(cfg: DeepseekV3Config) -> list[str]:
    attention = common.mla_attention_keys(cfg.attention_bias)
    return common.decoder_keys(cfg, lambda i: common.decoder_layer_keys(cfg, i, attention))


def hf_key_names(cfg: DeepseekV3Config) -> list[str]:
    """The sorted Hugging Face on-disk tensor names of a ``cfg`` checkpoint without MTP layers (what transformers'
    ``save_pretrained`` and :func:`save_hf_checkpoint` write)."""
    return common.names_on_disk(cfg, _our_keys(cfg))


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: DeepseekV3Config) -> dict[str, Tensor]:
    """Our state dict (``DeepseekV3ForCausalLM.state_dict()``, full tensors, wrapper prefixes allowed) -> Hugging Face
    on-disk names: per-expert views, ``lm_head.weight`` omitted when tied
    (:func:`moe_rl.models.common.state_dict.checked_hf_names`).

    Raises:
        ValueError: the key set or a stacked expert shape does not match ``cfg``.
    """
    return common.checked_hf_names(state_dict, cfg, lambda sd: _our_keys(cfg), _KEY_FIELDS)


def hf_key_ignored(key: str, cfg: DeepseekV3Config) -> bool:
    """True for checkpoint tensors :func:`from_hf_state_dict` drops: the MTP layers (``model.layers.{n}.*``,
    ``n >= num_hidden_layers``) and ``lm_head.weight`` when ``tie_word_embeddings``."""
    if key == "lm_head.weight":
        return cfg.tie_word_embeddings
    m = common.HF_LAYER_RE.match(key)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def hf_sources(shapes: dict[str, tuple[int, ...]], cfg: DeepseekV3Config) -> dict[str, list[HFBlock]]:
    """``{our key: [HFBlock, ...]}``: where each tensor of ``shapes`` (``{our key: global shape}``) lives in a Hugging
    Face checkpoint, for loading a shard without reading the rest (:mod:`moe_rl.models.sharded_load`,
    :func:`moe_rl.models.common.state_dict.checked_sources`).

    Raises:
        ValueError: the key set or a stacked expert shape does not match ``cfg``.
    """
    return common.checked_sources(shapes, cfg, lambda sd: _our_keys(cfg), _KEY_FIELDS)


def from_hf_state_dict(hf_state_dict: dict[str, Tensor], cfg: DeepseekV3Config) -> dict[str, Tensor]:
    """Hugging Face names (per-expert on disk or transformers 5's fused) -> ``{our_name: tensor}`` for
    ``DeepseekV3ForCausalLM(cfg).load_state_dict(..., strict=True)``, the inverse of :func:`to_hf_state_dict` (the
    round trip is exact). The MTP layers' tensors (``model.layers.{L + m}.*``, ``m < num_nextn_predict_layers``) are
    dropped, as transformers does.

    Raises:
        ValueError: missing/unexpected keys for ``cfg``, or an expert tensor of the wrong shape.
    """
    return common.from_hf_tensors(
        hf_state_dict, cfg, family="deepseek_v3", layer_prefix=common.mtp_layer_prefix(cfg, with_mtp=False),
        our_keys=_our_keys(cfg), fields=_KEY_FIELDS,
    )


def save_hf_checkpoint(
    model_or_state_dict: nn.Module | dict[str, Tensor],
    cfg: DeepseekV3Config,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Hugging Face ``deepseek_v3`` checkpoint directory: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (HF names). The correction bias stays fp32 (transformers keeps it in fp32); other tensors
    are cast to ``dtype``.

    Raises:
        TypeError: a tensor is a sharded DTensor (gather a full state dict first).
        ValueError: the state dict does not match ``cfg``.
    """
    return common.save_checkpoint(model_or_state_dict, lambda sd: to_hf_state_dict(sd, cfg), cfg, out_dir, dtype)


def load_hf_state_dict(path: str | Path, cfg: DeepseekV3Config | None = None) -> dict[str, Tensor]:
    """Read a Hugging Face ``deepseek_v3`` / ``kimi_k2`` checkpoint directory (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``) into our names; ``cfg`` defaults to ``path/config.json``.

    Raises:
        FileNotFoundError: no weights file. ValueError: the tensors do not match the config.
    """
    return common.load_checkpoint(path, cfg, DeepseekV3Config, from_hf_state_dict)
