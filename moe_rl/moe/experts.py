"""Routed SwiGLU experts with stacked weights, and two interchangeable compute backends.

Shape legend:
    T  tokens
    D  hidden size
    F  expert intermediate size (moe_intermediate_size)
    E  routed experts
    K  experts per token (top_k)
    N  routed token-slots, N = T * K (rows after sorting by expert)

Weight layout (same as transformers 5 ``Glm4MoeExperts`` in memory and vLLM's fused ``w13``/``w2``)::

    gate_up_proj  [E, 2F, D]   rows [0, F) = gate_proj.weight, rows [F, 2F) = up_proj.weight of each expert
    down_proj     [E, D, F]    down_proj.weight of each expert

Each expert e computes ``down_e(silu(gate_e(x)) * up_e(x))`` (``nn.Linear`` convention: ``y = x @ W^T``).

Backends (chosen explicitly, never by silent fallback):
    ``"loop"``: reference. One matmul pair per expert that received tokens. Works for any float dtype
        (float64 included) and any size. Needs one device-to-host sync for the per-expert counts.
    ``"grouped_mm"``: ``torch._grouped_mm`` over expert-sorted rows with int32 ``offs`` (no host sync).
        Works on CPU in fp32/bf16 (forward and backward) and on CUDA sm90+ in bf16. Constraints:
        fp32/bf16/fp16 only, and every row stride must be a multiple of 16 bytes, i.e. D and F must be
        multiples of ``16 / itemsize`` (4 in fp32, 8 in bf16). Known caveat: the backward of
        ``_grouped_mm`` fails on an expanded (stride-0) output gradient, e.g. ``y.sum().backward()``
        applied directly to a grouped_mm output ("Invalid strides/sizes"). Here the outputs are scattered
        back into token order by ``index_copy``, whose backward hands ``_grouped_mm`` a dense gradient, so
        callers of this module never hit it.

Both backends sort the N token-slots by expert (stable), compute, and scatter the results back to
``[T, K, D]`` with ``index_copy`` (unique indices), so the result does not depend on atomics: both are
deterministic. Gate weights are not applied here; :class:`moe_rl.moe.MoE` applies them in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ExpertsBackend",
    "GroupedExperts",
    "expert_slots_forward",
    "grouped_experts_forward",
    "grouped_mm_problem",
    "sort_by_expert",
]

ExpertsBackend = Literal["loop", "grouped_mm"]


def sort_by_expert(topk_ids_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Stable-sort the token-slots by expert id.

    Args:
        topk_ids_TK: ``[T, K]`` int64 expert ids.
        num_experts: E.

    Returns:
        ``(perm_N, token_N, counts_E)``: ``perm_N`` int64 flat slot indices (into ``T*K``) in expert order,
        ``token_N`` the token index of each sorted slot, ``counts_E`` int64 slots per expert.
    """
    flat_ids_N = topk_ids_TK.reshape(-1)
    perm_N = torch.argsort(flat_ids_N, stable=True)
    token_N = perm_N // topk_ids_TK.shape[1]
    # scatter_add instead of bincount: bincount syncs with the host on CUDA to size its output.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids_N.device)
    counts_E.scatter_add_(0, flat_ids_N, torch.ones_like(flat_ids_N))
    return perm_N, token_N, counts_E


