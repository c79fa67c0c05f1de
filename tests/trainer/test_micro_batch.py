"""Micro-batches (gradient accumulation) and batches with an uneven number of rows in
:func:`moe_rl.runtime.trainer.step.train_step`.

Every run is compared with an independent single-process fp32 reference: the unsharded model on the whole
*unpadded* batch in one forward/backward, ``compute_loss`` / ``loss_normalizer``, torch's clip, AdamW with the
warm-up schedule (what the one-shot trainer step computes). Checked per step: the report's ``loss``,
``mismatch_kl``, ``masked_frac``, ``grad_norm``, ``lr``, ``tokens``, ``loss_tokens`` and loss metrics (fractions,
age means, ratio quantiles), every gradient right before the AdamW step (after the clip), and every parameter
after 2 steps. Batches carry router-replay records (replayed, trainer-routed and fill rows), and step 1 has token
versions (the age weight of ``gspo`` is active).

* tier 1 (one process): ``micro_batch`` 1, 2, 4 (4 does not divide the 6 rows: chunks of 4 + 2) and ``None`` for
  ``dppo_kl`` and ``gspo`` (sequence-level: each row's term must be summed once over the chunks); ``pad_rows``
  rows contribute nothing to ``compute_loss`` / ``loss_normalizer``; bad settings raise.
* tier 2 (2 gloo ranks, ``_parallel_trainer_worker.py`` with a ``micro_batch.json`` per scenario): FSDP2 over 2 data ranks with 5 rows (padded to 6, one inert
  row on rank 1) and ``micro_batch=1``; FSDP2 with 3 rows of groups 2 + 1 (padded to 4) and ``gspo``; cp = 2 with
  3 rows and ``micro_batch=2`` (chunks 2 + 1, whole-row ``gspo`` loss under CP).

Tolerances (fp32, ``tests/_tolerance.py`` ``assert_train_run_close``): micro-batching and sharding change only the
summation order (per-row loss terms summed per chunk then across chunks, gradients accumulated in ``.grad`` over
backwards, FSDP's reduce-scatter). Gradients: per-tensor normwise bound of the decoder chain (forward + backward,
two paths); loss, ``mismatch_kl`` and ratio quantiles: the log-prob error bound propagated through
``d loss / d lp`` of the reference; parameters: AdamW (``eps = lr``) moves them by at most ``2 lr / eps`` times the
measured gradient differences. Counts, integer ages, dyadic age weights and the lr schedule are exact. A row
counted twice or missed, a padding row that counts, or a wrong scale is O(1) relative here.

Runtime on the shared 2-core machine: ~30 s for the file (measured 27 s idle, ~65 s with a CI run beside it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from _ranks import scenario_result
from _reference_trainer import reference_steps, spread_router_model, write_run_inputs
from _tolerance import assert_train_run_close, decoder_chain

from moe_rl.runtime.config import RLConfig

STEPS = 2
LENGTHS = [(4, 3), (6, 5), (5, 2), (4, 1), (7, 4), (5, 5)]  # (prompt, completion) of up to 6 rows
OPTIM = {"lr": 1e-3, "eps": 1e-3, "warmup_steps": 2, "weight_decay": 0.01}
GSPO = {"kind": "gspo", "kl_tau": 0.01, "gspo": {"clip_low": 0.9, "clip_high": 9.0}, "age": {"decay": 0.5}}
DPPO = {"kind": "dppo_kl", "kl_tau": 0.01}


def _cfg(out: Path, loss: dict, nproc: int = 1, parallel: dict | None = None) -> RLConfig:
    return RLConfig(output_dir=out, max_steps=STEPS, orchestrator={"batch_size": 4, "group_size": 2},
                    trainer={"nproc_per_node": nproc, "router_replay": True, "optim": OPTIM, "loss": loss,
                             "parallel": parallel or {}})


def _groups(step: int, cfg: RLConfig, sizes: list[int]):
    """Groups of the given sizes; every sample but the second carries a routed-experts record (last token a
    placeholder); at step 1 odd samples switch to policy version 1 after their first token."""
    from moe_rl.replay import RoutedExperts
    from moe_rl.rl.buffer import RolloutGroup, Sample

    m = cfg.model
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    rng = np.random.default_rng(500 + step)
    groups, k = [], 0
    for gid, size in enumerate(sizes):
        samples = []
        for j in range(size):
            p, c = LENGTHS[k]
            prompt = [1] + rng.integers(3, m.vocab_size, size=p - 1).tolist()
            comp = rng.integers(3, m.vocab_size, size=c).tolist()
            rec = None
            if k != 1:  # sample 1 has no record: OWN_ROW, the trainer routes it
                ids = np.argsort(rng.random((p + c, moe, m.n_routed_experts)), axis=-1)[..., : m.num_experts_per_tok]
                ids[-1] = -1
                rec = RoutedExperts.from_array(ids, m.n_routed_experts)
            s = Sample(prompt, comp, (-rng.random(c) * 2.0).tolist(), reward=float(rng.random()), routed_experts=rec)
            if step == 1 and j % 2 and c > 1:
                s.version_segments = [(0, 0), (1, 1)]
            samples.append(s)
            k += 1
        groups.append(RolloutGroup(gid, 0, "s", samples))
    return groups


def _batches(cfg: RLConfig, sizes: list[int]):
    from moe_rl.rl.batch import build_batch

    out = [build_batch(_groups(s, cfg, sizes), s, pad_id=cfg.pad_id) for s in range(STEPS)]
    assert out[0].num_samples == sum(sizes) and out[0].routed_experts is not None
    return out


def _init_state(cfg: RLConfig) -> dict[str, torch.Tensor]:
    # spread router scores: the trainer-routed sample has no near-tie top-k choice
    return {k: v.clone() for k, v in spread_router_model(cfg.model).state_dict().items()}


def _reference(cfg: RLConfig, init: dict, batches) -> tuple[list[dict], dict]:
    """Single process, fp32, the whole unpadded batch at once: per step the report's values and the gradients
    (after the clip), then the final parameters."""
    from moe_rl.models import GlmMoeForCausalLM

    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(init)
    return reference_steps(cfg, model, batches)


def _run_one_process(cfg: RLConfig, init: dict, batches, micro_batch: int | None) -> dict:
    """The real ``train_step`` on one rank (plain model, no process group)."""
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.runtime.trainer.step import StepSettings, TrainerState, make_optimizer, train_step

    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(init)
    model.train()
    opt, sched = make_optimizer(model, cfg.trainer.optim)
    settings = replace(StepSettings.from_rl_config(cfg), micro_batch=micro_batch)
    st = TrainerState(settings, model, opt, sched, cfg.trainer.dims, None, 0, 1)
    grads: list[dict] = []
    opt.register_step_pre_hook(
        lambda o, a, k: grads.append({n: p.grad.clone() for n, p in model.named_parameters()}))
    reports = [train_step(st, b, s) for s, b in enumerate(batches)]
    return {"reports": reports, "grads": grads, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def _assert_matches(got: dict, ref_steps: list[dict], ref_params: dict, label: str, cfg: RLConfig) -> dict:
    for step, (rep, ref) in enumerate(zip(got["reports"], ref_steps, strict=True)):
        assert (rep["tokens"], rep["loss_tokens"]) == (ref["tokens"], ref["loss_tokens"]), (label, step)
    k, depth = decoder_chain(cfg.model, max(r["chain_tokens"] for r in ref_steps), backward=True)
    o = cfg.trainer.optim
    quantiles = {f"loss_metrics.{q}": "ratio" for q in ("ratio_p01", "ratio_p50", "ratio_p99")}
    # counts of masked / clipped tokens: decisions on ratios this data keeps away from the thresholds; age sums:
    # integers and powers of 2 (exact in fp32 in any order); lr: the same schedule arithmetic
    exact = ("lr", "masked_frac", "loss_metrics.clipped_frac", "loss_metrics.masked_frac_low",
             "loss_metrics.age_mean", "loss_metrics.age_weight_mean")
    assert_train_run_close(got["reports"], got["grads"], got["params"], ref_steps, ref_params, k=k,
                           depth=2 * depth + 2, lr=o.lr, adam_eps=o.eps,
                           smooth={"loss": "loss", "mismatch_kl": "mismatch_kl", **quantiles}, exact=exact,
                           what=label)
    err = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, (rep, ref) in enumerate(zip(got["reports"], ref_steps, strict=True)):
        err["loss"] = max(err["loss"], abs(rep["loss"] - ref["loss"]))
        for n, g in ref["grads"].items():
            err["grad"] = max(err["grad"], (got["grads"][step][n] - g).abs().max().item())
    for n, p in ref_params.items():
        err["param"] = max(err["param"], (got["params"][n] - p).abs().max().item())
    return err


# ----------------------------------------------------------------------------------- tier 1: one process


@pytest.mark.parametrize("loss", [DPPO, GSPO], ids=["dppo_kl", "gspo"])
def test_micro_batches_match_one_pass(tmp_path, loss):
    cfg = _cfg(tmp_path, loss)
    init = _init_state(cfg)
    batches = _batches(cfg, [3, 3])
    ref_steps, ref_params = _reference(cfg, init, batches)
    assert ref_steps[1]["loss_metrics"]["age_mean"] > 0  # step 1 has older tokens
    for mb in (None, 1, 2, 4):
        err = _assert_matches(_run_one_process(cfg, init, batches, mb), ref_steps, ref_params, f"micro_batch={mb}",
                             cfg)
        print(f"\n{loss['kind']} micro_batch={mb}: max abs error vs one pass {err}")


def test_pad_rows_are_inert():
    from moe_rl.replay import FILL_ROW
    from moe_rl.rl.loss import LossConfig, compute_loss, loss_normalizer

    cfg = _cfg(Path("/tmp/unused"), GSPO)
    b = _batches(cfg, [2, 1])[1]
    assert b.pad_rows(3, cfg.pad_id) is b and b.pad_rows(1, cfg.pad_id) is b
    p = b.pad_rows(2, cfg.pad_id)
    assert p.num_samples == 4 and p.step == b.step
    assert torch.equal(p.input_ids[:3], b.input_ids) and (p.input_ids[3] == cfg.pad_id).all()
    assert not p.loss_mask[3].any() and (p.token_versions[3] == -1).all()
    assert (p.routed_experts[3] == 0).all() and (p.routed_experts_state[3] == FILL_ROW).all()
    assert p.pad_rows(4, cfg.pad_id).num_samples == 4 and b.pad_rows(4, cfg.pad_id).num_samples == 4
    lp = torch.randn(b.loss_mask.shape, generator=torch.Generator().manual_seed(0)) * 0.1 - 1.0
    lp_pad = torch.cat([lp, torch.full((1, lp.shape[1]), float("nan"))])  # a pad row's log-probs are never read
    for kind in ("dppo_kl", "gspo", "mis"):
        lc = LossConfig(kind=kind, mis={"level": "both"}, age={"decay": 0.5})
        a = compute_loss(lc, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, 1)
        c = compute_loss(lc, lp_pad, p.inference_logprobs, p.advantages, p.loss_mask, p.token_versions, 1)
        assert loss_normalizer(lc, p.loss_mask) == loss_normalizer(lc, b.loss_mask)
        assert (c.num_tokens, c.num_sequences) == (a.num_tokens, a.num_sequences)
        for x, y in ((c.loss_sum, a.loss_sum), (c.mismatch_kl_sum, a.mismatch_kl_sum), (c.ratios, a.ratios),
                     *((c.metrics[k], a.metrics[k]) for k in a.metrics)):
            # bit-equal: the pad row is appended after the real rows and masked to exact zeros, so every real
            # term keeps its index in torch's index-ordered (single-threaded below the 32768-element grain) sums
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_bad_settings_raise():
    from moe_rl.rl.loss import LossConfig
    from moe_rl.runtime.trainer.step import StepSettings

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"micro_batch={bad!r} must be an int >= 1"):
            StepSettings(loss=LossConfig(), max_grad_norm=1.0, temperature=1.0, pad_id=0, micro_batch=bad)
    b = _batches(_cfg(Path("/tmp/unused"), DPPO), [1, 1])[0]
    with pytest.raises(ValueError, match=r"multiple=0 must be >= 1"):
        b.pad_rows(0, 0)
    from moe_rl.runtime.trainer.step import _rows

    with pytest.raises(ValueError, match=r"the batch has 0 rows"):
        _rows(b, 0, 0).pad_rows(2, 0)


# ---------------------------------------------------------------------------------- tier 2: gloo, 2 ranks

WORLD = 2
TIMEOUT_S = 300
SCENARIOS = {  # name: (trainer.parallel, loss, group sizes, micro_batch)
    "fsdp2_rows5_mb1_dppo": ({}, DPPO, [3, 2], 1),
    "fsdp2_rows3_groups2_1_gspo": ({}, GSPO, [2, 1], None),
    "cp2_rows3_mb2_gspo": ({"dp_shard": 1, "cp": 2}, GSPO, [2, 1], 2),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_ranks):
    root = tmp_path_factory.mktemp("micro_batch")
    prepared = {}
    for name, (parallel, loss, sizes, mb) in SCENARIOS.items():
        d = root / name
        d.mkdir()
        cfg = _cfg(d, loss, WORLD, parallel)
        (d / "micro_batch.json").write_text(json.dumps(mb))
        init = _init_state(cfg)
        batches = _batches(cfg, sizes)
        write_run_inputs(cfg, init, batches)
        prepared[name] = (cfg, init, batches)
    results = launch_ranks(Path(__file__).with_name("_parallel_trainer_worker.py"), WORLD, root, TIMEOUT_S)
    print("\nseconds:", results[0]["_seconds"])
    return root, prepared, results


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_match_single_process(world2, scenario):
    (cfg, init, batches), got = scenario_result(world2, scenario)
    ref_steps, ref_params = _reference(cfg, init, batches)
    err = _assert_matches(got, ref_steps, ref_params, scenario, cfg)
    print(f"\n{scenario}: max abs error vs single process {err}")
