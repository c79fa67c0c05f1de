"""The Hugging Face state-dict conversion shared by the GLM and DeepSeek-V3 model families (``glm4_moe``,
``glm_moe_dsa``, ``deepseek_v3``).

The families name their tensors as Hugging Face does without the ``model.`` prefix, except the router
(``mlp.router`` here, ``mlp.gate`` on disk) and the routed experts (stacked ``mlp.experts.gate_up_proj
[E, 2F, D]`` / ``mlp.experts.down_proj [E, D, F]`` here, per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
on disk). Everything but the attention is shared: embeddings, the layer norms, the dense or MoE MLP (router,
experts, shared experts), the final norm, ``lm_head`` (absent on disk when tied) and the MTP layers'
placement (``mtp_layers.{m}`` here, ``model.layers.{L + m}`` on disk). Each family supplies its attention keys
(:func:`mla_attention_keys` for the two MLA families) and which checkpoint layers it keeps; the functions here do
the renaming, the expert (un)stacking and the checks (:func:`checked_hf_names`, :func:`checked_sources`). Shapes: E
routed experts, F ``moe_intermediate_size``, D ``hidden_size``.

The shared names, Hugging Face on disk (what transformers 5.19's ``save_pretrained`` writes) against ours, for a
decoder layer ``i``, an MoE layer ``j`` and an MTP depth ``m`` (``L = num_hidden_layers``)::

    HF on disk                                                  ours
    model.embed_tokens.weight                                   embed_tokens.weight
    model.layers.{i}.{input,post_attention}_layernorm.weight    layers.{i}.<same>
    model.layers.{i}.self_attn.*  (the family's attention)      layers.{i}.self_attn.<same>
    model.layers.{i}.mlp.{gate,up,down}_proj.weight  (dense)    layers.{i}.mlp.<same>
    model.layers.{j}.mlp.gate.{weight, e_score_correction_bias} layers.{j}.mlp.router.<same>
    model.layers.{j}.mlp.experts.{e}.{gate,up}_proj.weight [F,D]  layers.{j}.mlp.experts.gate_up_proj[e, :F | F:]
    model.layers.{j}.mlp.experts.{e}.down_proj.weight [D,F]     layers.{j}.mlp.experts.down_proj[e]
    model.layers.{j}.mlp.shared_experts.{gate,up,down}_proj.weight   layers.{j}.mlp.shared_experts.<same>
    model.norm.weight, lm_head.weight (absent when tied)        norm.weight, lm_head.weight
    model.layers.{L+m}.*  (MTP layers)                          mtp_layers.{m}.<same>, or dropped on load

transformers 5 keeps the experts fused in memory (``...mlp.experts.gate_up_proj [E, 2F, D]``, ``down_proj
[E, D, F]``: our layout) and converts to per-expert names when saving; :func:`from_hf_tensors` accepts both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from moe_rl.models.common import CHECKPOINT_FUNCTIONS
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
    "HF_LAYER_RE",
    "UNEXPECTED",
    "STATE_DICT_API",
    "MoeStateDictConfig",
    "checked_hf_names",
    "checked_sources",
    "decoder_keys",
    "decoder_layer_keys",
    "from_hf_tensors",
    "hf_prefix",
    "load_checkpoint",
    "mla_attention_keys",
    "mlp_keys",
    "mtp_layer_prefix",
    "names_on_disk",
    "save_checkpoint",
    "sources_on_disk",
    "to_hf_names",
]

STATE_DICT_API: tuple[str, ...] = tuple(sorted((*CHECKPOINT_FUNCTIONS, "hf_key_ignored", "hf_sources")))
"""The functions every family's ``state_dict`` module defines and exports (its ``__all__``, which may add more, e.g.
Nemotron-H's ``our_shapes``; :mod:`moe_rl.models.families` finds
the module): the checkpoint functions its package exports (``moe_rl.models.common.CHECKPOINT_FUNCTIONS``) plus
``hf_sources(shapes, cfg)`` (our key -> its Hugging Face regions) and ``hf_key_ignored(key, cfg)`` (a checkpoint
tensor the model drops), which the sharded loader and the weight publisher call."""

HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
"""A checkpoint layer tensor: group 1 the layer index, group 2 the name inside the layer."""

UNEXPECTED = ""
"""The value a ``layer_prefix`` callback of :func:`from_hf_tensors` returns for a checkpoint layer it rejects."""


class MoeStateDictConfig(Protocol):
    """The config fields the shared conversion reads (both families' configs have them)."""

    n_routed_experts: int
    moe_intermediate_size: int
    hidden_size: int
    num_hidden_layers: int
    n_shared_experts: int
    tie_word_embeddings: bool

    def is_moe_layer(self, layer_idx: int) -> bool: ...


def mlp_keys(cfg: MoeStateDictConfig, layer_idx: int) -> list[str]:
    """Our MLP parameter names inside layer ``layer_idx``: router, stacked experts and (when
    ``n_shared_experts > 0``) the shared experts of an MoE layer, else the dense SwiGLU's three projections."""
    if cfg.is_moe_layer(layer_idx):
        keys = ["mlp.router.weight", "mlp.router.e_score_correction_bias"]
        keys += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if cfg.n_shared_experts > 0:
            keys += [f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        return keys
    return [f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]


def decoder_keys(cfg: MoeStateDictConfig, layer_keys: Callable[[int], list[str]]) -> list[str]:
    """Our parameter names of a causal LM: ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight`` (present in
    the state dict even when tied) and ``layers.{i}.<k>`` for ``k`` in ``layer_keys(i)``, ``i <
    num_hidden_layers``."""
    keys = ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        keys += [f"layers.{i}.{k}" for k in layer_keys(i)]
    return keys


def decoder_layer_keys(cfg: MoeStateDictConfig, layer_idx: int, attention_keys: list[str]) -> list[str]:
    """Our parameter names inside decoder layer ``layer_idx``: ``input_layernorm.weight``,
    ``post_attention_layernorm.weight``, the family's ``attention_keys`` (``self_attn.*``) and :func:`mlp_keys`."""
    return ["input_layernorm.weight", "post_attention_layernorm.weight", *attention_keys, *mlp_keys(cfg, layer_idx)]


def mtp_layer_prefix(
    cfg: Any, *, with_mtp: bool, ignored: tuple[str, ...] = ()
) -> Callable[[int, str], str | None]:
    """The ``layer_prefix`` callback of :func:`from_hf_tensors` for a checkpoint whose layers
    ``L .. L + num_nextn_predict_layers - 1`` (``L = num_hidden_layers``) are MTP layers: decoder layer ``i`` ->
    ``"layers.{i}."``; MTP layer ``L + m`` -> ``"mtp_layers.{m}."`` when ``with_mtp`` (its tensors named in
    ``ignored``, e.g. copies of the shared head, dropped), else dropped; any later layer :data:`UNEXPECTED`."""
    L, n_mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers

    def layer_prefix(layer: int, rest: str) -> str | None:
        if layer < L:
            return f"layers.{layer}."
        if layer >= L + n_mtp:
            return UNEXPECTED
        if not with_mtp or rest in ignored:
            return None
        return f"mtp_layers.{layer - L}."

    return layer_prefix


def mla_attention_keys(attention_bias: bool) -> list[str]:
    """Our (and, under ``model.layers.{i}.``, Hugging Face's) parameter names of a multi-head latent attention
    block (:class:`moe_rl.attention.MultiheadLatentAttention` without an indexer): ``self_attn.{q_a_proj, q_b_proj,
    kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight``, the ``.bias`` of ``q_a_proj``, ``kv_a_proj_with_mqa`` and
    ``o_proj`` when ``attention_bias``, and the two latent norms ``self_attn.{q_a_layernorm, kv_a_layernorm}.weight``
    (DeepSeek-V3 and GLM-5 checkpoints)."""
    keys = []
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        keys.append(f"self_attn.{proj}.weight")
        if attention_bias and proj in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
            keys.append(f"self_attn.{proj}.bias")
    return keys + ["self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight"]


def _expert_shapes(cfg: MoeStateDictConfig) -> dict[str, tuple[int, int, int]]:
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return {"gate_up_proj": (e, 2 * f, d), "down_proj": (e, d, f)}


def hf_prefix(key: str, num_hidden_layers: int) -> tuple[str, str]:
    """``(HF prefix, rest)`` of one of our keys other than ``lm_head.weight``: ``layers.{i}.<rest>`` ->
    ``("model.layers.{i}.", rest)``, ``mtp_layers.{m}.<rest>`` -> ``("model.layers.{L + m}.", rest)`` with
    ``L = num_hidden_layers``, anything else (embed_tokens, norm) -> ``("model.", key)``."""
    head, _, rest = key.partition(".")
    if head not in ("layers", "mtp_layers"):
        return "model.", key
    idx, _, rest = rest.partition(".")
    layer = int(idx) + (num_hidden_layers if head == "mtp_layers" else 0)
    return f"model.layers.{layer}.", rest


def names_on_disk(cfg: MoeStateDictConfig, our_keys: list[str]) -> list[str]:
    """The sorted Hugging Face names of a state dict with keys ``our_keys`` (built on the meta device)."""
    shapes = _expert_shapes(cfg)
    fake = {k: torch.empty(shapes.get(k.rsplit(".", 1)[-1], (0,)), device="meta") for k in our_keys}
    return sorted(to_hf_names(fake, cfg))


def to_hf_names(sd: dict[str, Tensor], cfg: MoeStateDictConfig) -> dict[str, Tensor]:
    """Our state dict (key set already checked, wrapper prefixes stripped) -> Hugging Face on-disk names.

    Returns:
        ``{hf_name: tensor}``: per-expert tensors are views into the stacked ``[E, 2F, D]`` / ``[E, D, F]``
        weights (no copy), other tensors the inputs themselves; ``lm_head.weight`` omitted when tied.

    Raises:
        ValueError: a stacked expert tensor does not have the shape ``cfg`` gives.
    """
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, Tensor] = {}
    for key, tensor in sd.items():
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[key] = tensor
            continue
        prefix, rest = hf_prefix(key, cfg.num_hidden_layers)
        if not moe_to_hf(key, prefix, rest, tensor, e, f, d, out):
            out[prefix + rest] = tensor
    return out


def checked_hf_names(
    state_dict: dict[str, Tensor],
    cfg: MoeStateDictConfig,
    expected_keys: Callable[[dict[str, Any]], list[str]],
    fields: str,
) -> dict[str, Tensor]:
    """:func:`to_hf_names` of a model's state dict after stripping wrapper prefixes
    (:func:`moe_rl.models.hf_io.strip_wrappers`) and checking its key set.

    Args:
        state_dict: our names (possibly with ``torch.compile`` / checkpoint-wrapper prefixes), full tensors.
        cfg: the config the model was built with.
        expected_keys: the family's key list for the stripped state dict (it may look at it, e.g. whether it has
            MTP layers).
        fields: the config fields the key set depends on, named in the error.

    Raises:
        ValueError: missing or unexpected keys (naming them and ``fields``), or a stacked expert shape that does not
            match ``cfg``.
    """
    sd = {strip_wrappers(k): v for k, v in state_dict.items()}
    check_key_sets(set(sd), set(expected_keys(sd)), "state_dict", fields)
    return to_hf_names(sd, cfg)


def checked_sources(
    shapes: dict[str, tuple[int, ...]],
    cfg: MoeStateDictConfig,
    expected_keys: Callable[[dict[str, Any]], list[str]],
    fields: str,
) -> dict[str, list[HFBlock]]:
    """:func:`sources_on_disk` of ``{our key: global shape}`` after stripping wrapper prefixes and checking the
    key set (arguments and errors as :func:`checked_hf_names`)."""
    shapes = {strip_wrappers(k): tuple(v) for k, v in shapes.items()}
    check_key_sets(set(shapes), set(expected_keys(shapes)), "state_dict", fields)
    return sources_on_disk(shapes, cfg)


def sources_on_disk(shapes: dict[str, tuple[int, ...]], cfg: MoeStateDictConfig) -> dict[str, list[HFBlock]]:
    """Where each of our tensors lives in a Hugging Face checkpoint (``shapes``: our key -> global shape, key
    set already checked, wrappers stripped): ``{our key: [HFBlock, ...]}`` whose blocks tile the tensor; a
    tied ``lm_head.weight`` reads ``model.embed_tokens.weight``.

    Raises:
        ValueError: a stacked expert shape does not match ``cfg``.
    """
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, list[HFBlock]] = {}
    for key, shape in shapes.items():
        zero = (0,) * len(shape)
        if key == "lm_head.weight":
            hf = "model.embed_tokens.weight" if cfg.tie_word_embeddings else key
            out[key] = [HFBlock(hf, zero, shape)]
            continue
        prefix, rest = hf_prefix(key, cfg.num_hidden_layers)
        blocks = moe_hf_sources(rest, prefix, shape, e, f, d)
        out[key] = blocks if blocks is not None else [HFBlock(prefix + rest, zero, shape)]
    return out


