"""Expert-parallel token dispatch and combine (functional core), with autograd, chunking and alignment padding.

Shape legend:
    T  tokens on this rank (may be 0)
    D  hidden size
    K  experts per token (top_k)
    E  routed experts in total; expert e lives on rank ``e // L``
    R  ranks in the expert-parallel group (ep size)
    L  local experts per rank, L = E / R
    n  valid token-slots this rank sends (slots whose expert id is not -1), n <= T * K
    M  rows this rank receives for its L experts (unpadded)
    P  rows handed to the local experts, P = M when ``align == 1``, else each expert's segment padded up
       to a multiple of ``align`` with zero rows

Data flow of the ``"torch"`` backend (torchtitan's all2all token dispatcher,
``torchtitan/models/common/token_dispatcher.py``, and DeepEP normal-mode ``Buffer.dispatch``/``combine``
semantics, ``deep_ep/buffers/legacy.py``)::

    dispatch:
      validation + counts   one all_gather: per rank [header ints, min/max id, counts_E]   (1 host sync)
      slots sorted by (chunk, expert), stable                 ids_TK -> slot_n
      row exchange     all_to_all_single(x_TD[token_n])        -> rank-major rows (e0r0, e1r0, .., e0r1, ..)
      one gather (src_P): expert-major, chunks merged, each local expert padded to ``align`` -> recv_x_PD
    combine:
      one gather (dest_m): expert-major -> rank-major, reverse row exchange -> sorted slot rows
      one gather (src_S): slot rows -> [T, K, D] (zeros for id -1), then  out_TD = sum_k w_TK[:, k] * y_TKD[:, k]
      in fp32 (a [T, 1, K] @ [T, K, D] bmm)

Each direction moves the rows through exactly one gather on each side of the exchange (the minimum for one
``all_to_all_single`` with a rank-major wire order and an expert-major output); every chunk's exchange writes
straight into its slice of one receive buffer that ends with the zero row padding and dropped slots gather from,
so no ``cat`` copies the payload; when the rank-major rows already are the expert-major layout (one chunk, no
padding, ``L == 1`` or ``R == 1``) the gathers on the expert side are skipped. All index work (one stable sort over
the narrowest integer dtype holding the keys, the inverse permutations ``src_P``/``src_S``/``src_KT``) is computed
once per layout (vectorised, no Python loop over tokens or experts) and kept in the handle, which
``dispatch(..., handle=h)`` reuses (DeepEP's cached handle) to skip the count collective and all index work.
The backward of dispatch gathers the returned rows k-major (``[K, T, D]``) and adds the K contiguous blocks in
fp32 (bit-identical to ``sum(dim=1)`` over ``[T, K, D]``, ~20% faster in bf16 on CPU).

As in DeepEP, the gate weights are applied in combine, after the experts, in fp32 (DeepEP's normal-mode
``combine`` is an unweighted sum and its callers weight before it; we weight inside combine, which is the same
place in the math). The final sum over K is a batched matmul over a dense ``[T, K, D]`` tensor gathered with
``index_select``, so the result does not depend on atomics or thread order (deterministic), and it is the same
sum as :class:`moe_rl.moe.MoE`.

Autograd: the backward of dispatch is "combine without weights" of the gradient (sum over K), and the backward
of combine is "dispatch" of the gradient with the same layout (DeepEP: ``dispatch`` backward = ``combine``,
``combine`` backward = ``dispatch`` with the cached handle). Gradients reach ``x_TD``, the expert outputs and
``topk_weights_TK``.

Collective count: with ``chunk_size`` the tokens are cut into chunks and every rank runs
``max over ranks of ceil(T / chunk_size)`` chunks (at least 1), empty chunks included, so ranks with few or no
tokens issue exactly as many collectives as the others, in forward and in backward (prime-rl PR #3411;
prime-rl PR #3411, sglang PR #25397, NeMo Automodel PRs #935/#3680, Megatron-LM PR #4851).

FP8 dispatch payload (``dispatch(..., fp8=True)``, DeepSeek-V3 §3.3: the activations that go into dispatch are
FP8, combine stays BF16): ``x_TD`` is quantized once per token with :func:`moe_rl.fp8.quant.quantize_1x128`
(e4m3 codes ``[T, D]`` + fp32 scales ``[T, G]``, ``G = ceil(D / 128)``) *before* the rows are replicated per slot,
and codes and scales travel **packed into one uint8 row per token-slot** of ``D + 4 * G`` bytes (codes, then the
scales' fp32 bytes), so fp8 dispatch runs the same ``all_to_all_single`` per chunk as bf16 dispatch (no extra
exchange for the scales; gloo cannot send float8, so everything moves as bytes). Bytes on the wire per slot are
``D + 4 * G`` instead of ``2 * D`` (bf16): ratio ``(D + 4 * ceil(D / 128)) / (2 * D)``, 0.516 for D = 128, 0.508 for
D = 7168. Padding rows (``align > 1``) are all-zero bytes: zero codes with scale 0. The experts get either the
dequantized rows in ``x_TD``'s dtype (default; bit-identical to dispatching ``dequantize(quantize_1x128(x))``) or
``(codes_PD, scales_PG)`` for an FP8 grouped GEMM (``fp8_output="codes"``; not differentiable). Backward of an fp8
dispatch is a straight-through estimator of the quantizer: ``d dequant(quant(x)) / dx := I``, so ``x.grad`` is the
bf16/fp32 "combine without weights" of the gradient at the quantized point. ``combine(..., fp8_backward=True)``
also sends the gradient rows of combine's backward (a dispatch of gradients) as FP8 the same way.

Gloo notes (CPU tests): ``all_to_all_single`` with uneven splits works; float8 tensors are sent viewed as
``uint8``; the list form ``all_to_all`` needs equal sizes and is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["FUSED_MAX_EXPERTS", "DispatchHandle", "EPBackend", "combine", "dispatch"]

EPBackend = Literal["torch", "deep_ep"]

_DEEP_EP_INSTALL = (
    "backend='deep_ep' needs the deep_ep package (DeepEP, https://github.com/deepseek-ai/DeepEP), which "
    "requires CUDA GPUs and NVSHMEM and is built from source: clone the repository, install NVSHMEM as its "
    "README describes, then `NVSHMEM_DIR=/path/to/nvshmem pip install .` (or install moe_rl's `gpu` extra on "
    "a CUDA machine). Use backend='torch' on CPU or without DeepEP."
)

_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


@dataclass(slots=True)
class _ChunkLayout:
    """Layout of one chunk of tokens ``[token_start, token_start + num_tokens)``."""

    token_start: int
    num_tokens: int
    slot_n: Tensor
    """``[n]`` int64 flat slot indices (into the whole ``T * K``) of the chunk's valid slots, sorted by expert."""
    token_n: Tensor
    """``[n]`` int64 token index (into the whole T) of each sorted slot."""
    send_splits: list[int]
    """Rows sent to each rank, ``[R]``."""
    recv_splits: list[int]
    """Rows received from each rank, ``[R]``."""
    dest_m: Tensor
    """``[M_chunk]`` int64: row of the handed-to-experts layout ``[P, D]`` of each received (rank-major) row. One
    index composes the rank-major -> expert-major permute, the merge of the chunks and the alignment padding, so
    each direction moves the rows once (dispatch gathers with its inverse ``src_P``, combine with ``dest_m``)."""


