"""FP8 block-scaled GEMM ``out = a @ b.T`` (DeepGEMM "NT" layout), with explicit backends.

Shape legend:
    M   rows of ``a`` (tokens)
    N   rows of ``b`` (output features)
    K   contraction dimension; both operands are K-major
    SK  ceil(K / 128) scale columns

Recipe ``(gran_m, gran_n, gran_k)`` (DeepGEMM's name): ``a`` has one scale per ``gran_m x gran_k`` tile and ``b``
one per ``gran_n x gran_k`` tile. ``(1, 128, 128)`` is the DeepSeek-V3 forward/Dgrad recipe (activations 1x128,
weights 128x128; arXiv 2412.19437 §3.3); ``(1, 1, 128)`` is the Wgrad recipe (both operands per-row 1x128
along the token dimension).

Backends (never a silent fallback):
    ``"torch"``      reference: dequantize both operands with their configured blocks, fp32 matmul, cast.
                     A per-128-K-slice variant (fp32 matmul of codes per slice, scaled by ``sa * sb`` and
                     summed, like the kernel's promotion) was measured slower on CPU and is not kept
                     (``benchmarks/test_bench_fp8.py``, 1 thread, median / fp32 matmul: 2.7x vs 1.5x at
                     512x1024x1024, 4.0x vs 2.3x at 512x576x2048); dequantization is O((M+N)K) next to the
                     O(MNK) matmul, and the fp8->fp32 decode uses a 256-entry table.
    ``"deep_gemm"``  DeepGEMM on CUDA (SM90/SM100). Accepts the current ``fp8_gemm_nt`` and the pre-July-2025
                     ``gemm_fp8_fp8_bf16_nt``; ImportError with install instructions when missing.
    ``"triton"``     :func:`moe_rl.fp8.triton_kernels.fp8_block_gemm_triton`: K loop in 128-steps, fp8 ``tl.dot``
                     partial sums promoted into an fp32 accumulator with ``sA[m, k] * sB[n, k]`` (DeepSeek-V3
                     promotion). CUDA tensors (or CPU under ``TRITON_INTERPRET=1``, tests only); recipes with
                     ``gran_k == 128``. ImportError with install text when Triton is missing.
    ``"auto"``       ``"deep_gemm"`` when the operands are on CUDA and ``deep_gemm`` imports, else ``"torch"``;
                     the choice is logged at INFO and available from :func:`resolve_backend`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch

from moe_rl.fp8.layout import get_mn_major_tma_aligned_tensor
from moe_rl.fp8.quant import FP8_DTYPE, dequantize

__all__ = ["BACKENDS", "Backend", "check_backend", "fp8_block_gemm", "resolve_backend"]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton", "deep_gemm"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "deep_gemm")

_DEEP_GEMM_INSTALL = (
    "backend='deep_gemm' needs DeepGEMM (https://github.com/deepseek-ai/DeepGEMM) on an SM90/SM100 GPU with "
    "CUDA >= 12.3: `pip install 'moe_rl[gpu]'` or build it from source (`git clone --recursive "
    "https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh`). On CPU use backend='torch'."
)
_DEEP_GEMM_NAMES = ("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt")  # current name first, then the pre-July-2025 one


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _import_deep_gemm() -> Any:
    try:
        return importlib.import_module("deep_gemm")
    except (ImportError, OSError) as e:  # OSError: wheels whose _C.so cannot load its CUDA libraries
        raise ImportError(f"{_DEEP_GEMM_INSTALL} (import failed: {e})") from e


def _deep_gemm_fn(mod: Any, names: tuple[str, ...] = _DEEP_GEMM_NAMES) -> tuple[Callable[..., Any], str]:
    """Return ``(function, name)`` for the first of ``names`` that ``mod`` exports: one kernel under its names in
    DeepGEMM's API generations (default: the dense FP8 NT GEMM; the grouped GEMM passes its own names).

    Raises:
        ImportError: ``mod`` exports none of ``names`` (the message says how to install a matching DeepGEMM).
    """
    for name in names:
        fn = getattr(mod, name, None)
        if fn is not None:
            return fn, name
    raise ImportError(
        f"deep_gemm ({getattr(mod, '__version__', 'unknown version')}) exports none of {names}; "
        + _DEEP_GEMM_INSTALL
    )


def check_backend(backend: object, name: str = "backend") -> str:
    """Validate an FP8 GEMM backend name where it enters (a module's constructor, a function's entry); returns it.

    Modules call this when they are built, so a misspelt name fails there and not at the first forward.

    Args:
        backend: the name to check.
        name: the argument's name in the caller, for the message (e.g. ``"fp8_backend"``).

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS` (``"auto"``, ``"torch"``, ``"triton"``,
            ``"deep_gemm"``); the message names the argument, the value and the accepted names.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"{name}={backend!r} is not an FP8 GEMM backend; use one of {BACKENDS} ('auto' = deep_gemm on CUDA "
            "when importable, else the torch reference)"
        )
    return backend


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map ``backend`` (possibly ``"auto"``) to the concrete backend used for operands on ``device``.

    Raises:
        ValueError: unknown backend name.
    """
    check_backend(backend)
    if backend != "auto":
        return backend
    if torch.device(device).type == "cuda":
        try:
            _deep_gemm_fn(_import_deep_gemm())
            return "deep_gemm"
        except ImportError:
            return "torch"
    return "torch"


def _check_operands(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, recipe: tuple[int, int, int]
) -> None:
    if len(recipe) != 3 or any((not isinstance(r, int)) or r < 1 for r in recipe):
        raise ValueError(f"recipe={recipe!r}: must be (gran_m, gran_n, gran_k) positive ints, e.g. (1, 128, 128)")
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: expected 2-D {FP8_DTYPE} codes, got {t.dtype} shape {tuple(t.shape)}")
    (M, K), (N, Kb_) = a.shape, b.shape
    if K != Kb_:
        raise ValueError(f"a [M, K]={tuple(a.shape)} and b [N, K]={tuple(b.shape)} disagree on K (NT layout: a @ b.T)")
    gm, gn, gk = recipe
    for name, s, want in (
        ("a_scale", a_scale, (_ceil_div(M, gm), _ceil_div(K, gk))),
        ("b_scale", b_scale, (_ceil_div(N, gn), _ceil_div(K, gk))),
    ):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(
                f"{name}: got {s.dtype} shape {tuple(s.shape)}, expected float32 {want} for recipe {recipe} "
                f"(a={tuple(a.shape)}, b={tuple(b.shape)})"
            )


def _gemm_torch(a, a_scale, b, b_scale, out_dtype, recipe):
    gm, gn, gk = recipe
    with torch.autocast(a.device.type, enabled=False):  # an enclosing bf16 autocast must not round the fp32 GEMM
        a_f = dequantize(a, a_scale, (gm, gk))
        b_f = dequantize(b, b_scale, (gn, gk))
        return (a_f @ b_f.T).to(out_dtype)


def _pad_k(codes: torch.Tensor, mult: int = 128) -> torch.Tensor:
    """Zero-pad the last (K) dimension of fp8 codes to a multiple of ``mult`` (DeepGEMM needs K % 128 == 0).

    Zero codes contribute nothing; the scale grid (``ceil(K/128)`` columns) is unchanged.
    """
    K = codes.shape[-1]
    Kp = _ceil_div(K, mult) * mult
    if Kp == K:
        return codes
    out = torch.zeros((*codes.shape[:-1], Kp), dtype=torch.uint8, device=codes.device)
    out[..., :K] = codes.view(torch.uint8)
    return out.view(FP8_DTYPE)


def _gemm_deep_gemm(mod, a, a_scale, b, b_scale, out_dtype, recipe):
    fn, name = _deep_gemm_fn(mod)
    M, N = a.shape[0], b.shape[0]
    d = torch.empty((M, N), dtype=out_dtype, device=a.device)
    a, b = _pad_k(a), _pad_k(b)  # DeepGEMM needs K % 128 == 0; zero codes add nothing, scale grid unchanged
    if name == "gemm_fp8_fp8_bf16_nt":
        # Old API: bf16 out, recipe (1, 128, 128) only, LHS scales must already be MN-major TMA-aligned.
        if out_dtype != torch.bfloat16 or recipe != (1, 128, 128):
            raise ValueError(
                f"deep_gemm.{name} (old API) supports out_dtype=bfloat16 and recipe (1, 128, 128) only; got "
                f"out_dtype={out_dtype}, recipe={recipe}. Upgrade DeepGEMM for fp8_gemm_nt."
            )
        fn((a, get_mn_major_tma_aligned_tensor(a_scale)), (b, b_scale), d)
    else:
        # New API transforms the scale layouts itself (transform_sf_into_required_layout).
        fn((a, a_scale), (b, b_scale), d, recipe=None if recipe == (1, 128, 128) else recipe)
    return d


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: Backend = "torch",
    *,
    recipe: tuple[int, int, int] = (1, 128, 128),
) -> torch.Tensor:
    """Block-scaled FP8 GEMM ``out = (a * a_scale) @ (b * b_scale).T``.

    Args:
        a: ``[M, K]`` ``float8_e4m3fn`` codes, K-major (e.g. from ``quantize_1x128``).
        a_scale: ``[ceil(M/gran_m), ceil(K/gran_k)]`` fp32, row-major (K-major); the deep_gemm backend converts
            it to DeepGEMM's MN-major TMA-aligned layout itself.
        b: ``[N, K]`` ``float8_e4m3fn`` codes (``nn.Linear`` weight layout, e.g. from ``quantize_128x128``).
        b_scale: ``[ceil(N/gran_n), ceil(K/gran_k)]`` fp32.
        out_dtype: dtype of ``out`` (bf16 or fp32). Accumulation is fp32 in every backend.
        backend: ``"torch"`` | ``"deep_gemm"`` | ``"triton"`` | ``"auto"``, see the module docstring.
        recipe: ``(gran_m, gran_n, gran_k)``; ``(1, 128, 128)`` forward/Dgrad, ``(1, 1, 128)`` Wgrad.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.

    Raises:
        ValueError: bad dtypes/shapes/recipe, unknown backend, or deep_gemm/triton on non-CUDA tensors (triton
            accepts CPU tensors under ``TRITON_INTERPRET=1``).
        ImportError: backend ``"deep_gemm"`` and DeepGEMM cannot be imported (message says how to install).
        ImportError: backend ``"triton"`` and Triton cannot be imported.
    """
    _check_operands(a, a_scale, b, b_scale, recipe)
    chosen = resolve_backend(backend, a.device)
    if backend == "auto":
        logger.info("fp8_block_gemm: backend='auto' resolved to %r on %s", chosen, a.device)
    if chosen == "torch":
        return _gemm_torch(a, a_scale, b, b_scale, out_dtype, recipe)
    if chosen == "triton":
        from moe_rl.fp8.triton_kernels import fp8_block_gemm_triton  # lazy: imports triton

        return fp8_block_gemm_triton(a, a_scale, b, b_scale, out_dtype, recipe=recipe)
    mod = _import_deep_gemm()
    if a.device.type != "cuda" or b.device.type != "cuda":
        raise ValueError(f"backend='deep_gemm' needs CUDA tensors, got a on {a.device}, b on {b.device}")
    return _gemm_deep_gemm(mod, a, a_scale, b, b_scale, out_dtype, recipe)
