"""The memory planner's view of DeepSeek-V3 / Kimi-K2 (``DeepseekV3Config.arch_spec``, plain MLA in its dense form).

- parameters: ``arch_spec`` counts exactly the built model's parameters (tiny and a 3-layer Kimi-K2 on meta), and the
  published sizes (DeepSeek-V3 671B without MTP; Kimi-K2 1.03T, 32.9B active with the embedding and head);
- activations: the attention block's planned bytes per token (``_mla_dense_block`` + ``_dense_attn_saved``, as
  plan_memory adds them) bound what autograd keeps (``LiveBytesMeter``) from above, and the excess is at most the
  fp32 copies of q, k and v the planner counts, ``4 H (2 Dqk + Dv)`` per token (the kernel shares some of them with
  its inputs); the O(T^2) term (probabilities, exponentials, mask: ``(8 H + 1) T``) is exact, so the ratio tends to 1
  as T grows;
- phases: the dense attention's transients (fp32 score blocks) are planned, quadratic in the local tokens.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM


def test_arch_spec_counts_the_built_model_and_the_published_sizes():
    from moe_rl.distributed.memory import arch_spec

    cfg = DeepseekV3Config.tiny_debug()
    assert arch_spec(cfg).total_params == sum(p.numel() for p in DeepseekV3ForCausalLM(cfg).parameters())
    kimi3 = DeepseekV3Config.kimi_k2(num_hidden_layers=3)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(kimi3)
    assert arch_spec(kimi3).total_params == sum(p.numel() for p in model.parameters())
    v3, kimi = arch_spec(DeepseekV3Config.deepseek_v3()), arch_spec(DeepseekV3Config.kimi_k2())
    assert round(v3.total_params / 1e9) == 671  # DeepSeek-V3 report: 671B (MTP module excluded)
    assert round(kimi.total_params / 1e9) == 1026
    embed = 2 * 163840 * 7168
    assert round((kimi.active_params + embed) / 1e9, 1) == 32.9  # Kimi K2 report: 32B activated
    assert kimi.dsa is None and kimi.dense_attn is not None and kimi.name == "deepseek_v3"
    assert not any(layer.mtp for layer in v3.layers)  # not built, not counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_block_bytes_bound_the_meter(dtype):
    from moe_rl.distributed.memory import _act, _dense_attn_saved, arch_spec
    from moe_rl.distributed.meter import LiveBytesMeter
    from moe_rl.models.deepseek_v3.model import DeepseekV3DecoderLayer

    b = dtype.itemsize
    cfg = DeepseekV3Config.tiny_debug()
    arch, d = arch_spec(cfg), cfg.hidden_size
    a = arch.dense_attn
    slack = 4 * a.H * (2 * a.Dqk + a.Dv)
    for T in (48, 384):
        layer = DeepseekV3DecoderLayer(cfg, 0, "loop").to(dtype)
        x = torch.randn(T, d, dtype=dtype, requires_grad=True)
        meter = LiveBytesMeter()
        meter.track(*layer.parameters(), x)
        with meter:
            base = meter.current_bytes
            attn = layer.self_attn(layer.input_layernorm(x), cu_seqlens=torch.tensor([0, T]),
                                   token_idx=torch.arange(T))
            y = layer.post_attention_layernorm(x + attn.hidden)
            meter.track()
            saved = meter.current_bytes - base - y.untyped_storage().nbytes()
        # as in the GLM-5 test: the block's input (fp32 only) and output are outside `saved`
        planned = T * (_act(arch.attn_act_coeffs, b) + _dense_attn_saved(a, 1, T) - (4 * d if b == 4 else 0) - b * d)
        assert 0 <= planned - saved <= T * slack, (T, saved / T, planned / T)


def test_dense_attention_phases_are_quadratic_in_the_local_tokens():
    from moe_rl.distributed.memory import plan_memory
    from moe_rl.distributed.parallel_dims import ParallelDims

    cfg = DeepseekV3Config.kimi_k2()

    def plan(cp: int):
        return plan_memory(cfg, ParallelDims(dp_shard=128 // cp, cp=cp, ep=8), 131072, 1, "bf16", "full", True,
                           loss_chunk_tokens=4096, fp8=True, fp8_experts=True)

    p8, p32 = plan(8), plan(32)
    assert p8.peak_phase == "attention_backward"
    h, t8, t32 = 64, 131072 // 8, 131072 // 32
    # ring hop: 5 fp32 [H, T, T] copies + the bool mask in the backward, 3 + mask in the forward
    assert p8.details["attention_backward_transient_bytes"] == (20 * h + 1) * t8 * t8
    assert p32.details["attention_forward_transient_bytes"] == (12 * h + 1) * t32 * t32
    assert p8.details["dsa_backward_transient_bytes"] == 0.0
