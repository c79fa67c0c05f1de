"""Hugging Face checkpoint plumbing shared by the model families (``glm4_moe``, ``glm_moe_dsa``).

Our MoE layers hold stacked expert weights ``gate_up_proj [E, 2F, D]`` (gate rows first) and ``down_proj
[E, D, F]`` and call the router ``mlp.router``; Hugging Face checkpoints store one tensor per expert
(``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``) and call the router ``mlp.gate``. This module holds the
renaming of one layer's MoE tensors in both directions, the key-set and shape checks, and the safetensors
directory reader/writer; each model's ``state_dict.py`` keeps only its own key lists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "HF_EXPERT_RE",
    "HFBlock",
    "hf_weight_map",
    "moe_hf_sources",
    "check_key_sets",
    "check_shape",
    "keeps_fp32",
    "moe_to_hf",
    "read_hf_tensors",
    "stack_hf_experts",
    "strip_wrappers",
    "write_hf_checkpoint",
]

HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


FP32_SUFFIXES = ("e_score_correction_bias", "indexer.weights_proj.weight")
"""HF tensors this library writes in fp32 whatever the checkpoint dtype (``save_hf_checkpoint``, the weight
publishers): the router's bias correction (transformers keeps it in fp32 strictly; it only orders expert scores,
and bf16 rounding changes which experts win near-ties) and the DSA indexer's head weights (kept out of low
precision in the GLM-5 releases)."""


def keeps_fp32(hf_key: str) -> bool:
    """True for a tensor written in fp32 regardless of the checkpoint dtype (:data:`FP32_SUFFIXES`)."""
    return hf_key.endswith(FP32_SUFFIXES)


def strip_wrappers(key: str) -> str:
    """Drop ``torch.compile`` / checkpoint-wrapper / FSDP1 segments from a state-dict key."""
    for seg in _WRAPPER_SEGMENTS:
        key = key.replace(seg, "")
    return key


def check_key_sets(found: set[str], expected: set[str], what: str, hint: str) -> None:
    """Raise ValueError listing missing and unexpected keys (first 8 of each) and ``hint`` (config fields)."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match the config: missing {len(missing)} key(s) {missing[:8]}, unexpected "
            f"{len(unexpected)} key(s) {unexpected[:8]} (check {hint})"
        )


