"""FP8 weight transfer for FP8 engines: an HF state dict in the DeepSeek-V3 128x128 block-scaled checkpoint format.

An engine that serves an FP8 checkpoint (DeepSeek-V3/V3.2, GLM FP8 variants in the same format, vLLM's
``Fp8LinearMethod`` with ``weight_block_size=[128, 128]``) loads, for each quantized linear ``<prefix>``::

    <prefix>.weight            float8_e4m3fn [N, K]
    <prefix>.weight_scale_inv  float32       [ceil(N/128), ceil(K/128)]   dequant: weight.float() * scale_inv
                                                                           (per 128x128 tile)

and every other tensor in high precision. Sending the trainer's bf16/fp32 weights in this format roughly
halves the bytes on the wire vs bf16 (:func:`wire_bytes`), and the engine needs no requantization pass.

The quantization is ``moe_rl.fp8.quantize_128x128`` (DeepSeek-V3 §3.3 recipe, DeepGEMM ``per_block_cast_to_fp8``
semantics; ``ue8m0=True`` for DeepSeek-V3.1-style power-of-two scales): its ``scales`` (amax / 448 per tile)
*are* the checkpoint's ``weight_scale_inv``. Nothing is re-implemented here.

Which weights stay high precision (:func:`keep_high_precision`; the same choices as DeepSeek-V3's released
checkpoint and vLLM's ``deepseek_v2.py`` model, where these layers are built with ``quant_config=None``):

- everything that is not a 2-D ``*.weight`` (biases, ``e_score_correction_bias``, norms' 1-D weights, 3-D tensors);
- embeddings (``embed_tokens``) and the output head (``lm_head``): DeepSeek-V3 §3.3 keeps them in high precision;
- the MoE router (``mlp.gate.weight``; not ``gate_proj``, an ordinary FP8 GEMM) - vLLM's ``GateLinear``;
- norms (any name containing ``norm``: ``input_layernorm``, ``kv_a_layernorm``, ``indexer.k_norm``, ...);
- the MTP (next-token prediction) layer's ``eh_proj`` (a plain ``nn.Linear`` in vLLM's ``deepseek_mtp.py``) and
  its ``shared_head.head`` (a ``ParallelLMHead``, which the FP8 method does not quantize); both are bf16 in the
  DeepSeek-V3 release;
- the DSA indexer's ``weights_proj`` (vLLM fuses it with ``wk`` in a bf16 ``wk_weights_proj``, ``quant_config=None``);
  the indexer's ``wq_b`` and ``wk`` ARE quantized, as in the DeepSeek-V3.2 checkpoint (vLLM's
  ``_try_load_fp8_indexer_wk`` upcasts an FP8 ``wk``).

Limitation: this repo has no FP8 vLLM engine (vLLM's CPU backend has no block-FP8 linear), so the output is
checked against ``moe_rl.fp8`` numerics and can travel over ``moe_rl.weights.broadcast`` bit-exactly, but it
was NOT loaded by an FP8 engine here.

Shape legend: N output features, K input features, Nb = ceil(N/128), Kb = ceil(K/128).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK",
    "SCALE_SUFFIX",
    "dequantize_fp8_state_dict",
    "fp8_quantization_config",
    "keep_high_precision",
    "quantize_state_dict_fp8",
    "wire_bytes",
]

BLOCK = (128, 128)
"""Weight tile of the DeepSeek-V3 format (``quantization_config.weight_block_size``)."""

SCALE_SUFFIX = "weight_scale_inv"
"""Name of a quantized weight's scale tensor: ``<prefix>.weight`` -> ``<prefix>.weight_scale_inv``."""

_KEEP_LAST = {"embed_tokens", "lm_head", "gate", "weights_proj", "eh_proj", "head"}


