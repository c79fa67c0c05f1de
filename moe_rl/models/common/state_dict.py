"""The Hugging Face state-dict conversion shared by the GLM model families (``glm4_moe``, ``glm_moe_dsa``).

Both families name their tensors as Hugging Face does without the ``model.`` prefix, except the router
(``mlp.router`` here, ``mlp.gate`` on disk) and the routed experts (stacked ``mlp.experts.gate_up_proj
[E, 2F, D]`` / ``mlp.experts.down_proj [E, D, F]`` here, per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
on disk). Everything but the attention is shared: embeddings, the layer norms, the dense or MoE MLP (router,
experts, shared experts), the final norm, ``lm_head`` (absent on disk when tied) and the MTP layers'
placement (``mtp_layers.{m}`` here, ``model.layers.{L + m}`` on disk). Each family supplies its attention keys
and which checkpoint layers it keeps; the functions here do the renaming, the expert (un)stacking and the
checks. Shapes: E routed experts, F ``moe_intermediate_size``, D ``hidden_size``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from moe_rl.models.hf_io import (
    HF_EXPERT_RE,
    HFBlock,
    check_key_sets,
    check_shape,
    keeps_fp32,
    moe_hf_sources,
    moe_to_hf,
    stack_hf_experts,
    write_hf_checkpoint,
)

__all__ = [
    "HF_LAYER_RE",
    "UNEXPECTED",
    "MoeStateDictConfig",
    "from_hf_tensors",
    "hf_prefix",
    "mlp_keys",
    "names_on_disk",
    "save_checkpoint",
    "sources_on_disk",
    "to_hf_names",
]

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