def from_hf_tensors(
    hf_state_dict: dict[str, Tensor],
    cfg: MoeStateDictConfig,
    *,
    family: str,
    layer_prefix: Callable[[int, str], str | None],
    our_keys: list[str],
    fields: str,
) -> dict[str, Tensor]:
    """Hugging Face names -> our names (the inverse of :func:`to_hf_names`; the round trip is exact).

    Args:
        hf_state_dict: HF-named tensors, per-expert (on disk) or fused (transformers 5 in memory) experts.
        cfg: the config.
        family: the Hugging Face ``model_type``, for error messages.
        layer_prefix: ``(checkpoint layer index, name inside the layer) -> our prefix`` (e.g. ``"layers.3."``),
            ``None`` to drop the tensor, or :data:`UNEXPECTED` to reject it.
        our_keys: the complete key set expected after renaming.
        fields: the config fields that decide the key set (named in the error).

    Returns:
        ``{our_name: tensor}``: stacked expert weights are new tensors, everything else is the input tensor
        itself; with ``tie_word_embeddings`` ``lm_head.weight`` is the embedding (a checkpoint copy is ignored).

    Raises:
        ValueError: unexpected keys, missing keys or expert tensors, or an expert tensor of the wrong shape.
    """
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    unexpected: list[str] = []
    for key, tensor in hf_state_dict.items():
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[key] = tensor
            continue
        m = HF_LAYER_RE.match(key)
        if m is None:
            if key.startswith("model."):
                out[key.removeprefix("model.")] = tensor
            else:
                unexpected.append(key)
            continue
        rest = m.group(2)
        prefix = layer_prefix(int(m.group(1)), rest)
        if prefix is None:
            continue
        if prefix == UNEXPECTED:
            unexpected.append(key)
            continue
        em = HF_EXPERT_RE.match(rest)
        if em is not None:
            x, proj = int(em.group(1)), em.group(2)
            if x >= e:
                unexpected.append(key)
                continue
            check_shape(key, tensor, (d, f) if proj == "down_proj" else (f, d))
            experts.setdefault((prefix, proj), {})[x] = tensor
        elif rest.startswith("mlp.gate."):  # router (a dense layer's is mlp.gate_proj)
            out[prefix + "mlp.router." + rest.removeprefix("mlp.gate.")] = tensor
        else:
            out[prefix + rest] = tensor
    if unexpected:
        raise ValueError(f"unexpected Hugging Face key(s) for {family}: {sorted(unexpected)[:8]}")
    missing = stack_hf_experts(experts, e, out)
    if missing:
        raise ValueError(f"missing {len(missing)} expert tensor(s), e.g. {missing[:4]} (our names)")
    if cfg.tie_word_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    check_key_sets(set(out), set(our_keys), "Hugging Face state dict (after renaming)", fields)
    shapes = _expert_shapes(cfg)
    for key, t in out.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            check_shape(key, t, shapes["gate_up_proj"])
        elif key.endswith("mlp.experts.down_proj"):
            check_shape(key, t, shapes["down_proj"])
    return out


