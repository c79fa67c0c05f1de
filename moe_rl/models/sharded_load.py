"""Load a sharded Hugging Face safetensors checkpoint into a (meta-built, parallelized) model, each rank reading
only the elements it holds.

Shape legend:
    E    routed experts, F expert width (``moe_intermediate_size``), D hidden size
    n    one dim of a tensor; a local shard is the box ``[offset, offset + local_shape)`` of the global tensor

The sequence for a model too large for one rank (e.g. GLM-5.1, 744B parameters)::

    model = build_on_meta(cfg)                            # no memory
    parallelize_model(model, dims, mesh, ...)             # FSDP2 / EP DTensors, still on meta
    model.to_empty(device=...)                            # this rank's shards, uninitialised
    stats = load_sharded_hf_checkpoint(model, path, cfg)  # fills every parameter and buffer

For every tensor of ``model.state_dict()`` (a DTensor or a plain tensor; wrapper prefixes stripped) the loader
computes this rank's box in global coordinates
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, what ``torch.distributed.checkpoint``
uses: torch 2.13 has no public equivalent), asks the model family's ``hf_sources`` where the global tensor lives in
the checkpoint (a list of :class:`moe_rl.models.hf_io.HFBlock` regions: one HF tensor for most keys, one per expert
and projection for the stacked ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``), and reads the
intersection of the box with each region via ``safetensors.safe_open(file).get_slice(key)[...]``, casting to the
tensor's dtype. An EP rank that owns experts ``[e0, e1)`` (and an FSDP slice of them) thus opens only those
experts' HF keys, and only its rows of them.

Buffers: both families register one buffer, the MoE routers' ``e_score_correction_bias [E]`` (fp32,
persistent), which is in the checkpoint and loaded like a parameter. Rotary tables are computed on the fly
(:func:`moe_rl.models.rope.rope_cos_sin`), so nothing else needs re-initialising after ``to_empty``; a
non-persistent buffer (none today) would be left uninitialised by ``to_empty``, so the loader raises for one
rather than return a model with garbage in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
    from moe_rl.models.hf_io import HFBlock

__all__ = ["LoadStats", "build_on_meta", "load_sharded_hf_checkpoint"]


@dataclass
class LoadStats:
    """What one rank read in :func:`load_sharded_hf_checkpoint`."""

    bytes_read: int = 0
    """bytes of tensor data read from the files (stored dtype, before casting)."""
    tensors_read: int = 0
    """``get_slice(...)[...]`` reads (one per HF tensor region that intersects a local shard)."""
    files_opened: int = 0
    """safetensors files this rank read tensor data from."""
    headers_read: int = 0
    """safetensors file headers parsed to check the presence and shape of every needed tensor (every rank checks
    all of them, so a bad checkpoint raises on every rank; no tensor data is read)."""


def build_on_meta(cfg: GlmMoeConfig | GlmMoeDsaConfig, **kwargs) -> nn.Module:
    """The model of ``cfg`` on the meta device (no memory, no initialisation cost).

    Args:
        cfg: a :class:`GlmMoeConfig` (-> :class:`GlmMoeForCausalLM`), :class:`GlmMoeDsaConfig`
            (-> :class:`GlmMoeDsaForCausalLM`), ``DeepseekV3Config`` (-> ``DeepseekV3ForCausalLM``) or
            ``NemotronHConfig`` (-> ``NemotronHForCausalLM``, experts per ``experts_backend``).
        **kwargs: passed to the model's constructor (``experts_backend``, ``with_mtp``).

    Raises:
        TypeError: ``cfg`` is none of these config types.
    """
    from moe_rl.models.families import FAMILIES, family_of, model_class

    try:
        cls = model_class(family_of(cfg, kind="config"))
    except TypeError:
        raise TypeError(f"cfg must be a {_one_of(f.config_name for f in FAMILIES)}, got {type(cfg).__name__}") from None
    with torch.device("meta"):
        return cls(cfg, **kwargs)


def _one_of(names) -> str:
    """``"A, B, C or D"``."""
    *head, last = names
    return f"{', '.join(head)} or {last}"


def _family(model: nn.Module, cfg):
    """``(hf_sources(shapes), hf_key_ignored(key))`` of the model's family."""
    from moe_rl.models.families import FAMILIES, config_class, family_of, state_dict_module

    try:
        fam = family_of(model, kind="model")
    except TypeError:
        raise TypeError(f"model must be a {_one_of(f.model_name for f in FAMILIES)}, got {type(model).__name__}") from None
    if not isinstance(cfg, config_class(fam)):
        raise TypeError(f"cfg must be a {fam.config_name} for {fam.model_name}, got {type(cfg).__name__}")
    sd = state_dict_module(fam)
    extra = {"with_mtp": len(model.mtp_layers) > 0} if fam.mtp_keys_optional else {}
    return (lambda shapes: sd.hf_sources(shapes, cfg)), (lambda key: sd.hf_key_ignored(key, cfg, **extra))


