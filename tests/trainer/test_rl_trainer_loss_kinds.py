"""The torchrun RL trainer (2 gloo ranks, FSDP2) with a sequence-level loss (GSPO) and token-age weighting
equals a single-process reference that calls ``compute_loss`` on the whole batch and divides by
``loss_normalizer``: the global normalisation of every kind survives data-parallel sharding, the batch's
``token_versions`` reach the loss, and the step report carries the loss metrics.

Tolerances (``tests/_tolerance.py``), as in ``test_rl_trainer_fsdp.py``: loss, ``mismatch_kl`` and ratio quantiles
within the log-prob error bound propagated through the reference's ``d loss / d lp``; counts, integer ages and dyadic
age weights exact (decay 0.5: sums of powers of 2); weights after 2 AdamW steps with ``eps = lr`` within
``2 sum_s beta ||g_s||`` per tensor plus the updates' rounding."""

import json

import pytest
import torch
from _reference_trainer import run_trainer_process
from _tolerance import C_PROB, assert_within, decoder_chain, eps, train_step_bounds

from moe_rl.models import GlmMoeForCausalLM
from moe_rl.models.glm4_moe import load_hf_state_dict, to_hf_state_dict
from moe_rl.rl.batch import build_batch
from moe_rl.rl.buffer import RolloutGroup, Sample
from moe_rl.rl.loss import compute_loss, loss_normalizer, ratio_quantiles
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.trainer.rl_trainer import token_logprobs
from moe_rl.weights.filesystem import read_sharded, version_dir

pytestmark = pytest.mark.slow


def _groups(step: int, vocab: int) -> list[RolloutGroup]:
    """4 groups of 4; at step 1 half the samples switch to version 1 after their first token."""
    g = torch.Generator().manual_seed(200 + step)
    groups = []
    for gid in range(4):
        prompt = [1] + torch.randint(3, vocab, (4,), generator=g).tolist()
        samples = []
        for j in range(4):
            clen = int(torch.randint(2, 6, (1,), generator=g))
            s = Sample(prompt, torch.randint(3, vocab, (clen,), generator=g).tolist(),
                       (-torch.rand(clen, generator=g) * 3).tolist(), reward=float(torch.rand(1, generator=g)))
            if step == 1 and j % 2:
                s.version_segments = [(0, 0), (1, 1)]
            samples.append(s)
        groups.append(RolloutGroup(gid, 0, "s", samples))
    return groups


@pytest.mark.multirank  # torchrun inside run_trainer_process
def test_torchrun_gspo_with_age_weighting_matches_single_process(tmp_path):
    loss = {"kind": "gspo", "kl_tau": 0.01, "gspo": {"clip_low": 0.9, "clip_high": 9.0}, "age": {"decay": 0.5}}
    cfg = RLConfig(output_dir=tmp_path, max_steps=2, orchestrator={"batch_size": 16, "group_size": 4},
                   trainer={"nproc_per_node": 2, "optim": {"lr": 1e-2, "eps": 1e-2, "warmup_steps": 0}, "loss": loss})
    batches = [build_batch(_groups(s, cfg.model.vocab_size), s, pad_id=0) for s in range(2)]
    assert int(batches[1].token_versions.max()) == 1
    paths = run_trainer_process(cfg, batches)

    # single-process reference on the whole batch
    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(load_hf_state_dict(version_dir(paths.weights, 0)))
    o, lcfg = cfg.trainer.optim, cfg.trainer.loss
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    f32 = torch.float32
    dg: dict[str, float] = {}  # per published tensor: sum over steps of the gradient-difference bound
    for step, b in enumerate(batches):
        logits = model(b.input_ids)
        lp = token_logprobs(logits, b.input_ids, cfg.orchestrator.temperature)
        lp.retain_grad()
        out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, step)
        norm = loss_normalizer(lcfg, b.loss_mask)
        assert norm == 16  # sequences, not tokens
        (out.loss_sum / norm).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        k, depth = decoder_chain(cfg.model, b.input_ids.numel())
        bounds = train_step_bounds(lp, logits, out, k=k, depth=2 * depth)
        k, depth = decoder_chain(cfg.model, b.input_ids.numel(), backward=True)
        beta = (2 * depth + 2) * C_PROB * k**0.5 * eps(f32)
        grads = {n: torch.zeros_like(t) for n, t in model.state_dict().items()}  # buffers: zero
        grads.update({n: p.grad.detach() for n, p in model.named_parameters()})
        for n, g in to_hf_state_dict(grads, cfg.model).items():
            dg[n] = dg.get(n, 0.0) + beta * float(g.double().norm())
        opt.step()
        opt.zero_grad()
        rep = json.loads(paths.trainer_step(step).read_text())
        n_tok = out.num_tokens
        assert rep["loss_kind"] == "gspo"
        m = rep["loss_metrics"]
        checks = [("loss", rep["loss"], out.loss_sum.item() / norm, bounds["loss"]),
                  ("mismatch_kl", rep["mismatch_kl"], out.mismatch_kl_sum.item() / n_tok, bounds["mismatch_kl"])]
        checks += [(q, m[q], v, bounds["ratio"]) for q, v in ratio_quantiles(out.ratios).items()]
        for key, got_v, ref_v, bound in checks:
            assert_within(torch.tensor(got_v), torch.tensor(ref_v), bound + eps(f32) * abs(ref_v), f"step {step} {key}")
        # counts and ages: integers and powers of 2 (exact in fp32 in any order); the clip decisions: sequence ratios
        # this data keeps away from the clip bounds
        assert m["clipped_frac"] == out.metrics["clipped_tokens"].item() / n_tok
        assert m["age_mean"] == out.metrics["age_sum"].item() / n_tok
        assert m["age_weight_mean"] == out.metrics["age_weight_sum"].item() / n_tok
        if step == 1:
            assert m["age_mean"] > 0 and m["age_weight_mean"] < 1
    got = dict(read_sharded(version_dir(paths.weights, 2)))  # every trainer rank's shards, assembled
    for name, v in to_hf_state_dict(model.state_dict(), cfg.model).items():
        # AdamW with eps = lr: an update moves by <= 2 lr / eps = 2 times a gradient difference (+ the rounding)
        rounding = 2 * len(batches) * eps(f32) * (float(v.double().norm()) + o.lr * v.numel() ** 0.5)
        err = float((got[name].double() - v.double()).norm())
        assert err <= 2 * (o.lr / o.eps) * dg[name] + rounding, (name, err, dg[name], rounding)