def keep_high_precision(name: str, tensor: torch.Tensor) -> bool:
    """True when ``name`` stays in its own dtype (see the module docstring for the list and its sources)."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return True
    parts = name.split(".")[:-1]  # module path
    if not parts:
        return True
    return parts[-1] in _KEEP_LAST or any("norm" in p for p in parts)


def quantize_state_dict_fp8(
    state_dict: Mapping[str, torch.Tensor],
    *,
    keep: Callable[[str, torch.Tensor], bool] = keep_high_precision,
    ue8m0: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Convert an HF state dict to the 128x128 block FP8 checkpoint format.

    Args:
        state_dict: ``{hf_name: tensor}``, fp32/bf16/fp16 (any device); not modified.
        keep: ``(name, tensor) -> True`` to leave a tensor as is; default :func:`keep_high_precision`.
        ue8m0: power-of-two scales (DeepSeek-V3.1 ``scale_fmt="ue8m0"``).

    Returns:
        ``(out, report)``. ``out`` maps each quantized ``<p>.weight`` to ``float8_e4m3fn [N, K]`` plus
        ``<p>.weight_scale_inv`` ``float32 [Nb, Kb]``, and every kept tensor to itself (same object). ``report``:
        ``{"quantized": n, "kept": m, "quantized_names": [...], "kept_names": [...], **wire_bytes(...)}``.

    Raises:
        ValueError: a ``<p>.weight_scale_inv`` name is already taken (input already quantized), or a tensor to
            quantize is not floating point or has inf/NaN (``moe_rl.fp8.quantize_128x128``'s message).
    """
    from moe_rl.fp8.quant import quantize_128x128

    out: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    kept: list[str] = []
    for name, t in state_dict.items():
        if keep(name, t):
            out[name] = t
            kept.append(name)
            continue
        if not t.is_floating_point():
            raise ValueError(f"quantize_state_dict_fp8: {name!r} has dtype {t.dtype}; only float weights can be "
                             "quantized (pass keep= to leave it as is)")  # fmt: skip
        scale_name = name[: -len("weight")] + SCALE_SUFFIX
        if scale_name in state_dict:
            raise ValueError(f"quantize_state_dict_fp8: {scale_name!r} already exists: the input looks quantized "
                             "already; pass a bf16/fp32 state dict")  # fmt: skip
        codes, scales = quantize_128x128(t.detach(), ue8m0=ue8m0, name=name)
        out[name] = codes
        out[scale_name] = scales
        quantized.append(name)
    report: dict[str, Any] = {"quantized": len(quantized), "kept": len(kept), "quantized_names": quantized,
                              "kept_names": kept, **wire_bytes(state_dict, out)}  # fmt: skip
    return out, report


def dequantize_fp8_state_dict(
    fp8_state_dict: Mapping[str, torch.Tensor], out_dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Inverse view (for checks, or for an engine without FP8 linears): each ``<p>.weight`` with a
    ``<p>.weight_scale_inv`` becomes ``moe_rl.fp8.dequantize(codes, scale_inv, (128, 128))``; scales are dropped;
    other tensors pass through.

    Args:
        out_dtype: dtype of dequantized weights (default float32).

    Raises:
        ValueError: a scale has no weight, or a scale's shape does not match its weight's 128x128 grid.
    """
    import torch

    from moe_rl.fp8.quant import dequantize

    out: dict[str, torch.Tensor] = {}
    for name, t in fp8_state_dict.items():
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)] + "weight"
            if weight_name not in fp8_state_dict:
                raise ValueError(f"dequantize_fp8_state_dict: scale {name!r} has no weight {weight_name!r}")
            continue
        scale_name = name[: -len("weight")] + SCALE_SUFFIX if name.endswith(".weight") else None
        if scale_name is not None and scale_name in fp8_state_dict:
            out[name] = dequantize(t, fp8_state_dict[scale_name], BLOCK, out_dtype=out_dtype or torch.float32)
        else:
            out[name] = t
    return out


def wire_bytes(source: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Bytes of ``sent`` vs the same tensors as bf16 (and as in ``source``): what FP8 transfer saves.

    Returns:
        ``{"bytes_sent", "bytes_bf16", "bytes_source", "ratio_vs_bf16"}``; ``bytes_bf16`` counts every source
        tensor at 2 bytes per element (integer tensors at their own size).
    """
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    sent_b = sum(nbytes(t) for t in sent.values())
    src_b = sum(nbytes(t) for t in source.values())
    bf16_b = sum(t.numel() * 2 if t.is_floating_point() else nbytes(t) for t in source.values())
    return {"bytes_sent": sent_b, "bytes_bf16": bf16_b, "bytes_source": src_b,
            "ratio_vs_bf16": sent_b / bf16_b if bf16_b else float("nan")}  # fmt: skip


def fp8_quantization_config(ue8m0: bool = False) -> dict[str, Any]:
    """The ``config.json`` ``quantization_config`` of this format (as in DeepSeek-V3's release; ``scale_fmt``
    as in DeepSeek-V3.1 when ``ue8m0``)."""
    cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": list(BLOCK)}  # fmt: skip
    if ue8m0:
        cfg["scale_fmt"] = "ue8m0"
    return cfg