def expert_slots_forward(
    x_TD: Tensor, topk_ids_TK: Tensor, num_experts: int, rows_forward: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """Run each token's K slots through their experts: the ``N = T*K`` slots are sorted by expert
    (:func:`sort_by_expert`), ``rows_forward`` computes the expert-major rows, and the results go back to slot order.

    Args:
        x_TD: ``[T, D]`` tokens (``T = 0`` is allowed: the result is ``[0, K, D']``).
        topk_ids_TK: ``[T, K]`` int64 expert ids in ``[0, E)`` (the range is not checked: that would sync with the
            host).
        num_experts: E.
        rows_forward: ``(x_ND, counts_E) -> y_ND'``: ``x_ND [N, D]`` the slots' token rows, expert-major (the
            ``counts_E[0]`` rows of expert 0 first, ...), ``counts_E [E]`` int64; returns ``[N, D']``, row i computed
            by the expert of sorted row i.

    Returns:
        ``[T, K, D']`` in ``rows_forward``'s dtype; slot ``[t, k]`` is expert ``topk_ids_TK[t, k]`` applied to token
        t (differentiable through the gather and the scatter back).

    Raises:
        TypeError: ``topk_ids_TK`` is not an int64 tensor, or ``rows_forward`` returns something other than a
            tensor.
        ValueError: ``topk_ids_TK`` is not 2-D, ``x_TD`` is not ``[T, D]`` with the same T, or ``rows_forward``
            returns a shape other than ``[N, D']``.
    """
    if not isinstance(topk_ids_TK, Tensor) or topk_ids_TK.dtype != torch.int64:
        got = f"dtype {topk_ids_TK.dtype}" if isinstance(topk_ids_TK, Tensor) else type(topk_ids_TK).__name__
        raise TypeError(f"expert_slots_forward: topk_ids_TK must be an int64 tensor of expert ids, got {got}; "
                        "pass the router's top-k indices (cast with .long())")
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"expert_slots_forward: topk_ids_TK must be 2-D [T, K], got shape "
                         f"{tuple(topk_ids_TK.shape)}; reshape it to [num_tokens, top_k]")
    num_tokens, top_k = topk_ids_TK.shape
    if x_TD.dim() != 2 or x_TD.shape[0] != num_tokens:
        raise ValueError(f"expert_slots_forward: x_TD must be [T, D] with T = {num_tokens} (topk_ids_TK's rows), "
                         f"got shape {tuple(x_TD.shape)}; flatten the tokens to [T, D]")
    perm_N, token_N, counts_E = sort_by_expert(topk_ids_TK, num_experts)
    y_ND = rows_forward(x_TD[token_N], counts_E)
    if not isinstance(y_ND, Tensor):
        raise TypeError(f"expert_slots_forward: rows_forward returned {type(y_ND).__name__}, not a tensor; it must "
                        f"return the [N, D'] expert outputs (N = {perm_N.numel()})")
    if y_ND.dim() != 2 or y_ND.shape[0] != perm_N.numel():
        raise ValueError(f"expert_slots_forward: rows_forward returned shape {tuple(y_ND.shape)}; it must return "
                         f"[N, D'] with N = T*K = {perm_N.numel()}, one row per sorted slot")
    y_ND = y_ND.new_zeros(y_ND.shape).index_copy(0, perm_N, y_ND)
    return y_ND.view(num_tokens, top_k, y_ND.shape[1])


def _swiglu(h_N2F: Tensor) -> Tensor:
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    return F.silu(gate_NF) * up_NF


