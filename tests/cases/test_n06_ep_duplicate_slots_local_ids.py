"""N06: EP dispatch/combine with duplicate expert slots, and global-to-local expert ids.

Library behaviour under test (:func:`moe_rl.moe.ep.dispatch` / :func:`moe_rl.moe.ep.combine`, 4 gloo ranks):

* (a) a token whose routing names the same expert in two slots gets both slots' mass: combine weights each slot
  separately and sums (``out = 2 * (0.3 + 0.2) = 1.0``; last-wins would give 0.4, first-wins 0.6), and the
  gradient reaches each slot's gate (``d out / d p = 2.0`` for both).
* (b) 8 experts on EP = 4: each rank's experts see local ids in ``[0, L)`` only (the handle's ``layout_P``), rank 0's
  tokens land with local ids rank 0 ``[1, 0]`` (tokens 1, 5), rank 1 ``[1, 1]`` (2, 3), rank 2 ``[0]`` (4), rank 3
  ``[0, 1]`` (0, 6), and every token's output equals the single-rank reference exactly (fp64 payload; the gate 0.75 and the products are exact in fp32).

Replayed routing refuses duplicate ids (``moe_rl.replay.fill.resolve_replay_ids``) and so does the low-latency
backend; both raise rather than merge silently, checked here too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_n06_ep_worker.py")


@pytest.fixture(scope="module")
def ep4(tmp_path_factory, launch_ranks):
    return launch_ranks(WORKER, 4, tmp_path_factory.mktemp("n06"), 240)


def test_n06_duplicate_slots_sum_their_probabilities(ep4, check_scenario):
    check_scenario(ep4, "duplicate_slots")
    rep = ep4[0]["report"]
    # combine applies the gates in fp32: 0.3 and 0.2 are rounded to fp32 (relative 2^-24 each), two products and
    # one add of O(1) values: a few fp32 ulps of 1.0. Last-wins (0.4) or first-wins (0.6) is off by >= 0.4.
    tol = 4 * 2.0**-24
    assert rep["dup_out"] == pytest.approx(1.0, abs=tol)
    assert rep["dup_dw"] == pytest.approx([2.0, 2.0], abs=tol)
    assert rep["dup_dx"] == pytest.approx(1.0, abs=tol)  # 2 * 0.3 + 2 * 0.2


def test_n06_global_to_local_expert_ids(ep4, check_scenario):
    check_scenario(ep4, "local_ids")
    want = {0: ([1, 0], [1, 5]), 1: ([1, 1], [2, 3]), 2: ([0], [4]), 3: ([0, 1], [0, 6])}
    for r, (lids, toks) in want.items():
        rep = ep4[r]["report"]
        assert rep["local_ids_from_rank0"] == lids, f"rank {r}"
        assert rep["tokens_from_rank0"] == toks, f"rank {r}"


def test_n06_replay_refuses_duplicate_expert_ids():
    from moe_rl.replay.fill import resolve_replay_ids

    with pytest.raises(ValueError, match="repeat an expert"):
        resolve_replay_ids(torch.tensor([[3, 3]]), 8, None)
