"""The trainer of a cluster run: ``torchrun ... -m moe_rl.entrypoints.cluster_trainer --config CLUSTER_JSON --run-dir DIR``.

Started by the Slurm job ``moe-rl cluster`` renders (one ``torchrun`` per trainer node, :mod:`moe_rl.launch.plan`);
it speaks the same file protocol with the orchestrator as the one-machine trainer (:mod:`moe_rl.runtime.trainer.rl_trainer`):
batch ``DIR/batches/step_<n>.safetensors`` in, version ``n + 1`` out through ``weights.kind`` (announced in
``DIR/weights/announce/step_<n+1>.json``) and the step report ``DIR/trainer/step_<n>.json``.

Start-up on every rank (``ClusterConfig``: ``model``, ``trainer``, ``orchestrator.temperature``, ``weights``):

1. process group: NCCL on CUDA (device ``cuda:LOCAL_RANK``), gloo on CPU; the layout is
   ``trainer.parallel_dims(cluster.gpus_per_node)`` and must cover the world exactly;
2. the model (``glm_moe_dsa``: GLM-5/5.1, ``glm4_moe``: GLM-4.5, ``deepseek_v3``: DeepSeek-V3 / Kimi-K2,
   ``nemotron_h``: Nemotron-3 hybrid Mamba-2 / attention / latent MoE) is built on the meta device (no memory) with
   ``torch._grouped_mm`` routed experts (the per-expert loop for an fp32 trainer on CUDA, where grouped_mm is
   bf16-only), optionally converted to FP8 linears and grouped experts (``trainer.fp8``; under ``ep > 1`` the FP8
   experts become FP8 local experts), parallelized in ``trainer.dtype`` (bf16: FSDP2 mixed precision with fp32
   master weights, optimizer state and gradient reduction, :func:`moe_rl.runtime.trainer.step.apply_trainer_parallelism`;
   a 1-rank run takes the same path on a 1-rank mesh)
   (:func:`moe_rl.distributed.parallelize.parallelize_model`: EP x CP x FSDP2, CP attention
   ``dsa_allgather`` for GLM-5 and ``ring`` for GLM-4.5, DeepSeek-V3 (dense MLA; the family's parallelize is
   :func:`moe_rl.models.deepseek_v3.parallelize_deepseek_v3`) and Nemotron-H (GQA layers; its Mamba-2 layers pass
   their state between CP ranks, so its tokens are split in the contiguous layout, ``model.cp_layout``:
   :func:`moe_rl.models.nemotron_h.parallelize_nemotron_h`), full activation checkpointing when
   ``trainer.activation_checkpointing = "full"``), materialised with ``to_empty`` and filled from the sharded HF
   checkpoint ``model.trainer_checkpoint``, each rank reading only the slices it holds
   (:func:`moe_rl.models.sharded_load.load_sharded_hf_checkpoint`);
3. AdamW (``trainer.optim``), wrapped by :class:`moe_rl.distributed.optim_offload.OffloadedOptimizer` when
   ``trainer.optimizer_offload`` (moments in host memory between steps).

The start-up log line and the first step report carry ``dtype``, ``experts_backend`` and ``fp8_param_fraction``
(:func:`moe_rl.moe.fp8_parameter_fraction`: FP8-run parameters over all, global counts).

Per step: :func:`moe_rl.runtime.trainer.step.train_step` (rows per data rank, columns per CP rank, the off-policy loss
``trainer.loss`` over the global batch, head + log-probs in chunks of ``trainer.loss_chunk_tokens`` tokens), then
the weights in ``weights.dtype`` (bf16) through ``weights.kind`` (:mod:`moe_rl.weights`):

- ``filesystem``: every rank writes only its own shards (:class:`moe_rl.weights.filesystem.ShardedFilesystemPublisher`,
  no gather); with ``weights.quantize_fp8`` (an FP8 engine: 128x128 block FP8 in the DeepSeek-V3 checkpoint format)
  :func:`moe_rl.weights.streaming.publish_model_streaming` instead gathers one tensor at a time and rank 0 streams
  a Hugging Face folder (FP8 blocks are cut from whole tensors);
- ``broadcast``: every rank sends its own pieces over its own group with the engine workers
  (:class:`moe_rl.weights.broadcast.ShardedBroadcastPublisher`, NCCL on GPUs); the final version is also written
  as a sharded folder;
- ``p2p``: every rank snapshots its own pieces to host memory (its whole blocking time) and serves them from a
  thread; the engine workers pull the pieces they need from the owning ranks (:class:`moe_rl.weights.p2p.P2PPublisher`,
  gloo point-to-point over TCP: NIXL / Mooncake TransferEngine would be the RDMA path and are not implemented); the
  final version is also written as a sharded folder.

Rank 0 announces every version; the step report holds ``weight_update`` (the slowest rank's blocking seconds, the
bytes of all ranks).

Limits (stated, not hidden): FP8 on the wire needs the filesystem transport (``runtime.checks``); the
FP8 streaming path gathers one tensor at a time, not overlapped with the write.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.runtime.checks import check_trainer_supported

__all__ = ["build_cluster_trainer", "check_fresh_trainer_dir", "checkpoint_dir", "main", "train"]


def checkpoint_dir(ref: str, field: str = "model.trainer_checkpoint") -> Path:
    """A local folder for ``ref``: the path itself, or (a Hugging Face id) its snapshot in the HF cache
    (safetensors, JSON and tokenizer files).

    Raises:
        ValueError: ``ref`` looks like a path (starts with ``/``, ``.`` or ``~``) but is not a folder.
        ImportError: ``ref`` is a hub id and ``huggingface_hub`` is not installed.
    """
    p = Path(ref).expanduser()
    if p.is_dir():
        return p
    if ref.startswith(("/", ".", "~")):
        raise ValueError(f"{field}={ref!r} is not a folder; give the checkpoint folder (config.json + safetensors) "
                         "or a Hugging Face id like 'zai-org/GLM-5.1'")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ImportError(f"{field}={ref!r} is not a local folder and huggingface_hub is not installed to download "
                          "it: pip install huggingface_hub, or point the config at a local copy") from exc
    return Path(snapshot_download(ref, allow_patterns=["*.safetensors", "*.json", "tokenizer*", "*.model"]))


def check_fresh_trainer_dir(run_dir: Path) -> None:
    """Refuse a run directory that already holds trainer output (``trainer/step_*.json`` or a ``weights/step_<v>``
    folder with ``v >= 1``): the trainer would train a stale batch and then fail to publish an existing version.
    (``batches/`` is not checked: the orchestrator may write batch 0 before the trainer has loaded the model.)

    Raises:
        ValueError: naming what was found and the fix.
    """
    from moe_rl.runtime.run_dir import RunPaths

    paths = RunPaths(run_dir)
    found = sorted(p.name for p in paths.trainer.glob("step_*.json")) if paths.trainer.is_dir() else []
    if paths.weights.is_dir():
        found += sorted(p.name for p in paths.weights.iterdir()
                        if p.name.startswith("step_") and p.name.removeprefix("step_").split(".")[0].isdigit()
                        and int(p.name.removeprefix("step_").split(".")[0]) >= 1)
    if found:
        raise ValueError(f"--run-dir {str(run_dir)!r} already holds trainer output of an earlier run ({found[:4]}"
                         f"{' ...' if len(found) > 4 else ''}); start every run in a fresh run directory")


def pad_id_of(cfg: Any) -> int:
    """The padding id of the run's task tokenizer (what the orchestrator pads batches with); loads only the
    tokenizer (``cluster_orchestrator.build_tokenizer``), never the inference checkpoint's weights."""
    from moe_rl.entrypoints.cluster_orchestrator import build_tokenizer

    return int(build_tokenizer(cfg).pad_id)