def _local_box(t: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, local shape, global offset)`` of a DTensor or plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t._local_tensor, tuple(t.shape), tuple(shape), tuple(offset)
    return t, tuple(t.shape), tuple(t.shape), (0,) * t.dim()


def load_sharded_hf_checkpoint(
    model: nn.Module,
    path: str | Path,
    cfg: GlmMoeConfig | GlmMoeDsaConfig | None = None,
    *,
    device: torch.device | str | None = None,
) -> LoadStats:
    """Fill every parameter and buffer of ``model`` (this rank's shards) from a Hugging Face checkpoint directory,
    reading only the elements this rank holds.

    Works on a plain model and on one from :func:`moe_rl.distributed.parallelize.parallelize_model` (FSDP2 and EP
    DTensors, activation-checkpoint wrappers), for :class:`GlmMoeForCausalLM` and :class:`GlmMoeDsaForCausalLM`
    (with or without MTP layers). Names and layouts: ``hf_sources`` of
    :mod:`moe_rl.models.glm4_moe.state_dict` / :mod:`moe_rl.models.glm_moe_dsa.state_dict`. The result equals
    ``model.load_state_dict(load_hf_state_dict(path, cfg))`` on the unsharded model, bit for bit.

    Every rank parses the headers of every file holding a needed tensor (presence and shape checks, so a bad
    checkpoint raises on all ranks alike), then reads tensor data only from the files its shards need. The shard
    boxes are those ``torch.distributed.checkpoint`` plans with (``DTensor.__create_chunk_list__``); reading a
    box of a safetensors tensor is ``safe_open(...).get_slice(key)[...]`` (safetensors docs, "Loading only part
    of the tensors").

    Args:
        model: the model; its tensors must be materialised (``model.to_empty(device=...)`` after meta-device
            construction), or pass ``device``.
        path: directory with ``model.safetensors`` or ``model.safetensors.index.json`` + the files it lists.
        cfg: the model's config (default ``model.config``).
        device: if given and the model still has meta tensors, ``model.to_empty(device=device)`` is called first
            (and a tied ``lm_head`` re-tied when that broke the tie: verl-project/verl PR #7835).

    Returns:
        :class:`LoadStats` of this rank.

    Raises:
        TypeError: ``model`` / ``cfg`` of an unsupported type.
        FileNotFoundError: no checkpoint in ``path``, or a file the index names is missing.
        ValueError: the model still has meta tensors (and no ``device``); the model's keys do not match ``cfg``;
            a tensor the model needs is missing from the checkpoint; the checkpoint has tensors the model does
            not use; a checkpoint tensor's shape differs from the model's; a non-persistent buffer exists.
    """
    from safetensors import safe_open

    from moe_rl.models.hf_io import hf_weight_map, strip_wrappers

    cfg = model.config if cfg is None else cfg
    sources_of, ignored = _family(model, cfg)
    path = Path(path)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        if device is None:
            raise ValueError(
                "model has tensors on the meta device; call model.to_empty(device=...) first (after "
                "parallelize_model) or pass device=..."
            )
        model.to_empty(device=device)
        emb = model.embed_tokens if hasattr(model, "embed_tokens") else getattr(model, "embeddings", None)
        if getattr(cfg, "tie_word_embeddings", False) and emb is not None and model.lm_head.weight is not emb.weight:
            model.lm_head.weight = emb.weight  # verl-project/verl PR #7835: to_empty of an unsharded model unties

    state = model.state_dict(keep_vars=True)
    persistent = {id(t) for t in state.values()}
    for name, buf in model.named_buffers():
        if id(buf) not in persistent:
            raise ValueError(
                f"buffer {name} is non-persistent: it is not in the checkpoint and to_empty left it uninitialised; "
                "re-initialise it after loading (the loader knows of no such buffer in these models)"
            )
    # one entry per distinct tensor (a tied lm_head is the embedding parameter: read once)
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    shapes: dict[str, tuple[int, ...]] = {}
    for raw, t in state.items():
        key = strip_wrappers(raw)
        shapes[key] = tuple(t.shape)
        if id(t) not in seen:
            seen.add(id(t))
            tensors[key] = t
    sources = sources_of(shapes)
    weight_map = hf_weight_map(path)

    needed = {b.key for blocks in sources.values() for b in blocks}
    missing = sorted(needed - set(weight_map))
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:4]} (in no file of "
            f"its index / model.safetensors); check that the checkpoint matches the config (layers, experts, "
            "MTP: build with with_mtp=False for a checkpoint without MTP layers)"
        )
    unexpected = sorted(k for k in weight_map if k not in needed and not ignored(k))
    if unexpected:
        raise ValueError(
            f"checkpoint {path} has {len(unexpected)} tensor(s) the model does not use, e.g. {unexpected[:4]} "
            f"(file {weight_map[unexpected[0]]}); the config does not match the checkpoint (check its layer, "
            "expert and attention fields)"
        )

    # plan: per file, the (local tensor, block, box) reads
    plan: dict[str, list[tuple[str, Tensor, tuple[int, ...], HFBlock, tuple[int, ...], tuple[int, ...]]]] = {}
    for key, t in tensors.items():
        local, gshape, lshape, offset = _local_box(t)
        if tuple(local.shape) != lshape:
            raise ValueError(
                f"{key}: local shard has shape {tuple(local.shape)} but its placements give {lshape}; this "
                "sharding layout is not supported by the sharded loader (load a full state dict instead)"
            )
        covered = 0
        for block in sources[key]:
            lo, hi = _intersect(block, gshape, offset, lshape)
            if lo is None:
                continue
            covered += math.prod(h - a for a, h in zip(lo, hi, strict=True))
            plan.setdefault(weight_map[block.key], []).append((key, local, offset, block, lo, hi))
        if covered != local.numel():
            raise ValueError(
                f"{key}: the checkpoint regions cover {covered} of the {local.numel()} elements of this rank's "
                "shard (a bug in hf_sources; report it)"
            )

    stats = LoadStats()
    _check_headers(path, weight_map, sources, stats)
    with torch.no_grad():
        for fname in sorted(plan):
            stats.files_opened += 1
            with safe_open(str(path / fname), "pt", device="cpu") as fh:
                for _key, local, off, block, lo, hi in plan[fname]:
                    sl = fh.get_slice(block.key)
                    lead = len(lo) - len(block.shape)
                    idx = tuple(
                        slice(a - o, b - o)
                        for a, b, o in zip(lo[lead:], hi[lead:], block.offset[lead:], strict=True)
                    )
                    data = sl[idx]
                    stats.tensors_read += 1
                    stats.bytes_read += data.numel() * data.element_size()
                    dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, off, strict=True))
                    local[dst].copy_(data.reshape(tuple(b - a for a, b in zip(lo, hi, strict=True))))
    return stats


