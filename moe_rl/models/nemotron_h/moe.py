"""The Nemotron-H MoE layer: squared-ReLU routed experts, optionally in a latent space (LatentMoE), plus a shared
expert.

Shape legend:
    T   tokens (batch and sequence flattened)
    D   hidden size
    L   expert input/output width: ``moe_latent_size`` when set (LatentMoE), else D
    F   routed expert intermediate size (``moe_intermediate_size``)
    Fs  shared expert intermediate size (``moe_shared_expert_intermediate_size``)
    E   routed experts
    K   experts per token (top_k)
    N   routed token-slots, N = T * K

Computation (Hugging Face ``NemotronHMoE`` in ``transformers/models/nemotron_h/modeling_nemotron_h.py``; LatentMoE
of the Nemotron 3 white paper)::

    ids_TK, w_TK  = gate(x_TD)                         # sigmoid, noaux_tc bias, group limit, norm, scaling (fp32)
    z_TL          = fc1_latent_proj(x_TD)              # identity without a latent
    y_TKL         = experts(z_TL, ids_TK)              # down_e(relu(up_e(z))^2), unweighted
    out_TL        = sum_k w_TK[:, k] * y_TKL[:, k]     # fp32, cast back
    out_TD        = fc2_latent_proj(out_TL) + shared_experts(x_TD)

The router sees the hidden state (not the latent); the shared expert works on the hidden state. Parameter names
are transformers 5's in-memory names of ``NemotronHMoE`` (``gate.weight``, ``gate.e_score_correction_bias``,
``experts.up_proj [E, F, L]``, ``experts.down_proj [E, L, F]``, ``shared_experts.{up,down}_proj.weight``,
``fc1_latent_proj.weight``, ``fc2_latent_proj.weight``); checkpoints store one tensor per expert
(:mod:`moe_rl.models.nemotron_h.state_dict`).

FP8 (``trainer.fp8``, :func:`moe_rl.moe.convert_model_to_fp8` calls :meth:`ReluSquaredExperts.enable_fp8`): both
routed projections run as FP8 block-scaled grouped GEMMs (:func:`moe_rl.fp8.fp8_grouped_linear`: DeepGEMM's
128-row padded contiguous layout, 1x128 activations, 128x128 per-expert weights, Wgrad 128x1 along tokens), the
squared ReLU in between in the input dtype (:func:`fp8_relu2_rows_forward`). The parameters, their names and the
state dict do not change; only the GEMMs do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_rl.models.nemotron_h.config import NemotronHConfig
from moe_rl.moe.experts import ExpertsBackend, expert_slots_forward
from moe_rl.moe.router import TopKRouter, flat_replay_ids

__all__ = ["NemotronHMLP", "NemotronHMoE", "ReluSquaredExperts", "fp8_relu2_rows_forward", "relu2",
           "relu2_experts_forward", "relu2_rows_forward"]


def relu2(x: Tensor) -> Tensor:
    """Squared ReLU ``relu(x)^2`` (transformers' ``relu2``, Primer: So et al., arXiv 2109.08668)."""
    return torch.square(F.relu(x))


class NemotronHMLP(nn.Module):
    """``down_proj(relu2(up_proj(x)))``, ``[..., D] -> [..., D]`` (the dense ``-`` layer and the shared expert).

    Args:
        hidden_size: D. intermediate_size: the hidden activation's width. bias: biases on both projections.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


def fp8_relu2_rows_forward(x_NL: Tensor, counts_E: Tensor, up_proj: Tensor, down_proj: Tensor, *,
                           backend: str) -> Tensor:
    """Squared-ReLU experts on rows already sorted by expert, both projections in FP8 block scaling.

    ``y = down_e(relu(up_e(x))^2)`` per row, with ``up_e`` and ``down_e`` each an FP8 grouped GEMM
    (:func:`moe_rl.fp8.fp8_grouped_linear`: rows copied into the 128-row padded contiguous layout, activations
    quantized 1x128, weights 128x128 per expert, Wgrad 128x1 along the tokens of each expert's segment; fp32
    accumulation) and the squared ReLU in ``x_NL``'s dtype. Experts with no rows still take part in the graph
    (their weight gradients are zero tensors, as expert parallelism needs).

    Args:
        x_NL: ``[N, L]`` float rows, expert-major (expert 0's rows first), N may be 0.
        counts_E: ``[E]`` int64 rows per expert, summing to N.
        up_proj: ``[E, F, L]``; down_proj: ``[E, L, F]`` high-precision master weights (``y = x @ W^T``).
        backend: FP8 grouped GEMM backend, ``"torch"`` (CPU reference), ``"triton"``, ``"deep_gemm"`` or
            ``"auto"`` (:func:`moe_rl.fp8.fp8_grouped_gemm`).

    Returns:
        ``[N, L]`` in ``x_NL``'s dtype.

    Raises:
        ValueError: an unknown ``backend``, non-finite input / weight / output gradient (named ``input``,
            ``expert_weight``, ``grad_output``), or ``counts_E`` negative or not summing to N.
    """
    from moe_rl.fp8.grouped import contiguous_layout, fp8_grouped_linear

    layout = contiguous_layout(counts_E)
    if layout.rows.shape[0] != x_NL.shape[0]:
        raise ValueError(f"counts_E sums to {layout.rows.shape[0]} rows but x_NL has {x_NL.shape[0]}; pass the "
                         "rows per expert of x_NL's expert-major order")
    x_ML = x_NL.new_zeros(layout.num_rows, x_NL.shape[1]).index_copy(0, layout.rows, x_NL)
    h_MF = relu2(fp8_grouped_linear(x_ML, up_proj, layout, backend))  # relu2(0) = 0 on padding rows
    return fp8_grouped_linear(h_MF, down_proj, layout, backend)[layout.rows]


def relu2_rows_forward(x_NL: Tensor, counts_E: Tensor, up_proj: Tensor, down_proj: Tensor, *, backend: str,
                       fp8_backend: str | None = None) -> Tensor:
    """Run rows already sorted by expert through the squared-ReLU experts (unweighted).

    Every expert takes part in the autograd graph even with no rows, so its weight gradient is a zero tensor
    rather than None (under expert parallelism the same parameters carry gradients on every rank).

    Args:
        x_NL: ``[N, L]`` rows, expert-major (the ``counts_E[0]`` rows of expert 0 first, ...).
        counts_E: ``[E]`` int64 rows per expert, summing to N.
        up_proj: ``[E, F, L]``; down_proj: ``[E, L, F]`` (``y = x @ W^T``).
        backend: ``"loop"`` (one matmul pair per expert; any dtype, one host sync) or ``"grouped_mm"``
            (``torch._grouped_mm``; fp32/bf16/fp16, L and F multiples of ``16 / itemsize``).
        fp8_backend: ``None`` (high precision, ``backend`` picks the kernel) or an FP8 grouped GEMM backend
            (``"torch"`` | ``"triton"`` | ``"deep_gemm"`` | ``"auto"``): both projections in FP8 block scaling
            (:func:`fp8_relu2_rows_forward`), ``backend`` unused.

    Returns:
        ``[N, L]`` in ``x_NL``'s dtype.

    Raises:
        ValueError: an unknown backend, or a ``grouped_mm`` dtype/alignment rule is not met.
    """
    if fp8_backend is not None:
        return fp8_relu2_rows_forward(x_NL, counts_E, up_proj, down_proj, backend=fp8_backend)
    if backend == "grouped_mm":
        align = 16 // x_NL.element_size()
        width, inter = down_proj.shape[1], down_proj.shape[2]
        if x_NL.dtype not in (torch.float32, torch.bfloat16, torch.float16) or width % align or inter % align:
            raise ValueError(f"backend='grouped_mm' needs fp32/bf16/fp16 and expert widths L={width}, F={inter} that "
                             f"are multiples of {align} ({x_NL.dtype}); use backend='loop'")
        offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        h_NF = relu2(torch._grouped_mm(x_NL, up_proj.transpose(-2, -1), offs=offs_E))
        return torch._grouped_mm(h_NF, down_proj.transpose(-2, -1), offs=offs_E)
    if backend != "loop":
        raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
    outs, start = [], 0
    for e, count in enumerate(counts_E.tolist()):  # empty slices too: every expert is in the graph
        outs.append(F.linear(relu2(F.linear(x_NL[start:start + count], up_proj[e])), down_proj[e]))
        start += count
    return torch.cat(outs)


def relu2_experts_forward(x_TL: Tensor, topk_ids_TK: Tensor, up_proj: Tensor, down_proj: Tensor, *,
                          backend: ExpertsBackend, fp8_backend: str | None = None) -> Tensor:
    """Run each token through its K squared-ReLU experts (unweighted).

    Args:
        x_TL: ``[T, L]`` expert inputs.
        topk_ids_TK: ``[T, K]`` int64 expert ids.
        up_proj: ``[E, F, L]``; down_proj: ``[E, L, F]`` (``nn.Linear`` convention, ``y = x @ W^T``).
        backend, fp8_backend: the kernel of the expert-sorted rows, as :func:`relu2_rows_forward` takes them.

    Returns:
        ``[T, K, L]`` in ``x_TL``'s dtype; slot ``[t, k]`` is expert ``topk_ids_TK[t, k]`` applied to token t.

    Raises:
        ValueError: an unknown backend, or a ``grouped_mm`` dtype/alignment rule is not met.
    """
    def rows_forward(x_NL: Tensor, counts_E: Tensor) -> Tensor:
        return relu2_rows_forward(x_NL, counts_E, up_proj, down_proj, backend=backend, fp8_backend=fp8_backend)

    return expert_slots_forward(x_TL, topk_ids_TK, up_proj.shape[0], rows_forward)


class ReluSquaredExperts(nn.Module):
    """E routed squared-ReLU experts with stacked weights ``up_proj [E, F, L]`` and ``down_proj [E, L, F]``.

    ``forward(x_TL [T, L], topk_ids_TK [T, K]) -> [T, K, L]`` (:func:`relu2_experts_forward`). ``backend`` can be
    switched later through the attribute. ``fp8_backend``: ``None`` (high precision) or the FP8 grouped GEMM
    backend set by :meth:`enable_fp8` (then both projections run in FP8 and ``backend`` is unused).
    """

    fp8_backend: str | None = None

    def __init__(self, num_experts: int, width: int, intermediate_size: int, *, backend: ExpertsBackend) -> None:
        super().__init__()
        if backend not in ("loop", "grouped_mm"):
            raise ValueError(f"backend={backend!r} is not supported; use 'loop' or 'grouped_mm'")
        self.backend: ExpertsBackend = backend
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate_size))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) for both stacks (transformers' ``_init_weights``)."""
        nn.init.normal_(self.up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)

    def enable_fp8(self, backend: str = "auto") -> ReluSquaredExperts:
        """Run both projections as FP8 block-scaled grouped GEMMs from now on (in place; the parameters, their
        dtype and the state dict are unchanged). :func:`moe_rl.moe.convert_model_to_fp8` calls this. Returns self.

        Args:
            backend: ``"torch"`` | ``"triton"`` | ``"deep_gemm"`` | ``"auto"`` (:func:`moe_rl.fp8.fp8_grouped_gemm`).

        Raises:
            ValueError: an unknown ``backend`` (checked here, not at the first forward).
        """
        from moe_rl.fp8.gemm import check_backend

        check_backend(backend)
        self.fp8_backend = backend
        return self

    def forward(self, x_TL: Tensor, topk_ids_TK: Tensor) -> Tensor:
        return relu2_experts_forward(x_TL, topk_ids_TK, self.up_proj, self.down_proj, backend=self.backend,
                                     fp8_backend=self.fp8_backend)

    def extra_repr(self) -> str:
        e, f, w = self.up_proj.shape
        return f"num_experts={e}, width={w}, intermediate_size={f}, backend={self.backend!r}, " \
               f"fp8_backend={self.fp8_backend!r}"


class NemotronHMoE(nn.Module):
    """The ``E`` layer's mixer (module docstring). ``forward(x [..., D], replay_ids [..., K] | None) -> [..., D]``
    in ``x``'s dtype.

    Args:
        cfg: the architecture. experts_backend: ``"loop"`` or ``"grouped_mm"``.
    """

    def __init__(self, cfg: NemotronHConfig, experts_backend: ExpertsBackend = "loop") -> None:
        super().__init__()
        hidden, latent = cfg.hidden_size, cfg.moe_latent_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = TopKRouter(hidden, cfg.n_routed_experts, cfg.num_experts_per_tok, score_func="sigmoid",
                               n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                               routed_scaling_factor=cfg.routed_scaling_factor, use_correction_bias=True)
        self.experts = ReluSquaredExperts(cfg.n_routed_experts, latent or hidden, cfg.moe_intermediate_size,
                                          backend=experts_backend)
        self.shared_experts = NemotronHMLP(hidden, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        if latent is None:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        else:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=cfg.mlp_bias)

    def forward(self, x: Tensor, replay_ids: Tensor | None = None) -> Tensor:
        """Args: ``x [..., D]``; ``replay_ids`` optional ``[..., K]`` integer expert ids to replay (R3; sentinel rows
        as in :func:`moe_rl.moe.router.topk_route`). Raises ValueError when ``replay_ids`` does not match."""
        x_TD = x.reshape(-1, x.shape[-1])
        replay_TK = flat_replay_ids(replay_ids, x, self.top_k)
        ids_TK, w_TK, _ = self.gate(x_TD, replay_TK)
        z_TL = x_TD if self.fc1_latent_proj is None else self.fc1_latent_proj(x_TD)
        y_TKL = self.experts(z_TL, ids_TK)
        out_TL = torch.einsum("tkl,tk->tl", y_TKL.float(), w_TK).to(x.dtype)
        out_TD = out_TL if self.fc2_latent_proj is None else self.fc2_latent_proj(out_TL)
        return (out_TD + self.shared_experts(x_TD)).view(x.shape)