def build_cluster_trainer(cfg: Any, device: torch.device) -> tuple[Any, dict]:
    """Steps 2-3 of the module docstring on this rank (a collective: every rank calls it).

    Returns:
        ``(state, info)``: the :class:`moe_rl.runtime.trainer.step.TrainerState` and start-up facts for the log
        (``fp8`` conversion counts, ``load`` statistics of this rank, ``dims``).

    Raises:
        ValueError: an unsupported architecture or weight transport, or a world size that differs from the layout.
    """
    from moe_rl.models.sharded_load import build_on_meta, load_sharded_hf_checkpoint
    from moe_rl.runtime.trainer.step import (
        StepSettings,
        TrainerState,
        apply_trainer_parallelism,
        make_optimizer,
        resolve_experts_backend,
    )

    check_trainer_supported(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    t = cfg.trainer
    dims = t.parallel_dims(cfg.cluster.gpus_per_node)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world != dims.world_size:
        raise ValueError(f"the trainer runs on {world} ranks but the layout {dims!r} (trainer.num_nodes="
                         f"{t.num_nodes} x cluster.gpus_per_node={cfg.cluster.gpus_per_node}) needs "
                         f"{dims.world_size}; launch torchrun with --nnodes trainer.num_nodes --nproc-per-node "
                         "cluster.gpus_per_node")
    mcfg = cfg.model.model_config_obj()
    backend = resolve_experts_backend("grouped_mm", mcfg, t.dtype, device.type, field="experts backend")
    info: dict[str, Any] = {"dims": repr(dims), "dtype": t.dtype, "experts_backend": backend}
    model = build_on_meta(mcfg)
    model.set_experts_backend(backend)
    if t.fp8:
        from moe_rl.fp8 import Fp8Config
        from moe_rl.moe.fp8_convert import convert_model_to_fp8

        # FP8 linears and experts; under EP the experts become FP8 LocalExperts (ExpertParallelMoE.from_full)
        info["fp8"] = convert_model_to_fp8(model, Fp8Config(enabled=True))
    from moe_rl.models import GlmMoeDsaForCausalLM

    mesh = apply_trainer_parallelism(
        model, dims, dtype=t.dtype, device_type=device.type,
        cp_method="dsa_allgather" if isinstance(model, GlmMoeDsaForCausalLM) else "ring",
        activation_checkpointing=t.activation_checkpointing == "full")
    from moe_rl.moe.fp8_convert import fp8_parameter_fraction

    info["fp8_param_fraction"] = fp8_parameter_fraction(model)
    model.to_empty(device=device)
    stats = load_sharded_hf_checkpoint(model, checkpoint_dir(cfg.model.trainer_checkpoint), mcfg, device=device)
    info["load"] = dataclasses.asdict(stats)
    model.train()
    opt, sched = make_optimizer(model, t.optim)
    if t.optimizer_offload:
        from moe_rl.distributed.optim_offload import OffloadedOptimizer

        opt = OffloadedOptimizer(opt)
    settings = StepSettings(loss=t.loss, max_grad_norm=t.optim.max_grad_norm,
                            temperature=cfg.orchestrator.temperature, pad_id=pad_id_of(cfg),
                            router_replay=t.router_replay, loss_chunk_tokens=t.loss_chunk_tokens,
                            micro_batch=t.micro_batch)
    start = {k: info[k] for k in ("dtype", "experts_backend", "fp8_param_fraction")}
    return TrainerState(settings, model, opt, sched, dims, mesh, rank, world, start), info


def _publish_setup(cfg: Any, mcfg: Any) -> tuple[dict, list[Path]]:
    """The ``config.json`` dict of every version and the tokenizer files copied beside the weights."""
    hf_config = mcfg.to_hf_config_dict(torch_dtype=cfg.weights.dtype)
    if cfg.weights.quantize_fp8:
        from moe_rl.weights.fp8 import fp8_quantization_config

        hf_config["quantization_config"] = fp8_quantization_config()
    src = checkpoint_dir(cfg.model.trainer_checkpoint)
    extra = sorted(p for p in src.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))
    return hf_config, extra