def _experts_loop(x_ND: Tensor, counts_E: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    outs = []
    start = 0
    for e, count in enumerate(counts_E.tolist()):
        if count == 0:
            continue
        x_nD = x_ND[start : start + count]
        outs.append(F.linear(_swiglu(F.linear(x_nD, gate_up_proj[e])), down_proj[e]))
        start += count
    if not outs:  # N = 0: an empty product through expert 0 keeps the result on the autograd graph (zero grads)
        return F.linear(_swiglu(F.linear(x_ND, gate_up_proj[0])), down_proj[0])
    return torch.cat(outs, dim=0)


def grouped_mm_problem(hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> str | None:
    """Why ``backend="grouped_mm"`` cannot run experts of these sizes in ``dtype``, or ``None`` when it can.

    ``torch._grouped_mm`` (CPU fp32/bf16/fp16; CUDA sm90+ bf16) needs 16-byte row strides: D and F multiples of
    ``16 / itemsize``. A trainer checks this once at start instead of failing in the first forward.

    Args:
        hidden_size: D.
        intermediate_size: F (``moe_intermediate_size``).
        dtype: the compute dtype of the expert GEMMs (the parameter dtype, or FSDP2's ``param_dtype``).

    Returns:
        A sentence naming the rule and the sizes, or ``None``.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"grouped_mm runs float32/bfloat16/float16 only, not {dtype}"
    align = 16 // torch.empty(0, dtype=dtype).element_size()
    if hidden_size % align or intermediate_size % align:
        return (f"grouped_mm needs hidden size D={hidden_size} and expert intermediate size F={intermediate_size} "
                f"to be multiples of {align} in {dtype} (16-byte row strides)")
    return None


def _check_grouped_mm(x_ND: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> None:
    if x_ND.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"backend='grouped_mm' needs float32/bfloat16/float16 inputs, got {x_ND.dtype}; "
            "use backend='loop' (e.g. for float64 references)"
        )
    if gate_up_proj.dtype != x_ND.dtype or down_proj.dtype != x_ND.dtype:
        raise ValueError(
            f"backend='grouped_mm' needs one dtype: x is {x_ND.dtype}, gate_up_proj {gate_up_proj.dtype}, "
            f"down_proj {down_proj.dtype}"
        )
    align = 16 // x_ND.element_size()
    hidden, inter = down_proj.shape[1], down_proj.shape[2]
    if hidden % align or inter % align:
        raise ValueError(
            f"backend='grouped_mm' needs hidden size D={hidden} and expert intermediate size F={inter} to be "
            f"multiples of {align} for {x_ND.dtype} (16-byte row strides); use backend='loop' or pad the sizes"
        )


def _experts_grouped_mm(x_ND: Tensor, counts_E: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    _check_grouped_mm(x_ND, gate_up_proj, down_proj)
    offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    h_N2F = torch._grouped_mm(x_ND, gate_up_proj.transpose(-2, -1), offs=offs_E)
    return torch._grouped_mm(_swiglu(h_N2F), down_proj.transpose(-2, -1), offs=offs_E)


def grouped_experts_forward(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    *,
    backend: ExpertsBackend,
) -> Tensor:
    """Run each token through its K experts (unweighted).

    Args:
        x_TD: ``[T, D]`` tokens.
        topk_ids_TK: ``[T, K]`` int64 expert ids.
        gate_up_proj: ``[E, 2F, D]`` stacked gate/up weights (gate rows first).
        down_proj: ``[E, D, F]`` stacked down weights.
        backend: ``"loop"`` (reference) or ``"grouped_mm"``.

    Returns:
        ``[T, K, D]`` expert outputs in ``x_TD``'s dtype; slot ``[t, k]`` is expert ``topk_ids_TK[t, k]``
        applied to token t.

    Raises:
        ValueError: unknown backend, or a ``grouped_mm`` dtype/alignment constraint is not met.
    """
    if backend == "loop":
        rows = _experts_loop
    elif backend == "grouped_mm":
        rows = _experts_grouped_mm
    else:
        raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
    return expert_slots_forward(x_TD, topk_ids_TK, gate_up_proj.shape[0],
                                lambda x_ND, counts_E: rows(x_ND, counts_E, gate_up_proj, down_proj))


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts with stacked weights (layout in the module docstring).

    Args:
        num_experts: E.
        hidden_size: D.
        intermediate_size: F (``moe_intermediate_size``).
        backend: ``"loop"`` or ``"grouped_mm"``; can be changed later through the ``backend`` attribute.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, backend: ExpertsBackend
    ) -> None:
        super().__init__()
        if backend not in ("loop", "grouped_mm"):
            raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.backend: ExpertsBackend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) for both stacked weights (Hugging Face ``_init_weights``)."""
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)

    def forward(self, x_TD: Tensor, topk_ids_TK: Tensor) -> Tensor:
        """``[T, D]`` tokens and ``[T, K]`` int64 ids -> ``[T, K, D]`` unweighted expert outputs."""
        return grouped_experts_forward(
            x_TD, topk_ids_TK, self.gate_up_proj, self.down_proj, backend=self.backend
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, backend={self.backend}"
        )