@dataclass(slots=True)
class DispatchHandle:
    """Everything :func:`combine`, the backward passes and a reused :func:`dispatch` need.

    Holds index tensors only (plus the routing); no communication buffers. Pass it back as
    ``dispatch(..., handle=h)`` to skip the validation/count collective and all layout work when the routing
    (``topk_ids_TK``) is the same, e.g. replayed routing (R3) or a second micro-step (DeepEP's cached handle).
    """

    group: dist.ProcessGroup | None
    rank: int
    """This rank's index in the EP group."""
    world_size: int
    """R."""
    num_experts: int
    """E."""
    num_tokens: int
    """T on this rank."""
    top_k: int
    """K."""
    hidden: int
    """D."""
    chunks: tuple[_ChunkLayout, ...]
    """One layout per chunk; the same number of chunks on every rank."""
    has_dropped: bool
    """Some slot has expert id -1 (its row of the dense ``[T, K, D]`` in combine is zero)."""
    counts_L: Tensor
    """``[L]`` int64 rows received per local expert (unpadded)."""
    align: int
    """Each local expert's segment is padded to a multiple of this."""
    chunk_size: int | None
    """Tokens per chunk as passed to :func:`dispatch` (``None``: one chunk)."""
    padded_counts_L: Tensor
    """``[L]`` int64 segment sizes after padding (equal to ``counts_L`` when ``align == 1``)."""
    num_recv_rows: int
    """P, the rows handed to the local experts (padding included)."""
    layout_P: Tensor
    """``[P]`` int64 local expert id of each row handed to the experts, -1 on padding rows (DeepGEMM's
    ``m_indices`` for the contiguous grouped layout)."""
    src_P: Tensor
    """``[P]`` int64 row of the received rows (chunks concatenated, then one zero row when padded) that lands at
    each position of the ``[P, D]`` layout (the inverse of the chunks' ``dest_m``)."""
    src_S: Tensor
    """``[T * K]`` int64 row of the returned sorted slot rows (chunks concatenated, then one zero row when some
    slot has id -1) of each slot."""
    src_KT: Tensor
    """``[K * T]`` int64: ``src_S`` in k-major order (``src_S.view(T, K).t()``), so the backward of dispatch gathers
    ``[K, T, D]`` and sums over k as K contiguous ``[T, D]`` adds."""
    recv_is_expert_major: bool
    """The received rank-major rows already are the ``[P, D]`` layout (``src_P`` is the identity: one chunk, no
    padding, and ``L == 1`` or ``R == 1``), so dispatch skips its receive gather and combine its send gather."""
    topk_ids_TK: Tensor
    """``[T, K]`` the routing this layout was built from."""
    topk_weights_TK: Tensor
    """``[T, K]`` gate weights, applied by :func:`combine` in fp32."""

    @property
    def num_local_experts(self) -> int:
        """L."""
        return self.num_experts // self.world_size

    @property
    def num_chunks(self) -> int:
        """Dispatch/combine rounds (row exchanges) this handle runs; equal on every rank."""
        return len(self.chunks)

    @property
    def is_padded(self) -> bool:
        """Whether P > M (some rows of the ``[P, D]`` layout are alignment padding)."""
        return self.num_recv_rows > sum(sum(c.recv_splits) for c in self.chunks)


