"""The pieces of a sharded model every trainer rank publishes, and their assembly on the engine side.

Shape legend: ``F`` the full shape of one Hugging Face checkpoint tensor (rank ``d``), ``o`` the global offset of a
piece inside it, ``s`` the piece's shape (``o[i] + s[i] <= F[i]``).

A trainer rank holds, for every parameter, the region of the global tensor its DTensor shard covers
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: FSDP2 ``Shard``/``_StridedShard``, EP
``Shard`` and ``Replicate`` placements). A parameter maps to one or more Hugging Face tensors, each a region of it
(``hf_sources`` of the model family's ``state_dict`` module: per-expert slices of stacked experts, MTP layers as
``model.layers.{L+m}``). A *piece* is the intersection of the rank's region with one Hugging Face tensor's region:
it is what that rank, and only that rank, publishes. Of several ranks holding the same region (``Replicate`` mesh
dims, or a plain tensor on every rank) only the one with coordinate 0 on the replicated dims publishes it, so the
pieces of all ranks tile every Hugging Face tensor exactly once; :func:`assemble` checks that.

Every transport names a piece by :func:`piece_key` (``"<hf name>@<o>@<F>"``), so the engine side can rebuild any
tensor from ``(key, piece)`` pairs whatever carried them (files, a broadcast, a store). Nothing is gathered: no rank
ever holds more than its own shards plus one cast copy of one piece.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Piece", "PieceCutter", "assemble", "hf_sources_of", "local_pieces", "parse_piece_key", "piece_key"]


@dataclass(frozen=True)
class Piece:
    """One rank's part of one Hugging Face tensor.

    Attributes:
        name: Hugging Face checkpoint name.
        full_shape: ``F``, the whole tensor's shape.
        offset: ``o``, where the piece starts in it.
        tensor: ``[s]`` the piece (CPU, contiguous, in the published dtype).
    """

    name: str
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def key(self) -> str:
        return piece_key(self.name, self.offset, self.full_shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def piece_key(name: str, offset: tuple[int, ...], full_shape: tuple[int, ...]) -> str:
    """``"<name>@<o0>_<o1>...@<F0>_<F1>..."``, the name a piece travels under (no ``|`` or whitespace: a valid
    Mooncake key component and safetensors key)."""
    return f"{name}@{'_'.join(map(str, offset))}@{'_'.join(map(str, full_shape))}"


def parse_piece_key(key: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``(name, offset, full_shape)`` of a :func:`piece_key`.

    Raises:
        ValueError: ``key`` is not a piece key (the message quotes it).
    """
    parts = key.rsplit("@", 2)
    try:
        if len(parts) != 3:
            raise ValueError
        name, o, f = parts
        offset = tuple(int(x) for x in o.split("_")) if o else ()
        full = tuple(int(x) for x in f.split("_")) if f else ()
        if len(offset) != len(full) or not name:
            raise ValueError
    except ValueError:
        raise ValueError(f"parse_piece_key: key={key!r} is not '<hf name>@<offsets>@<full shape>' "
                         "(moe_rl.weights.regions.piece_key)") from None
    return name, offset, full


def hf_sources_of(model: torch.nn.Module, mcfg: Any, shapes: dict[str, tuple[int, ...]]) -> dict:
    """``hf_sources`` of ``model``'s family (:mod:`moe_rl.models.families`): our key -> its Hugging Face regions.

    Args:
        model: a family's model (``GlmMoeForCausalLM``, ``GlmMoeDsaForCausalLM``, ``DeepseekV3ForCausalLM``,
            ``NemotronHForCausalLM``), plain or from ``parallelize_model``; any other module (a wrapper) is taken
            to be of ``mcfg``'s family.
        mcfg: its config.
        shapes: ``{our key: global shape}`` of the model's state dict (wrapper prefixes stripped).

    Returns:
        ``{our key: [HFBlock, ...]}`` (``moe_rl.models.hf_io.HFBlock``).

    Raises:
        TypeError: neither ``model`` nor ``mcfg`` belongs to a model family.
        ValueError: ``shapes`` do not match ``mcfg`` (from the family's ``hf_sources``).
    """
    from moe_rl.models.families import family_of, state_dict_module

    try:
        family = family_of(model, kind="model")
    except TypeError:
        try:
            family = family_of(mcfg, kind="config")
        except TypeError as exc:
            raise TypeError(f"hf_sources_of: model is a {type(model).__name__}, which is no family's model, so "
                            f"mcfg must name the family: {exc}") from None
    return state_dict_module(family).hf_sources(shapes, mcfg)


