"""FP8 block-scaled linear layer (DeepSeek-V3 recipe, arXiv 2412.19437 §3.3): functional core + module swap.

Shape legend:
    T  tokens (all leading dims of the input flattened)
    K  in_features
    N  out_features

The three GEMMs, all E4M3 with fp32 accumulation (:func:`moe_rl.fp8.gemm.fp8_block_gemm`)::

    Fprop  y_TN  = x_TK  @ W_NK^T     x 1x128 along K,  W 128x128                   recipe (1, 128, 128)
    Dgrad  dx_TK = dy_TN @ W_NK       dy 1x128 along N, W^T = (codes.T, scales.T)   recipe (1, 128, 128)
                                      (the same 128x128 weight blocks, transposed)
    Wgrad  dW_NK = dy_TN^T @ x_TK     dy and x quantized 128x1 (groups of 128 tokens), i.e. 1x128 of the
                                      transposes dy^T [N, T] and x^T [K, T]          recipe (1, 1, 128)

Master weights stay in their own dtype (fp32 by default) and receive a gradient of that dtype; the weight is
re-quantized on every forward. Bias (optional) is added in high precision. Deviation from DeepSeek-V3: the
high-precision input is saved for Wgrad (they cache it in FP8); memory, not numerics, differs.
Router/gate, lm_head and embeddings stay in high precision (§3.3), hence the default filter of
:func:`convert_to_fp8_block_linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_rl.fp8.gemm import Backend, check_backend, fp8_block_gemm
from moe_rl.fp8.quant import quantize_1x128, quantize_128x1, quantize_128x128

__all__ = [
    "Fp8BlockLinear",
    "convert_to_fp8_block_linear",
    "default_fp8_filter",
    "fp8_block_linear",
    "quant_backend_for",
]


def quant_backend_for(backend: str, device: torch.device) -> str:
    """Quantizer backend paired with a GEMM backend: ``"triton"`` for the triton GEMM, and for deep_gemm /
    auto on CUDA when Triton imports (the fused kernels); ``"torch"`` otherwise (CPU reference)."""
    if backend == "triton":
        return "triton"
    if device.type == "cuda" and backend in ("deep_gemm", "auto"):
        from moe_rl.fp8.triton_kernels import triton_available

        return "triton" if triton_available() else "torch"
    return "torch"


class _Fp8BlockLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, w_NK, backend):
        qb = quant_backend_for(backend, x_TK.device)
        xq, xs = quantize_1x128(x_TK, name="input", backend=qb)
        wq, ws = quantize_128x128(w_NK, name="weight", backend=qb)
        y = fp8_block_gemm(xq, xs, wq, ws, out_dtype=x_TK.dtype, backend=backend)
        ctx.save_for_backward(x_TK, wq, ws)
        ctx.w_dtype = w_NK.dtype
        ctx.backend = backend
        ctx.quant_backend = qb
        return y

    @staticmethod
    def backward(ctx, dy_TN):
        x_TK, wq, ws = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, gs = quantize_1x128(dy_TN, name="grad_output", backend=ctx.quant_backend)
            dx = fp8_block_gemm(gq, gs, wq.T.contiguous(), ws.T.contiguous(), out_dtype=x_TK.dtype,
                                backend=ctx.backend)
        if ctx.needs_input_grad[1]:
            gq, gs = quantize_128x1(dy_TN, name="grad_output", backend=ctx.quant_backend)
            xq, xs = quantize_128x1(x_TK, name="input", backend=ctx.quant_backend)
            dw = fp8_block_gemm(gq.T.contiguous(), gs.T.contiguous(), xq.T.contiguous(), xs.T.contiguous(),
                                out_dtype=torch.float32, backend=ctx.backend, recipe=(1, 1, 128)).to(ctx.w_dtype)
        return dx, dw, None


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: Backend = "torch"
) -> torch.Tensor:
    """``F.linear`` with all three GEMMs in FP8 block scaling (see the module docstring).

    Args:
        x: ``[..., K]`` float input (fp32/bf16); the output has its dtype.
        weight: ``[N, K]`` master weight (fp32 by default).
        bias: optional ``[N]``, added after the GEMM in the output dtype.
        backend: GEMM backend for all three GEMMs (:func:`moe_rl.fp8.gemm.fp8_block_gemm`).

    Returns:
        ``[..., N]``.

    Raises:
        TypeError: ``x``, ``weight`` or ``bias`` is not a floating-point tensor (an integer input would come back
            as an integer output, silently rounded).
        ValueError: non-finite input, weight or output gradient (the quantizers refuse inf/NaN); an unknown
            ``backend``.
    """
    check_backend(backend)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(
                f"fp8_block_linear: {name} has dtype {t.dtype}; it must be a floating-point tensor (float32, "
                f"bfloat16, float16): cast it first, e.g. {name}.float()"
            )
    lead = x.shape[:-1]
    y = _Fp8BlockLinearFn.apply(x.reshape(-1, x.shape[-1]), weight, backend)
    y = y.reshape(*lead, weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


class Fp8BlockLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in FP8 block scaling; parameters stay high precision.

    Raises:
        ValueError: unknown ``backend`` (checked at construction).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, backend: Backend = "torch",
                 device=None, dtype=None) -> None:
        check_backend(backend)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend: Backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.bias, backend=self.backend)

    @classmethod
    def from_linear(cls, lin: nn.Linear, *, backend: Backend = "torch") -> Fp8BlockLinear:
        """Swap in place of ``lin``, sharing its parameters (no copy).

        Raises:
            ValueError: unknown ``backend`` (checked here, not at the first forward).
        """
        check_backend(backend)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        new.backend = backend
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"


_EXCLUDED_NAMES = ("router", "gate", "lm_head")


def default_fp8_filter(fqn: str, module: nn.Module) -> bool:
    """Default ``filter_fn``: convert every ``nn.Linear`` except the MoE router/gate and the output head.

    A module is excluded when the last component of its qualified name is ``gate``, ``router`` or ``lm_head``,
    or when any component is ``router`` (e.g. ``mlp.router.proj``). ``gate_proj`` (the SwiGLU FFN projection)
    is *not* excluded: it is an ordinary FP8 GEMM in DeepSeek-V3.
    """
    if not isinstance(module, nn.Linear):
        return False
    parts = fqn.split(".")
    return parts[-1] not in _EXCLUDED_NAMES and "router" not in parts


def convert_to_fp8_block_linear(
    model: nn.Module,
    *,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    backend: Backend = "torch",
) -> nn.Module:
    """Swap ``nn.Linear`` submodules of ``model`` (in place) for :class:`Fp8BlockLinear` sharing their parameters.

    Args:
        model: module to convert; returned for chaining.
        filter_fn: ``(fqn, module) -> bool``, True to convert; defaults to :func:`default_fp8_filter`.
        backend: GEMM backend for the converted layers.

    Raises:
        ValueError: unknown ``backend`` (checked before any layer is swapped).
    """
    check_backend(backend)
    filter_fn = filter_fn or default_fp8_filter
    for fqn, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and filter_fn(fqn, mod):
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Fp8BlockLinear.from_linear(mod, backend=backend))
    return model
