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

Tolerances (fp32): micro-batching and sharding change only the summation order (per-row loss terms summed per
chunk then across chunks, gradients accumulated in ``.grad`` over backwards, FSDP's reduce-scatter), i.e. a few
ulps of O(1) values, ~1e-7 relative; losses and gradients are compared at atol 1e-6 + rtol 1e-5, parameters at
atol 1e-5 (AdamW's eps = lr = 1e-3 bounds the parameter change of a gradient difference by 1x; see
``test_rl_trainer_parallel.py``). A row counted twice or missed, a padding row that counts, or a wrong scale is
>= 1e-3 here.

Runtime on the shared 2-core machine: ~30 s for the file (measured 27 s idle, ~65 s with a CI run beside it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_rl.runtime.config import RLConfig

ATOL_GRAD, RTOL = 1e-6, 1e-5
ATOL_PARAM = 1e-5
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
    from moe_rl.models import GlmMoeForCausalLM

    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg.model)
    with torch.no_grad():  # spread the router scores: the trainer-routed sample has no near-tie top-k choice
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.router.weight.normal_(0.0, 1.0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference(cfg: RLConfig, init: dict, batches) -> tuple[list[dict], dict]:
    """Single process, fp32, the whole unpadded batch at once: per step the report's values and the gradients
    (after the clip), then the final parameters."""
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.replay import model_replay_ids
    from moe_rl.rl.loss import compute_loss, loss_normalizer, ratio_quantiles
    from moe_rl.runtime.trainer.step import token_logprobs

    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(init)
    o, lcfg = cfg.trainer.optim, cfg.trainer.loss
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, o.warmup_steps)))
    moe_layers = [layer.is_moe for layer in model.layers]
    steps = []
    for step, b in enumerate(batches):
        replay = model_replay_ids(b.routed_experts, b.routed_experts_state, moe_layers)
        lp = token_logprobs(model(b.input_ids, replay_ids=replay), b.input_ids, cfg.orchestrator.temperature)
        out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, step)
        norm = loss_normalizer(lcfg, b.loss_mask)
        (out.loss_sum / norm).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        n = out.num_tokens
        steps.append({
            "loss": out.loss_sum.item() / norm,
            "mismatch_kl": out.mismatch_kl_sum.item() / n,
            "masked_frac": out.masked_sum.item() / n,
            "grad_norm": grad_norm.item(),
            "lr": sched.get_last_lr()[0],
            "tokens": int((b.input_ids != cfg.pad_id).sum()),
            "loss_tokens": n,
            "loss_metrics": {"clipped_frac": out.metrics["clipped_tokens"].item() / n,
                             "masked_frac_low": out.metrics["masked_low"].item() / n,
                             "age_mean": out.metrics["age_sum"].item() / n,
                             "age_weight_mean": out.metrics["age_weight_sum"].item() / n,
                             **ratio_quantiles(out.ratios)},
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
        })
        opt.step()
        sched.step()
        opt.zero_grad()
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


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


def _assert_matches(got: dict, ref_steps: list[dict], ref_params: dict, label: str) -> dict:
    err = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, (rep, ref) in enumerate(zip(got["reports"], ref_steps, strict=True)):
        for key in ("loss", "mismatch_kl", "masked_frac", "grad_norm", "lr"):
            assert rep[key] == pytest.approx(ref[key], rel=RTOL, abs=ATOL_GRAD), (label, step, key)
        assert (rep["tokens"], rep["loss_tokens"]) == (ref["tokens"], ref["loss_tokens"]), (label, step)
        for key, v in ref["loss_metrics"].items():
            assert rep["loss_metrics"][key] == pytest.approx(v, rel=RTOL, abs=ATOL_GRAD), (label, step, key)
        err["loss"] = max(err["loss"], abs(rep["loss"] - ref["loss"]))
        grads = got["grads"][step]
        assert set(grads) == set(ref["grads"]), sorted(set(grads) ^ set(ref["grads"]))
        for n, g in ref["grads"].items():
            torch.testing.assert_close(grads[n], g, atol=ATOL_GRAD, rtol=RTOL,
                                       msg=lambda m, n=n, s=step: f"{label} step {s} grad {n}: {m}")
            err["grad"] = max(err["grad"], (grads[n] - g).abs().max().item())
    assert set(got["params"]) == set(ref_params), sorted(set(got["params"]) ^ set(ref_params))
    for n, p in ref_params.items():
        torch.testing.assert_close(got["params"][n], p, atol=ATOL_PARAM, rtol=0, msg=lambda m, n=n: f"{label} {n}: {m}")
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
        err = _assert_matches(_run_one_process(cfg, init, batches, mb), ref_steps, ref_params, f"micro_batch={mb}")
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
    from moe_rl.inference.weights import WeightPublisher
    from moe_rl.models.glm4_moe import to_hf_state_dict
    from moe_rl.rl.batch import write_batch

    root = tmp_path_factory.mktemp("micro_batch")
    prepared = {}
    for name, (parallel, loss, sizes, mb) in SCENARIOS.items():
        d = root / name
        d.mkdir()
        cfg = _cfg(d, loss, WORLD, parallel)
        (d / "config.json").write_text(cfg.model_dump_json())
        (d / "micro_batch.json").write_text(json.dumps(mb))
        init = _init_state(cfg)
        WeightPublisher(d / "weights", cfg.model.to_hf_config_dict(torch_dtype="float32")).publish(
            to_hf_state_dict(init, cfg.model), 0)
        batches = _batches(cfg, sizes)
        for b in batches:
            write_batch(b, d / "batches")
        prepared[name] = (cfg, init, batches)
    results = launch_ranks(Path(__file__).with_name("_parallel_trainer_worker.py"), WORLD, root, TIMEOUT_S)
    print("\nseconds:", results[0]["_seconds"])
    return root, prepared, results


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_match_single_process(world2, check_scenario, scenario):
    root, prepared, results = world2
    check_scenario(results, scenario)
    cfg, init, batches = prepared[scenario]
    got = torch.load(root / scenario / "result.pt", weights_only=True)
    ref_steps, ref_params = _reference(cfg, init, batches)
    err = _assert_matches(got, ref_steps, ref_params, scenario)
    print(f"\n{scenario}: max abs error vs single process {err}")
