"""FP8 block-scaled numerics (DeepSeek-V3 recipe): quantizers, DeepGEMM scale layouts, block GEMM, linear.

Imports torch but no optional backend; ``deep_gemm`` is imported only when its backend is used.
"""

from moe_rl.fp8.config import Fp8Config
from moe_rl.fp8.convert import convert_model_to_fp8, fp8_parameter_fraction
from moe_rl.fp8.experts import Fp8GroupedExperts
from moe_rl.fp8.gemm import fp8_block_gemm, resolve_backend
from moe_rl.fp8.grouped import (
    GROUP_ALIGN_M,
    ContiguousLayout,
    contiguous_layout,
    fp8_experts_forward,
    fp8_grouped_gemm,
    fp8_grouped_linear,
    fp8_grouped_wgrad,
    quantize_128x128_grouped,
)
from moe_rl.fp8.layout import (
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    unpack_ue8m0,
)
from moe_rl.fp8.linear import Fp8BlockLinear, convert_to_fp8_block_linear, fp8_block_linear
from moe_rl.fp8.quant import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
    quantize_blocks,
    sqnr_db,
)

__all__ = [
    "AMAX_FLOOR",
    "FP8_DTYPE",
    "FP8_MAX",
    "GROUP_ALIGN_M",
    "ContiguousLayout",
    "Fp8BlockLinear",
    "Fp8Config",
    "Fp8GroupedExperts",
    "contiguous_layout",
    "convert_model_to_fp8",
    "fp8_parameter_fraction",
    "convert_to_fp8_block_linear",
    "dequantize",
    "fp8_block_gemm",
    "fp8_experts_forward",
    "fp8_grouped_gemm",
    "fp8_grouped_linear",
    "fp8_grouped_wgrad",
    "quantize_128x128_grouped",
    "fp8_block_linear",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "quantize_128x1",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_blocks",
    "resolve_backend",
    "sqnr_db",
    "unpack_ue8m0",
]