class _Publish:
    """``weights.kind`` on this rank: ``publish(model, version) -> UpdateStats`` (rank 0 announces), ``close()``."""

    def __init__(self, cfg: Any, mcfg: Any, paths: Any) -> None:
        import socket

        from moe_rl.weights.filesystem import ShardedFilesystemPublisher

        self.cfg, self.mcfg, self.paths = cfg, mcfg, paths
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.hf_config, self.extra = _publish_setup(cfg, mcfg)
        self.dtype = getattr(torch, cfg.weights.dtype)
        self.sharded = ShardedFilesystemPublisher(paths.weights, self.hf_config, self.extra, mcfg=mcfg,
                                                  dtype=self.dtype,
                                                  delta=cfg.weights.delta if cfg.weights.kind == "filesystem" else None)
        self.broadcast = None
        if cfg.weights.kind == "broadcast":
            from moe_rl.weights.broadcast import BroadcastTransportConfig, ShardedBroadcastPublisher

            workers = sum(g.replicas * g.nodes_per_replica * cfg.cluster.gpus_per_node
                          for _, g in cfg.inference.groups())
            bcfg = BroadcastTransportConfig(host=socket.gethostname(), engine_workers=workers,
                                            backend="nccl" if torch.cuda.is_available() else "gloo",
                                            timeout_s=cfg.weights.broadcast_timeout_s,
                                            bucket_bytes=cfg.weights.bucket_bytes)
            # returns once every engine worker joined (the orchestrator connects them when the group file appears)
            self.broadcast = ShardedBroadcastPublisher(paths.weights, bcfg, mcfg=mcfg, dtype=self.dtype,
                                                       delta=cfg.weights.delta)
        self.p2p = None
        if cfg.weights.kind == "p2p":
            from moe_rl.weights.p2p import P2PTransportConfig
            from moe_rl.weights.p2p_nixl import p2p_publisher

            workers = sum(g.replicas * g.nodes_per_replica * cfg.cluster.gpus_per_node
                          for _, g in cfg.inference.groups())
            pcfg = P2PTransportConfig(host=socket.gethostname(), engine_workers=workers,
                                      timeout_s=cfg.weights.broadcast_timeout_s,
                                      keep_versions=cfg.weights.keep_versions, bucket_bytes=cfg.weights.bucket_bytes,
                                      backend=cfg.weights.p2p_backend)
            # does not wait for the engines: each rank's server thread forms its group when the workers join
            self.p2p = p2p_publisher(paths.weights, pcfg, mcfg=mcfg, dtype=self.dtype, delta=cfg.weights.delta)

    def __call__(self, model: Any, version: int) -> Any:
        from moe_rl.weights.announce import write_announcement
        from moe_rl.weights.protocol import UpdateStats

        t0 = time.perf_counter()
        kw: dict[str, Any] = {}
        if self.broadcast is not None:
            if self.rank == 0:  # first: the orchestrator starts the engines' receive when it sees it
                write_announcement(self.paths.weights, version, "broadcast",
                                   filesystem_copy=version == self.cfg.max_steps)
            upd = self.broadcast.publish(model, version)
            upd.extra["source"] = "broadcast"
            if version == self.cfg.max_steps:  # the run's output checkpoint
                self.sharded.publish(model, version)
            upd.blocking_s = time.perf_counter() - t0
            return upd
        if self.p2p is not None:
            from moe_rl.weights.filesystem import version_dir
            from moe_rl.weights.regions import local_pieces

            final = version == self.cfg.max_steps
            source: Any = model  # the publisher cuts it with its reused cut (PieceCutter)
            if final:  # the run's output checkpoint, complete before the announcement that names it
                source = list(local_pieces(model, self.mcfg, self.dtype))
                self.sharded.publish(source, version)
            kw = dict(filesystem_copy=final, path=str(version_dir(self.paths.weights, version)) if final else None,
                      layout="sharded" if final else None)

            def announce(st: Any) -> None:  # rank 0's index thread, once every rank's part and the index are in
                write_announcement(self.paths.weights, version, "p2p", stats=st.as_dict(), **kw)

            # a snapshot: the CRCs, the index and the announcement follow on the publisher's index thread, and the
            # engines pull while the next step runs
            upd = self.p2p.publish(source, version, on_ready=announce if self.rank == 0 else (lambda _st: None))
            upd.extra["source"] = "p2p"
            upd.blocking_s = time.perf_counter() - t0
            return upd
        if self.cfg.weights.quantize_fp8:
            from moe_rl.weights.streaming import publish_model_streaming

            # a collective: tensors gathered one at a time, rank 0 streams them into an FP8 Hugging Face folder
            rep = publish_model_streaming(model, self.mcfg, self.paths.weights, version, self.hf_config, self.extra,
                                          dtype=self.dtype, quantize_fp8=True)
            upd = UpdateStats(version, "filesystem", bytes=int(rep["bytes"]) if rep else 0,
                              bytes_total=int(rep["bytes"]) if rep else 0, tensors=int(rep["tensors"]) if rep else 0,
                              extra={"source": "filesystem", "path": rep["path"] if rep else None})
            kw = {"layout": "hf"}
        else:
            upd = self.sharded.publish(model, version)
            upd.extra["source"] = "filesystem"
            kw = {"layout": "sharded"}
        upd.blocking_s = time.perf_counter() - t0
        if self.rank == 0:
            write_announcement(self.paths.weights, version, "filesystem", filesystem_copy=True,
                               path=upd.extra["path"], stats=upd.as_dict(), **kw)
        return upd

    def close(self) -> None:
        if self.broadcast is not None:
            self.broadcast.close()
        if self.p2p is not None:
            self.p2p.close()


