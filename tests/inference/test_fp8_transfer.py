"""``moe_rl.weights.fp8``: the DeepSeek-V3 128x128 block FP8 checkpoint format built from an HF state
dict with ``moe_rl.fp8``'s quantizer (exact equality), dequantization within the repo's FP8 SQNR floor, the
high-precision filter, and the bytes on the wire. (No FP8 engine on CPU: nothing here is loaded by one.)"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.fp8 import FP8_DTYPE, dequantize, quantize_128x128, sqnr_db
from moe_rl.weights.fp8 import (
    dequantize_fp8_state_dict,
    fp8_quantization_config,
    keep_high_precision,
    quantize_state_dict_fp8,
    wire_bytes,
)

SQNR_FLOOR_DB = 25.0
"""The FP8 floor of tests/fp8 (test_fp8_gemm/test_fp8_linear). One E4M3 rounding of a Gaussian weight measures
~30-31 dB (3 mantissa bits: relative error <= 2^-4, RMS ~2^-4/sqrt(3) of a uniformly spread mantissa)."""

H, FFN, E, V = 256, 200, 2, 96  # FFN=200: 2 column tiles, the second partial (72 wide)


def _state_dict(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    sd = {"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H), "model.norm.weight": w(H),
          "model.layers.0.input_layernorm.weight": w(H),
          "model.layers.0.self_attn.q_a_proj.weight": w(130, H),          # N=130: a partial row tile
          "model.layers.0.self_attn.q_a_layernorm.weight": w(130),
          "model.layers.0.self_attn.kv_b_proj.weight": w(H, 130),
          "model.layers.0.self_attn.indexer.wq_b.weight": w(64, 130),
          "model.layers.0.self_attn.indexer.wk.weight": w(32, H),
          "model.layers.0.self_attn.indexer.weights_proj.weight": w(4, H),
          "model.layers.0.self_attn.indexer.k_norm.weight": w(32),
          "model.layers.0.self_attn.indexer.k_norm.bias": w(32),
          "model.layers.0.mlp.gate.weight": w(E, H),
          "model.layers.0.mlp.gate.e_score_correction_bias": w(E).float()}  # fmt: skip
    for e in range(E):
        for proj, shape in (("gate_proj", (FFN, H)), ("up_proj", (FFN, H)), ("down_proj", (H, FFN))):
            sd[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = w(*shape)
    sd["model.layers.0.mlp.shared_experts.down_proj.weight"] = w(H, FFN)
    return sd


QUANTIZED = {"self_attn.q_a_proj", "self_attn.kv_b_proj", "indexer.wq_b", "indexer.wk", "gate_proj", "up_proj",
             "down_proj"}  # fmt: skip


def test_filter_matches_deepseek_v3_choices():
    sd = _state_dict()
    for name, t in sd.items():
        expect_quantized = any(f".{q}.weight" in name for q in QUANTIZED)
        assert keep_high_precision(name, t) is (not expect_quantized), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantized_state_dict_format_exactness_and_sqnr(dtype, ue8m0):
    sd = _state_dict(dtype)
    out, report = quantize_state_dict_fp8(sd, ue8m0=ue8m0)
    n_quant = sum(not keep_high_precision(k, t) for k, t in sd.items())
    assert report["quantized"] == n_quant == 11 and report["kept"] == len(sd) - n_quant
    assert set(out) == set(sd) | {k[: -len("weight")] + "weight_scale_inv" for k in report["quantized_names"]}
    for name in report["kept_names"]:
        assert out[name] is sd[name]
    recon = dequantize_fp8_state_dict(out)
    assert set(recon) == set(sd)
    for name in report["quantized_names"]:
        src, codes, scale = sd[name], out[name], out[name[: -len("weight")] + "weight_scale_inv"]
        n, k = src.shape
        assert codes.dtype == FP8_DTYPE and codes.shape == src.shape
        assert scale.dtype == torch.float32 and scale.shape == (math.ceil(n / 128), math.ceil(k / 128))
        # exactly moe_rl.fp8's own 128x128 quantization of the same tensor
        ref_codes, ref_scale = quantize_128x128(src, ue8m0=ue8m0)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scale, ref_scale)
        assert torch.equal(recon[name], dequantize(ref_codes, ref_scale, (128, 128)))
        # the DeepSeek-V3 dequant rule (weight_dequant: codes * scale_inv per 128x128 tile), in float64
        s_full = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        manual = codes.double() * s_full
        assert torch.equal(manual.float(), recon[name])
        db = sqnr_db(src.double(), manual)
        assert db >= SQNR_FLOOR_DB, (name, db)
        assert db <= 45.0, (name, db)  # it IS quantized: one E4M3 rounding cannot be near-lossless
    assert fp8_quantization_config(ue8m0)["weight_block_size"] == [128, 128]
    assert ("scale_fmt" in fp8_quantization_config(ue8m0)) is ue8m0


def test_wire_bytes_ratio_vs_bf16():
    sd = _state_dict(torch.bfloat16)
    out, report = quantize_state_dict_fp8(sd)
    # hand count: each quantized [N, K] weight sends N*K bytes + 4*ceil(N/128)*ceil(K/128) of scales instead of 2*N*K
    q = report["quantized_names"]
    expect_sent = sum(sd[k].numel() + 4 * math.ceil(sd[k].shape[0] / 128) * math.ceil(sd[k].shape[1] / 128) for k in q)
    expect_sent += sum(sd[k].numel() * sd[k].element_size() for k in report["kept_names"])
    bf16 = sum(t.numel() * 2 for t in sd.values())
    source = bf16 + 2 * E  # the fp32 e_score_correction_bias: 4 bytes per element, not 2
    assert report["bytes_sent"] == expect_sent and report["bytes_bf16"] == bf16 and report["bytes_source"] == source
    assert report["ratio_vs_bf16"] == pytest.approx(expect_sent / bf16)
    print(f"fp8 transfer: {report['bytes_sent']} B vs {bf16} B bf16 -> ratio {report['ratio_vs_bf16']:.3f} "
          f"(embeddings/lm_head/norms/router kept bf16)")  # fmt: skip
    # weights alone (kept tensors excluded): 1 byte + scales per element instead of 2
    wq = wire_bytes({k: sd[k] for k in q}, {k: out[k] for k in out if k not in report["kept_names"]})
    assert 0.5 < wq["ratio_vs_bf16"] < 0.501
    assert report["ratio_vs_bf16"] < 0.8


def test_rejects_quantized_or_bad_input():
    sd = {"a.proj.weight": torch.randn(4, 4), "a.proj.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="'a.proj.weight_scale_inv' already exists"):
        quantize_state_dict_fp8(sd)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        quantize_state_dict_fp8({"a.proj.weight": torch.ones(4, 4, dtype=torch.int32)})
    bad = torch.randn(4, 4)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="a.proj.weight: 1 non-finite"):
        quantize_state_dict_fp8({"a.proj.weight": bad})
    with pytest.raises(ValueError, match="has no weight"):
        dequantize_fp8_state_dict({"b.weight_scale_inv": torch.ones(1, 1)})
