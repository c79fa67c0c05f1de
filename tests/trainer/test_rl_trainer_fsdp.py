"""The real RL trainer under torchrun (2 gloo ranks, FSDP2) equals a single-process reference:
same per-step loss/mismatch_kl and the same published weights after 2 optimizer steps (fp32)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from moe_rl.inference.weights import WeightPublisher, is_published, version_dir
from moe_rl.models import GlmMoeForCausalLM
from moe_rl.models.glm4_moe import load_hf_state_dict, to_hf_state_dict
from moe_rl.rl.batch import build_batch, write_batch
from moe_rl.rl.buffer import RolloutGroup, Sample
from moe_rl.rl.loss import dppo_kl_loss
from moe_rl.runtime.config import RLConfig
from moe_rl.runtime.run_dir import RunPaths
from moe_rl.runtime.trainer.rl_trainer import token_logprobs

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
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, o.warmup_steps)))
    stats = []
    for b in batches:
        lp = token_logprobs(model(b.input_ids), b.input_ids, cfg.orchestrator.temperature)
        out = dppo_kl_loss(lp, b.inference_logprobs, b.advantages, b.loss_mask, cfg.trainer.loss)
        (out.loss_sum / out.num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        stats.append({"loss": out.loss_sum.item() / out.num_tokens,
                      "mismatch_kl": out.mismatch_kl_sum.item() / out.num_tokens})
    return to_hf_state_dict(model.state_dict(), cfg.model), stats


def test_torchrun_fsdp2_trainer_matches_single_process(tmp_path):
    cfg = RLConfig(output_dir=tmp_path, max_steps=2,
                   orchestrator={"batch_size": 16, "group_size": 4},
                   trainer={"nproc_per_node": 2, "optim": {"lr": 1e-2, "warmup_steps": 0}})
    paths = RunPaths(tmp_path)
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    torch.manual_seed(0)
    init = GlmMoeForCausalLM(cfg.model)
    WeightPublisher(paths.weights, cfg.model.to_hf_config_dict(torch_dtype="float32")).publish(
        to_hf_state_dict(init.state_dict(), cfg.model), 0)
    batches = [build_batch(_random_groups(s, 4, 4, cfg.model.vocab_size), s, pad_id=0) for s in range(2)]
    for b in batches:
        write_batch(b, paths.batches)
    paths.trainer.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "moe_rl.runtime.trainer.rl_trainer", "--run-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert is_published(paths.weights, 1) and is_published(paths.weights, 2)
    ref_sd, ref_stats = _reference(cfg, paths, batches)
    got = load_hf_state_dict(version_dir(paths.weights, 2))
    got_hf = to_hf_state_dict(got, cfg.model)
    assert set(got_hf) == set(ref_sd)
    for k, v in ref_sd.items():
        torch.testing.assert_close(got_hf[k], v, atol=2e-5, rtol=1e-4, msg=k)
    for step, ref in enumerate(ref_stats):
        rep = json.loads(paths.trainer_step(step).read_text())
        assert rep["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
        assert rep["mismatch_kl"] == pytest.approx(ref["mismatch_kl"], rel=1e-4, abs=1e-7)
