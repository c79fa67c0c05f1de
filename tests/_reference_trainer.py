"""Shared by the RL trainer tests: the single-process fp32 reference of the trainer's steps (compared with a real run,
sharded, micro-batched or chunked, through ``_tolerance.assert_train_run_close``) and a run of the real trainer
process under ``torchrun``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from _tolerance import assert_normwise_close, decoder_chain, eps, train_step_bounds

PARALLEL_TRAINER_WORKER = Path(__file__).with_name("trainer") / "_parallel_trainer_worker.py"


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


def sampling_mask_batch(cfg, seed: int, kept_of: Callable):
    """A ``TrainingBatch`` of one group of four samples (prompt/completion lengths (4, 3), (6, 5), (3, 2), (2, 6)) with
    random tokens in ``[3, vocab)``, log-probs in ``(-2, 0]`` and rewards, drawn from ``np.random.default_rng(seed)``.
    Sample ``k``'s kept sets are ``kept_of(rng, k, c, vocab) -> bool [c, vocab]`` with each sampled token added;
    sample 2 carries no record (the whole vocabulary)."""
    import numpy as np

    from moe_rl.rl.batch import build_batch
    from moe_rl.rl.buffer import RolloutGroup, Sample
    from moe_rl.rl.sampling_mask import encode_kept

    v = cfg.model.vocab_size
    rng = np.random.default_rng(seed)
    samples = []
    for k, (p, c) in enumerate([(4, 3), (6, 5), (3, 2), (2, 6)]):
        prompt = [1] + rng.integers(3, v, size=p - 1).tolist()
        comp = rng.integers(3, v, size=c).tolist()
        kept = kept_of(rng, k, c, v)
        kept[np.arange(c), comp] = True  # the sampled token is always in its kept set
        samples.append(Sample(prompt, comp, (-rng.random(c) * 2.0).tolist(), reward=float(rng.random()),
                              sampling_mask=None if k == 2 else encode_kept(kept)))
    return build_batch([RolloutGroup(0, 0, "s", samples)], 0, pad_id=cfg.pad_id)


def sampling_mask_reference(cfg, init: dict, b) -> dict:
    """One fp32 forward + backward of ``GlmMoeForCausalLM(cfg.model)`` (state ``init``) on the padded batch ``b``,
    log-probs renormalised over each position's kept set (``masked_logprobs`` over ``dense_keep`` of the batch's
    sampling masks). Returns ``{"loss", "bounds": train_step_bounds(...), "tokens", "grads": {name: grad}}``."""
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


def launch_one_step_scenarios(root: Path, scenarios: Iterable[str], prepare: Callable, launch_ranks: Callable,
                              world: int, timeout_s: float = 300) -> tuple[Path, dict, dict[int, dict]]:
    """Run one trainer step per scenario on ``world`` gloo ranks (``trainer/_parallel_trainer_worker.py``).

    ``prepare(name, folder) -> (cfg, init, batch)`` builds each scenario's ``RLConfig`` (``output_dir=folder``),
    initial state dict and batch; they are written to ``root/<name>`` (:func:`write_run_inputs`) and all scenarios
    run in one launch. Returns ``(root, {name: (cfg, init, batch)}, {rank: report})``, the form
    ``_ranks.scenario_result`` reads.
    """
    prepared = {}
    for name in scenarios:
        folder = root / name
        folder.mkdir()
        cfg, init, b = prepared[name] = prepare(name, folder)
        write_run_inputs(cfg, init, [b])
    return root, prepared, launch_ranks(PARALLEL_TRAINER_WORKER, world, root, timeout_s)


def assert_step_matches_reference(got: dict, ref: dict, model_cfg, what: str) -> None:
    """Rank 0's loss of a scenario's step (``got``: its ``result.pt``) is within the reference's bound
    (``ref["bounds"]["loss"]`` plus one fp32 rounding), and every gradient matches ``ref["grads"]`` norm-wise
    (``assert_normwise_close`` with the backward decoder chain of ``ref["tokens"]``; no clipping assumed)."""
    rep = got["reports"][0]
    assert abs(rep["loss"] - ref["loss"]) <= ref["bounds"]["loss"] + eps(torch.float32) * abs(ref["loss"])
    k, depth = decoder_chain(model_cfg, ref["tokens"], backward=True)
    for n, g in ref["grads"].items():
        assert_normwise_close(got["grads"][0][n], g, dtype=torch.float32, k=k, depth=2 * depth + 2,
                              what=f"{what} {n}")


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