def train(cfg: Any, run_dir: Path) -> None:
    """Run ``cfg.max_steps`` steps (see the module docstring); a collective over the default process group."""
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.runtime.run_dir import RunPaths
    from moe_rl.runtime.trainer.rl_trainer import record_step
    from moe_rl.runtime.trainer.step import train_step

    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(cfg.seed + rank)
    paths = RunPaths(run_dir)
    paths.trainer.mkdir(parents=True, exist_ok=True)
    (paths.trainer / f"rank_{rank}.pid").write_text(str(os.getpid()))
    st, info = build_cluster_trainer(cfg, device)
    mcfg = cfg.model.model_config_obj()
    if rank == 0:
        print(f"cluster trainer: {info}", flush=True)
    published: dict[str, Any] = {"mode": cfg.weights.kind, "versions": 0, "bytes": 0, "seconds": 0.0}
    publish = _Publish(cfg, mcfg, paths)

    def transport_stats(total_bytes: int, publish_s: float, upd: Any) -> dict:  # rank 0, once per step
        published.update(versions=published["versions"] + 1, bytes=published["bytes"] + total_bytes,
                         seconds=published["seconds"] + publish_s, last=upd.as_dict())
        return dict(published)

    for step in range(cfg.max_steps):
        t_wait = time.perf_counter()
        path = batch_path(paths.batches, step)
        poll = 0.01
        while not path.exists():  # every rank polls; backing off to 1 s keeps the shared filesystem's load low
            time.sleep(poll)
            poll = min(1.0, poll * 1.5)
        idle_s = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        report = train_step(st, read_batch(path), step)
        compute_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        upd = publish(st.model, step + 1)  # a collective; rank 0 announces the version
        publish_s = time.perf_counter() - t1
        record_step(st, step, report, upd, paths, idle_s=idle_s, compute_s=compute_s, publish_s=publish_s,
                    transport_stats=transport_stats, device=device)
    publish.close()
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    """Entry point (run under torchrun)."""
    from moe_rl.launch.config import ClusterConfig

    parser = argparse.ArgumentParser(description="moe_rl cluster trainer (launch with torchrun)")
    parser.add_argument("--config", required=True, type=Path, help="configs/cluster.json of the run")
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory (shared filesystem)")
    args = parser.parse_args(argv)
    cfg = ClusterConfig.model_validate_json(args.config.read_text())
    check_trainer_supported(cfg, "cuda" if torch.cuda.is_available() else "cpu")  # before any collective: every rank exits with the same message
    check_fresh_trainer_dir(args.run_dir)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # generous: ranks wait in collectives while rank 0 writes a version (prime-rl uses 7200 s for GLM-5)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.trainer.dist_timeout_s))
    try:
        train(cfg, args.run_dir)
    finally:
        gc.collect()  # the model's reference cycles hold its process groups: free them before the groups go
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
