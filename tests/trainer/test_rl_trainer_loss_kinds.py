"""The torchrun RL trainer (2 gloo ranks, FSDP2) with a sequence-level loss (GSPO) and token-age weighting
equals a single-process reference that calls ``compute_loss`` on the whole batch and divides by
``loss_normalizer``: the global normalisation of every kind survives data-parallel sharding, the batch's
``token_versions`` reach the loss, and the step report carries the loss metrics."""

import json
import os
import subprocess
import sys

import pytest
import torch

from moe_rl.inference.weights import WeightPublisher, version_dir
from moe_rl.models import GlmMoeForCausalLM
from moe_rl.models.glm4_moe import load_hf_state_dict, to_hf_state_dict
from moe_rl.rl.batch import build_batch, write_batch
from moe_rl.rl.buffer import RolloutGroup, Sample
from moe_rl.rl.loss import compute_loss, loss_normalizer, ratio_quantiles
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.run_dir import RunPaths
from moe_rl.runtime.trainer.rl_trainer import token_logprobs

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


def test_torchrun_gspo_with_age_weighting_matches_single_process(tmp_path):
    loss = {"kind": "gspo", "kl_tau": 0.01, "gspo": {"clip_low": 0.9, "clip_high": 9.0}, "age": {"decay": 0.5}}
    cfg = RLConfig(output_dir=tmp_path, max_steps=2, orchestrator={"batch_size": 16, "group_size": 4},
                   trainer={"nproc_per_node": 2, "optim": {"lr": 1e-2, "warmup_steps": 0}, "loss": loss})
    paths = RunPaths(tmp_path)
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    torch.manual_seed(0)
    init = GlmMoeForCausalLM(cfg.model)
    WeightPublisher(paths.weights, cfg.model.to_hf_config_dict(torch_dtype="float32")).publish(
        to_hf_state_dict(init.state_dict(), cfg.model), 0)
    batches = [build_batch(_groups(s, cfg.model.vocab_size), s, pad_id=0) for s in range(2)]
    assert int(batches[1].token_versions.max()) == 1
    for b in batches:
        write_batch(b, paths.batches)
    paths.trainer.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "moe_rl.runtime.trainer.rl_trainer", "--run-dir", str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    # single-process reference on the whole batch
    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(load_hf_state_dict(version_dir(paths.weights, 0)))
    o, lcfg = cfg.trainer.optim, cfg.trainer.loss
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    for step, b in enumerate(batches):
        lp = token_logprobs(model(b.input_ids), b.input_ids, cfg.orchestrator.temperature)
        out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, step)
        norm = loss_normalizer(lcfg, b.loss_mask)
        assert norm == 16  # sequences, not tokens
        (out.loss_sum / norm).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        opt.zero_grad()
        rep = json.loads(paths.trainer_step(step).read_text())
        n_tok = out.num_tokens
        assert rep["loss_kind"] == "gspo"
        assert rep["loss"] == pytest.approx(out.loss_sum.item() / norm, rel=1e-4, abs=1e-6)
        assert rep["mismatch_kl"] == pytest.approx(out.mismatch_kl_sum.item() / n_tok, rel=1e-4, abs=1e-7)
        m = rep["loss_metrics"]
        assert m["clipped_frac"] == pytest.approx(out.metrics["clipped_tokens"].item() / n_tok, abs=1e-9)
        assert m["age_mean"] == pytest.approx(out.metrics["age_sum"].item() / n_tok, abs=1e-9)
        assert m["age_weight_mean"] == pytest.approx(out.metrics["age_weight_sum"].item() / n_tok, rel=1e-9)
        for k, v in ratio_quantiles(out.ratios).items():
            assert m[k] == pytest.approx(v, rel=1e-4), k
        if step == 1:
            assert m["age_mean"] > 0 and m["age_weight_mean"] < 1
    got = to_hf_state_dict(load_hf_state_dict(version_dir(paths.weights, 2)), cfg.model)
    for k, v in to_hf_state_dict(model.state_dict(), cfg.model).items():
        # 1e-4 = 1% of one Adam step (lr 1e-2): Adam's first update lr*g/(|g|+1e-8) amplifies float32 differences in
        # the summation order of FSDP's gradient reduction on elements whose gradient is near 1e-8 (observed up to
        # 6e-5 on single elements; the reported losses and metrics agree to 1e-4 relative)
        torch.testing.assert_close(got[k], v, atol=1e-4, rtol=1e-4, msg=k)
