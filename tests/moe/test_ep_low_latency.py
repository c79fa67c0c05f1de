"""Low-latency (decode) EP dispatch/combine in DeepEP's / DeepGEMM's masked layout (:mod:`moe_rl.moe.ep.low_latency`).

On 2 and 4 real gloo ranks the decode step ``low_latency_dispatch -> masked_experts_forward -> low_latency_combine``
equals the single-process :class:`moe_rl.moe.MoE` (fp32, atol 1e-5) with the ``torch`` backend and with the
``deep_ep`` backend driven through ``tests/moe/fake_deep_ep`` (a gloo stand-in of DeepEP's legacy
``Buffer.low_latency_*`` API, on a buffer the test makes with ``make_low_latency_buffer``), including zero tokens on a rank (B04), all tokens to one expert (a full ``M * R`` slab), top_k = E and
-1 slots; padding rows are NaN, so reading one would fail the test. On 2 ranks also: the slab layout against an
independent all_gather view, bf16 and FP8 payloads with justified bounds, and input validation. Real DeepEP needs
CUDA + NVSHMEM; nothing here runs on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _ranks import ranks_fixture
from _tolerance import assert_normwise_close

from moe_rl.moe.ep.low_latency import masked_experts_forward

WORKER = Path(__file__).with_name("_ep_low_latency_worker.py")
TIMEOUT_S = 240


ll2 = ranks_fixture(WORKER, 2, TIMEOUT_S)
ll4 = ranks_fixture(WORKER, 4, TIMEOUT_S)


@pytest.mark.parametrize(
    "scenario",
    [
        "decode_equals_reference_torch",
        "decode_equals_reference_deep_ep",
        "slab_layout",
        "bf16_decode",
        "fp8_decode",
        "validation_errors",
    ],
)
def test_low_latency_ep2(ll2, check_scenario, scenario):
    check_scenario(ll2, scenario)


@pytest.mark.parametrize(
    "scenario", ["decode_equals_reference_torch", "decode_equals_reference_deep_ep", "slab_layout"]
)
def test_low_latency_ep4(ll4, check_scenario, scenario):
    check_scenario(ll4, scenario)


@pytest.mark.parametrize("backend", ["loop", "bmm"])
def test_masked_experts_forward_matches_float64_per_row(backend):
    """Each valid row equals its expert's SwiGLU in float64 (independent math); padding rows (NaN) stay zero."""
    torch.manual_seed(0)
    L, S, H, F = 3, 5, 8, 6
    x = torch.randn(L, S, H)
    m = torch.tensor([2, 0, 5], dtype=torch.int32)
    x[0, 2:] = float("nan")
    x[1] = float("nan")
    gu, dn = torch.randn(L, 2 * F, H), torch.randn(L, H, F)
    y = masked_experts_forward(x, m, gu, dn, backend=backend)
    for e in range(L):
        for r in range(S):
            if r < int(m[e]):
                h = gu[e].double() @ x[e, r].double()
                act = torch.nn.functional.silu(h[:F]) * h[F:]
                # fp32 vs float64: the H-term gate_up and F-term down GEMMs (tests/_tolerance.py normwise, depth 2)
                assert_normwise_close(y[e, r], dn[e].double() @ act, dtype=torch.float32, k=max(H, F), depth=2)
            else:
                assert torch.count_nonzero(y[e, r]) == 0, (e, r, y[e, r])


def test_masked_experts_forward_rejects_bad_masked_m():
    x = torch.zeros(2, 4, 8)
    gu, dn = torch.zeros(2, 12, 8), torch.zeros(2, 8, 6)
    with pytest.raises(ValueError, match=r"masked_m_L=\[5, 0\] must lie in \[0, S=4\]"):
        masked_experts_forward(x, torch.tensor([5, 0]), gu, dn)
    with pytest.raises(ValueError, match="backend='cuda' is not supported"):
        masked_experts_forward(x, torch.tensor([1, 0]), gu, dn, backend="cuda")


def test_deep_ep_backend_without_deep_ep_says_how_to_install(monkeypatch):
    import sys

    from moe_rl.moe.ep.low_latency import low_latency_dispatch, make_low_latency_buffer

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # makes `import deep_ep` raise ImportError
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ImportError, match=r"deepseek-ai/DeepEP.*NVSHMEM.*setup\.py install"):
        make_low_latency_buffer(object(), max_tokens_per_rank=4, hidden=8, num_experts=4)
    x, ids = torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ImportError, match=r"deepseek-ai/DeepEP"):
        low_latency_dispatch(x, ids, num_experts=2, max_tokens_per_rank=4, backend="deep_ep")


def test_deep_ep_backend_needs_a_caller_owned_buffer(monkeypatch):
    import sys
    import types

    from moe_rl.moe.ep.low_latency import low_latency_dispatch

    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))  # importable; never reached
    x, ids = torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"needs buffer=: create the low-latency buffer once per EP group"):
        low_latency_dispatch(x, ids, num_experts=2, max_tokens_per_rank=4, backend="deep_ep")
    with pytest.raises(ValueError, match=r"buffer= is only used by backend='deep_ep'"):
        low_latency_dispatch(x, ids, num_experts=2, max_tokens_per_rank=4, buffer=object())
