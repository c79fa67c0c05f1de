"""FP8 block conversion of ``transformers`` MoE models: fused routed experts counted and converted, SQNR floors.

Floors (``tests/_tolerance.py``: E4M3 gives ~28-29 dB for one GEMM of two quantized Gaussian operands):
- one fused experts block = two chained FP8 grouped GEMMs (gate_up, then down on re-quantized activations):
  22 dB, the floor of ``moe_rl``'s own FP8 experts block (``tests/fp8/test_fp8_grouped.py``); measured ~24 dB;
- model logits with the experts in FP8 (linears high precision): 25 dB; measured 35-40 dB (the experts' error
  enters the residual stream beside the high-precision attention and embeddings);
- model logits with linears *and* experts in FP8 (attention q/k/v/o add four more chained FP8 GEMMs per layer):
  20 dB, the torchtitan converter's logits floor (``test_fp8_torchtitan.py``); measured ~22 dB.
A wrong token/expert mapping or a dropped routing weight gives ~0 dB, far below every floor.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _tiny_hf_moe import VOCAB, build
from _tolerance import assert_sqnr_at_least
from torch import nn

pytest.importorskip("transformers")

from moe_rl.fp8 import Fp8BlockLinear  # noqa: E402
from moe_rl.fp8.hf import HfFp8Report, convert_hf_moe_to_fp8, fp8_hf_experts_forward, is_fp8_hf_experts  # noqa: E402

torch.set_num_threads(1)
BLOCK_FLOOR_DB = 22.0
EXPERTS_LOGITS_FLOOR_DB = 25.0
ALL_LOGITS_FLOOR_DB = 20.0


def _qwen(**kw):
    return build("qwen3_moe", hidden=128, inter=128, **kw)


def _ref_experts64(gu, dn, x, idx, w):
    """Our float64 reference of the fused experts forward (module docstring of ``moe_rl.fp8.hf``), autograd."""
    gu, dn = gu.double(), dn.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for j in range(idx.shape[1]):
        e = idx[:, j]
        h = torch.einsum("tfd,td->tf", gu[e], x.double())
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        out = out + w[:, j, None].double() * torch.einsum("tdf,tf->td", dn[e], a)
    return out


def _ids(seed=0):
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


def test_qwen3_moe_experts_converted_and_counted_sqnr():
    model = _qwen()
    with torch.no_grad():
        ref = model(_ids()).logits
    experts_only = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped -> no warning
        rep = convert_hf_moe_to_fp8(experts_only, filter_fn=lambda fqn, mod: False)
    assert rep == HfFp8Report(linear=0, skipped_linear=9, expert_modules=2, experts=16, skipped=[])
    assert all(is_fp8_hf_experts(layer.mlp.experts) for layer in experts_only.model.layers)
    with torch.no_grad():
        assert_sqnr_at_least(ref, experts_only(_ids()).logits, EXPERTS_LOGITS_FLOOR_DB, "logits, experts in FP8")

    full = copy.deepcopy(model)
    rep = convert_hf_moe_to_fp8(full)
    # 2 layers x (q, k, v, o) converted; lm_head stays high precision; the routers are not nn.Linear.
    assert rep == HfFp8Report(linear=8, skipped_linear=1, expert_modules=2, experts=16, skipped=[])
    assert sum(isinstance(m, Fp8BlockLinear) for m in full.modules()) == 8
    with torch.no_grad():
        assert_sqnr_at_least(ref, full(_ids()).logits, ALL_LOGITS_FLOOR_DB, "logits, linears and experts in FP8")
    # Parameters are shared and unchanged: the state dict is the model's.
    assert model.state_dict().keys() == full.state_dict().keys()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in model.state_dict().items())
    # Idempotent: a second call counts the converted experts again and converts nothing new.
    assert convert_hf_moe_to_fp8(full) == HfFp8Report(linear=0, skipped_linear=1, expert_modules=2, experts=16)


@pytest.mark.parametrize("hidden,inter", [(128, 128), (64, 96)])  # also partial 128-blocks
def test_fp8_experts_block_forward_backward_vs_float64(hidden, inter):
    model = build("qwen3_moe", hidden=hidden, inter=inter)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    t, k, e = 96, 2, experts.num_experts
    x = torch.randn(t, hidden, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    dy = torch.randn(t, hidden, generator=g)

    assert experts.config.hidden_act == "silu"
    leaves64 = [t_.detach().double().requires_grad_() for t_ in (experts.gate_up_proj, experts.down_proj, x, w)]
    y64 = _ref_experts64(leaves64[0], leaves64[1], leaves64[2], idx, leaves64[3])
    y64.backward(dy.double())
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_hf_experts_forward(experts, xl, idx, wl)
    y.backward(dy)
    assert y.dtype == torch.float32 and y.shape == (t, hidden)
    assert_sqnr_at_least(y64, y, BLOCK_FLOOR_DB, "experts output")
    got = (experts.gate_up_proj.grad, experts.down_proj.grad, xl.grad, wl.grad)
    for name, r, o in zip(("gate_up_proj", "down_proj", "hidden_states", "routing weights"), leaves64, got,
                          strict=True):
        assert_sqnr_at_least(r.grad, o, BLOCK_FLOOR_DB, f"d {name}")


def test_out_of_range_ids_contribute_nothing():
    experts = build("qwen3_moe", hidden=128, inter=128).model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 128, generator=g)
    idx = torch.tensor([[0, 1]] * 8)
    w = torch.rand(8, 2, generator=g)
    masked = idx.clone()
    masked[:, 1] = experts.num_experts  # transformers' expert-parallel mask id
    only_first = fp8_hf_experts_forward(experts, x, masked, w)
    w0 = w.clone()
    w0[:, 1] = 0
    assert torch.equal(only_first, fp8_hf_experts_forward(experts, x, idx, w0))
    none = fp8_hf_experts_forward(experts, x, torch.full_like(idx, experts.num_experts), w)
    assert torch.equal(none, torch.zeros_like(x))  # every slot masked: an empty layout, zero output


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "glm4_moe"])
def test_other_families_convert_their_experts(family):
    # Logits floors depend on how much of the residual stream the experts write (DeepSeek-V3's
    # routed_scaling_factor=2.5 makes them dominate in a tiny random model: ~20 dB); each converted block is
    # checked instead, on the inputs it sees inside the model, against our float64 reference.
    model = build(family, hidden=128, inter=128)
    rep = convert_hf_moe_to_fp8(model, filter_fn=lambda fqn, mod: False)
    assert (rep.expert_modules, rep.experts, rep.skipped) == (2, 16, [])
    seen = []
    converted = [m for m in model.modules() if is_fp8_hf_experts(m)]
    for m in converted:
        m.register_forward_hook(lambda mod, a, out: seen.append((mod, *[t.detach() for t in a], out.detach())))
    with torch.no_grad():
        model(_ids())
    assert [s[0] for s in seen] == converted
    for mod, x, idx, w, out in seen:
        assert_sqnr_at_least(_ref_experts64(mod.gate_up_proj, mod.down_proj, x, idx, w), out, BLOCK_FLOOR_DB,
                             f"{family} experts block")


class _FusedLookalike(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(4, 4, 4))


def test_refusals_name_each_skipped_module():
    model = build("qwen3_moe")
    model.model.layers[1].mlp.experts.has_bias = True
    model.model.extra = _FusedLookalike()
    with pytest.warns(UserWarning, match=r"2 expert module\(s\) left in high precision") as rec:
        rep = convert_hf_moe_to_fp8(model, filter_fn=lambda fqn, mod: False)
    text = str(rec[0].message)
    assert "model.layers.1.mlp.experts (Qwen3MoeExperts): has expert biases" in text
    assert "model.extra (_FusedLookalike): not a supported fused-experts class" in text
    assert (rep.expert_modules, rep.experts, len(rep.skipped)) == (1, 8, 2)

    with pytest.warns(UserWarning, match="experts=False"):
        rep = convert_hf_moe_to_fp8(build("mixtral"), experts=False)
    assert rep.expert_modules == 0 and len(rep.skipped) == 2


def test_bad_arguments_raise_before_any_swap():
    model = build("qwen3_moe")
    with pytest.raises(ValueError, match="backend='fp8' is not an FP8 GEMM backend"):
        convert_hf_moe_to_fp8(model, backend="fp8")
    assert not any(isinstance(m, Fp8BlockLinear) or is_fp8_hf_experts(m) for m in model.modules())
    with pytest.raises(TypeError, match="nn.Module"):
        convert_hf_moe_to_fp8({"model": model})
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(TypeError, match="top_k_index has dtype torch.float32"):
        fp8_hf_experts_forward(experts, torch.zeros(2, 32), torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(TypeError, match="hidden_states has dtype torch.int64"):
        fp8_hf_experts_forward(experts, torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long),
                               torch.zeros(2, 2))


def test_generic_converter_warns_about_transformers_experts():
    from moe_rl.moe.fp8_convert import convert_model_to_fp8

    model = build("qwen3_moe")
    with pytest.warns(UserWarning, match=r"2 fused experts module\(s\).*model.layers.0.mlp.experts "
                                         r"\(Qwen3MoeExperts\).*convert_hf_moe_to_fp8"):
        counts = convert_model_to_fp8(model)
    assert counts["experts"] == 0
