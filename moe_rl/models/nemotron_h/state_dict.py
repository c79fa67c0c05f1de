"""Conversion between our Nemotron-H state dict and the Hugging Face checkpoint format, plus save/load.

Hugging Face on-disk names (``model.safetensors`` of ``NemotronHForCausalLM``: the released checkpoints and what
transformers 5.19's ``save_pretrained`` writes) against ours, for a layer ``i`` and an MoE layer ``j``::

    HF on disk                                              ours
    backbone.embeddings.weight                              embeddings.weight
    backbone.layers.{i}.norm.weight                         layers.{i}.norm.weight
    backbone.layers.{i}.mixer.<name>                        layers.{i}.mixer.<name>   (Mamba-2, attention, MLP,
                                                            and the MoE router, shared expert, latent projections)
    backbone.layers.{j}.mixer.experts.{e}.up_proj.weight    layers.{j}.mixer.experts.up_proj[e]    [F, L]
    backbone.layers.{j}.mixer.experts.{e}.down_proj.weight  layers.{j}.mixer.experts.down_proj[e]  [L, F]
    backbone.norm_f.weight                                  norm_f.weight
    lm_head.weight                                          lm_head.weight   (written even when tied: transformers'
                                                                              NemotronH never ties, it reads the head)

transformers 5 keeps the experts stacked in memory under ``model.`` (``model.layers.{j}.mixer.experts.up_proj``
``[E, F, L]``, our layout); :func:`from_hf_state_dict` accepts both spellings. Multi-token-prediction tensors
(``mtp.*``) are dropped, as transformers does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from moe_rl.models.common.state_dict import STATE_DICT_API
from moe_rl.models.hf_io import (
    check_key_sets,
    check_shape,
    keeps_fp32,
    read_hf_tensors,
    strip_wrappers,
    write_hf_checkpoint,
)
from moe_rl.models.nemotron_h.config import NemotronHConfig

if TYPE_CHECKING:
    from moe_rl.models.hf_io import HFBlock

__all__ = [*STATE_DICT_API, "our_shapes"]

_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")
_FIELDS = "hybrid_override_pattern, moe_latent_size, mlp_bias, use_bias, use_conv_bias, tie_word_embeddings"


def our_shapes(cfg: NemotronHConfig) -> dict[str, tuple[int, ...]]:
    """``{our key: shape}`` of :class:`NemotronHForCausalLM` built from ``cfg`` (built on the meta device, so any
    size is free). A tied ``lm_head.weight`` is left out (it is ``embeddings.weight``)."""
    from moe_rl.models.nemotron_h.model import NemotronHForCausalLM

    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def _hf_name(key: str) -> str:
    return key if key == "lm_head.weight" else f"backbone.{key}"


def hf_key_names(cfg: NemotronHConfig) -> list[str]:
    """The Hugging Face on-disk tensor names a checkpoint of ``cfg`` contains (no MTP tensors)."""
    names = ["lm_head.weight"] if cfg.tie_word_embeddings else []
    for key, shape in our_shapes(cfg).items():
        m = _STACKED_RE.match(key)
        if m is None:
            names.append(_hf_name(key))
        else:
            names += [f"backbone.layers.{m.group(1)}.mixer.experts.{e}.{m.group(2)}.weight" for e in range(shape[0])]
    return names


def hf_key_ignored(key: str, cfg: NemotronHConfig) -> bool:
    """True for checkpoint tensors :func:`from_hf_state_dict` drops: the multi-token-prediction tensors (``mtp.*``)
    and ``lm_head.weight`` when ``tie_word_embeddings``."""
    return key.startswith("mtp.") or (key == "lm_head.weight" and cfg.tie_word_embeddings)


def hf_sources(shapes: dict[str, tuple[int, ...]], cfg: NemotronHConfig) -> dict[str, list[HFBlock]]:
    """``{our key: [HFBlock, ...]}``: where each tensor of ``shapes`` (``{our key: global shape}``, wrapper prefixes
    stripped here) lives in a Hugging Face checkpoint on disk, for loading a shard without reading the rest
    (:mod:`moe_rl.models.sharded_load`): ``backbone.<key>`` for every tensor but the stacked experts, whose expert
    ``e`` is the region ``[e:e+1]`` of ``layers.{j}.mixer.experts.{up,down}_proj`` read from
    ``backbone.layers.{j}.mixer.experts.{e}.{up,down}_proj.weight``; ``lm_head.weight`` reads itself (transformers'
    ``NemotronHForCausalLM`` never ties: the head is on disk).

    Raises:
        ValueError: the key set or a shape does not match ``cfg``.
    """
    from moe_rl.models.hf_io import HFBlock

    shapes = {strip_wrappers(k): tuple(v) for k, v in shapes.items()}
    want = our_shapes(cfg)
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    check_key_sets(set(shapes), set(want), "state_dict", _FIELDS)
    out: dict[str, list[HFBlock]] = {}
    for key, shape in shapes.items():
        if shape != want[key]:
            raise ValueError(f"{key}: shape {shape} does not match {want[key]} of the config ({_FIELDS})")
        m = _STACKED_RE.match(key)
        if m is None:
            out[key] = [HFBlock(_hf_name(key), (0,) * len(shape), shape)]
        else:
            out[key] = [HFBlock(f"backbone.layers.{m.group(1)}.mixer.experts.{e}.{m.group(2)}.weight", (e, 0, 0),
                                shape[1:]) for e in range(shape[0])]
    return out


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: NemotronHConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face on-disk names (per-expert tensors are views of the stacks, no copy).

    Args:
        state_dict: ``NemotronHForCausalLM.state_dict()`` (``torch.compile``/checkpoint-wrapper prefixes are
            stripped); full tensors on any device.
        cfg: the config it was built with.

    Returns:
        ``{hf name: tensor}``; with ``tie_word_embeddings`` ``lm_head.weight`` is the embedding tensor (transformers'
        ``NemotronHForCausalLM`` does not tie, so the head must be on disk).

    Raises:
        ValueError: the key set or a shape does not match ``cfg``.
    """
    sd = {strip_wrappers(k): v for k, v in state_dict.items()}
    shapes = our_shapes(cfg)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    check_key_sets(set(sd), set(shapes), "state dict", _FIELDS)
    out: dict[str, Tensor] = {"lm_head.weight": sd["embeddings.weight"]} if cfg.tie_word_embeddings else {}
    for key, tensor in sd.items():
        check_shape(key, tensor, shapes[key])
        m = _STACKED_RE.match(key)
        if m is None:
            out[_hf_name(key)] = tensor
        else:
            for e in range(tensor.shape[0]):
                out[f"backbone.layers.{m.group(1)}.mixer.experts.{e}.{m.group(2)}.weight"] = tensor[e]
    return out