def check_shape(key: str, tensor: Tensor, shape: tuple[int, ...]) -> None:
    """Raise ValueError when ``tensor`` is not ``shape``."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{key} has shape {tuple(tensor.shape)}, expected {shape} from the config")


def moe_to_hf(
    key: str, prefix: str, rest: str, tensor: Tensor, e: int, f: int, d: int, out: dict[str, Tensor]
) -> bool:
    """Rename one of our layer tensors (``rest`` after the layer prefix) into ``out`` if it is MoE-specific.

    ``mlp.router.*`` -> ``mlp.gate.*``; stacked experts -> per-expert views (no copy). Returns False for any
    other tensor (the caller keeps its name).

    Raises:
        ValueError: a stacked expert tensor does not have shape ``[E, 2F, D]`` / ``[E, D, F]``.
    """
    if rest.startswith("mlp.router."):
        out[prefix + "mlp.gate." + rest.removeprefix("mlp.router.")] = tensor
    elif rest == "mlp.experts.gate_up_proj":
        check_shape(key, tensor, (e, 2 * f, d))
        for x in range(e):
            out[f"{prefix}mlp.experts.{x}.gate_proj.weight"] = tensor[x, :f]
            out[f"{prefix}mlp.experts.{x}.up_proj.weight"] = tensor[x, f:]
    elif rest == "mlp.experts.down_proj":
        check_shape(key, tensor, (e, d, f))
        for x in range(e):
            out[f"{prefix}mlp.experts.{x}.down_proj.weight"] = tensor[x]
    else:
        return False
    return True


def stack_hf_experts(
    experts: dict[tuple[str, str], dict[int, Tensor]], e: int, out: dict[str, Tensor]
) -> list[str]:
    """Stack per-expert HF tensors, collected as ``{(our layer prefix, proj): {expert: tensor}}``, into
    ``out[prefix + "mlp.experts.gate_up_proj" | "down_proj"]``. Returns the names of missing expert tensors
    (nothing is written for a layer with any missing)."""
    missing: list[str] = []
    for prefix in sorted({p for p, _ in experts}):
        per = {p: experts.get((prefix, p), {}) for p in ("gate_proj", "up_proj", "down_proj")}
        gone = [f"{prefix}mlp.experts.{x}.{p}" for p, got in per.items() for x in range(e) if x not in got]
        if gone:
            missing += gone
            continue
        gate = torch.stack([per["gate_proj"][x] for x in range(e)])
        up = torch.stack([per["up_proj"][x] for x in range(e)])
        out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[prefix + "mlp.experts.down_proj"] = torch.stack([per["down_proj"][x] for x in range(e)])
    return missing


def write_hf_checkpoint(
    hf_tensors: dict[str, Tensor],
    config_dict: dict,
    generation_ids: dict,
    out_dir: str | Path,
    dtype: torch.dtype,
    keep_fp32: Callable[[str], bool],
) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` into ``out_dir``.

    Tensors are copied to CPU (per-expert views share storage, which safetensors refuses) and cast to ``dtype``
    except those for which ``keep_fp32(name)`` holds.

    Raises:
        TypeError: a tensor is a sharded DTensor (gather a full state dict first, e.g. with
            ``torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=
            StateDictOptions(full_state_dict=True, cpu_offload=True))``).
    """
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    for key, tensor in hf_tensors.items():
        if type(tensor).__name__ == "DTensor":
            raise TypeError(
                f"{key} is a DTensor; save_hf_checkpoint needs full tensors (gather the state dict first)"
            )
        target = torch.float32 if keep_fp32(key) else dtype
        tensors[key] = tensor.detach().to(device="cpu", dtype=target, copy=True).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    gen = {k: v for k, v in generation_ids.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def read_hf_tensors(path: str | Path) -> dict[str, Tensor]:
    """CPU tensors of ``path/model.safetensors`` or of the shards listed in ``model.safetensors.index.json``.

    Raises:
        FileNotFoundError: neither file exists.
    """
    from safetensors.torch import load_file

    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single), device="cpu")
    if index.is_file():
        hf: dict[str, Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            hf.update(load_file(str(path / shard), device="cpu"))
        return hf
    raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


class HFBlock(NamedTuple):
    """One Hugging Face tensor's place inside one of our (global, unsharded) tensors.

    The HF tensor of shape ``shape`` fills the region that starts at ``offset`` (one entry per dim of our tensor)
    and has the extent ``(1,) * (ndim - len(shape)) + shape``: leading singleton dims are added, e.g. expert
    ``e``'s ``gate_proj [F, D]`` is the region ``[e:e+1, 0:F, 0:D]`` of our ``gate_up_proj [E, 2F, D]``.
    """

    key: str
    """HF on-disk tensor name."""
    offset: tuple[int, ...]
    """start of the region in our global tensor."""
    shape: tuple[int, ...]
    """the HF tensor's shape."""


def moe_hf_sources(
    rest: str, prefix: str, shape: tuple[int, ...], e: int, f: int, d: int
) -> list[HFBlock] | None:
    """The HF blocks of one of our layer tensors (``rest`` after the layer prefix) if it is MoE-specific (the
    inverse direction of :func:`moe_to_hf`, as regions instead of views); None for any other tensor.

    Raises:
        ValueError: a stacked expert tensor's ``shape`` is not ``[E, 2F, D]`` / ``[E, D, F]``.
    """
    if rest.startswith("mlp.router."):
        return [HFBlock(prefix + "mlp.gate." + rest.removeprefix("mlp.router."), (0,) * len(shape), shape)]
    if rest == "mlp.experts.gate_up_proj":
        if shape != (e, 2 * f, d):
            raise ValueError(f"{prefix}{rest} has shape {shape}, expected {(e, 2 * f, d)} from the config")
        return [
            b
            for x in range(e)
            for b in (
                HFBlock(f"{prefix}mlp.experts.{x}.gate_proj.weight", (x, 0, 0), (f, d)),
                HFBlock(f"{prefix}mlp.experts.{x}.up_proj.weight", (x, f, 0), (f, d)),
            )
        ]
    if rest == "mlp.experts.down_proj":
        if shape != (e, d, f):
            raise ValueError(f"{prefix}{rest} has shape {shape}, expected {(e, d, f)} from the config")
        return [HFBlock(f"{prefix}mlp.experts.{x}.down_proj.weight", (x, 0, 0), (d, f)) for x in range(e)]
    return None


def hf_weight_map(path: str | Path) -> dict[str, str]:
    """``{hf_key: file name}`` of a checkpoint directory: every key of ``model.safetensors`` (read from its header
    only) or, when that file is absent, the ``weight_map`` of ``model.safetensors.index.json``.

    Raises:
        FileNotFoundError: neither file exists.
        ValueError: the index has no ``weight_map``.
    """
    from safetensors import safe_open

    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():  # the same preference as read_hf_tensors
        with safe_open(str(single), "pt") as fh:
            return {k: single.name for k in fh.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    if index.is_file():
        data = json.loads(index.read_text())
        if not isinstance(data.get("weight_map"), dict):
            raise ValueError(f"{index} has no 'weight_map' object; write the index as transformers does")
        return dict(data["weight_map"])
    raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
