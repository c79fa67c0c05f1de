"""Argument and cross-rank checks shared by the expert-parallel backends (``torch`` and ``deep_ep``).

Shape legend:
    T  tokens on this rank (may be 0)       D  hidden size
    K  experts per token (top_k)            E  routed experts; expert e lives on rank ``e // L``
    R  ranks in the EP group                L  local experts per rank, ``E / R``
    C  dispatch chunks (the same number on every rank)

Every rank checks its own inputs (shapes, dtypes, ``align``, ``chunk_size``, the FP8 payload's finiteness, and the
backend's own limits), then ONE ``all_gather`` carries each rank's verdict together with ``E``, ``R``, ``D``,
``chunk_size``, the range of its expert ids and (when ``E <= FUSED_MAX_EXPERTS`` and one chunk) its per-expert
counts, so that bad input on any rank raises ``ValueError`` on EVERY rank before a token moves (a raise on one rank
alone would leave its peers waiting in the next collective). The counts riding along are the ``torch`` backend's
split sizes; the ``deep_ep`` backend runs the same collective for its validation and ignores them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

DEEP_EP_INSTALL = (
    "backend='deep_ep' needs the deep_ep package (DeepEP >= 2.0, https://github.com/deepseek-ai/DeepEP, the "
    "`ElasticBuffer` API), which requires CUDA GPUs and NCCL (its low-latency `Buffer` also NVSHMEM) and is "
    "built from source: clone the repository and run `python setup.py install` as its README describes (or "
    "install moe_rl's `gpu` extra on a CUDA machine). "
    "Use backend='torch' on CPU or without DeepEP."
)
"""The install hint every ``deep_ep`` code path raises ``ImportError`` with when DeepEP is missing."""

FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
"""The float8 dtypes this torch build has (they travel as ``uint8``: gloo has no float8)."""

_HEADER = 8
"""Ints per rank in front of the counts in the fused validation/count ``all_gather``: num_experts, world size,
D, chunk_size (0 = None), local chunks, shape problem (0/1), min id, max id."""
FUSED_MAX_EXPERTS = 512
"""Per-expert counts ride in the validation ``all_gather`` (one collective before the rows) when E is at most
this; the payload has a fixed size (``_HEADER + FUSED_MAX_EXPERTS`` int64 per rank) so that ranks that disagree
on E still meet in a well-formed collective and raise. Larger E or chunked dispatch add one ``all_gather`` of the
per-chunk counts after validation."""


def fp8_problem(x_TD: Tensor) -> str | None:
    """Why ``x_TD`` cannot be quantized for an fp8 dispatch (one host sync for the finiteness check)."""
    if not x_TD.dtype.is_floating_point or x_TD.dtype in FLOAT8_DTYPES:
        return f"fp8=True needs a float x_TD (fp32/bf16/fp16) to quantize, got dtype {x_TD.dtype}"
    n_bad = int((~torch.isfinite(x_TD)).sum())
    if n_bad:
        return f"fp8=True: x_TD has {n_bad} non-finite value(s) (inf/NaN), which FP8 quantization refuses"
    return None


def agree_finite(t: Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise on EVERY rank of ``group`` if ``t`` holds inf/NaN on ANY rank (one ``all_reduce`` of R ints).

    Used where FP8 quantization runs without the validation ``all_gather`` (a reused handle, the FP8 backward of
    combine): raising only on the rank with the bad values would leave its peers waiting in the next exchange.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    bad_R = torch.zeros(world, dtype=torch.int64, device=t.device)
    bad_R[rank] = (~torch.isfinite(t)).sum()
    dist.all_reduce(bad_R, group=group)
    bad = {r: n for r, n in enumerate(bad_R.tolist()) if n}
    if bad:
        detail = ", ".join(f"rank {r}: {n}" for r, n in bad.items())
        raise ValueError(
            f"{what} holds non-finite values (inf/NaN) on EP rank(s) {sorted(bad)} ({detail} values), which FP8 "
            "quantization refuses; find the source of the inf/NaN (e.g. lower the learning rate, check the loss "
            "scale) or run this layer without FP8"
        )


def routing_problem(x: Tensor, x_name: str, topk_ids_TK: Tensor) -> str | None:
    """The checks every EP entry point makes on its tokens and their routing (no host sync).

    Args:
        x: the tokens, must be 2-D ``[T, hidden]``.
        x_name: ``x``'s name in the messages, ending in its dims (``"x_TD"``, ``"x_TH"``).
        topk_ids_TK: the expert ids, must be an integer ``[T, K]`` tensor with ``x``'s ``T``.

    Returns:
        The first problem as a message naming the argument, its shape/dtype and the rule, or None.
    """
    dims = ", ".join(x_name.rsplit("_", 1)[-1])
    if x.dim() != 2:
        return f"{x_name} must be 2-D [{dims}], got shape {tuple(x.shape)}"
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x.shape[0]:
        return (f"topk_ids_TK must be [T, K] with T={x.shape[0]} (the rows of {x_name}), got shape "
                f"{tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        return f"topk_ids_TK must be an integer tensor, got dtype {topk_ids_TK.dtype}"
    return None


def local_problem(
    x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, align: int, chunk_size, fp8: bool = False
) -> str | None:
    """Shape/argument problems visible on this rank (id range is checked after the gather); no host sync unless
    ``fp8`` (finiteness of ``x_TD``)."""
    if problem := routing_problem(x_TD, "x_TD", topk_ids_TK):
        return problem
    if tuple(topk_weights_TK.shape) != tuple(topk_ids_TK.shape):
        return (
            f"topk_weights_TK has shape {tuple(topk_weights_TK.shape)} but topk_ids_TK has "
            f"{tuple(topk_ids_TK.shape)}; they must match"
        )
    if align < 1:
        return f"align={align} must be >= 1 (1 = no padding; 128 = DeepGEMM contiguous layout)"
    if chunk_size is not None and chunk_size < 1:
        return f"chunk_size={chunk_size} must be >= 1 or None (no chunking)"
    return fp8_problem(x_TD) if fp8 else None


def expert_keys(ids_TK: Tensor, num_experts: int) -> Tensor:
    """``[T * K]`` int64 expert id per slot, with -1 and out-of-range ids mapped to E (sorted last, dropped)."""
    key_N = ids_TK.reshape(-1).to(torch.int64)
    return torch.where((key_N >= 0) & (key_N < num_experts), key_N, torch.full_like(key_N, num_experts))


def _chunk_counts(key_N: Tensor, top_k: int, step: int, num_chunks: int, num_experts: int) -> Tensor:
    """``[C, E]`` int64 slots per (chunk, expert); one ``bincount``, no host sync."""
    chunk_N = torch.arange(key_N.shape[0], device=key_N.device) // max(step * top_k, 1)
    flat = torch.bincount(chunk_N * (num_experts + 1) + key_N, minlength=num_chunks * (num_experts + 1))
    return flat[: num_chunks * (num_experts + 1)].view(num_chunks, num_experts + 1)[:, :num_experts]


def _splits(counts_RCE: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """From every rank's ``[R, C, E]`` counts: ``[C, R, L]`` rows this rank receives per (chunk, source, local
    expert) and the flat ``[2 * C * R + L]`` host-bound send splits and recv splits per chunk, then rows received
    per local expert."""
    _, num_chunks, num_experts = counts_RCE.shape
    local = num_experts // world
    send_CR = counts_RCE[rank].view(num_chunks, world, local).sum(2)
    recv_CRL = counts_RCE[:, :, rank * local : (rank + 1) * local].permute(1, 0, 2)
    return recv_CRL, torch.cat([send_CR.reshape(-1), recv_CRL.sum(2).reshape(-1), recv_CRL.sum((0, 1))])


def validate_and_count(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None,
    num_experts: int,
    align: int,
    chunk_size: int | None,
    fp8: bool = False,
    extra_problem: str | None = None,
) -> tuple[int, Tensor, list[int]]:
    """Validate across ranks and exchange per-expert counts, before any token moves.

    ``extra_problem``: a backend's own rank-local objection (e.g. more tokens than the DeepEP buffer was sized
    for), reported like a shape problem, so it too raises on every rank.

    One ``all_gather`` of ``_HEADER + FUSED_MAX_EXPERTS`` int64 per rank carries both the validation ints and
    this rank's per-expert counts (the counts are computed speculatively; they are only used once every rank's
    header passed). Chunked dispatch or ``E > FUSED_MAX_EXPERTS`` adds one ``all_gather`` of ``[C, E]`` counts.
    Exactly one host sync per collective (the ``tolist`` that yields the split sizes).

    Raising on every rank (not only on the rank with the bad input) keeps the others from waiting in a
    collective that will never come.

    Returns:
        ``(num_chunks, recv_CRL, splits)``: C = max over ranks of ``ceil(T / chunk_size)`` (at least 1),
        ``[C, R, L]`` int64 rows received per (chunk, source rank, local expert) on the device, and the host
        list of send splits then recv splits, ``C * R`` each, then the ``L`` rows received per local expert.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = x_TD.device
    problem = local_problem(x_TD, topk_ids_TK, topk_weights_TK, align, chunk_size, fp8) or extra_problem
    num_tokens = x_TD.shape[0]
    local_chunks = 1 if chunk_size is None or problem is not None else math.ceil(num_tokens / chunk_size)
    hidden = x_TD.shape[-1] if x_TD.dim() == 2 else -1
    head = torch.tensor(
        [num_experts, world, hidden, chunk_size or 0, local_chunks, int(problem is not None)],
        dtype=torch.int64,
        device=device,
    )
    lo_hi = torch.zeros(2, dtype=torch.int64, device=device)
    counts = torch.zeros(FUSED_MAX_EXPERTS, dtype=torch.int64, device=device)
    fused = problem is None and 1 <= num_experts <= FUSED_MAX_EXPERTS and num_experts % world == 0
    if problem is None and topk_ids_TK.numel():
        lo_hi = torch.stack(torch.aminmax(topk_ids_TK.to(torch.int64)))
    if fused and local_chunks == 1 and topk_ids_TK.numel():
        key_N = expert_keys(topk_ids_TK, num_experts)
        counts[:num_experts] = torch.bincount(key_N, minlength=num_experts + 1)[:num_experts]
    mine = torch.cat([head, lo_hi, counts])
    gathered_RX = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_single(gathered_RX, mine, group=group)  # flat output: gloo wants [R * X]
    gathered_RX = gathered_RX.view(world, -1)
    speculative: list[int] = []
    if fused:  # splits from the gathered counts, fetched in the same host sync as the headers
        counts_RCE = gathered_RX[:, _HEADER : _HEADER + num_experts].unsqueeze(1)
        recv_CRL, splits = _splits(counts_RCE, rank, world)
        host = torch.cat([gathered_RX[:, :_HEADER].reshape(-1), splits]).tolist()
        per_rank = [host[r * _HEADER : (r + 1) * _HEADER] for r in range(world)]
        speculative = host[world * _HEADER :]
    else:
        per_rank = gathered_RX[:, :_HEADER].tolist()

    def column(i: int) -> list[int]:
        return [row[i] for row in per_rank]

    bad_ranks = [r for r, row in enumerate(per_rank) if row[5]]
    if bad_ranks:
        here = f"; on this rank: {problem}" if problem is not None else ""
        raise ValueError(f"invalid dispatch input on EP rank(s) {bad_ranks}{here}")
    for i, name in (
        (0, "num_experts"),
        (1, "world size"),
        (2, "hidden size D"),
        (3, "chunk_size (0 = None)"),
    ):
        if len(set(column(i))) != 1:
            raise ValueError(
                f"EP ranks disagree on {name}: per-rank values {column(i)}; every rank of the group must pass "
                "the same value"
            )
    bad_ids = [r for r, row in enumerate(per_rank) if row[6] < -1 or row[7] >= num_experts]
    if bad_ids:
        ranges = ", ".join(f"rank {r}: [{per_rank[r][6]}, {per_rank[r][7]}]" for r in bad_ids)
        raise ValueError(
            f"invalid dispatch input on EP rank(s) {bad_ids}: topk_ids_TK holds values outside "
            f"[-1, num_experts - 1 = {num_experts - 1}] ({ranges}; -1 means 'no expert' for that slot)"
        )
    if num_experts < 1 or num_experts % world != 0:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the EP group size {world} "
            "(each rank holds num_experts / ep experts)"
        )
    num_chunks = max(1, max(column(4)))
    if fused and num_chunks == 1:
        return 1, recv_CRL, speculative
    # Chunked (or E > FUSED_MAX_EXPERTS): every rank now agrees on C and E; one more all_gather of [C, E].
    step = num_tokens if chunk_size is None else chunk_size
    mine_CE = _chunk_counts(
        expert_keys(topk_ids_TK, num_experts), topk_ids_TK.shape[1], step, num_chunks, num_experts
    )
    counts_RCE = torch.empty(world * num_chunks * num_experts, dtype=torch.int64, device=device)
    dist.all_gather_single(counts_RCE, mine_CE.reshape(-1), group=group)
    counts_RCE = counts_RCE.view(world, num_chunks, num_experts)
    recv_CRL, splits = _splits(counts_RCE, rank, world)
    return num_chunks, recv_CRL, splits.tolist()


