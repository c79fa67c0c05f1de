"""N07: loss normalization under context parallelism.

One data rank, a row of 8 tokens, loss mask 1 at positions 6 and 7 with per-token losses 2.0 and 4.0; CP = 2 and
CP = 4 gloo ranks, contiguous shards ([0-3], [4-7] at CP = 2) and the zigzag shards the trainer uses; masks: the
case's, all ones, a single valid token at 7, one valid token per shard, all zeros
(``tests/cases/_n07_cp_worker.py``: :func:`moe_rl.runtime.trainer.step.gather_context_parallel` + ``compute_loss`` +
``loss_normalizer`` with ``train_step``'s scaling, then FSDP2's sum-and-divide over the ranks).

Expected: the objective is the un-sharded token mean, 3.0; ``d objective / d loss_i`` = 0.5 for both valid tokens
and 0 elsewhere (a local-count division would give 0.25, an overcounted denominator a loss of 1.5), for every CP
degree and mask layout; the all-zero mask gives exactly zero gradients; every reduced gradient equals the CP = 1
reference to 1e-6 in fp32 (8 O(1) terms: a few ulps).
"""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_n07_cp_worker.py")
SCENARIOS = [f"{layout}/{name}" for layout in ("contiguous", "zigzag")
             for name in ("case", "all_ones", "single_last", "one_per_shard", "all_zeros")]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_run(request, tmp_path_factory, launch_ranks):
    return launch_ranks(WORKER, request.param, tmp_path_factory.mktemp(f"n07_cp{request.param}"), 600)


def test_n07_every_layout_matches_the_unsharded_reference(cp_run, check_scenario):
    for key in SCENARIOS:
        check_scenario(cp_run, key)


def test_n07_case_values(cp_run):
    for layout in ("contiguous", "zigzag"):
        for r, res in cp_run.items():
            rep = res["report"][f"{layout}/case"]
            assert rep["objective"] == pytest.approx(3.0, abs=1e-6), (layout, r)
            assert rep["weights"] == pytest.approx([0.0] * 6 + [0.5, 0.5], abs=1e-6), (layout, r)
            zeros = res["report"][f"{layout}/all_zeros"]
            assert zeros["objective"] == 0.0 and zeros["weights"] == [0.0] * 8
            single = res["report"][f"{layout}/single_last"]
            assert single["weights"] == pytest.approx([0.0] * 7 + [1.0], abs=1e-6)