# --------------------------------------------------------------------------------------------- validation

_HEADER = 8
"""Ints per rank in front of the counts in the fused validation/count ``all_gather``: num_experts, world size,
D, chunk_size (0 = None), local chunks, shape problem (0/1), min id, max id."""
FUSED_MAX_EXPERTS = 512
"""Per-expert counts ride in the validation ``all_gather`` (one collective before the rows) when E is at most
this; the payload has a fixed size (``_HEADER + FUSED_MAX_EXPERTS`` int64 per rank) so that ranks that disagree
on E still meet in a well-formed collective and raise. Larger E or chunked dispatch add one ``all_gather`` of the
per-chunk counts after validation."""


def _fp8_problem(x_TD: Tensor) -> str | None:
    """Why ``x_TD`` cannot be quantized for an fp8 dispatch (one host sync for the finiteness check)."""
    if not x_TD.dtype.is_floating_point or x_TD.dtype in _FLOAT8_DTYPES:
        return f"fp8=True needs a float x_TD (fp32/bf16/fp16) to quantize, got dtype {x_TD.dtype}"
    n_bad = int((~torch.isfinite(x_TD)).sum())
    if n_bad:
        return f"fp8=True: x_TD has {n_bad} non-finite value(s) (inf/NaN), which FP8 quantization refuses"
    return None


def _agree_finite(t: Tensor, group: dist.ProcessGroup | None, what: str) -> None:
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


def _local_problem(
    x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, align: int, chunk_size, fp8: bool = False
) -> str | None:
    """Shape/argument problems visible on this rank (id range is checked after the gather); no host sync unless
    ``fp8`` (finiteness of ``x_TD``)."""
    if x_TD.dim() != 2:
        return f"x_TD must be [T, D], got shape {tuple(x_TD.shape)}"
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0]:
        return f"topk_ids_TK must be [T, K] with T={x_TD.shape[0]}, got shape {tuple(topk_ids_TK.shape)}"
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        return f"topk_ids_TK must be an integer tensor, got dtype {topk_ids_TK.dtype}"
    if tuple(topk_weights_TK.shape) != tuple(topk_ids_TK.shape):
        return (
            f"topk_weights_TK has shape {tuple(topk_weights_TK.shape)} but topk_ids_TK has "
            f"{tuple(topk_ids_TK.shape)}; they must match"
        )
    if align < 1:
        return f"align={align} must be >= 1 (1 = no padding; 128 = DeepGEMM contiguous layout)"
    if chunk_size is not None and chunk_size < 1:
        return f"chunk_size={chunk_size} must be >= 1 or None (no chunking)"
    return _fp8_problem(x_TD) if fp8 else None


def _expert_keys(ids_TK: Tensor, num_experts: int) -> Tensor:
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