def import_deep_ep():
    """``import deep_ep``, requiring DeepEP's current (V2, >= 2.0) API: ``deep_ep.ElasticBuffer``.

    Raises:
        ImportError: DeepEP is not installed (the message says how to install it), or the installed build is a
            V1-only release (it has ``deep_ep.Buffer`` but no ``deep_ep.ElasticBuffer``; install DeepEP >= 2.0).
    """
    try:
        import deep_ep
    except ImportError as err:
        raise ImportError(DEEP_EP_INSTALL) from err
    if not hasattr(deep_ep, "ElasticBuffer"):
        version = getattr(deep_ep, "__version__", "unknown")
        raise ImportError(
            f"the installed deep_ep (version {version}, {getattr(deep_ep, '__file__', '?')}) has no ElasticBuffer: "
            "it is a V1-only DeepEP release (deep_ep.Buffer). moe_rl's deep_ep backend drives DeepEP >= 2.0 "
            "(deep_ep.ElasticBuffer / EPHandle); upgrade DeepEP (" + DEEP_EP_INSTALL + ")"
        )
    return deep_ep


def check_backend(backend: str) -> None:
    """Refuse an unknown backend name (ValueError); for ``"deep_ep"`` also a missing or V1-only DeepEP
    (ImportError, see :func:`import_deep_ep`). Never falls back to another backend."""
    if backend == "torch":
        return
    if backend == "deep_ep":
        import_deep_ep()
        return
    raise ValueError(f"backend={backend!r} is not supported; use 'torch' or 'deep_ep'")


def check_reuse(
    handle,
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group,
    num_experts: int,
    align: int,
    chunk_size: int | None,
) -> None:
    """Rank-local checks of a reused handle (either backend's; no collective, no host sync)."""
    expected = {
        "group": (group, handle.group),
        "num_experts": (num_experts, handle.num_experts),
        "align": (align, handle.align),
        "chunk_size": (chunk_size, getattr(handle, "chunk_size", None)),
        "x_TD shape": (tuple(x_TD.shape), (handle.num_tokens, handle.hidden)),
        "topk_ids_TK shape": (tuple(topk_ids_TK.shape), (handle.num_tokens, handle.top_k)),
        "topk_weights_TK shape": (tuple(topk_weights_TK.shape), (handle.num_tokens, handle.top_k)),
    }
    for name, (got, want) in expected.items():
        if got != want:
            raise ValueError(
                f"dispatch(handle=...): {name} is {got!r} but the handle was built with {want!r}; pass "
                "handle=None to build a new layout (on every rank)"
            )
