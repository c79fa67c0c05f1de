"""Sampling-mask replay on two trainer ranks equals one process: context parallelism (cp = 2, the kept sets sharded
with their label columns) and two data ranks with sequence packing (the kept sets concatenated per packed row).

Runs the real trainer step (``_parallel_trainer_worker.py``: ``build_trainer`` + ``train_step``) on a 2-rank gloo
world. Reference: one process, fp32, the padded batch in one forward, ``masked_logprobs`` over ``dense_keep`` of the
batch fields at loss positions (the whole vocabulary elsewhere). Tolerances as ``test_packing.py``: the loss within
``train_step_bounds`` (the log-prob error bound propagated through the loss), gradients per tensor with
``assert_normwise_close``. A kept set on the wrong column moves a token's log-prob by the dropped mass (~0.1-1 nats
here) and the loss far outside the bound; the single-process test of ``tests/rl/test_sampling_mask.py`` checks
that replay off changes the loss by more than 100 bounds.
"""

from __future__ import annotations

import pytest
from _ranks import scenario_result
from _reference_trainer import (
    assert_step_matches_reference,
    launch_one_step_scenarios,
    sampling_mask_batch,
    sampling_mask_reference,
    spread_router_model,
)

from moe_rl.runtime.config import RLConfig

WORLD = 2
DPPO = {"kind": "dppo_kl", "kl_tau": 0.01}
SCENARIOS = {
    "cp2": {"nproc_per_node": 2, "parallel": {"dp_shard": 1, "cp": 2}},
    "dp2_packed": {"nproc_per_node": 2},
}


def _batch(cfg: RLConfig):
    return sampling_mask_batch(cfg, 11, lambda rng, k, c, v: rng.random((c, v)) < [0.2, 0.5, 0.9][k % 3])


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_ranks):
    def prepare(name, folder):
        cfg = RLConfig(output_dir=folder, max_steps=1, trainer={
            **SCENARIOS[name], "sampling_mask_replay": True, "loss": DPPO, "optim": {"max_grad_norm": 1e9}})
        init = {k: v.clone() for k, v in spread_router_model(cfg.model).state_dict().items()}
        return cfg, init, _batch(cfg)

    root = tmp_path_factory.mktemp("sampling_mask_parallel")
    return launch_one_step_scenarios(root, SCENARIOS, prepare, launch_ranks, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_with_sampling_masks_match_single_process(world2, scenario):
    (cfg, init, b), got = scenario_result(world2, scenario)
    assert_step_matches_reference(got, sampling_mask_reference(cfg, init, b), cfg.model, scenario)
