"""OffloadedOptimizer: bit-identical to the plain optimizer; state storage released between steps; DTensor
parameters (FSDP2 on 2 gloo ranks) equal a single process."""

import copy
from pathlib import Path

import pytest
import torch

from moe_rl.distributed.optim_offload import OffloadedOptimizer


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _train(model, opt, steps=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_bit_identical_to_plain_adamw_and_storage_released():
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    m = copy.deepcopy(ref)
    off = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
    assert off.offloaded_bytes == 0  # no state before the first step
    _train(ref, ref_opt)
    _train(m, off)
    # bit-equal: the same model on the same inputs (same GEMM shapes and thread count) and the same AdamW
    # element-wise update; the offload only moves the state between steps
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)
    n_params = sum(p.numel() for p in m.parameters())
    assert off.offloaded_bytes == 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32
    for st in off.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].untyped_storage().size() == 0  # device storage released between steps
    # the state_dict sees ordinary tensors equal to the reference optimizer's, and leaves the state offloaded
    sd, ref_sd = off.state_dict(), ref_opt.state_dict()
    for k, st in ref_sd["state"].items():
        for n in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][k][n], st[n])
    assert all(st["exp_avg"].untyped_storage().size() == 0 for st in off.state.values())


def test_load_state_dict_resumes_identically():
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, steps=3)
    m = copy.deepcopy(ref)
    off = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2))
    off.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _train(ref, ref_opt, steps=2, seed=5)
    _train(m, off, steps=2, seed=5)
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)


def test_rejects_non_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OffloadedOptimizer(object())


def test_fsdp2_dtensor_state_two_ranks(tmp_path, launch_ranks, check_scenario):
    """FSDP2 (DTensor parameters and moments) on 2 gloo ranks with the offload equals one process without it."""
    results = launch_ranks(Path(__file__).with_name("_optim_offload_worker.py"), 2, tmp_path, timeout_s=180)
    check_scenario(results, "fsdp2_offload")
