"""Grouped (MoE) FP8 block-scaled GEMMs in DeepGEMM's m-grouped *contiguous* layout, and an FP8 expert path.

Sources: DeepSeek-V3 (arXiv 2412.19437, §3.3: MoE expert GEMMs in FP8, 1x128 activations, 128x128 weights,
Wgrad along tokens) and DeepGEMM's contiguous layout (``m_grouped_fp8_gemm_nt_contiguous``; pre-July-2025
``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``): every expert's segment of rows is padded to a multiple of 128
(``get_mk_alignment_for_contiguous_layout()`` on SM90) and padding rows carry expert id -1. The code is ours.

Shape legend:
    N    routed token-slots (rows sorted by expert), N = T * top_k
    M    rows of the padded contiguous layout, M = sum_e ceil(n_e / 128) * 128  (n_e rows of expert e)
    G    experts (groups) = E
    K    contraction dimension (hidden size D for gate_up, intermediate F for down)
    Nw   output features of one expert's weight (2F for gate_up, D for down)
    SK   ceil(K / 128) scale columns

Layout (``ContiguousLayout``)::

    m_indices [M] int32     expert id of each padded row, -1 on padding rows
    rows      [N] int64     where real row i (expert-sorted order) sits in the padded buffer
    starts/padded  host lists: segment start and padded length of each expert (0 for experts with no rows)

Because segments are 128-aligned, 128-row quantization groups along M (the Wgrad operands, 128x1) never
straddle two experts, and 1x128 groups along K are per-row anyway, so one quantizer call covers all experts.

The three GEMMs of one grouped linear ``y[m] = x[m] @ W[e(m)]^T`` (same recipes as :mod:`moe_rl.fp8.linear`)::

    Fprop   y_MNw  = grouped(x_MK 1x128,  W_GNwK 128x128 per expert)            m-grouped, recipe (1,128,128)
    Dgrad   dx_MK  = grouped(dy_MNw 1x128, W^T_GKNw = per-expert transposed blocks) m-grouped
    Wgrad   dW_GNwK[e] = dy_e^T @ x_e over expert e's (padded) rows, both 128x1 along tokens, recipe (1,1,128)

Rows with id -1 produce zero outputs in every backend (DeepGEMM leaves them undefined; we zero them) and
contribute nothing to the weight gradient (their activations and gradients are zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_rl.fp8.gemm import _deep_gemm_fn, _import_deep_gemm, _pad_k, fp8_block_gemm
from moe_rl.fp8.layout import get_mn_major_tma_aligned_tensor
from moe_rl.fp8.linear import quant_backend_for
from moe_rl.fp8.quant import FP8_DTYPE, dequantize, quantize_1x128, quantize_128x1, quantize_128x128

__all__ = [
    "GROUP_ALIGN_M",
    "ContiguousLayout",
    "GroupedBackend",
    "contiguous_layout",
    "fp8_grouped_gemm",
    "fp8_grouped_linear",
    "fp8_grouped_wgrad",
    "quantize_128x128_grouped",
]

GROUP_ALIGN_M = 128
"""Row alignment of each expert segment (DeepGEMM SM90 ``get_mk_alignment_for_contiguous_layout()``)."""

GroupedBackend = Literal["auto", "torch", "triton", "deep_gemm"]
_GROUPED_BACKENDS = ("auto", "torch", "triton", "deep_gemm")
_DEEP_GEMM_GROUPED_NAMES = ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ContiguousLayout:
    """Padded contiguous grouped layout of expert-sorted rows (see the module docstring).

    Attributes:
        m_indices: ``[M]`` int32 expert id per padded row, -1 on padding rows.
        rows: ``[N]`` int64 index of each real row in the padded buffer (expert-sorted order preserved).
        starts: host list ``[G]``: first padded row of each expert's segment.
        padded: host list ``[G]``: padded segment length (a multiple of 128; 0 for an expert with no rows).
        counts: host list ``[G]``: real rows per expert.
    """

    m_indices: Tensor
    rows: Tensor
    starts: list[int]
    padded: list[int]
    counts: list[int]

    @property
    def num_rows(self) -> int:
        """M, the padded row count."""
        return int(self.m_indices.shape[0])

    @property
    def num_padding_rows(self) -> int:
        """M - N: rows that are padding (id -1)."""
        return self.num_rows - int(self.rows.shape[0])


def contiguous_layout(counts_E: Tensor, align: int = GROUP_ALIGN_M) -> ContiguousLayout:
    """Build the padded contiguous layout for rows already sorted by expert (``sort_by_expert`` order).

    Args:
        counts_E: ``[G]`` int rows per expert (>= 0), e.g. ``counts_E`` from
            :func:`moe_rl.moe.experts.sort_by_expert`. One host sync reads it (M sizes the buffers).
        align: segment alignment (128 for DeepGEMM on SM90).

    Returns:
        :class:`ContiguousLayout`.

    Raises:
        ValueError: ``counts_E`` not 1-D integer, negative counts, or ``align < 1``.
    """
    if counts_E.dim() != 1 or counts_E.dtype.is_floating_point or counts_E.dtype == torch.bool:
        raise ValueError(f"counts_E: expected a 1-D integer tensor [G], got {counts_E.dtype} {tuple(counts_E.shape)}")
    if align < 1:
        raise ValueError(f"align={align}: must be >= 1 (DeepGEMM's contiguous layout uses 128)")
    counts = [int(c) for c in counts_E.tolist()]
    if any(c < 0 for c in counts):
        raise ValueError(f"counts_E: negative row count(s) {counts}; counts must be >= 0")
    padded = [_ceil_div(c, align) * align for c in counts]
    starts, s = [], 0
    for p in padded:
        starts.append(s)
        s += p
    dev = counts_E.device
    m_indices = torch.full((s,), -1, dtype=torch.int32, device=dev)
    rows = torch.cat(
        [torch.arange(st, st + c, dtype=torch.int64, device=dev) for st, c in zip(starts, counts, strict=True)]
        or [torch.zeros(0, dtype=torch.int64, device=dev)]
    )
    for e, (st, c) in enumerate(zip(starts, counts, strict=True)):
        m_indices[st : st + c] = e
    return ContiguousLayout(m_indices=m_indices, rows=rows, starts=starts, padded=padded, counts=counts)


def quantize_128x128_grouped(
    w_GNK: Tensor, *, ue8m0: bool = False, name: str = "expert_weight", backend: Literal["torch", "triton"] = "torch"
) -> tuple[Tensor, Tensor]:
    """Per-expert 128x128 block quantization of stacked weights (blocks never straddle two experts).

    Args:
        w_GNK: ``[G, Nw, K]`` float (finite).

        backend: quantizer backend (``quantize_128x128``'s).

    Returns:
        codes ``[G, Nw, K]`` e4m3fn, scales ``[G, ceil(Nw/128), ceil(K/128)]`` fp32.

    Raises:
        ValueError: not 3-D, or non-finite values (named ``name``).
    """
    if w_GNK.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor [G, Nw, K], got shape {tuple(w_GNK.shape)}")
    G, Nw, K = w_GNK.shape
    Np = _ceil_div(Nw, 128) * 128
    w_p = F.pad(w_GNK, (0, 0, 0, Np - Nw)) if Np != Nw else w_GNK  # zero rows do not change any amax
    codes, scales = quantize_128x128(w_p.reshape(G * Np, K), ue8m0=ue8m0, name=name, backend=backend)
    return codes.view(G, Np, K)[:, :Nw], scales.view(G, Np // 128, scales.shape[1])


def _check_grouped(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, m_indices: Tensor) -> None:
    if a.dim() != 2 or a.dtype != FP8_DTYPE:
        raise ValueError(f"a: expected 2-D {FP8_DTYPE} codes [M, K], got {a.dtype} {tuple(a.shape)}")
    if b.dim() != 3 or b.dtype != FP8_DTYPE:
        raise ValueError(f"b: expected 3-D {FP8_DTYPE} codes [G, N, K], got {b.dtype} {tuple(b.shape)}")
    (M, K), (G, N, Kb) = a.shape, b.shape
    if K != Kb:
        raise ValueError(f"a [M, K]={tuple(a.shape)} and b [G, N, K]={tuple(b.shape)} disagree on K")
    SK = _ceil_div(K, 128)
    for nm, s, want in (("a_scale", a_scale, (M, SK)), ("b_scale", b_scale, (G, _ceil_div(N, 128), SK))):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{nm}: got {s.dtype} {tuple(s.shape)}, expected float32 {want} (1x128 / 128x128)")
    if m_indices.dim() != 1 or m_indices.shape[0] != M or m_indices.dtype != torch.int32:
        raise ValueError(f"m_indices: expected int32 [M={M}], got {m_indices.dtype} {tuple(m_indices.shape)}")
    if M % GROUP_ALIGN_M:
        raise ValueError(
            f"a: M={M} rows is not a multiple of {GROUP_ALIGN_M}; pad every expert segment to {GROUP_ALIGN_M} rows "
            "with id -1 (contiguous_layout)"
        )
    if M == 0:
        return
    if int(m_indices.min()) < -1 or int(m_indices.max()) >= G:
        raise ValueError(
            f"m_indices: ids must be in [-1, {G}) (G={G} groups, -1 = padding); got range "
            f"[{int(m_indices.min())}, {int(m_indices.max())}]"
        )
    blk = m_indices.view(-1, GROUP_ALIGN_M)
    top = blk.max(dim=1, keepdim=True).values
    mixed = int((~((blk == top) | (blk == -1))).any(dim=1).sum())
    if mixed:
        raise ValueError(
            f"m_indices: {mixed} block(s) of {GROUP_ALIGN_M} rows mix two experts; each expert segment must be "
            f"padded to a multiple of {GROUP_ALIGN_M} rows (contiguous_layout)"
        )


def _grouped_torch(a, a_scale, b, b_scale, m_indices, out_dtype):
    M, N = a.shape[0], b.shape[1]
    out = torch.zeros((M, N), dtype=torch.float32, device=a.device)
    if M == 0:
        return out.to(out_dtype)
    with torch.autocast(a.device.type, enabled=False):
        a_f = dequantize(a, a_scale, (1, 128))
        for g in torch.unique(m_indices[m_indices >= 0]).tolist():
            idx = (m_indices == g).nonzero().squeeze(1)
            out.index_copy_(0, idx, a_f[idx] @ dequantize(b[g], b_scale[g], (128, 128)).T)
    return out.to(out_dtype)


def _grouped_deep_gemm(mod, a, a_scale, b, b_scale, m_indices, out_dtype):
    fn, name = _deep_gemm_fn(mod, _DEEP_GEMM_GROUPED_NAMES)
    if out_dtype != torch.bfloat16:
        raise ValueError(f"backend='deep_gemm' grouped GEMM writes bfloat16; got out_dtype={out_dtype}")
    M, N = a.shape[0], b.shape[1]
    d = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    a_p, b_p = _pad_k(a), _pad_k(b)
    if name == "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous":  # old API: LHS scales MN-major TMA-aligned
        fn((a_p, get_mn_major_tma_aligned_tensor(a_scale)), (b_p, b_scale), d, m_indices)
    else:  # current API transforms the scale layouts itself
        fn((a_p, a_scale), (b_p, b_scale), d, m_indices)
    return d.masked_fill_((m_indices < 0)[:, None], 0)


def fp8_grouped_gemm(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    m_indices: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: GroupedBackend = "torch",
) -> Tensor:
    """m-grouped contiguous FP8 GEMM: ``out[m] = (a[m] * a_scale[m]) @ (b[g] * b_scale[g]).T`` with
    ``g = m_indices[m]``; rows with ``g == -1`` are zero.

    Args:
        a: ``[M, K]`` e4m3fn codes (1x128 groups), M a multiple of 128.
        a_scale: ``[M, ceil(K/128)]`` fp32 (row-major; the deep_gemm backend converts the layout).
        b: ``[G, N, K]`` e4m3fn codes (per-expert 128x128 blocks, ``quantize_128x128_grouped``).
        b_scale: ``[G, ceil(N/128), ceil(K/128)]`` fp32.
        m_indices: ``[M]`` int32 expert id per row, -1 = padding; every 128-row block holds one expert
            (plus padding), as :func:`contiguous_layout` makes.
        out_dtype: output dtype (deep_gemm: bfloat16 only). Accumulation is fp32 everywhere.
        backend: ``"torch"`` (reference: dequantize, per-expert fp32 matmul), ``"triton"``
            (:func:`moe_rl.fp8.triton_kernels.fp8_grouped_gemm_triton`), ``"deep_gemm"``
            (``m_grouped_fp8_gemm_nt_contiguous`` or the old ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``; K is
            zero-padded to a multiple of 128), or ``"auto"`` (deep_gemm on CUDA when importable, else torch).

    Returns:
        ``[M, N]`` of ``out_dtype``.

    Raises:
        ValueError: bad shapes/dtypes, ids out of ``[-1, G)``, a 128-row block mixing experts, unknown backend,
            deep_gemm on non-CUDA tensors.
        ImportError: the chosen backend's package is missing (message says how to install it).
    """
    if backend not in _GROUPED_BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {_GROUPED_BACKENDS}")
    _check_grouped(a, a_scale, b, b_scale, m_indices)
    chosen = backend
    if backend == "auto":
        chosen = "torch"
        if a.device.type == "cuda":
            try:
                _deep_gemm_fn(_import_deep_gemm(), _DEEP_GEMM_GROUPED_NAMES)
                chosen = "deep_gemm"
            except ImportError:
                pass
    if chosen == "torch":
        return _grouped_torch(a, a_scale, b, b_scale, m_indices, out_dtype)
    if chosen == "triton":
        from moe_rl.fp8.triton_kernels import fp8_grouped_gemm_triton  # lazy: imports triton

        return fp8_grouped_gemm_triton(a, a_scale, b, b_scale, m_indices, out_dtype)
    mod = _import_deep_gemm()
    if a.device.type != "cuda":
        raise ValueError(f"backend='deep_gemm' needs CUDA tensors, got {a.device}")
    return _grouped_deep_gemm(mod, a, a_scale, b, b_scale, m_indices, out_dtype)


def fp8_grouped_wgrad(
    dy_MN: Tensor, x_MK: Tensor, layout: ContiguousLayout, num_groups: int, backend: GroupedBackend = "torch"
) -> Tensor:
    """Per-expert weight gradient ``dW[e] = dy_e^T @ x_e`` with both operands in 128x1 groups along tokens.

    Args:
        dy_MN: ``[M, N]`` output gradient in the padded layout (padding rows zero).
        x_MK: ``[M, K]`` input in the padded layout (padding rows zero).
        layout: the :class:`ContiguousLayout` of both (segments are 128-aligned, so token groups never cross
            experts).
        num_groups: G.
        backend: dense GEMM backend per expert (:func:`moe_rl.fp8.gemm.fp8_block_gemm`, recipe (1, 1, 128);
            ``"auto"`` resolves per device). DeepGEMM's ``k_grouped_fp8_gemm_*_contiguous`` would fuse the loop.

    Returns:
        ``[G, N, K]`` fp32; zero for experts with no rows.

    Raises:
        ValueError: non-finite ``dy_MN`` / ``x_MK`` (named ``grad_output`` / ``input``).
    """
    M, N = dy_MN.shape
    K = x_MK.shape[1]
    qb = quant_backend_for(backend, dy_MN.device)
    gq, gs = quantize_128x1(dy_MN, name="grad_output", backend=qb)  # [M, N], [M/128, N]
    xq, xs = quantize_128x1(x_MK, name="input", backend=qb)
    dw = torch.zeros((num_groups, N, K), dtype=torch.float32, device=dy_MN.device)
    for e, (st, p) in enumerate(zip(layout.starts, layout.padded, strict=True)):
        if p == 0:
            continue
        sl, sb = slice(st, st + p), slice(st // 128, (st + p) // 128)
        dw[e] = fp8_block_gemm(
            gq[sl].T.contiguous(), gs[sb].T.contiguous(), xq[sl].T.contiguous(), xs[sb].T.contiguous(),
            out_dtype=torch.float32, backend=backend, recipe=(1, 1, 128),
        )  # fmt: skip
    return dw


class _Fp8GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, layout, backend):
        qb = ctx.quant_backend = quant_backend_for(backend, x_MK.device)
        xq, xs = quantize_1x128(x_MK, name="input", backend=qb)
        wq, ws = quantize_128x128_grouped(w_GNK, name="expert_weight", backend=qb)
        out_dtype = torch.bfloat16 if backend == "deep_gemm" else x_MK.dtype
        y = fp8_grouped_gemm(xq, xs, wq, ws, layout.m_indices, out_dtype=out_dtype, backend=backend).to(x_MK.dtype)
        ctx.save_for_backward(x_MK, wq, ws)
        ctx.layout, ctx.backend, ctx.w_dtype = layout, backend, w_GNK.dtype
        return y

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, wq, ws = ctx.saved_tensors
        layout, backend = ctx.layout, ctx.backend
        dy_MN = dy_MN.masked_fill((layout.m_indices < 0)[:, None], 0)  # padding rows never carry gradient
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, gs = quantize_1x128(dy_MN, name="grad_output", backend=ctx.quant_backend)
            out_dtype = torch.bfloat16 if backend == "deep_gemm" else x_MK.dtype
            dx = fp8_grouped_gemm(gq, gs, wq.transpose(1, 2).contiguous(), ws.transpose(1, 2).contiguous(),
                                  layout.m_indices, out_dtype=out_dtype, backend=backend).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = fp8_grouped_wgrad(dy_MN, x_MK, layout, wq.shape[0], backend).to(ctx.w_dtype)
        return dx, dw, None, None


def fp8_grouped_linear(x_MK: Tensor, w_GNK: Tensor, layout: ContiguousLayout,
                       backend: GroupedBackend = "torch") -> Tensor:
    """Grouped ``y[m] = x[m] @ w[e(m)]^T`` with all three GEMMs in FP8 (module docstring); autograd.

    Args:
        x_MK: ``[M, K]`` float rows in the padded layout (padding rows should be zero).
        w_GNK: ``[G, Nw, K]`` high-precision master weights (``nn.Linear`` layout per expert).
        layout: :class:`ContiguousLayout` of ``x_MK``.
        backend: grouped GEMM backend (:func:`fp8_grouped_gemm`).

    Returns:
        ``[M, Nw]`` in ``x_MK``'s dtype; padding rows are zero. ``w_GNK`` gets a gradient of its own dtype.

    Raises:
        ValueError: non-finite input, weight or output gradient (named ``input``, ``expert_weight``,
            ``grad_output``), layout/shape mismatches, or an unknown ``backend`` (checked on entry).
    """
    from moe_rl.fp8.gemm import check_backend

    check_backend(backend)
    if x_MK.dim() != 2 or x_MK.shape[0] != layout.num_rows:
        raise ValueError(f"x_MK: expected [M={layout.num_rows}, K], got {tuple(x_MK.shape)}")
    return _Fp8GroupedLinearFn.apply(x_MK, w_GNK, layout, backend)


