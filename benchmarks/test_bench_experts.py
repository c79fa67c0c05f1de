"""Routed experts forward + backward: ``grouped_mm`` backend vs the per-expert ``loop`` baseline (fp32, CPU).

Shapes: the debug_cpu recipe's MoE layer (D=128, F=64, E=8, K=2) and a wider layer (D=512, F=256, E=16,
K=4) at 1024 tokens.
"""

import pytest
import torch

from moe_rl.moe import GroupedExperts

SHAPES = {"debug_cpu": (1024, 128, 64, 8, 2), "wide": (1024, 512, 256, 16, 4)}


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_experts_fwd_bwd(benchmark, shape, backend):
    T, D, F, E, K = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(E, D, F, backend=backend)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    grad = torch.randn(T, K, D, generator=g)

    def step():
        experts.zero_grad(set_to_none=True)
        x.grad = None
        experts(x, ids).backward(grad)

    benchmark.group = f"experts fwd+bwd {shape} T={T} D={D} F={F} E={E} K={K}"
    benchmark.extra_info["role"] = "baseline" if backend == "loop" else "candidate"
    benchmark.pedantic(step, rounds=20, warmup_rounds=3)
