"""Fp8BlockLinear under FSDP2 (2 gloo ranks, CPU) and under torch.compile (CPU inductor), against eager.

* FSDP2: two gloo ranks (``_fsdp_worker.py`` through ``launch_ranks``) shard a 2-layer Fp8BlockLinear MLP with
  ``fully_shard`` (per layer and root); the global loss and the full gradients equal those of the single-process
  model on the whole batch (fp32 master weights) to fp32 summation order. Why the FP8 numerics are identical
  and only summation order differs is in the worker's docstring.
* torch.compile: forward + backward of the compiled module match eager. The quantizers' inf/NaN check
  (``int(...)``, a host sync) is a graph break by design; the test only requires correctness, not one graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tolerance import assert_normwise_close

WORKER = Path(__file__).with_name("_fsdp_worker.py")


def test_fsdp2_fp8_block_linear_matches_single_process(tmp_path, launch_ranks, check_scenario):
    check_scenario(launch_ranks(WORKER, 2, tmp_path, 180), "fsdp2_matches_single_process")


@pytest.mark.slow  # torch.compile (inductor, C++ codegen): 10-25 s on 2 cores
def test_torch_compile_fp8_block_linear_matches_eager():
    from moe_rl.fp8.linear import Fp8BlockLinear

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lin = Fp8BlockLinear(256, 128)
    x = torch.randn(64, 256)

    def step(mod):
        xi = x.clone().requires_grad_(True)
        y = mod(xi)
        (y * y).sum().backward()
        out = (y.detach(), xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
        lin.zero_grad()
        return out

    ref = step(lin)
    got = step(torch.compile(lin, backend="inductor"))
    # eager vs inductor: the same FP8 codes and scales (quantization is element-wise, the compiled kernels compute the
    # same amax), the dequantized fp32 GEMMs in possibly other orders: two fp32 paths of K-term reductions (K = 256
    # in, 128 out, 64 tokens for dW / db), normwise (tests/_tolerance.py), depth 2 (y -> dy = 2y -> dx, dW)
    for name, r, o in zip(("y", "dx", "dW", "db"), ref, got, strict=True):
        assert_normwise_close(o, r, dtype=torch.float32, k=256, depth=2 * 2, what=name)
