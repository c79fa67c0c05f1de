"""DeepseekV3ForCausalLM under FSDP2 x EP x CP (:func:`moe_rl.models.deepseek_v3.parallelize_deepseek_v3`) on 2 gloo
ranks against the single-process model: loss and every gradient (the worker gives the tolerance). Layouts:
``dp2_ep2`` (FSDP over 2 data ranks, experts split), ``cp2_ep2_ring_ac`` (ring CP of the dense MLA with EP borrowed
from the CP ranks, activation checkpointing), ``cp2_ulysses``; ``validation_errors``: a DSA CP method refused, a CP
forward without positions."""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import check_scenario, ranks_fixture

WORKER = Path(__file__).with_name("_deepseek_v3_parallel_worker.py")
world2 = ranks_fixture(WORKER, 2, 300)


@pytest.mark.parametrize("scenario", ["dp2_ep2", "cp2_ep2_ring_ac", "cp2_ulysses", "validation_errors"])
def test_parallel_step_matches_single_process(world2, scenario):
    check_scenario(world2, scenario)