def _validate_and_count(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None,
    num_experts: int,
    align: int,
    chunk_size: int | None,
    fp8: bool = False,
) -> tuple[int, Tensor, list[int]]:
    """Validate across ranks and exchange per-expert counts, before any token moves.

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
    problem = _local_problem(x_TD, topk_ids_TK, topk_weights_TK, align, chunk_size, fp8)
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
        key_N = _expert_keys(topk_ids_TK, num_experts)
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
        _expert_keys(topk_ids_TK, num_experts), topk_ids_TK.shape[1], step, num_chunks, num_experts
    )
    counts_RCE = torch.empty(world * num_chunks * num_experts, dtype=torch.int64, device=device)
    dist.all_gather_single(counts_RCE, mine_CE.reshape(-1), group=group)
    counts_RCE = counts_RCE.view(world, num_chunks, num_experts)
    recv_CRL, splits = _splits(counts_RCE, rank, world)
    return num_chunks, recv_CRL, splits.tolist()


# ------------------------------------------------------------------------------------------------- layout


def _exclusive_cumsum(t: Tensor) -> Tensor:
    return torch.cumsum(t, 0) - t


def _build_layout(
    topk_ids_TK: Tensor,
    num_experts: int,
    world: int,
    chunk_size: int | None,
    align: int,
    num_chunks: int,
    recv_CRL: Tensor,
    splits: list[int],
):
    """Sort slots by (chunk, expert) once and build each chunk's send order and receive destinations.

    Vectorised: one stable ``argsort`` of ``T * K`` keys, a few ``cumsum``/``repeat_interleave`` over the
    ``[C, R, L]`` counts; no Python loop over tokens or experts and no host sync (sizes come from ``splits``).
    """
    num_tokens, top_k = topk_ids_TK.shape
    device = topk_ids_TK.device
    local = num_experts // world
    step = num_tokens if chunk_size is None else chunk_size
    key_N = _expert_keys(topk_ids_TK, num_experts)
    if num_chunks > 1:
        chunk_N = torch.arange(key_N.shape[0], device=device) // max(step * top_k, 1)
        key_N = chunk_N * (num_experts + 1) + key_N
    # The keys take num_chunks * (E + 1) values: sort them in the narrowest integer dtype that holds them (same
    # stable order; a radix/merge sort over int16 keys is ~4x faster than over int64 at T * K = 32K on CPU).
    num_keys = num_chunks * (num_experts + 1)
    key_dtype = torch.int16 if num_keys <= 2**15 else torch.int32 if num_keys <= 2**31 else torch.int64
    perm_N = torch.argsort(key_N.to(key_dtype), stable=True)
    send = [splits[c * world : (c + 1) * world] for c in range(num_chunks)]
    recv = [splits[(num_chunks + c) * world : (num_chunks + c + 1) * world] for c in range(num_chunks)]
    sent = sum(sum(s) for s in send)
    # Destination of every received row in the [P, D] layout: expert-major, chunks in order within an expert,
    # source ranks in order within a chunk, each expert's segment padded to `align`.
    counts_L = recv_CRL.sum((0, 1))
    padded_L = counts_L if align == 1 else (counts_L + align - 1) // align * align
    seg_LCR = recv_CRL.permute(2, 0, 1).reshape(-1)
    seg_start_LCR = _exclusive_cumsum(seg_LCR).view(local, num_chunks, world)
    shift_L = _exclusive_cumsum(padded_L) - seg_start_LCR[:, 0, 0]
    base_CRL = (seg_start_LCR + shift_L.view(local, 1, 1)).permute(1, 2, 0)
    arange_RL = torch.arange(world * local, device=device)
    chunks = []
    for c in range(num_chunks):
        start = min(c * step, num_tokens)
        begin = start * top_k
        slot_n = perm_N[begin : begin + sum(send[c])]
        m = sum(recv[c])
        counts_RL = recv_CRL[c].reshape(-1)
        seg_m = torch.repeat_interleave(arange_RL, counts_RL, output_size=m)
        dest_m = (
            base_CRL[c].reshape(-1)[seg_m]
            + torch.arange(m, device=device)
            - _exclusive_cumsum(counts_RL)[seg_m]
        )
        chunks.append(
            _ChunkLayout(
                token_start=start,
                num_tokens=min((c + 1) * step, num_tokens) - start,
                slot_n=slot_n,
                token_n=slot_n // max(top_k, 1),
                send_splits=send[c],
                recv_splits=recv[c],
                dest_m=dest_m,
            )
        )
    total = sum(sum(r) for r in recv)
    num_recv_rows = total
    if align == 1:
        layout_P = torch.repeat_interleave(torch.arange(local, device=device), counts_L, output_size=total)
    else:
        host_L = splits[2 * num_chunks * world :]
        num_recv_rows = sum((n + align - 1) // align * align for n in host_L)
        lid_P = torch.repeat_interleave(
            torch.arange(local, device=device), padded_L, output_size=num_recv_rows
        )
        within_P = torch.arange(num_recv_rows, device=device) - _exclusive_cumsum(padded_L)[lid_P]
        layout_P = torch.where(within_P < counts_L[lid_P], lid_P, torch.full_like(lid_P, -1))
    dest_M = chunks[0].dest_m if num_chunks == 1 else torch.cat([c.dest_m for c in chunks])
    src_P = torch.full((num_recv_rows,), total, dtype=torch.int64, device=device)
    src_P.scatter_(0, dest_M, torch.arange(total, device=device))
    slot_n = chunks[0].slot_n if num_chunks == 1 else torch.cat([c.slot_n for c in chunks])
    src_S = torch.full((num_tokens * top_k,), sent, dtype=torch.int64, device=device)
    src_S.scatter_(0, slot_n, torch.arange(sent, device=device))
    src_KT = src_S.view(num_tokens, top_k).t().reshape(-1)
    identity = num_chunks == 1 and num_recv_rows == total and (local == 1 or world == 1)
    layout = (counts_L, padded_L, num_recv_rows, layout_P, src_P, src_S, src_KT, identity)
    return tuple(chunks), sent < num_tokens * top_k, layout


# ------------------------------------------------------------------------------------------ data movement


def _exchange(rows: Tensor, in_splits: list[int], out_splits: list[int], group, out: Tensor) -> None:
    """``all_to_all_single`` of rows with uneven splits into ``out`` (``[sum(out_splits), ...]``, contiguous);
    float8 travels as uint8 (gloo has no float8)."""
    send, recv = rows.contiguous(), out
    if send.dtype in _FLOAT8_DTYPES:
        send, recv = send.view(torch.uint8), out.view(torch.uint8)
    dist.all_to_all_single(
        recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )


def _exchange_chunks(rows_per_chunk: list[Tensor], send_splits, recv_splits, group, zero_row: bool) -> Tensor:
    """Exchange every chunk straight into its slice of ONE receive buffer ``[M (+ 1), ...]``.

    The chunks land back to back in chunk order, then (``zero_row``) one zero row that padding rows / dropped slots
    gather from, so no ``cat`` copies the received rows before the one gather that follows.
    """
    first = rows_per_chunk[0]
    total = sum(sum(s) for s in recv_splits)
    buf = first.new_empty((total + int(zero_row), *first.shape[1:]))
    if zero_row:
        (buf.view(torch.uint8) if buf.dtype in _FLOAT8_DTYPES else buf)[total:].zero_()
    start = 0
    for rows, sends, recvs in zip(rows_per_chunk, send_splits, recv_splits, strict=True):
        m = sum(recvs)
        _exchange(rows, sends, recvs, group, buf[start : start + m])
        start += m
    return buf


def _select_rows(src: Tensor, index: Tensor) -> Tensor:
    """``src.index_select(0, index)``; float8 moves as uint8 (no float8 index kernels).

    Gathers rather than scatters everywhere: on CPU ``index_copy_`` is about 2x slower than ``index_select`` for
    rows.
    """
    if src.dtype in _FLOAT8_DTYPES:
        return src.view(torch.uint8).index_select(0, index).view(src.dtype)
    return src.index_select(0, index)


def _to_experts(rows_per_chunk: list[Tensor], h: DispatchHandle) -> Tensor:
    """Per-chunk sorted slot rows ``[n_c, D]`` -> rows for the local experts ``[P, D]`` (one gather after receive,
    none when the received rows already are expert-major)."""
    recv = _exchange_chunks(
        rows_per_chunk,
        [c.send_splits for c in h.chunks],
        [c.recv_splits for c in h.chunks],
        h.group,
        zero_row=h.is_padded,
    )
    return recv if h.recv_is_expert_major else _select_rows(recv, h.src_P)


def _from_experts(y_PD: Tensor, h: DispatchHandle) -> Tensor:
    """Rows of the local experts ``[P, D]`` -> the sorted slot rows back on their owners, chunks concatenated,
    then one zero row when some slot has id -1 (the rows ``src_S`` / ``src_KT`` index)."""
    if h.recv_is_expert_major:
        send = [y_PD]
    else:
        send = [_select_rows(y_PD, c.dest_m) for c in h.chunks]
    return _exchange_chunks(
        send,
        [c.recv_splits for c in h.chunks],
        [c.send_splits for c in h.chunks],
        h.group,
        zero_row=h.has_dropped,
    )


def _slots_to_TKD(rows_S: Tensor, h: DispatchHandle) -> Tensor:
    """Returned slot rows (:func:`_from_experts`) -> ``[T, K, D]`` in slot order, zeros on slots with expert id -1."""
    return _select_rows(rows_S, h.src_S).view(h.num_tokens, h.top_k, rows_S.shape[1])


def _sum_slots(rows_S: Tensor, h: DispatchHandle) -> Tensor:
    """``[T, D]``: ``sum_k`` of each token's returned slot rows (zero for id -1), i.e. ``_slots_to_TKD(...).sum(1)``.

    Gathers k-major (``[K, T, D]``, so each k is one contiguous ``[T, D]`` block) and adds the K blocks in order;
    bf16/fp16 accumulate in fp32 and round once, as ``torch.sum`` does (bit-identical to it on CPU, and about 20%
    faster than ``sum(dim=1)`` over a ``[T, K, D]`` bf16 gather).
    """
    T, K, D = h.num_tokens, h.top_k, rows_S.shape[1]
    if K == 0:
        return rows_S.new_zeros((T, D))
    y_KTD = _select_rows(rows_S, h.src_KT).view(K, T, D)
    if y_KTD.dtype not in (torch.bfloat16, torch.float16):
        return y_KTD.sum(0)
    acc_TD = y_KTD[0].float()
    for k in range(1, K):
        acc_TD.add_(y_KTD[k])
    return acc_TD.to(y_KTD.dtype)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, h: DispatchHandle) -> Tensor:  # type: ignore[override]
        ctx.handle = h
        rows = [_select_rows(x_TD, c.token_n) for c in h.chunks]
        return _to_experts(rows, h)

    @staticmethod
    def backward(ctx, grad_PD: Tensor):  # type: ignore[override]
        h: DispatchHandle = ctx.handle
        return _sum_slots(_from_experts(grad_PD, h), h), None


def _pack_fp8(x_ND: Tensor) -> Tensor:
    """``[N, D]`` float -> ``[N, D + 4 * G]`` uint8: 1x128 e4m3 codes then the fp32 scales' bytes, per row."""
    from moe_rl.fp8.quant import quantize_1x128

    codes_ND, scales_NG = quantize_1x128(x_ND.detach())
    # N = 0: the empty scales come with stride 0 in the last dim, which .view refuses.
    if not scales_NG.numel():
        scales_NG = scales_NG.new_empty(scales_NG.shape)
    return torch.cat([codes_ND.view(torch.uint8), scales_NG.contiguous().view(torch.uint8)], dim=1)


