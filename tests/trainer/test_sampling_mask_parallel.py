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

from pathlib import Path

import numpy as np
import pytest
import torch
from _ranks import scenario_result
from _reference_trainer import spread_router_model, write_run_inputs
from _tolerance import assert_normwise_close, decoder_chain, eps, train_step_bounds

from moe_rl.runtime.config import RLConfig

WORLD = 2
DPPO = {"kind": "dppo_kl", "kl_tau": 0.01}
SCENARIOS = {
    "cp2": {"nproc_per_node": 2, "parallel": {"dp_shard": 1, "cp": 2}},
    "dp2_packed": {"nproc_per_node": 2},
}


def _batch(cfg: RLConfig):
    from moe_rl.rl.batch import build_batch
    from moe_rl.rl.buffer import RolloutGroup, Sample
    from moe_rl.rl.sampling_mask import encode_kept

    v = cfg.model.vocab_size
    rng = np.random.default_rng(11)
    samples = []
    for k, (p, c) in enumerate([(4, 3), (6, 5), (3, 2), (2, 6)]):
        prompt = [1] + rng.integers(3, v, size=p - 1).tolist()
        comp = rng.integers(3, v, size=c).tolist()
        kept = rng.random((c, v)) < [0.2, 0.5, 0.9][k % 3]
        kept[np.arange(c), comp] = True  # the sampled token is in its kept set
        samples.append(Sample(prompt, comp, (-rng.random(c) * 2.0).tolist(), reward=float(rng.random()),
                              sampling_mask=None if k == 2 else encode_kept(kept)))
    return build_batch([RolloutGroup(0, 0, "s", samples)], 0, pad_id=cfg.pad_id)


def _reference(cfg: RLConfig, init: dict, b) -> dict:
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.rl.loss import compute_loss, loss_normalizer
    from moe_rl.rl.sampling_mask import dense_keep, masked_logprobs

    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(init)
    logits = model(b.input_ids)
    keep = dense_keep(b.sampling_mask_ids, b.sampling_mask_kind, cfg.model.vocab_size)
    lp = masked_logprobs(logits[:, :-1], b.input_ids[:, 1:], 1.0, keep)
    lp.retain_grad()
    lcfg = cfg.trainer.loss
    out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, 0)
    norm = loss_normalizer(lcfg, b.loss_mask)
    (out.loss_sum / norm).backward()
    k, depth = decoder_chain(cfg.model, b.input_ids.numel())
    return {"loss": out.loss_sum.item() / norm, "bounds": train_step_bounds(lp, logits, out, k=k, depth=2 * depth),
            "tokens": b.input_ids.numel(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_ranks):
    root = tmp_path_factory.mktemp("sampling_mask_parallel")
    prepared = {}
    for name, trainer in SCENARIOS.items():
        d = root / name
        d.mkdir()
        cfg = RLConfig(output_dir=d, max_steps=1, trainer={
            **trainer, "sampling_mask_replay": True, "loss": DPPO, "optim": {"max_grad_norm": 1e9}})
        init = {k: v.clone() for k, v in spread_router_model(cfg.model).state_dict().items()}
        b = _batch(cfg)
        write_run_inputs(cfg, init, [b])
        prepared[name] = (cfg, init, b)
    results = launch_ranks(Path(__file__).with_name("_parallel_trainer_worker.py"), WORLD, root, 300)
    return root, prepared, results


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_with_sampling_masks_match_single_process(world2, scenario):
    (cfg, init, b), got = scenario_result(world2, scenario)
    ref = _reference(cfg, init, b)
    rep = got["reports"][0]
    assert abs(rep["loss"] - ref["loss"]) <= ref["bounds"]["loss"] + eps(torch.float32) * abs(ref["loss"])
    k, depth = decoder_chain(cfg.model, ref["tokens"], backward=True)
    for n, g in ref["grads"].items():  # no clip (max_grad_norm 1e9): the gradients of the loss
        assert_normwise_close(got["grads"][0][n], g, dtype=torch.float32, k=k, depth=2 * depth + 2,
                              what=f"{scenario} {n}")
