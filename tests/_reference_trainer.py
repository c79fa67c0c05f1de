"""Shared by the RL trainer tests: the single-process fp32 reference of the trainer's steps (compared with a real run,
sharded, micro-batched or chunked, through ``_tolerance.assert_train_run_close``) and a run of the real trainer
process under ``torchrun``."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from _tolerance import decoder_chain, train_step_bounds


def spread_router_model(model_cfg, seed: int = 0):
    """``GlmMoeForCausalLM(model_cfg)`` built after ``torch.manual_seed(seed)``, its router weights redrawn from
    N(0, 1): spread router scores, so that no sample's top-k choice is a near tie that another summation order
    could flip."""
    from moe_rl.models import GlmMoeForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(model_cfg)
    with torch.no_grad():
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.router.weight.normal_(0.0, 1.0)
    return model


def reference_steps(cfg, model, batches) -> tuple[list[dict], dict]:
    """Train ``model`` (fp32, one process, the whole unpadded batch at once) on ``batches`` with the run's loss,
    optimiser and schedule (``cfg``: an ``RLConfig``), replaying the batches' routed experts.

    Returns:
        Per step the report's values (``loss``, ``mismatch_kl``, ``masked_frac``, ``grad_norm``, ``lr``, ``tokens``,
        ``loss_tokens``, ``loss_metrics``), the error ``bounds`` of :func:`train_step_bounds`, ``chain_tokens`` and
        the ``grads`` after the clip; then the final parameters.
    """
    from moe_rl.replay import model_replay_ids
    from moe_rl.rl.loss import compute_loss, loss_normalizer, ratio_quantiles
    from moe_rl.runtime.trainer.step import token_logprobs

    o, lcfg = cfg.trainer.optim, cfg.trainer.loss
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, o.warmup_steps)))
    moe_layers = [layer.is_moe for layer in model.layers]
    steps = []
    for step, b in enumerate(batches):
        replay = model_replay_ids(b.routed_experts, b.routed_experts_state, moe_layers)
        logits = model(b.input_ids, replay_ids=replay)
        lp = token_logprobs(logits, b.input_ids, cfg.orchestrator.temperature)
        lp.retain_grad()
        out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, step)
        norm = loss_normalizer(lcfg, b.loss_mask)
        (out.loss_sum / norm).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        n = out.num_tokens
        k, depth = decoder_chain(cfg.model, b.input_ids.numel())
        steps.append({
            "bounds": train_step_bounds(lp, logits, out, k=k, depth=2 * depth), "chain_tokens": b.input_ids.numel(),
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
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        })
        opt.step()
        sched.step()
        opt.zero_grad()
    return steps, {name: v.detach().clone() for name, v in model.state_dict().items()}


def write_run_inputs(cfg, state_dict, batches) -> None:
    """Write what a trainer process reads from the run folder ``cfg.output_dir`` (an ``RLConfig``; the folder exists):
    ``config.json``, ``state_dict`` (``GlmMoeForCausalLM`` names, fp32) published as weight version 0, and
    ``batches`` (one per step)."""
    from moe_rl.models.glm4_moe import to_hf_state_dict
    from moe_rl.rl.batch import write_batch
    from moe_rl.runtime.run_dir import RunPaths
    from moe_rl.weights.filesystem import WeightPublisher

    paths = RunPaths(cfg.output_dir)
    (cfg.output_dir / "config.json").write_text(cfg.model_dump_json())
    WeightPublisher(paths.weights, cfg.model.to_hf_config_dict(torch_dtype="float32")).publish(
        to_hf_state_dict(state_dict, cfg.model), 0)
    for b in batches:
        write_batch(b, paths.batches)


def run_trainer_process(cfg, batches):
    """Run the RL trainer process (``moe_rl.runtime.trainer.rl_trainer``) under ``torchrun`` on
    ``cfg.trainer.nproc_per_node`` gloo ranks in the run folder ``cfg.output_dir``: writes ``config.json``, version 0
    (``GlmMoeForCausalLM(cfg.model)`` built after ``torch.manual_seed(0)``) and ``batches``, then waits for the
    trainer and asserts it exited 0. Returns the run's ``RunPaths``. A test that calls it is ``multirank``."""
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.runtime.run_dir import RunPaths

    paths = RunPaths(cfg.output_dir)
    torch.manual_seed(0)
    write_run_inputs(cfg, GlmMoeForCausalLM(cfg.model).state_dict(), batches)
    paths.trainer.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={cfg.trainer.nproc_per_node}", "-m", "moe_rl.runtime.trainer.rl_trainer",
         "--run-dir", str(cfg.output_dir)],
        env={**os.environ, "OMP_NUM_THREADS": os.environ["MOE_RL_TEST_THREADS"]}, capture_output=True, text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return paths
