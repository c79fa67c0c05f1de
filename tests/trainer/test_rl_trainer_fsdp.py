"""The real RL trainer under torchrun (2 gloo ranks, FSDP2) equals a single-process reference:
same per-step loss/mismatch_kl and the same published weights after 2 optimizer steps (fp32).

Tolerances (``tests/_tolerance.py``): two fp32 runs of the same steps in other summation orders (FSDP2's
reduce-scatter). Loss and ``mismatch_kl``: the log-prob error bound of the forward chain (two paths) propagated
through the reference's ``d loss / d lp``. Weights: AdamW runs with ``eps = lr`` so that an update moves by at most
``2 lr / eps = 2`` times a gradient difference; each published tensor may differ by ``2 sum_s beta ||g_s||``
(``beta``: the normwise relative bound of the forward + backward chain, two paths) plus the rounding of the
updates. A wrong loss scale, a dropped row or a stale weight is O(1) relative."""

import json

import pytest
import torch
from _reference_trainer import run_trainer_process
from _tolerance import C_PROB, assert_within, decoder_chain, eps, train_step_bounds

from moe_rl.models import GlmMoeForCausalLM
from moe_rl.models.glm4_moe import load_hf_state_dict, to_hf_state_dict
from moe_rl.rl.batch import build_batch
from moe_rl.rl.buffer import RolloutGroup, Sample
from moe_rl.rl.loss import dppo_kl_loss
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.run_dir import RunPaths
from moe_rl.runtime.trainer.rl_trainer import token_logprobs
from moe_rl.weights.filesystem import is_published, read_sharded, version_dir

pytestmark = pytest.mark.slow


def _random_groups(step: int, n_groups: int, group_size: int, vocab: int) -> list[RolloutGroup]:
    g = torch.Generator().manual_seed(100 + step)
    groups = []
    for gid in range(n_groups):
        plen = int(torch.randint(4, 8, (1,), generator=g))
        prompt = [1] + torch.randint(3, vocab, (plen - 1,), generator=g).tolist()
        samples = []
        for _ in range(group_size):
            clen = int(torch.randint(1, 5, (1,), generator=g))
            comp = torch.randint(3, vocab, (clen,), generator=g).tolist()
            lps = (-torch.rand(clen, generator=g) * 3).tolist()
            samples.append(Sample(prompt, comp, lps, reward=float(torch.rand(1, generator=g))))
        groups.append(RolloutGroup(gid, step, "s", samples))
    return groups


def _reference(cfg: RLConfig, paths: RunPaths, batches) -> tuple[dict, list[dict]]:
    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(load_hf_state_dict(version_dir(paths.weights, 0)))
    o = cfg.trainer.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, o.warmup_steps)))
    stats = []
    for b in batches:
        logits = model(b.input_ids)
        lp = token_logprobs(logits, b.input_ids, cfg.orchestrator.temperature)
        lp.retain_grad()
        out = dppo_kl_loss(lp, b.inference_logprobs, b.advantages, b.loss_mask, cfg.trainer.loss)
        (out.loss_sum / out.num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        k, depth = decoder_chain(cfg.model, b.input_ids.numel())
        # per published (HF) tensor: the gradient's norm after the clip (what AdamW saw)
        grads = {n: torch.zeros_like(t) for n, t in model.state_dict().items()}  # buffers: zero
        grads.update({n: p.grad.detach() for n, p in model.named_parameters()})
        hf_grads = to_hf_state_dict(grads, cfg.model)
        stats.append({"loss": out.loss_sum.item() / out.num_tokens,
                      "mismatch_kl": out.mismatch_kl_sum.item() / out.num_tokens,
                      "bounds": train_step_bounds(lp, logits, out, k=k, depth=2 * depth),
                      "chain_tokens": b.input_ids.numel(),
                      "grad_norms": {n: float(g.double().norm()) for n, g in hf_grads.items()}})
        opt.step()
        sched.step()
        opt.zero_grad()
    return to_hf_state_dict(model.state_dict(), cfg.model), stats


@pytest.mark.multirank  # torchrun inside run_trainer_process
def test_torchrun_fsdp2_trainer_matches_single_process(tmp_path):
    cfg = RLConfig(output_dir=tmp_path, max_steps=2,
                   orchestrator={"batch_size": 16, "group_size": 4},
                   trainer={"nproc_per_node": 2, "optim": {"lr": 1e-2, "eps": 1e-2, "warmup_steps": 0}})
    batches = [build_batch(_random_groups(s, 4, 4, cfg.model.vocab_size), s, pad_id=0) for s in range(2)]
    paths = run_trainer_process(cfg, batches)
    assert is_published(paths.weights, 1) and is_published(paths.weights, 2)
    ref_sd, ref_stats = _reference(cfg, paths, batches)
    got_hf = dict(read_sharded(version_dir(paths.weights, 2)))  # every trainer rank's shards, assembled
    assert set(got_hf) == set(ref_sd)
    f32, o = torch.float32, cfg.trainer.optim
    k, depth = decoder_chain(cfg.model, max(r["chain_tokens"] for r in ref_stats), backward=True)
    beta = (2 * depth + 2) * C_PROB * k**0.5 * eps(f32)  # normwise relative error of a gradient (two paths)
    for name, v in ref_sd.items():
        dg = sum(beta * r["grad_norms"].get(name, 0.0) for r in ref_stats)  # buffers: no gradient
        rounding = 2 * len(ref_stats) * eps(f32) * (float(v.double().norm()) + o.lr * v.numel() ** 0.5)
        err = float((got_hf[name].double() - v.double()).norm())
        assert err <= 2 * (o.lr / o.eps) * dg + rounding, (name, err, dg, rounding)
    for step, ref in enumerate(ref_stats):
        rep = json.loads(paths.trainer_step(step).read_text())
        for key in ("loss", "mismatch_kl"):
            assert_within(torch.tensor(rep[key]), torch.tensor(ref[key]),
                          ref["bounds"][key] + eps(f32) * abs(ref[key]), f"step {step} {key}")
