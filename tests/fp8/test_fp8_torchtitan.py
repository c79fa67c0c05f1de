"""The "moe_rl_fp8_block" torchtitan converter on torchtitan's DeepSeek-V3 debug model (CPU).

Reference: the same model built without the converter, loaded with the same weights (the converter keeps
parameter names). Attention is swapped for causal SDPA in both models (FlexAttention has no CPU backward:
shared/notes/feasibility.md §1). Floors: 43 linears + 5 MoE layers of chained FP8 GEMMs through 6 layers;
per-GEMM SQNR is ~28 dB, the logits measured 27.8 dB (seed 0), floor 20 dB for the logits; the grouped seam alone is
checked at the single-GEMM floor (25 dB; measured 28.6 dB) against ``torch._grouped_mm``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan.models.deepseek_v3 imports triton

from moe_rl.fp8 import sqnr_db  # noqa: E402

pytestmark = pytest.mark.slow  # importing torchtitan's DeepSeek-V3 costs ~5 s; the two models ~10 s


class _CausalSDPA(torch.nn.Module):
    def forward(self, q, k, v, attention_masks=None, scale=None):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
        return out.transpose(1, 2)


def _build(converters=None):
    from torchtitan.models.deepseek_v3 import model_registry

    spec = model_registry("debugmodel", converters=converters)
    with torch.device("meta"):
        m = spec.model.build()
    m.to_empty(device="cpu")
    for layer in m.layers.values():
        layer.attention.inner_attention = _CausalSDPA()
    return m


def test_converter_swaps_linears_and_experts_and_matches_fp32_model():
    from moe_rl.fp8.torchtitan_converter import CONVERTERS, MoeRlFp8BlockConverter, MoeRlFp8Linear

    torch.manual_seed(0)
    torch.set_num_threads(2)
    ref = _build()
    ref.init_weights(buffer_device=torch.device("cpu"))
    cfg = CONVERTERS["moe_rl_fp8_block"](backend="torch")
    assert isinstance(cfg, MoeRlFp8BlockConverter.Config)
    fp8 = _build([cfg])
    # to_empty leaves every tensor uninitialized: init the non-persistent buffers (rope tables) too, which the state
    # dict does not carry (left as garbage they made the inputs non-finite now and then), then copy ref's weights
    fp8.init_weights(buffer_device=torch.device("cpu"))
    fp8.load_state_dict(ref.state_dict(), strict=True)
    assert {n for n, _ in fp8.named_buffers()} == {n for n, _ in ref.named_buffers()}
    for (n, b), (_, rb) in zip(sorted(fp8.named_buffers()), sorted(ref.named_buffers()), strict=True):
        assert torch.equal(b, rb), n  # every buffer, persistent or not, equals the reference's
    lin = {n for n, m in fp8.named_modules() if isinstance(m, MoeRlFp8Linear)}
    assert lin and not any(n == "output" or n.endswith(".gate") for n in lin)
    assert "layers.1.attention.wkv_a" in lin  # 576 outputs: a partial 128-block (B03), still converted
    experts = [m for n, m in fp8.named_modules() if n.endswith("inner_experts")]
    assert experts and all(type(m).__name__.startswith("MoeRlFp8") for m in experts)

    tokens = torch.randint(0, 2000, (2, 32))
    logits_ref = ref(tokens)
    logits = fp8(tokens)
    assert sqnr_db(logits_ref, logits) >= 20.0
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in fp8.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.1.moe.routed_experts.inner_experts.w1_EFD"].abs().sum() > 0


def test_grouped_mm_seam_matches_torch_grouped_mm():
    from moe_rl.fp8.torchtitan_converter import fp8_grouped_mm

    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([40, 0, 200, 7])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    A = torch.randn(int(counts.sum()) + 5, 256, generator=g)  # 5 trailing dispatcher-padding rows
    B_t = torch.randn(4, 256, 192, generator=g) * 0.05
    ref = torch._grouped_mm(A, B_t, offs=offs)
    out = fp8_grouped_mm(A, B_t, offs, backend="torch")
    n = int(counts.sum())
    assert out.shape == ref.shape and (out[n:] == 0).all()
    assert sqnr_db(ref[:n], out[:n]) >= 25.0
