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
3. publish the weights as version ``n + 1`` through ``trainer.weight_transport`` (``moe_rl.weights.publisher``:
   every rank publishes only its own shards, nothing is gathered; rank 0 announces the version), then write
   ``DIR/trainer/step_<n>.json`` with the step's statistics, among them ``weight_update``: the slowest rank's
   blocking seconds and the bytes all ranks published (step 0's report also holds the start-up facts:
   ``dtype``, ``experts_backend``, ``fp8_param_fraction``);
4. every ``trainer.checkpoint_every`` steps and after the last one, before that report: the trainer's part of a
   resumable checkpoint (:func:`moe_rl.runtime.checkpoint.save_trainer_state`; the report then holds
   ``checkpoint``: step, seconds). A resumed run (``DIR/trainer/resume.json``, written by ``moe-rl rl --resume``)
   loads it first and starts at its step; that step's report holds ``resumed_from`` (every rank's state digest as
   saved and as loaded).

The trainer never waits for inference: publishing is the only synchronisation point, and the next batch
is usually on disk already.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.procs import orphaned
from moe_rl.runtime.trainer.step import token_logprobs

__all__ = ["main", "record_step", "token_logprobs", "train"]


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def record_step(
    st: Any,
    step: int,
    report: dict,
    upd: Any,
    paths: Any,
    *,
    idle_s: float,
    compute_s: float,
    publish_s: float,
    transport_stats: Callable[[int, float, Any], dict],
    device: torch.device | None = None,
) -> None:
    """Finish step ``step`` after its weights were published: a collective when a process group is initialised.

    All-reduces this rank's ``publish_s`` (max over ranks: the step's blocking seconds) and ``upd.bytes`` (sum:
    the bytes all ranks published); on rank 0 adds to ``report`` the idle / compute / publish seconds,
    ``weight_transport`` (what ``transport_stats`` returns) and ``weight_update`` (version
    ``step + 1``, transport, source, blocking seconds, bytes), plus ``st.info`` on step 0 (the start-up facts),
    writes it atomically to ``paths.trainer_step(step)`` and prints one line.

    Args:
        st: the trainer state (its ``info`` dict is read on step 0).
        step: the step index (0-based); the published version is ``step + 1``.
        report: :func:`moe_rl.runtime.trainer.step.train_step`'s report of this step (updated in place).
        upd: the publisher's ``WeightUpdate`` of this step (``bytes``, ``transport``, ``extra``).
        paths: the run's :class:`moe_rl.runtime.run_dir.RunPaths`.
        idle_s, compute_s, publish_s: this rank's seconds waiting for the batch, training, publishing.
        transport_stats: called on rank 0 as ``transport_stats(summed bytes, publish_s, upd)``; returns the run's
            weight-transport totals.
        device: where the reduced tensor lives (the process group's device; CPU by default).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    agg = torch.tensor([publish_s, float(upd.bytes)], dtype=torch.float64, device=device)
    blocking = agg[:1].clone()
    if dist.is_initialized():
        dist.all_reduce(blocking, op=dist.ReduceOp.MAX)  # the slowest rank: the step cannot go on before it
        dist.all_reduce(agg)
    if rank != 0:
        return
    total_bytes = int(agg[1].item())
    report.update(idle_s=idle_s, compute_s=compute_s, publish_s=publish_s,
                  weight_transport=transport_stats(total_bytes, publish_s, upd),
                  weight_update={"version": step + 1, "transport": upd.transport,
                                 "source": upd.extra.get("source", upd.transport),
                                 "blocking_s": float(blocking.item()), "bytes": total_bytes})
    if step == 0:  # start-up facts: dtype, experts backend, fp8_param_fraction
        report.update(st.info)
    _atomic_json(paths.trainer_step(step), report)
    print(f"step {step}: loss {report['loss']:+.5f} mismatch_kl {report['mismatch_kl']:.2e} "
          f"grad_norm {report['grad_norm']:.3f} idle {idle_s:.3f}s compute {compute_s:.3f}s "
          f"publish {publish_s:.3f}s", flush=True)


def train(run_dir: Path) -> None:
    """Run ``max_steps`` trainer steps of the run in ``run_dir`` (``config.json``, ``weights/``, ``batches/``)."""
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.runtime import checkpoint
    from moe_rl.runtime.config import RLConfig
    from moe_rl.runtime.run_dir import RunPaths
    from moe_rl.runtime.trainer.step import build_trainer, train_step
    from moe_rl.weights.filesystem import version_dir
    from moe_rl.weights.publisher import make_weight_publisher

    # torchrun starts each rank in a session of its own, so a launcher stopping torchrun's process group misses the
    # ranks when torchrun itself was killed: the ranks notice while they wait for a batch
    torchrun_pid = os.getppid()
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
    tok_files = [p for p in version_dir(paths.weights, 0).iterdir() if p.name.startswith(("tokenizer", "special"))]
    # trainer.weight_transport on every rank: sharded folders, broadcast groups, or the run's Mooncake store
    hf_config = cfg.model.to_hf_config_dict(torch_dtype=cfg.inference.dtype)
    publisher = make_weight_publisher(cfg, paths.weights, hf_config, extra_files=tok_files)
    start, resumed = 0, None
    request = checkpoint.resume_request(run_dir)
    if request is not None:  # moe-rl rl --resume: continue from the checkpoint's step (versions continue above it)
        mine = checkpoint.load_trainer_state(st, request["path"])
        start = mine["step"]
        digests: list = [None] * dist.get_world_size()
        dist.all_gather_object(digests, [mine["digest_saved"], mine["digest_loaded"]])
        resumed = {"step": start, "checkpoint": request["path"], "digests_saved": [d[0] for d in digests],
                   "digests_loaded": [d[1] for d in digests]}
        if rank == 0:
            print(f"resumed from {request['path']} at step {start} (state digests equal on every rank)", flush=True)

    for step in range(start, cfg.max_steps):
        t_wait = time.perf_counter()
        path = batch_path(paths.batches, step)
        while not publisher.agree(path.exists()):  # mooncake with several ranks: rank 0 decides for all
            publisher.serve_requests()  # mooncake: re-send a version the engine could not load, via the folder
            if orphaned(torchrun_pid):
                raise SystemExit(f"rank {rank}: torchrun (pid {torchrun_pid}) has exited; stopping this rank")
            time.sleep(tcfg.batch_poll_s)
        idle_s = time.perf_counter() - t_wait

        t0 = time.perf_counter()
        report = train_step(st, read_batch(path), step)
        compute_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        upd = publisher.publish(st.model, version=step + 1)  # every rank its own pieces; rank 0 announces
        publish_s = time.perf_counter() - t1
        if step == start and resumed is not None:
            report["resumed_from"] = resumed
        if checkpoint.checkpoint_due(step + 1, tcfg.checkpoint_every, cfg.max_steps):
            t2 = time.perf_counter()  # before the report: the launcher completes the checkpoint once it reads it
            checkpoint.save_trainer_state(st, run_dir, step + 1, hf_config=hf_config, extra_files=tok_files,
                                          mcfg=cfg.model, dtype=getattr(torch, cfg.inference.dtype))
            report["checkpoint"] = {"step": step + 1, "seconds": time.perf_counter() - t2}
        record_step(st, step, report, upd, paths, idle_s=idle_s, compute_s=compute_s, publish_s=publish_s,
                    transport_stats=lambda *_: publisher.stats())
    dist.barrier()
    publisher.close()
    # The model's and optimizer's DTensors hold the device mesh and so its process groups; FSDP2's hooks make
    # reference cycles, so without this the groups outlive destroy_process_group and are torn down during
    # interpreter shutdown, where a gloo group's threads can end in std::terminate (an intermittent SIGABRT after
    # a complete run). Release them while the runtime is intact, then destroy the groups.
    st = publisher = None  # noqa: F841 - drop the references before the collection
    gc.collect()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="moe_rl RL trainer (launch with torchrun)")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    train(args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
