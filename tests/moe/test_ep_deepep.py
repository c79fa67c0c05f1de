"""The ``deep_ep`` backend of dispatch/combine, driven through DeepEP's current ``ElasticBuffer`` API.

Real DeepEP needs CUDA and NCCL, so on CPU the API is served by ``tests/moe/fake_deep_ep`` (a gloo stand-in of
DeepEP 2.1: ``ElasticBuffer.get_buffer_size_hint``, ``dispatch`` returning ``(recv_x, recv_topk_idx,
recv_topk_weights, EPHandle, event)`` with once-per-rank token delivery, local ``recv_topk_idx`` with -1 and
unspecified weights at -1 slots, unweighted ``combine`` that also returns each slot's weight from its owner, cached
dispatch with ``handle=``, deterministic or scrambled receive order). What this proves is that
``moe_rl.moe.ep.deepep`` uses that API correctly, on a buffer the caller creates with ``make_deepep_buffer``: on 2
and 4 real gloo ranks the EP MoE with ``backend="deep_ep"`` equals the single-process MoE (outputs and all gradients
incl. the router's, fp32 atol 1e-5), including a rank with zero tokens (B04), all tokens to one rank, top_k = E, -1
slots, align=128 (same rows and ``layout_P`` as the ``torch`` backend), a scrambled receive order, handle reuse
(DeepEP's cached dispatch), validation before any token moves (also for more tokens than the buffer holds), the
buffer's size hint, and the FP8 payload. The real kernels run in ``benchmarks/gpu/ep_deepep.py`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import check_scenario, ranks_fixture

WORKER = Path(__file__).with_name("_deepep_worker.py")
TIMEOUT_S = 240


ep2 = ranks_fixture(WORKER, 2, TIMEOUT_S)
ep4 = ranks_fixture(WORKER, 4, TIMEOUT_S)


@pytest.mark.parametrize(
    "scenario",
    [
        "moe_equals_reference",
        "b04_zero_token_rank",
        "layout_matches_torch_backend",
        "dropped_slots_and_weight_grads",
        "handle_reuse",
        "validation_errors",
        "buffer_is_sized_by_the_hint",
        "nondeterministic_order",
        "fp8_payload",
    ],
)
def test_deep_ep_backend_ep2(ep2, scenario):
    check_scenario(ep2, scenario)


@pytest.mark.parametrize(
    "scenario", ["moe_equals_reference", "b04_zero_token_rank", "layout_matches_torch_backend", "nondeterministic_order"]
)
def test_deep_ep_backend_ep4(ep4, scenario):
    check_scenario(ep4, scenario)