def _unpack_fp8(rows_PB: Tensor, hidden: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_pack_fp8` on received rows: codes ``[P, D]`` e4m3, scales ``[P, G]`` fp32 (0 on padding)."""
    from moe_rl.fp8.quant import FP8_DTYPE

    codes_PD = rows_PB[:, :hidden].contiguous().view(FP8_DTYPE)
    scales_PG = rows_PB[:, hidden:].contiguous().view(torch.float32)
    return codes_PD, scales_PG


def _dequant(codes_PD: Tensor, scales_PG: Tensor, dtype: torch.dtype) -> Tensor:
    from moe_rl.fp8.quant import dequantize

    return dequantize(codes_PD, scales_PG, (1, 128), out_dtype=dtype)


def _to_experts_fp8(x_ND: Tensor, index_per_chunk: list[Tensor], h: DispatchHandle) -> tuple[Tensor, Tensor]:
    """Quantize the ``[N, D]`` source rows once, send row ``index`` of each chunk as packed bytes, unpack."""
    packed = _pack_fp8(x_ND)
    return _unpack_fp8(_to_experts([_select_rows(packed, i) for i in index_per_chunk], h), x_ND.shape[1])


class _DispatchFP8(torch.autograd.Function):
    """FP8 payload; backward is the straight-through estimator (the quantizer's Jacobian taken as identity)."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, h: DispatchHandle) -> Tensor:  # type: ignore[override]
        ctx.handle = h
        codes_PD, scales_PG = _to_experts_fp8(x_TD, [c.token_n for c in h.chunks], h)
        return _dequant(codes_PD, scales_PG, x_TD.dtype)

    backward = _Dispatch.backward


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_PD: Tensor, h: DispatchHandle, fp8_backward: bool) -> Tensor:  # type: ignore[override]
        ctx.handle = h
        ctx.fp8_backward = fp8_backward
        return _slots_to_TKD(_from_experts(y_PD, h), h)

    @staticmethod
    def backward(ctx, grad_TKD: Tensor):  # type: ignore[override]
        h: DispatchHandle = ctx.handle
        grad_ND = grad_TKD.reshape(h.num_tokens * h.top_k, grad_TKD.shape[2])
        if ctx.fp8_backward:
            _agree_finite(grad_ND, h.group, "combine(fp8_backward=True): the gradient of combine's output")
            codes_PD, scales_PG = _to_experts_fp8(grad_ND, [c.slot_n for c in h.chunks], h)
            return _dequant(codes_PD, scales_PG, grad_ND.dtype), None, None
        rows = [_select_rows(grad_ND, c.slot_n) for c in h.chunks]
        return _to_experts(rows, h), None, None


# ------------------------------------------------------------------------------------------------ public


def _check_backend(backend: str) -> None:
    if backend == "torch":
        return
    if backend == "deep_ep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as err:
            raise ImportError(_DEEP_EP_INSTALL) from err
        return
    raise ValueError(f"backend={backend!r} is not supported; use 'torch' or 'deep_ep'")


def _check_reuse(
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


def dispatch(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_weights_TK: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    backend: EPBackend = "torch",
    align: int = 1,
    chunk_size: int | None = None,
    handle: DispatchHandle | None = None,
    fp8: bool = False,
    fp8_output: Literal["dequant", "codes"] = "dequant",
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor, DispatchHandle]:
    """Send every token-slot to the rank that owns its expert (DeepEP normal-mode ``dispatch`` semantics).

    Collective: every rank of ``group`` must call it, with the same ``num_experts``, D and ``chunk_size``, and
    either all with ``handle=None`` or all with a handle.

    Collectives per call (``handle=None``): one ``all_gather`` that carries both the validation ints and the
    per-expert counts (plus one ``all_gather`` of per-chunk counts when chunked or ``E > FUSED_MAX_EXPERTS``),
    then one ``all_to_all_single`` of rows per chunk. One host sync (the split sizes) per count collective.
    With ``handle=h``: the row exchanges only.

    Args:
        x_TD: ``[T, D]`` tokens on this rank, any dtype gloo/NCCL can move (float8 is sent as uint8); T may be 0.
        topk_ids_TK: ``[T, K]`` integer expert ids in ``[0, E)``; -1 marks a slot that goes nowhere.
        topk_weights_TK: ``[T, K]`` gate weights (any float dtype; applied in fp32 by :func:`combine`). Kept
            in the handle; gradients reach it through :func:`combine`.
        group: the expert-parallel process group (``None`` = default group). Rank r owns experts
            ``[r * L, (r + 1) * L)``.
        num_experts: E, a multiple of the group size.
        backend: ``"torch"`` (``all_to_all_single``, works on gloo and NCCL) or ``"deep_ep"`` (needs DeepEP;
            raises ImportError with install instructions when it is missing; never falls back silently).
        align: pad each local expert's rows to a multiple of ``align`` with zero rows (128 = DeepGEMM
            contiguous grouped layout); ``handle.layout_P`` then marks padding with -1.
        chunk_size: if set, exchange tokens in chunks of this many tokens; all ranks run the same number of
            chunks, ``max over ranks of ceil(T / chunk_size)``.
        handle: a :class:`DispatchHandle` from an earlier dispatch of the **same** ``topk_ids_TK`` (replayed
            routing, a later micro-step): its layout is reused, so no count collective, no host sync and no
            sort run (DeepEP's cached-handle dispatch). The ids are not re-read (that would cost a sync);
            new ``topk_weights_TK`` are allowed. Shapes, E, ``align``, ``chunk_size`` and the group are checked
            on this rank only: the cross-rank validation ran when the handle was built. A handle works for either
            payload (the layout does not depend on it).
        fp8: send an FP8 payload (DeepSeek-V3): ``x_TD`` (fp32/bf16/fp16, finite) is quantized 1x128 per token
            (:func:`moe_rl.fp8.quant.quantize_1x128`) and each token-slot moves as one packed uint8 row of
            ``D + 4 * ceil(D / 128)`` bytes (e4m3 codes, then fp32 scales), in the same exchanges as without
            ``fp8``. All ranks must pass the same ``fp8``. Backward: straight-through estimator of the quantizer
            (the gradient of the dequantized rows reaches ``x_TD`` unchanged, in ``x_TD``'s dtype).
        fp8_output: with ``fp8``, what the experts get: ``"dequant"`` (default) the rows dequantized to ``x_TD``'s
            dtype, bit-identical to dispatching ``dequantize(*quantize_1x128(x_TD), (1, 128), out_dtype=x.dtype)``;
            or ``"codes"``: ``(codes_PD float8_e4m3fn, scales_PG fp32)`` for an FP8 grouped GEMM (padding rows have
            zero codes and scale 0). ``"codes"`` is not differentiable (no gradient reaches ``x_TD``); its FP8 GEMM
            owns the backward.

    Returns:
        ``(recv_x_PD, recv_counts_L, handle)``: ``recv_x_PD`` ``[P, D]`` in ``x_TD``'s dtype, expert-major
        (all rows of local expert 0, then 1, ...), ``recv_counts_L`` ``[L]`` int64 rows per local expert
        (padded counts when ``align > 1``, as DeepEP's ``num_recv_tokens_per_expert_list``), and the
        :class:`DispatchHandle` for :func:`combine`. Differentiable w.r.t. ``x_TD``. With
        ``fp8_output="codes"`` the first item is ``(codes_PD, scales_PG)``.

    Raises:
        ValueError: on every rank, before any token moves, if the ranks disagree on ``num_experts``, D or
            ``chunk_size``, if E is not a multiple of the group size, or if any rank passes bad shapes or
            ids out of range, or (``fp8``) a non-float or non-finite ``x_TD``. The message names the values.
            With ``handle=``, on this rank only, if the inputs do not match the handle; with ``handle=`` and
            ``fp8``, a non-finite ``x_TD`` on any rank raises on every rank (one ``all_reduce`` of R ints, the only
            collective besides the row exchanges).
        ImportError: ``backend="deep_ep"`` without DeepEP installed.
    """
    _check_backend(backend)
    if fp8_output not in ("dequant", "codes"):
        raise ValueError(f"fp8_output={fp8_output!r} is not supported; use 'dequant' or 'codes'")
    if backend == "deep_ep":
        from moe_rl.moe.ep_deepep import DeepEPHandle, deepep_dispatch

        if chunk_size is not None:
            raise ValueError(
                f"chunk_size={chunk_size} is not supported with backend='deep_ep' (DeepEP pipelines a dispatch "
                "internally); pass chunk_size=None"
            )
        if handle is not None and not isinstance(handle, DeepEPHandle):
            raise ValueError(
                f"dispatch(backend='deep_ep', handle=...) got a {type(handle).__name__} from the 'torch' backend; "
                "reuse a handle only with the backend that built it"
            )
        return deepep_dispatch(
            x_TD, topk_ids_TK, topk_weights_TK, group, num_experts=num_experts, align=align, handle=handle,
            fp8=fp8, fp8_output=fp8_output,
        )
    if handle is not None and not isinstance(handle, DispatchHandle):
        raise ValueError(
            f"dispatch(backend='torch', handle=...) got a {type(handle).__name__}; reuse a handle only with the "
            "backend that built it"
        )
    if handle is not None:
        _check_reuse(handle, x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, chunk_size)
        if fp8:
            if not x_TD.dtype.is_floating_point or x_TD.dtype in _FLOAT8_DTYPES:
                raise ValueError(f"dispatch(handle=...): {_fp8_problem(x_TD)}")
            _agree_finite(x_TD, group, "dispatch(handle=..., fp8=True): x_TD")
        handle = replace(handle, topk_weights_TK=topk_weights_TK)
        return _move(x_TD, handle, fp8, fp8_output), handle.padded_counts_L, handle
    num_chunks, recv_CRL, splits = _validate_and_count(
        x_TD, topk_ids_TK, topk_weights_TK, group, num_experts, align, chunk_size, fp8
    )
    world = dist.get_world_size(group)
    chunks, has_dropped, layout = _build_layout(
        topk_ids_TK, num_experts, world, chunk_size, align, num_chunks, recv_CRL, splits
    )
    counts_L, padded_L, num_recv_rows, layout_P, src_P, src_S, src_KT, identity = layout
    handle = DispatchHandle(
        group=group,
        rank=dist.get_rank(group),
        world_size=world,
        num_experts=num_experts,
        num_tokens=topk_ids_TK.shape[0],
        top_k=topk_ids_TK.shape[1],
        hidden=x_TD.shape[1],
        chunks=chunks,
        has_dropped=has_dropped,
        counts_L=counts_L,
        align=align,
        chunk_size=chunk_size,
        padded_counts_L=padded_L,
        num_recv_rows=num_recv_rows,
        layout_P=layout_P,
        src_P=src_P,
        src_S=src_S,
        src_KT=src_KT,
        recv_is_expert_major=identity,
        topk_ids_TK=topk_ids_TK,
        topk_weights_TK=topk_weights_TK,
    )
    return _move(x_TD, handle, fp8, fp8_output), padded_L, handle


def _move(x_TD: Tensor, h: DispatchHandle, fp8: bool, fp8_output: str) -> Tensor | tuple[Tensor, Tensor]:
    if not fp8:
        return _Dispatch.apply(x_TD, h)
    if fp8_output == "codes":
        return _to_experts_fp8(x_TD, [c.token_n for c in h.chunks], h)
    return _DispatchFP8.apply(x_TD, h)


def combine(y_PD: Tensor, handle: DispatchHandle, *, fp8_backward: bool = False) -> Tensor:
    """Return expert outputs to the tokens' ranks and sum them with the gate weights (fp32).

    Collective: every rank of the handle's group must call it.

    Args:
        y_PD: ``[P, D]`` outputs of the local experts, rows in the order :func:`dispatch` returned (padding rows
            are ignored).
        handle: the :class:`DispatchHandle` from :func:`dispatch`.
        fp8_backward: the forward stays in ``y_PD``'s dtype (DeepSeek-V3: combine in BF16), but the backward (a
            dispatch of the per-slot gradients ``w * dout``) sends them as 1x128 FP8 packed bytes like
            ``dispatch(..., fp8=True)`` and hands ``y_PD`` their dequantized values (straight-through). All ranks
            must pass the same value; a non-finite gradient raises ValueError on every rank (one ``all_reduce`` of R
            ints before the exchange).

    Autograd caveat (prime-rl PR #3411): the backward of combine and of dispatch are collectives too, so on
    every rank ``y_PD`` must be computed from the dispatched rows inside the autograd graph, even when this rank
    received no rows (run the experts on the empty tensor, as :func:`moe_rl.moe.ep_moe.local_experts_forward`
    does; do not replace the output by a fresh ``zeros`` tensor), or the other ranks wait forever in backward.

    Returns:
        ``[T, D]`` in ``y_PD``'s dtype: ``sum_k topk_weights_TK[t, k] * y[slot (t, k)]`` computed in fp32, slots
        with id -1 contribute nothing. Differentiable w.r.t. ``y_PD`` and ``topk_weights_TK``.
    """
    if not isinstance(handle, DispatchHandle):
        from moe_rl.moe.ep_deepep import deepep_combine

        return deepep_combine(y_PD, handle, fp8_backward=fp8_backward)
    if y_PD.dim() != 2 or y_PD.shape[0] != handle.num_recv_rows:
        raise ValueError(
            f"combine expects y of shape [P={handle.num_recv_rows}, D] (the rows dispatch returned), "
            f"got {tuple(y_PD.shape)}"
        )
    y_TKD = _Combine.apply(y_PD, handle, fp8_backward)
    w_T1K = handle.topk_weights_TK.float().unsqueeze(1)
    return torch.bmm(w_T1K, y_TKD.float()).squeeze(1).to(y_PD.dtype)  # [T, 1, K] @ [T, K, D]: sum over K