def from_hf_state_dict(hf_state_dict: dict[str, Tensor], cfg: NemotronHConfig) -> dict[str, Tensor]:
    """Hugging Face names -> our state dict (inverse of :func:`to_hf_state_dict`; the round trip is exact).

    Accepts the on-disk names (``backbone.``, per-expert tensors) and transformers 5's in-memory names
    (``model.``, stacked experts). ``mtp.*`` tensors are dropped; with ``tie_word_embeddings`` a checkpoint
    ``lm_head.weight`` is ignored and ours is the embedding.

    Returns:
        ``{our key: tensor}`` for ``NemotronHForCausalLM.load_state_dict(..., strict=True)``; stacked experts are
        new tensors, everything else the input tensors themselves.

    Raises:
        ValueError: keys missing or unexpected for ``cfg``, an expert index outside ``[0, E)`` or missing, or a
            shape that does not match.
    """
    shapes = our_shapes(cfg)
    ours: dict[str, Tensor] = {}
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}
    for hf_key, tensor in hf_state_dict.items():
        if hf_key.startswith("mtp.") or (hf_key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        key = hf_key.removeprefix("backbone.").removeprefix("model.")
        m = _EXPERT_RE.match(key)
        if m is None:
            ours[key] = tensor
            continue
        layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        if not 0 <= e < cfg.n_routed_experts:
            raise ValueError(f"{hf_key}: expert {e} is outside [0, n_routed_experts={cfg.n_routed_experts})")
        experts.setdefault((layer, proj), {})[e] = tensor
    for (layer, proj), per_expert in experts.items():
        missing = sorted(set(range(cfg.n_routed_experts)) - set(per_expert))
        if missing:
            raise ValueError(f"layer {layer} {proj}: experts {missing[:8]} are missing from the checkpoint")
        ours[f"layers.{layer}.mixer.experts.{proj}"] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    check_key_sets(set(ours), set(shapes), "Hugging Face checkpoint", _FIELDS)
    for key, tensor in ours.items():
        check_shape(key, tensor, shapes[key])
    if cfg.tie_word_embeddings:
        ours["lm_head.weight"] = ours["embeddings.weight"]
    return ours


def save_hf_checkpoint(model_or_state_dict: nn.Module | dict[str, Tensor], cfg: NemotronHConfig, out_dir: str | Path,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face ``nemotron_h`` checkpoint directory: ``config.json``
    (:meth:`NemotronHConfig.to_hf_config_dict`), ``generation_config.json`` and ``model.safetensors`` (one file).
    The router's ``e_score_correction_bias`` stays fp32; other tensors are cast to ``dtype``.

    Raises:
        TypeError: a tensor is a sharded DTensor (gather the full state dict first).
        ValueError: the state dict does not match ``cfg``.
    """
    sd = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    return write_hf_checkpoint(to_hf_state_dict(sd, cfg), cfg.to_hf_config_dict(dtype), ids, out_dir, dtype,
                               keeps_fp32)


def load_hf_state_dict(path: str | Path, cfg: NemotronHConfig | None = None) -> dict[str, Tensor]:
    """Read a Hugging Face ``nemotron_h`` checkpoint directory into our names (CPU tensors, stored dtypes).

    Args:
        path: directory with ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
        cfg: the config; read from ``path/config.json`` when None.

    Raises:
        FileNotFoundError: no weights (or no ``config.json`` when ``cfg`` is None).
        ValueError: the tensors do not match the config.
    """
    import json

    if cfg is None:
        cfg = NemotronHConfig.from_hf_config_dict(json.loads((Path(path) / "config.json").read_text()))
    return from_hf_state_dict(read_hf_tensors(path), cfg)