def _local_region(value: Any) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """``(local tensor, its global offset, whether this rank publishes it)`` of a parameter value."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        import torch.distributed as dist

        owner = not dist.is_initialized() or dist.get_rank() == 0
        return value, (0,) * value.dim(), owner
    mesh = value.device_mesh
    shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    local = value.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard shape {tuple(local.shape)} != computed {tuple(shape)} for placements "
                           f"{value.placements}: a layout this module does not know; publish with the "
                           "streaming gather (moe_rl.weights.streaming) instead")
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    owner = all(c == 0 for c, p in zip(coord, value.placements, strict=True) if isinstance(p, Replicate))
    return local, tuple(offset), owner


def local_pieces(model: torch.nn.Module, mcfg: Any, dtype: torch.dtype = torch.bfloat16) -> Iterator[Piece]:
    """This rank's pieces of ``model``'s Hugging Face checkpoint, one at a time (no collective, no gather).

    Args:
        model: a ``GlmMoeForCausalLM`` / ``GlmMoeDsaForCausalLM``, plain or from ``parallelize_model``.
        mcfg: its config.
        dtype: dtype of the published tensors; those :func:`moe_rl.models.hf_io.keeps_fp32` names stay fp32, as in
            the models' checkpoints.

    Yields:
        :class:`Piece` (CPU, contiguous, cast); empty intersections are skipped.

    Raises:
        ValueError: the model's keys do not match ``mcfg`` (from ``hf_sources``).
    """
    from moe_rl.models.hf_io import strip_wrappers

    sd = model.state_dict()
    sources, tied = _sources(model, mcfg, sd)
    for k, v in sd.items():
        key = strip_wrappers(k)
        if key == "lm_head.weight" and tied:
            continue  # the checkpoint stores the embedding once
        local, lo, owner = _local_region(v)
        if not owner or local.numel() == 0:
            continue
        local = local.detach()
        for cut in _cuts(local, lo, sources[key], dtype):
            yield cut.piece(local)


def _sources(model: torch.nn.Module, mcfg: Any, sd: dict[str, Any]) -> tuple[dict, bool]:
    """``(hf_sources of the model, whether the embedding is tied)`` for a state dict of ``model``."""
    from moe_rl.models.hf_io import strip_wrappers

    shapes = {strip_wrappers(k): tuple(v.shape) for k, v in sd.items()}
    return hf_sources_of(model, mcfg, shapes), bool(getattr(mcfg, "tie_word_embeddings", False))


@dataclass(frozen=True)
class _Cut:
    """Where one piece lies in its parameter's local tensor: ``local[region]`` (leading ``lead`` dims of size 1
    dropped), cast to ``dtype``; ``name`` / ``full_shape`` / ``offset`` as in :class:`Piece`."""

    name: str
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    region: tuple[slice, ...]
    lead: int
    dtype: torch.dtype

    def piece(self, local: torch.Tensor) -> Piece:
        part = local[self.region]
        part = part.reshape(part.shape[self.lead:]) if self.lead else part
        return Piece(self.name, self.full_shape, self.offset, part.to("cpu", self.dtype).contiguous())


def _cuts(local: torch.Tensor, lo: tuple[int, ...], blocks: Iterable[Any], dtype: torch.dtype) -> list[_Cut]:
    """The non-empty intersections of a local tensor (global offset ``lo``) with its Hugging Face tensors."""
    from moe_rl.models.hf_io import keeps_fp32

    out = []
    for blk in blocks:
        lead = local.dim() - len(blk.shape)
        size = (1,) * lead + tuple(blk.shape)
        start = [max(o, a) for o, a in zip(blk.offset, lo, strict=True)]
        stop = [min(o + s, a + n) for o, s, a, n in zip(blk.offset, size, lo, local.shape, strict=True)]
        if any(b <= a for a, b in zip(start, stop, strict=True)):
            continue
        region = tuple(slice(a - x, b - x) for a, b, x in zip(start, stop, lo, strict=True))
        offset = tuple(a - o for a, o in zip(start[lead:], blk.offset[lead:], strict=True))
        out.append(_Cut(blk.key, tuple(blk.shape), offset, region, lead,
                        torch.float32 if keeps_fp32(blk.key) else dtype))
    return out


class PieceCutter:
    """:func:`local_pieces` for a model published again and again: the cut (which parameter regions make which
    pieces, the DTensor offset arithmetic, ``hf_sources``) is computed once and reused while the model's layout is
    unchanged, which is checked on every call.

    The plan is reused only when ``model`` is the same object, its state dict (``keep_vars=True``) has the same keys
    and the same tensor objects, and every local tensor (a DTensor's ``to_local()``) starts at the same address
    (``data_ptr``) with the same shape and strides; anything else (parameters replaced or re-sharded, ``.data``
    reassigned, a new model) rebuilds it. The plan's views keep the storage they were cut from alive, so a new
    storage cannot reuse its address. The pieces are then exactly :func:`local_pieces`'s (same keys, order,
    values and dtypes; views of the parameters where no cast is needed, as there).

    Args:
        mcfg: the model's config.
        dtype: dtype of the published tensors (:func:`moe_rl.models.hf_io.keeps_fp32` names stay fp32).
    """

    def __init__(self, mcfg: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        self.mcfg, self.dtype = mcfg, dtype
        self._model: Any = None  # weakref.ref of the planned model
        self._check: list[tuple[str, Any, int, tuple[int, ...], tuple[int, ...]]] = []  # key, value, ptr, shape, stride
        self._plan: list[tuple[torch.Tensor, list[_Cut]]] = []
        self.builds = 0
        """How often the plan was (re)built."""

    def _valid(self, model: torch.nn.Module, sd: dict[str, Any]) -> bool:
        from torch.distributed.tensor import DTensor

        if self._model is None or self._model() is not model or len(sd) != len(self._check):
            return False
        for (k, v), (ck, cv, ptr, shape, stride) in zip(sd.items(), self._check, strict=True):
            if k != ck or v is not cv:
                return False
            local = v.to_local() if isinstance(v, DTensor) else v
            if local.data_ptr() != ptr or tuple(local.shape) != shape or local.stride() != stride:
                return False
        return True

    def _build(self, model: torch.nn.Module, sd: dict[str, Any]) -> None:
        import weakref

        from torch.distributed.tensor import DTensor

        from moe_rl.models.hf_io import strip_wrappers

        sources, tied = _sources(model, self.mcfg, sd)
        check, plan = [], []
        for k, v in sd.items():
            local = v.to_local() if isinstance(v, DTensor) else v
            check.append((k, v, local.data_ptr(), tuple(local.shape), local.stride()))
            key = strip_wrappers(k)
            if key == "lm_head.weight" and tied:
                continue
            region, lo, owner = _local_region(v)
            if not owner or region.numel() == 0:
                continue
            region = region.detach()
            plan.append((region, _cuts(region, lo, sources[key], self.dtype)))
        self._model, self._check, self._plan = weakref.ref(model), check, plan
        self.builds += 1

    def __call__(self, model: torch.nn.Module) -> list[Piece]:
        """This rank's pieces of ``model`` (a list; see :func:`local_pieces`).

        Raises:
            ValueError: the model's keys do not match ``mcfg`` (from ``hf_sources``).
        """
        with torch.no_grad():
            sd = model.state_dict(keep_vars=True)
            if not self._valid(model, sd):
                self._build(model, sd)
            return [cut.piece(local) for local, cuts in self._plan for cut in cuts]




def assemble(pieces: Iterable[tuple[str, torch.Tensor]], names: set[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Rebuild whole Hugging Face tensors from ``(piece_key, piece)`` pairs; nothing is returned unless every
    tensor is covered exactly once (the caller then swaps them in: an engine never serves a half-updated version).

    Args:
        pieces: ``(key, tensor)`` with keys from :func:`piece_key`, in any order.
        names: keep only these Hugging Face names (the tensors the engine serves); None keeps all.

    Returns:
        ``[(hf_name, tensor)]`` sorted by name, each ``[F]`` in its pieces' dtype.

    Raises:
        ValueError: a piece outside its tensor, pieces of one tensor with different dtypes or full shapes,
            overlapping pieces or a tensor not fully covered (element counts named).
    """
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for key, t in pieces:
        name, offset, shape = parse_piece_key(key)
        if names is not None and name not in names:
            continue
        if t.dim() != len(shape) or any(o + s > f for o, s, f in zip(offset, t.shape, shape, strict=True)):
            raise ValueError(f"assemble: piece {key!r} of shape {tuple(t.shape)} lies outside its tensor {shape}")
        dst = full.get(name)
        if dst is None:
            dst = full[name] = torch.empty(shape, dtype=t.dtype)
            covered[name] = 0
        elif dst.dtype != t.dtype or tuple(dst.shape) != shape:
            raise ValueError(f"assemble: piece {key!r} ({t.dtype}, full shape {shape}) disagrees with an earlier "
                             f"piece of {name!r} ({dst.dtype}, {tuple(dst.shape)}): pieces of two publications mixed")
        dst[tuple(slice(o, o + s) for o, s in zip(offset, t.shape, strict=True))].copy_(t)
        covered[name] += t.numel()
    bad = {n: (covered[n], full[n].numel()) for n in full if covered[n] != full[n].numel()}
    if bad:
        first = ", ".join(f"{n}: {c}/{m}" for n, (c, m) in list(bad.items())[:5])
        raise ValueError(f"assemble: {len(bad)} tensors not covered exactly once by their pieces (elements "
                         f"received/needed: {first}); a trainer rank's pieces are missing or duplicated")
    if names is not None and set(full) != names:
        missing = sorted(names - set(full))[:5]
        raise ValueError(f"assemble: no pieces of {len(names - set(full))} requested tensors (e.g. {missing})")
    return sorted(full.items())