def _check_headers(
    path: Path, weight_map: dict[str, str], sources: dict[str, list[HFBlock]], stats: LoadStats
) -> None:
    """Check every needed tensor's presence and shape from the file headers (no tensor data is read), so all
    ranks raise the same error rather than only the ranks whose shard reads the bad tensor."""
    from safetensors import safe_open

    by_file: dict[str, list[tuple[str, HFBlock]]] = {}
    for key, blocks in sources.items():
        for block in blocks:
            by_file.setdefault(weight_map[block.key], []).append((key, block))
    for fname in sorted(by_file):
        file = path / fname
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} (named by the index of {path}) does not exist; complete the download"
            )
        stats.headers_read += 1
        with safe_open(str(file), "pt", device="cpu") as fh:
            present = set(fh.keys())  # noqa: SIM118 (safe_open is not a mapping)
            for key, block in by_file[fname]:
                if block.key not in present:
                    raise ValueError(
                        f"{block.key} (for {key} of the model) is listed in the index of {path} under {fname}, "
                        f"but {file} does not contain it; rewrite the index (or the file) so they agree"
                    )
                found = tuple(fh.get_slice(block.key).get_shape())
                if found != block.shape:
                    raise ValueError(
                        f"{block.key} in {file} has shape {found}, but {key} of the model needs {block.shape}; "
                        "the checkpoint does not match the config (check hidden_size, intermediate sizes, heads, "
                        "vocab_size)"
                    )


def _intersect(
    block: HFBlock, gshape: tuple[int, ...], offset: tuple[int, ...], lshape: tuple[int, ...]
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``(lo, hi)`` global bounds of the intersection of ``block``'s region with the box ``[offset, offset +
    lshape)``, or ``(None, None)`` when it is empty."""
    lead = len(gshape) - len(block.shape)
    extent = (1,) * lead + tuple(block.shape)
    lo = tuple(max(o, b) for o, b in zip(offset, block.offset, strict=True))
    hi = tuple(min(o + n, b + x) for o, n, b, x in zip(offset, lshape, block.offset, extent, strict=True))
    if any(h <= a for a, h in zip(lo, hi, strict=True)):
        return None, None
    return lo, hi
