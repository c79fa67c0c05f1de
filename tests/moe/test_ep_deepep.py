"""The ``deep_ep`` backend of dispatch/combine, driven through DeepEP's ``Buffer`` API.

Real DeepEP needs CUDA + NVSHMEM, so on CPU the API is served by ``tests/moe/fake_deep_ep`` (a gloo stand-in that
implements DeepEP's documented normal-mode semantics: once-per-rank token delivery, local ``recv_topk_idx`` with -1,
zeroed ``recv_topk_weights``, unweighted ``combine``, cached dispatch). What this proves is that
``moe_rl.moe.ep_deepep`` uses that API correctly: on 2 and 4 real gloo ranks the EP MoE with ``backend="deep_ep"``
equals the single-process MoE (outputs and all gradients incl. the router's, fp32 atol 1e-5), including a rank
with zero tokens (B04), all tokens to one rank, top_k = E, -1 slots, align=128 (same rows and ``layout_P`` as the
``torch`` backend), handle reuse, validation before any token moves, and the FP8 payload. The real kernels run in
``benchmarks/gpu/ep_deepep.py`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_deepep_worker.py")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, launch_ranks):
    return launch_ranks(WORKER, 2, tmp_path_factory.mktemp("deepep2"), TIMEOUT_S)


@pytest.fixture(scope="module")
def ep4(tmp_path_factory, launch_ranks):
    return launch_ranks(WORKER, 4, tmp_path_factory.mktemp("deepep4"), TIMEOUT_S)


def _check(results, scenario: str) -> None:
    failures = {r: res.get(scenario, "scenario did not run") for r, res in results.items()}
    failures = {r: msg for r, msg in failures.items() if msg != "ok"}
    assert not failures, "\n".join(f"--- rank {r}:\n{msg}" for r, msg in failures.items())


@pytest.mark.parametrize(
    "scenario",
    [
        "moe_equals_reference",
        "b04_zero_token_rank",
        "layout_matches_torch_backend",
        "dropped_slots_and_weight_grads",
        "handle_reuse",
        "validation_errors",
        "fp8_payload",
    ],
)
def test_deep_ep_backend_ep2(ep2, scenario):
    _check(ep2, scenario)


@pytest.mark.parametrize("scenario", ["moe_equals_reference", "b04_zero_token_rank", "layout_matches_torch_backend"])
def test_deep_ep_backend_ep4(ep4, scenario):
    _check(ep4, scenario)
