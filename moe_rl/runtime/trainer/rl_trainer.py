"""The RL trainer process: ``torchrun --nproc-per-node N -m moe_rl.runtime.trainer.rl_trainer --run-dir DIR``.

Each rank builds the policy from the version-0 checkpoint and applies the library's parallelism
(:func:`moe_rl.distributed.parallelize.parallelize_model` with ``trainer.parallel``: EP x CP x FSDP2/HSDP, optional
activation checkpointing; default: FSDP2 over all N ranks), gloo on CPU. Per step ``n``:

1. wait for ``DIR/batches/step_<n>.safetensors`` (time spent here is the trainer's idle time);
2. :func:`moe_rl.runtime.trainer.step.train_step`: this rank's rows (data rank) and columns (CP rank, with positions and
   the router-replay rows sharded like ``input_ids``), token log-probs gathered over the CP group, the off-policy
   loss (``moe_rl.rl.loss.compute_loss``, the kind set by ``trainer.loss.kind``, with the batch's per-token policy
   versions) normalised over the *global* batch (``loss_normalizer``: loss tokens, or sequences for GSPO),
   backward, the EP-aware global-norm clip, AdamW step (``trainer.dtype``: fp32, or bf16 compute with fp32 master
   weights and fp32 gradient reduction);
3. publish the weights as version ``n + 1`` (full tensors gathered from the shards, HF names, safetensors,
   ``STABLE`` marker; only rank 0 writes), then write ``DIR/trainer/step_<n>.json`` with the step's statistics
   (step 0's also holds the start-up facts: ``dtype``, ``experts_backend``, ``fp8_param_fraction``).

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

from moe_rl.runtime.trainer.step import token_logprobs

__all__ = ["token_logprobs", "train", "main"]


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def train(run_dir: Path) -> None:
    """Run ``max_steps`` trainer steps of the run in ``run_dir`` (``config.json``, ``weights/``, ``batches/``)."""
    from moe_rl.inference.weights import version_dir
    from moe_rl.models.glm4_moe import to_hf_state_dict
    from moe_rl.models.hf_io import keeps_fp32
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.runtime.config import RLConfig
    from moe_rl.runtime.run_dir import RunPaths
    from moe_rl.runtime.trainer.publish import make_weight_publisher
    from moe_rl.runtime.trainer.step import build_trainer, full_state_dict, train_step

    cfg = RLConfig.model_validate_json((run_dir / "config.json").read_text())
    tcfg = cfg.trainer
    torch.set_num_threads(tcfg.torch_threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed + rank)
    paths = RunPaths(run_dir)
    paths.trainer.mkdir(parents=True, exist_ok=True)
    (paths.trainer / f"rank_{rank}.pid").write_text(str(os.getpid()))
    st = build_trainer(cfg, version_dir(paths.weights, 0))
    if rank == 0:
        frac = st.info["fp8_param_fraction"]
        print(f"trainer layout: {st.dims!r} cp_method={tcfg.parallel.cp_method} "
              f"activation_checkpointing={tcfg.parallel.activation_checkpointing} dtype={st.info['dtype']} "
              f"experts_backend={st.info['experts_backend']} fp8 parameters: {frac['fp8_params']}/"
              f"{frac['total_params']} = {frac['fraction']:.4f}", flush=True)
    publisher = None
    if rank == 0:
        tok_files = [p for p in version_dir(paths.weights, 0).iterdir() if p.name.startswith(("tokenizer", "special"))]
        # trainer.weight_transport: folders (STABLE marker) or the run's Mooncake store with a folder fallback
        publisher = make_weight_publisher(cfg, paths.weights,
                                          cfg.model.to_hf_config_dict(torch_dtype=cfg.inference.dtype),
                                          extra_files=tok_files)
    out_dtype = getattr(torch, cfg.inference.dtype)

    for step in range(cfg.max_steps):
        t_wait = time.perf_counter()
        path = batch_path(paths.batches, step)
        while not path.exists():
            if publisher is not None:
                publisher.serve_requests()  # mooncake: re-send a version the engine could not load, via the folder
            time.sleep(tcfg.batch_poll_s)
        idle_s = time.perf_counter() - t_wait

        t0 = time.perf_counter()
        report = train_step(st, read_batch(path), step)
        compute_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        sd = full_state_dict(st.model)  # a collective: every rank gathers, rank 0 writes
        if rank == 0:
            # the router bias correction stays fp32 (moe_rl.models.hf_io.keeps_fp32), as in the checkpoint
            hf = {k: v.to(torch.float32 if keeps_fp32(k) else out_dtype)
                  for k, v in to_hf_state_dict(sd, cfg.model).items()}
            publisher.publish(hf, version=step + 1)
        publish_s = time.perf_counter() - t1
        if rank == 0:
            report.update(idle_s=idle_s, compute_s=compute_s, publish_s=publish_s,
                          weight_transport=publisher.stats())
            if step == 0:  # start-up facts: dtype, experts backend, fp8_param_fraction
                report.update(st.info)
            _atomic_json(paths.trainer_step(step), report)
            print(f"step {step}: loss {report['loss']:+.5f} mismatch_kl {report['mismatch_kl']:.2e} "
                  f"grad_norm {report['grad_norm']:.3f} idle {idle_s:.3f}s compute {compute_s:.3f}s "
                  f"publish {publish_s:.3f}s", flush=True)
    dist.barrier()
    if publisher is not None:
        publisher.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="moe_rl RL trainer (launch with torchrun)")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    train(args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
