"""``moe-rl cluster ... --dry-run``: print every process's command and the resolved config, and check the trainer
layout with the memory planner, without starting anything.

Verdicts (:class:`DryRun`): ``errors`` make the command exit 1 (the layout does not fit in GPU or host memory, or the
entry points would refuse the config's settings at start-up -- an architecture the trainer cannot build is a
warning instead, because the Kimi-K2 / Nemotron-3 recipes are checked as plans; the
message carries the planner's table and the nearest layouts that do fit), ``warnings`` are printed and do not
(memory not modelled for the architecture beyond its parameter state; an entry point the plan runs that this checkout
does not have yet). Config validation errors happen earlier, at load time (exit 2).

Memory check, modelled architectures (GLM-5 / GLM-4.5): :func:`moe_rl.distributed.memory.plan_memory` on the
trainer's :class:`ParallelDims` (bf16 compute, fp32 master weights, the recipe's checkpointing, optimizer offload and
loss chunk), against ``cluster.gpu_memory_gb`` with ``trainer.reserve_gib`` kept free. FP8 training is not modelled
(the plan is the bf16 run's). Published-only architectures: the parameter state alone, ``(4 + 4 + 8) B`` per
parameter (fp32 weights, gradients, AdamW moments; ``8`` dropped with optimizer offload) over ``dp_shard * cp``
GPUs: a strict lower bound of the peak, an error when even it does not fit.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.engines import kv_transfer_config
from moe_rl.launch.plan import LaunchPlan, build_plan

__all__ = ["DryRun", "dry_run", "trainer_memory_plan"]

GiB = 1024**3


@dataclass
class DryRun:
    """What ``--dry-run`` found."""

    plan: LaunchPlan
    text: str
    """Everything printed (processes, resolved config, memory plan, verdict)."""
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    memory_plan: object | None = None
    """The trainer's :class:`moe_rl.distributed.memory.MemoryPlan` (modelled architectures)."""
    state_lower_bound_bytes: float | None = None
    """Published-only architectures: parameter-state bytes per GPU."""

    @property
    def ok(self) -> bool:
        return not self.errors


def trainer_memory_plan(cfg: ClusterConfig, **changes):
    """The planner's per-GPU plan of ``cfg``'s trainer (``changes`` override ``TrainerLayout`` fields, e.g.
    ``cp=8``), or None for an architecture the planner does not model.

    Raises:
        ValueError: the changed layout is invalid (``ParallelDims`` / ``plan_memory`` rules).
    """
    from moe_rl.distributed.memory import plan_memory

    model = cfg.model.model_config_obj()
    if model is None:
        return None
    t = cfg.trainer.model_copy(update=changes)
    plan = plan_memory(model, t.parallel_dims(cfg.cluster.gpus_per_node), t.seq_len, t.micro_batch, "bf16",
                       t.activation_checkpointing, t.optimizer_offload, loss_chunk_tokens=t.loss_chunk_tokens)
    plan.reserve_bytes = t.reserve_gib * GiB
    return plan


def _alternatives(cfg: ClusterConfig, gpu_bytes: float) -> list[str]:
    """Nearby trainer layouts that fit, with their margins."""
    t, out = cfg.trainer, []
    candidates: list[tuple[str, dict]] = [(f"trainer.cp={t.cp * 2}", {"cp": t.cp * 2})]
    if not t.optimizer_offload:
        candidates.append(("trainer.optimizer_offload=true", {"optimizer_offload": True}))
    for extra in range(1, cfg.inference.nodes):
        candidates.append((f"trainer.num_nodes={t.num_nodes + extra} (nodes taken from inference)",
                           {"num_nodes": t.num_nodes + extra}))
    found_nodes = False
    for label, change in candidates:
        if "num_nodes" in change and found_nodes:
            continue
        try:
            plan = trainer_memory_plan(cfg, **change)
        except ValueError:
            continue
        margin = gpu_bytes - plan.peak_bytes - plan.reserve_bytes
        if margin >= 0:
            out.append(f"{label}: peak {plan.peak_bytes / GiB:.2f} GiB, margin {margin / GiB:+.2f} GiB")
            found_nodes = found_nodes or "num_nodes" in change
    return out


def _missing_entry_points(plan: LaunchPlan) -> list[str]:
    missing = []
    for p in plan.processes:
        argv = list(p.argv)
        for i, tok in enumerate(argv[:-1]):
            if tok == "-m" and argv[i + 1].startswith("moe_rl"):
                mod = argv[i + 1]
                if importlib.util.find_spec(mod) is None and mod not in missing:
                    missing.append(mod)
    return missing


