"""The RL trainer process: ``torchrun --nproc-per-node N -m moe_rl.trainer.rl_trainer --run-dir DIR``.

Each rank: FSDP2 (``fully_shard`` per decoder layer, then the root) over a 1-D mesh of all ranks (gloo on
CPU, NCCL on GPU). Per step ``n``:

1. wait for ``DIR/batches/step_<n>.safetensors`` (time spent here is the trainer's idle time);
2. take this rank's contiguous shard of samples, compute token log-probs, the off-policy loss
   (``moe_rl.rl.loss.compute_loss``, the kind set by ``trainer.loss.kind``, with the batch's per-token
   policy versions) normalised over the *global* batch (``loss_normalizer``: loss tokens, or sequences for
   GSPO), backward;
3. clip, AdamW step;
4. publish the weights as version ``n + 1`` (HF names, safetensors, ``STABLE`` marker), then write
   ``DIR/trainer/step_<n>.json`` with the step's statistics.

The trainer never waits for inference: publishing is the only synchronisation point, and the next batch
is usually on disk already.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["token_logprobs", "main"]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token.

    Args:
        logits: ``[B, L, V]`` float.
        input_ids: ``[B, L]`` int64.
        temperature: logits are divided by it (must match the sampler).

    Returns:
        ``[B, L-1]`` float32: entry ``t`` is ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``.
    """
    lp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather FSDP2-sharded parameters (a collective: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def build_fsdp_model(cfg, init_dir: Path, world_size: int, fp8=None):
    """Build the policy, load the initial HF checkpoint and apply FSDP2.

    Args:
        cfg: ``GlmMoeConfig``.
        init_dir: directory of the version-0 checkpoint.
        world_size: number of ranks (1 skips FSDP).
        fp8: ``moe_rl.fp8.Fp8Config``; when enabled, linears and experts become FP8 before ``fully_shard``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moe_rl.models import GlmMoeForCausalLM, load_hf_state_dict

    model = GlmMoeForCausalLM(cfg)
    model.load_state_dict(load_hf_state_dict(init_dir), strict=True)
    if fp8 is not None and fp8.enabled:
        from moe_rl.fp8 import convert_model_to_fp8

        print(f"fp8: {convert_model_to_fp8(model, fp8)}", flush=True)
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _reduce_loss_stats(out, global_tokens: int, norm: int, world: int) -> tuple[torch.Tensor, dict]:
    """All-reduce a shard's loss sums (a collective: every rank calls it) and gather the ratios for quantiles.

    Returns:
        ``(stats, metrics)``: ``stats = [loss_sum, mismatch_kl_sum, masked_tokens]`` summed over ranks, and
        the step's loss metrics as fractions of the global loss tokens (``masked_frac_low``,
        ``masked_frac_high``, ``clipped_frac``, ``masked_seq_frac``, ``age_masked_frac``), means
        (``age_mean``, ``age_weight_mean``) and ratio quantiles ``ratio_p01/p50/p99``.
    """
    from moe_rl.rl.loss import METRIC_KEYS, ratio_quantiles

    vec = torch.stack([out.loss_sum.detach(), out.mismatch_kl_sum, *[out.metrics[k] for k in METRIC_KEYS]])
    vec = vec.double()
    ratios = out.ratios.float()
    if world > 1:
        dist.all_reduce(vec)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, ratios)
        ratios = torch.cat(gathered)
    m = dict(zip(METRIC_KEYS, vec[2:].tolist(), strict=True))
    n = max(1, global_tokens)
    metrics = {
        "masked_frac_low": m["masked_low"] / n,
        "masked_frac_high": m["masked_high"] / n,
        "clipped_frac": m["clipped_tokens"] / n,
        "masked_seq_frac": m["masked_sequences_tokens"] / n,
        "age_masked_frac": m["age_masked_tokens"] / n,
        "age_mean": m["age_sum"] / n,
        "age_weight_mean": m["age_weight_sum"] / n,
        **ratio_quantiles(ratios),
    }
    stats = torch.stack([vec[0], vec[1], torch.tensor(m["masked_tokens"], dtype=torch.float64)])
    return stats, metrics


def train(run_dir: Path) -> None:
    from moe_rl.entrypoints.rl import RLConfig
    from moe_rl.inference.weights import WeightPublisher, version_dir
    from moe_rl.models import to_hf_state_dict
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.rl.loss import compute_loss, loss_normalizer
    from moe_rl.rl.orchestrator import RunPaths

    cfg = RLConfig.model_validate_json((run_dir / "config.json").read_text())
    tcfg = cfg.trainer
    torch.set_num_threads(tcfg.torch_threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed + rank)
    paths = RunPaths(run_dir)
    paths.trainer.mkdir(parents=True, exist_ok=True)
    (paths.trainer / f"rank_{rank}.pid").write_text(str(os.getpid()))
    model = build_fsdp_model(cfg.model, version_dir(paths.weights, 0), world, fp8=tcfg.fp8)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.optim.lr, betas=tcfg.optim.betas,
                            weight_decay=tcfg.optim.weight_decay)
    warm = max(1, tcfg.optim.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    publisher = None
    if rank == 0:
        tok_files = [p for p in version_dir(paths.weights, 0).iterdir() if p.name.startswith(("tokenizer", "special"))]
        publisher = WeightPublisher(paths.weights, cfg.model.to_hf_config_dict(torch_dtype=cfg.inference.dtype),
                                    extra_files=tok_files)
    temperature = cfg.orchestrator.temperature
    out_dtype = getattr(torch, cfg.inference.dtype)

    for step in range(cfg.max_steps):
        t_wait = time.perf_counter()
        path = batch_path(paths.batches, step)
        while not path.exists():
            time.sleep(tcfg.batch_poll_s)
        idle_s = time.perf_counter() - t_wait

        t0 = time.perf_counter()
        full = read_batch(path)
        batch = full.shard(rank, world)
        replay = None
        if tcfg.router_replay and batch.routed_experts is not None:
            from moe_rl.replay import model_replay_ids

            replay = model_replay_ids(batch.routed_experts, batch.routed_experts_state,
                                      [layer.is_moe for layer in model.layers])
        logits = model(batch.input_ids, replay_ids=replay)
        logprobs = token_logprobs(logits, batch.input_ids, temperature)
        out = compute_loss(tcfg.loss, logprobs, batch.inference_logprobs, batch.advantages, batch.loss_mask,
                           token_versions=batch.token_versions, trainer_version=step)
        global_tokens = int(full.loss_mask.sum())
        norm = loss_normalizer(tcfg.loss, full.loss_mask)
        # Normalised over the *global* batch (loss tokens; sequences for GSPO); FSDP2 averages gradients over
        # ranks, so scale by the world size to obtain the sum (gloo lacks the PREMUL_SUM that
        # set_gradient_divide_factor(1) needs).
        loss = out.loss_sum * world / norm
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.optim.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        stats, loss_metrics = _reduce_loss_stats(out, global_tokens, norm, world)
        compute_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        sd = _full_state_dict(model)
        if rank == 0:
            hf = {k: v.to(out_dtype) for k, v in to_hf_state_dict(sd, cfg.model).items()}
            publisher.publish(hf, version=step + 1)
        publish_s = time.perf_counter() - t1
        if rank == 0:
            n_tok = max(1, global_tokens)
            _atomic_json(paths.trainer_step(step), {
                "step": step,
                "loss": float(stats[0]) / norm,
                "mismatch_kl": float(stats[1]) / n_tok,
                "masked_frac": float(stats[2]) / n_tok,
                "loss_kind": tcfg.loss.kind,
                "loss_metrics": loss_metrics,
                "grad_norm": float(grad_norm),
                "lr": lr,
                "idle_s": idle_s,
                "compute_s": compute_s,
                "publish_s": publish_s,
                "tokens": int((full.input_ids != cfg.pad_id).sum()),
                "loss_tokens": global_tokens,
            })
            print(f"step {step}: loss {float(stats[0]) / norm:+.5f} mismatch_kl {float(stats[1]) / n_tok:.2e} "
                  f"grad_norm {float(grad_norm):.3f} idle {idle_s:.3f}s compute {compute_s:.3f}s "
                  f"publish {publish_s:.3f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="moe_rl RL trainer (launch with torchrun)")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    train(args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
