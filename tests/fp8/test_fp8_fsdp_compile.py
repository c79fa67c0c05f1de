"""Fp8BlockLinear under FSDP2 (2 gloo ranks, CPU) and under torch.compile (CPU inductor), against eager.

* FSDP2: two spawned processes (``_fsdp_worker.py``, file:// init) shard a 2-layer Fp8BlockLinear MLP with
  ``fully_shard`` (per layer and root); the global loss and the full gradients equal those of the single-process
  model on the whole batch (fp32 master weights) to fp32 summation order. Why the FP8 numerics are identical
  and only summation order differs is in the worker's docstring.
* torch.compile: forward + backward of the compiled module match eager. The quantizers' inf/NaN check
  (``int(...)``, a host sync) is a graph break by design; the test only requires correctness, not one graph.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tolerance import assert_normwise_close

WORKER = Path(__file__).with_name("_fsdp_worker.py")


@pytest.mark.multirank  # two processes on a gloo group (own launcher, not launch_ranks)
def test_fsdp2_fp8_block_linear_matches_single_process(tmp_path):
    world = 2
    init_file = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(init_file), str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r] if r < len(logs) else ''}"
        res = json.loads((tmp_path / f"rank{r}.json").read_text())["result"]
        assert res == "ok", f"rank {r}:\n{res}"


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
