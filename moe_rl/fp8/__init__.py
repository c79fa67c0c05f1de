"""FP8 block-scaled numerics (DeepSeek-V3 recipe): quantizers, block GEMM, grouped GEMM, linear.

Pure numerics: no MoE and no model code (FP8 routed experts and the whole-model conversion are
``moe_rl.moe.Fp8GroupedExperts`` and ``moe_rl.moe.convert_model_to_fp8``). DeepGEMM scale layouts, backend
resolution and constants such as ``AMAX_FLOOR`` are not public; import them from their submodules
(``moe_rl.fp8.layout``, ``moe_rl.fp8.gemm``, ``moe_rl.fp8.quant``) if needed.

Imports are lazy: ``import moe_rl.fp8`` loads no torch; a name loads its submodule (torch, never an optional
backend; ``deep_gemm`` and ``triton`` are imported only when their backend is used).
"""

from __future__ import annotations

from moe_rl._lazy import lazy_dir, lazy_getattr

_EXPORTS = {
    "ContiguousLayout": "grouped",
    "FP8_DTYPE": "quant",
    "FP8_MAX": "quant",
    "Fp8BlockLinear": "linear",
    "Fp8Config": "config",
    "HfFp8Report": "hf",
    "convert_hf_moe_to_fp8": "hf",
    "contiguous_layout": "grouped",
    "convert_to_fp8_block_linear": "linear",
    "dequantize": "quant",
    "fp8_block_gemm": "gemm",
    "fp8_block_linear": "linear",
    "fp8_grouped_gemm": "grouped",
    "fp8_grouped_linear": "grouped",
    "quantize_128x1": "quant",
    "quantize_128x128": "quant",
    "quantize_128x128_grouped": "grouped",
    "quantize_1x128": "quant",
    "quantize_blocks": "quant",
    "sqnr_db": "quant",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__dir__ = lazy_dir(globals(), _EXPORTS)
