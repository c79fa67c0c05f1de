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

import json
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.models.hf_io import (
    HF_EXPERT_RE,
    HFBlock,
    check_key_sets,
    check_shape,
    keeps_fp32,
    moe_hf_sources,
    moe_to_hf,
    read_hf_tensors,
    stack_hf_experts,
    strip_wrappers,
    write_hf_checkpoint,
)

__all__ = [
    "from_hf_state_dict",
    "hf_key_ignored",
    "hf_key_names",
    "hf_sources",
    "load_hf_state_dict",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _our_layer_keys(cfg: GlmMoeConfig, layer_idx: int) -> list[str]:
    keys = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        keys.append(f"self_attn.{proj}.weight")
        if cfg.attention_bias:
            keys.append(f"self_attn.{proj}.bias")
    keys.append("self_attn.o_proj.weight")
    if cfg.use_qk_norm:
        keys += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.is_moe_layer(layer_idx):
        keys += ["mlp.router.weight", "mlp.router.e_score_correction_bias"]
        keys += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if cfg.n_shared_experts > 0:
            keys += [f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    else:
        keys += [f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return [f"layers.{layer_idx}.{k}" for k in keys]


def _our_keys(cfg: GlmMoeConfig) -> list[str]:
    keys = ["embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        keys += _our_layer_keys(cfg, i)
    keys += ["norm.weight", "lm_head.weight"]
    return keys


def _check_key_sets(found: set[str], expected: set[str], what: str) -> None:
    check_key_sets(found, expected, what, "num_hidden_layers, first_k_dense_replace, attention_bias, use_qk_norm, "
                   "n_shared_experts")


def hf_key_names(cfg: GlmMoeConfig) -> list[str]:
    """The Hugging Face on-disk tensor names a checkpoint of ``cfg`` contains (no MTP layers)."""
    num_experts, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"gate_up_proj": (num_experts, 2 * inter, hidden), "down_proj": (num_experts, hidden, inter)}
    fake = {k: torch.empty(shapes.get(k.rsplit(".", 1)[-1], (0,)), device="meta") for k in _our_keys(cfg)}
    return sorted(to_hf_state_dict(fake, cfg))


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
    sd = {strip_wrappers(k): v for k, v in state_dict.items()}
    _check_key_sets(set(sd), set(_our_keys(cfg)), "state_dict")
    num_experts, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, Tensor] = {}
    for key, tensor in sd.items():
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[key] = tensor
            continue
        prefix, rest = _hf_prefix(key)
        if not moe_to_hf(key, prefix, rest, tensor, num_experts, inter, hidden, out):
            out[prefix + rest] = tensor
    return out


def _hf_prefix(key: str) -> tuple[str, str]:
    """``(HF prefix, rest)`` of one of our keys other than ``lm_head.weight``: ``layers.{i}.<rest>`` ->
    ``("model.layers.{i}.", rest)``, anything else (embed_tokens, norm) -> ``("model.", key)``."""
    m = _LAYER_RE.match(key)
    if m is None:
        return "model.", key
    return f"model.layers.{m.group(1)}.", m.group(2)


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
    shapes = {strip_wrappers(k): tuple(v) for k, v in shapes.items()}
    _check_key_sets(set(shapes), set(_our_keys(cfg)), "state_dict")
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, list[HFBlock]] = {}
    for key, shape in shapes.items():
        zero = (0,) * len(shape)
        if key == "lm_head.weight":
            hf = "model.embed_tokens.weight" if cfg.tie_word_embeddings else key
            out[key] = [HFBlock(hf, zero, shape)]
            continue
        prefix, rest = _hf_prefix(key)
        blocks = moe_hf_sources(rest, prefix, shape, e, f, d)
        out[key] = blocks if blocks is not None else [HFBlock(prefix + rest, zero, shape)]
    return out


def hf_key_ignored(key: str, cfg: GlmMoeConfig) -> bool:
    """True for checkpoint tensors :func:`from_hf_state_dict` drops: MTP layers (``model.layers.{n}``,
    ``n >= num_hidden_layers``) and ``lm_head.weight`` when ``tie_word_embeddings``."""
    if key == "lm_head.weight":
        return cfg.tie_word_embeddings
    m = _HF_LAYER_RE.match(key)
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
    num_experts, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    unexpected: list[str] = []
    for key, tensor in hf_state_dict.items():
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[key] = tensor
            continue
        m = _HF_LAYER_RE.match(key)
        if m is None:
            if key.startswith("model."):
                out[key.removeprefix("model.")] = tensor
            else:
                unexpected.append(key)
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= cfg.num_hidden_layers:
            continue  # MTP (next-token prediction) layers are not part of this model
        prefix = f"layers.{layer}."
        em = HF_EXPERT_RE.match(rest)
        if em is not None:
            expert, proj = int(em.group(1)), em.group(2)
            if expert >= num_experts:
                unexpected.append(key)
                continue
            want = (hidden, inter) if proj == "down_proj" else (inter, hidden)
            check_shape(key, tensor, want)
            experts.setdefault((prefix, proj), {})[expert] = tensor
        elif rest.startswith("mlp.gate."):  # router (not mlp.gate_proj of a dense layer)
            out[prefix + "mlp.router." + rest.removeprefix("mlp.gate.")] = tensor
        else:
            out[prefix + rest] = tensor
    if unexpected:
        raise ValueError(f"unexpected Hugging Face key(s) for glm4_moe: {sorted(unexpected)[:8]}")
    missing_experts = stack_hf_experts(experts, num_experts, out)
    if missing_experts:
        raise ValueError(f"missing {len(missing_experts)} expert tensor(s), e.g. {missing_experts[:4]}")
    if cfg.tie_word_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    _check_key_sets(set(out), set(_our_keys(cfg)), "Hugging Face state dict (after renaming)")
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            check_shape(
                f"layers.{layer}.mlp.experts.gate_up_proj",
                out[f"layers.{layer}.mlp.experts.gate_up_proj"],
                (num_experts, 2 * inter, hidden),
            )
            check_shape(
                f"layers.{layer}.mlp.experts.down_proj",
                out[f"layers.{layer}.mlp.experts.down_proj"],
                (num_experts, hidden, inter),
            )
    return out


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
    sd = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, nn.Module)
        else model_or_state_dict
    )
    return write_hf_checkpoint(
        to_hf_state_dict(sd, cfg),
        cfg.to_hf_config_dict(torch_dtype=dtype),
        {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        out_dir,
        dtype,
        keep_fp32=keeps_fp32,
    )


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
    path = Path(path)
    if cfg is None:
        cfg = GlmMoeConfig.from_hf_config_dict(json.loads((path / "config.json").read_text()))
    return from_hf_state_dict(read_hf_tensors(path), cfg)
