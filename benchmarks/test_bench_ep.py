"""Expert-parallel dispatch/combine on 2 gloo ranks (CPU, bf16) vs a plain ``all_to_all_single`` of the same bytes.

This process is rank 0 and does the timing; rank 1 is ``_ep_bench_peer.py``, which runs each case the same number
of times (see that file for the command protocol and the shapes: T=1024 tokens per rank, D=512, E=8, K=4).
The ratio to the baseline is the cost of the layout work (sort, count exchange, validation ``all_gather``,
permutes, the [T, K, D] gather and the fp32 weighting) on top of the row exchange itself. The ``*_gathers``
reference rows measure the copy floor of an ``all_to_all_single`` dispatcher in the same run: the row gather into
the send buffer and the one out of the receive buffer around each exchange, without any layout work.

Run (save the JSON under a new name, keep the old ones):
``.venv/bin/pytest benchmarks/test_bench_ep.py --benchmark-json benchmarks/results/ep_<hardware>_<date>.json``
"""

from __future__ import annotations

from pathlib import Path

import _ep_bench_peer as peer  # benchmarks/ is on sys.path (conftest.py)
import pytest
import torch

_PEER = Path(__file__).with_name("_ep_bench_peer.py")  # ranks 1..world-1 run it; rank 0 (here) imports it

WORLD = 2
ROUNDS, WARMUP = 40, 5


@pytest.fixture(scope="module")
def ep_group(tmp_path_factory, gloo_peers):
    with gloo_peers(_PEER, lambda: peer.command(0), WORLD, tmp_path_factory.mktemp("ep_bench") / "init", 120):
        yield None


@pytest.mark.parametrize(
    "group_name, case, role",
    [
        ("ep dispatch fwd", "a2a_same_bytes", "baseline"),
        ("ep dispatch fwd", "a2a_same_bytes_fresh_out", "reference"),
        ("ep dispatch fwd", "dispatch", "candidate"),
        ("ep dispatch fwd", "dispatch_reuse_handle", "candidate"),
        ("ep dispatch fwd", "a2a_plus_two_gathers", "reference"),
        ("ep dispatch+combine fwd+bwd", "a2a_same_bytes_x4", "baseline"),
        ("ep dispatch+combine fwd+bwd", "a2a_x4_plus_gathers", "reference"),
        ("ep dispatch+combine fwd+bwd", "dispatch_combine_fwd_bwd", "candidate"),
        ("ep dispatch+combine fwd+bwd", "dispatch_combine_fwd_bwd_reuse_handle", "candidate"),
    ],
)
def test_ep_dispatch(benchmark, ep_group, group_name, case, role):
    calls = 1 if benchmark.disabled else ROUNDS + WARMUP
    peer.command(1, peer.CASES.index(case), calls)
    step = peer.make_case(case)
    benchmark.group = f"{group_name} EP={WORLD} gloo T={peer.T} D={peer.D} E={peer.E} K={peer.K} {peer.DTYPE}"
    benchmark.extra_info["role"] = role
    benchmark.extra_info["threads"] = torch.get_num_threads()
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP)
