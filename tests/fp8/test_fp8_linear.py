"""Fp8BlockLinear / fp8_block_linear autograd vs nn.Linear (SQNR), master weights, module swap filter."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from torch import nn

from moe_rl.fp8.linear import Fp8BlockLinear, convert_to_fp8_block_linear, fp8_block_linear
from moe_rl.fp8.quant import sqnr_db

torch.set_num_threads(1)

SQNR_FLOOR_DB = 25.0  # same justification as test_fp8_gemm: two E4M3 operands per GEMM, ~28-29 dB measured


@pytest.mark.parametrize(("T", "K", "N"), [(64, 256, 128), (150, 576, 300)], ids=["aligned", "b03_tails"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_sqnr_vs_nn_linear(T, K, N, bias):
    torch.manual_seed(0)
    ref = nn.Linear(K, N, bias=bias)
    fp8 = Fp8BlockLinear.from_linear(copy.deepcopy(ref))
    x = torch.randn(2, T // 2, K, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    g = torch.randn(2, T // 2, N)
    y, y8 = ref(x), fp8(x8)
    y.backward(g)
    y8.backward(g)
    assert y8.shape == y.shape
    assert sqnr_db(y, y8) >= SQNR_FLOOR_DB
    assert sqnr_db(x.grad, x8.grad) >= SQNR_FLOOR_DB
    assert sqnr_db(ref.weight.grad, fp8.weight.grad) >= SQNR_FLOOR_DB
    if bias:
        torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)
    # master weights stay fp32 and receive fp32 gradients
    assert fp8.weight.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32


def test_bf16_activations_fp32_master_weight():
    torch.manual_seed(1)
    w = torch.randn(128, 256, requires_grad=True)
    x = torch.randn(40, 256, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_block_linear(x, w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert sqnr_db(x.detach().float() @ w.detach().T, y.float()) >= SQNR_FLOOR_DB


def test_b01_zero_weight_tiles_and_zero_grads_stay_finite():
    # padded vocab rows / unused experts: whole zero 128x128 tiles in the weight, zero gradient blocks
    w = torch.zeros(256, 256)
    w[0, 0] = 1.0
    w.requires_grad_()
    x = torch.randn(130, 256, requires_grad=True)
    y = fp8_block_linear(x, w)
    assert torch.isfinite(y).all() and (y[:, 1:] == 0).all()
    g = torch.zeros_like(y)
    g[:, :1] = 1.0
    y.backward(g)
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    assert (w.grad[1:] == 0).all()


def test_non_finite_grad_raises_naming_tensor():
    w = torch.randn(128, 128, requires_grad=True)
    y = fp8_block_linear(torch.randn(4, 128), w)
    g = torch.ones_like(y)
    g[0, 0] = float("nan")
    with pytest.raises(ValueError, match="grad_output: 1 non-finite"):
        y.backward(g)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 8, bias=False)  # MoE router gate: stays high precision
        self.router = nn.Module()
        self.router.proj = nn.Linear(64, 8)
        self.gate_proj = nn.Linear(64, 128, bias=False)  # SwiGLU FFN projection: converted
        self.down_proj = nn.Linear(128, 64, bias=False)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.lm_head = nn.Linear(64, 10, bias=False)


def test_convert_excludes_router_gate_lm_head_by_default():
    m = _Model()
    w_before = m.layers[0].gate_proj.weight
    convert_to_fp8_block_linear(m)
    converted = {n for n, mod in m.named_modules() if isinstance(mod, Fp8BlockLinear)}
    assert converted == {f"layers.{i}.{p}" for i in (0, 1) for p in ("gate_proj", "down_proj")}
    assert type(m.lm_head) is nn.Linear and type(m.layers[0].gate) is nn.Linear
    assert type(m.layers[1].router.proj) is nn.Linear
    assert m.layers[0].gate_proj.weight is w_before  # parameters shared, not copied


def test_convert_custom_filter_and_backend():
    m = _Model()
    convert_to_fp8_block_linear(m, filter_fn=lambda fqn, mod: fqn == "lm_head", backend="triton")
    assert isinstance(m.lm_head, Fp8BlockLinear) and m.lm_head.backend == "triton"
    assert sum(isinstance(mod, Fp8BlockLinear) for mod in m.modules()) == 1
    if importlib.util.find_spec("triton") is not None and not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):  # CPU, no interpreter
            m.lm_head(torch.randn(2, 64))