def dry_run(cfg: ClusterConfig, out_dir: str | Path | None = None) -> DryRun:
    """Build the plan of ``cfg``, check it, and describe it.

    Args:
        cfg: a validated :class:`ClusterConfig`.
        out_dir: when given, writes ``job.sbatch`` (rendered), ``plan.json`` (every process: node, role, argv, env),
            ``dry_run.txt`` (the printed text) and the plan's files (``configs/*.json``) there.

    Returns:
        A :class:`DryRun`; ``ok`` is False when the layout does not fit.
    """
    plan = build_plan(cfg)
    res = DryRun(plan, "")
    lines: list[str] = []
    c, t, inf = cfg.cluster, cfg.trainer, cfg.inference
    dims = t.parallel_dims(c.gpus_per_node)
    lines.append(f"# moe-rl cluster dry run: {cfg.name}")
    lines.append(
        f"nodes: {c.num_nodes} x {c.gpus_per_node} {c.gpu_name} = trainer {t.num_nodes} + inference {inf.nodes} "
        f"({' + '.join(f'{r} {g.nodes_per_replica}x{g.replicas}' for r, g in inf.groups())})"
    )
    lines.append(f"processes: {len(plan.processes)} ("
                 + ", ".join(f"{r} {len(plan.by_role(r))}" for r in dict.fromkeys(p.role for p in plan.processes)) + ")")
    lines.append(f"trainer: dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} cp={dims.cp} ep={dims.ep} "
                 f"(world {dims.world_size}), seq_len {t.seq_len}, fp8={str(t.fp8).lower()}, AC {t.activation_checkpointing}, "
                 f"optimizer_offload={str(t.optimizer_offload).lower()}")
    for role, g in inf.groups():
        kv = kv_transfer_config(inf, role)
        lines.append(
            f"inference.{role}: {g.replicas} replica(s) x {g.nodes_per_replica} nodes, DP={g.dp_size(c.gpus_per_node)} "
            f"TP={g.tensor_parallel_size} EP={g.ep_size(c.gpus_per_node)}, all2all={g.resolved_all2all(role)}, "
            f"max_num_seqs={g.max_num_seqs}, gpu_memory_utilization={g.gpu_memory_utilization:g}, "
            f"kv_transfer={json.dumps(kv, separators=(',', ':')) if kv else 'none'}"
        )
    lines.append("node roles: " + plan.node_summary())
    lines.append("")
    lines.append("## processes (hosts are ${HOST_<node>} = line <node> of `scontrol show hostnames`)")
    for p in plan.processes:
        lines.append(f"[stage {p.stage}] {p.name}  node {p.node}  gpus {p.gpus}"
                     + (f"  ready: {p.health_url}" if p.health_url else ""))
        if p.env:
            lines.append("  env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.env.items())))
        lines.append("  $ " + shlex.join(p.argv))
    lines.append("")
    for path, content in plan.files.items():
        lines.append(f"## file ${{RUN_DIR}}/{path}")
        lines.append(content.rstrip("\n"))
        lines.append("")

    lines.append("## trainer memory (per GPU)")
    gpu_bytes = c.gpu_memory_gb * 1e9
    if cfg.model.modelled:
        mplan = trainer_memory_plan(cfg)
        res.memory_plan = mplan
        lines.append(f"plan_memory({cfg.model.architecture}, {dims.dp_replicate}x{dims.dp_shard}x{dims.cp}, ep={dims.ep}, "
                     f"seq {t.seq_len} x {t.micro_batch}, bf16, AC {t.activation_checkpointing}, optimizer_offload="
                     f"{str(t.optimizer_offload).lower()}, loss chunk {t.loss_chunk_tokens}); peak in {mplan.peak_phase}")
        lines.append(mplan.report(gpu_bytes))
        if t.fp8:
            lines.append("note: fp8=true is not modelled; this is the plan of the bf16 run")
        if not mplan.fits(gpu_bytes):
            alts = _alternatives(cfg, gpu_bytes)
            res.errors.append(
                f"the trainer layout does not fit: peak {mplan.peak_bytes / GiB:.2f} GiB + reserve "
                f"{mplan.reserve_bytes / GiB:.2f} GiB > {gpu_bytes / GiB:.2f} GiB per {c.gpu_name} (margin "
                f"{(gpu_bytes - mplan.peak_bytes - mplan.reserve_bytes) / GiB:+.2f} GiB). "
                + ("Layouts that fit: " + "; ".join(alts) if alts else "No nearby layout fits; add trainer nodes.")
            )
        optim_per_gpu = 4.0 * 2 * mplan.details["total_params"] / dims.fsdp_size
    else:
        total = float(cfg.model.total_params)  # type: ignore[arg-type]
        state = (8.0 + (0.0 if t.optimizer_offload else 8.0)) * total / dims.fsdp_size
        res.state_lower_bound_bytes = state
        reserve = t.reserve_gib * GiB
        lines.append(
            f"NOT MODELLED: the memory planner has no block model for architecture {cfg.model.architecture!r} (its "
            "activation coefficients are measured on moe_rl's GLM blocks; this architecture saves other tensors). "
            "Checked: the parameter state only, a lower bound of the peak."
        )
        lines.append(
            f"parameter state: {total / 1e9:.0f}B parameters (published: {cfg.model.source}) x "
            f"{8 + (0 if t.optimizer_offload else 8)} B / {dims.fsdp_size} GPUs = {state / GiB:.2f} GiB per GPU "
            f"(+ reserve {t.reserve_gib:.1f} GiB) of {gpu_bytes / GiB:.1f} GiB; activations and FSDP buffers NOT counted"
        )
        if state + reserve > gpu_bytes:
            res.errors.append(
                f"even the parameter state ({state / GiB:.2f} GiB per GPU) + reserve does not fit in "
                f"{gpu_bytes / GiB:.1f} GiB; add trainer nodes or turn on trainer.optimizer_offload"
            )
        else:
            res.warnings.append(
                f"memory of architecture {cfg.model.architecture!r} is checked for the parameter state only "
                f"({state / GiB:.2f} GiB per GPU); activations are not modelled, measure the first step"
            )
        optim_per_gpu = 8.0 * total / dims.fsdp_size
    if c.host_memory_gb is not None:
        host = c.host_memory_gb * 1e9
        if t.optimizer_offload:
            need = optim_per_gpu * c.gpus_per_node
            lines.append(f"trainer host memory: AdamW state {need / GiB:.1f} GiB per node of {host / GiB:.1f} GiB")
            if need > host:
                res.errors.append(f"optimizer offload needs {need / GiB:.1f} GiB of host memory per trainer node, more "
                                  f"than cluster.host_memory_gb={c.host_memory_gb}")
        if inf.kv_offload is not None:
            need = inf.kv_offload.segment_gib_per_node * GiB
            lines.append(f"inference host memory: Mooncake segment {need / GiB:.1f} GiB per node of {host / GiB:.1f} GiB")
            if need > host:
                res.errors.append(f"inference.kv_offload.segment_gib_per_node={inf.kv_offload.segment_gib_per_node} "
                                  f"exceeds cluster.host_memory_gb={c.host_memory_gb}")
    lines.append("")

    from moe_rl.runtime.checks import check_supported

    try:  # what the entry points refuse at start-up, reported before the job is submitted
        check_supported(cfg)
    except ValueError as exc:
        res.errors.append(f"the cluster entry points refuse this config: {exc}")
    if not cfg.model.modelled:
        res.warnings.append(f"the cluster trainer builds glm_moe_dsa and glm4_moe models only: a "
                            f"{cfg.model.architecture!r} job stops at trainer start-up (the plan is still checked)")
    for mod in _missing_entry_points(plan):
        res.warnings.append(f"entry point {mod} is not in this checkout: the plan is checked, but the job cannot run "
                            "until it exists")
    lines.append("## resolved config")
    lines.append(cfg.model_dump_json(indent=2))
    lines.append("")
    for w in res.warnings:
        lines.append(f"WARNING: {w}")
    for e in res.errors:
        lines.append(f"ERROR: {e}")
    lines.append(f"verdict: {'OK' if res.ok else 'FAILED'} ({len(res.errors)} errors, {len(res.warnings)} warnings)")
    res.text = "\n".join(lines) + "\n"

    if out_dir is not None:
        from moe_rl.launch.slurm import render_sbatch

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.sbatch").write_text(render_sbatch(plan))
        (out / "dry_run.txt").write_text(res.text)
        (out / "plan.json").write_text(json.dumps(
            [{"name": p.name, "role": p.role, "node": p.node, "stage": p.stage, "gpus": p.gpus, "argv": list(p.argv),
              "env": p.env, "health_url": p.health_url} for p in plan.processes], indent=2) + "\n")
        for rel, content in plan.files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(content)
    return res