def save_checkpoint(
    model_or_state_dict: nn.Module | dict[str, Tensor],
    to_hf: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    cfg: Any,
    out_dir: str | Path,
    dtype: torch.dtype,
) -> Path:
    """Write ``config.json`` (``cfg.to_hf_config_dict``), ``generation_config.json`` (bos/eos/pad ids) and
    ``model.safetensors`` (``to_hf`` of the state dict) to ``out_dir``; tensors :func:`~moe_rl.models.hf_io.
    keeps_fp32` names stay fp32, the rest are cast to ``dtype``. Returns ``Path(out_dir)``.

    Raises:
        TypeError: a sharded DTensor (gather a full state dict first).
        ValueError: from ``to_hf`` (the state dict does not match ``cfg``).
    """
    sd = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    return write_hf_checkpoint(
        to_hf(sd),
        cfg.to_hf_config_dict(torch_dtype=dtype),
        {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        out_dir,
        dtype,
        keep_fp32=keeps_fp32,
    )


def load_checkpoint(
    path: str | Path,
    cfg: Any,
    config_cls: Any,
    from_hf: Callable[[dict[str, Tensor], Any], dict[str, Tensor]],
) -> dict[str, Tensor]:
    """Read a Hugging Face checkpoint directory (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``, :func:`moe_rl.models.hf_io.read_hf_tensors`) and convert it with the family's
    ``from_hf(tensors, cfg)``; ``cfg`` None reads ``path/config.json`` with ``config_cls.from_hf_config_dict``.

    Raises:
        FileNotFoundError: no weights file. ValueError: the config or the tensors do not match the family.
    """
    path = Path(path)
    if cfg is None:
        cfg = config_cls.from_hf_config_dict(json.loads((path / "config.json").read_text()))
    return from_hf(read_hf_tensors(path), cfg)
