"""Resumable checkpoints of a ``moe-rl rl`` run and ``moe-rl rl --resume``.

Layout under the run directory (``n`` = trainer steps done = the policy version the engines serve after it)::

    checkpoints/step_<n>/           a complete checkpoint (only folders holding COMPLETE are ever read)
        COMPLETE                    {"step": n, "version": n}: written last, inside the temporary folder
        meta.json                   step, version, wall-clock time, the run's resolved config
        dcp/                        model + optimizer state: torch.distributed.checkpoint (each rank its own shards)
        trainer/rank_<r>.pt         this rank's scheduler state, RNG states (torch, Python) and state digest
        trainer/trainer.json        rank 0, the last file of the trainer's part: step, world size, per-rank digests
        engine/step_<n>/            the version-n weights as the engines load them (sharded folder layout,
                                    ``moe_rl.weights.filesystem``)
        orchestrator.json           rollout accounting (``moe_rl.rl.buffer.BufferCounters``), staleness histogram,
                                    data-stream position (prompt RNG state, next group id, re-queued prompts),
                                    engine-error and weight-load bookkeeping
    checkpoints/step_<n>.tmp/       being written; never read, removed by the next complete checkpoint

Who writes what (``trainer.checkpoint_every``, after every that many steps and after the last step; 0 = off):

1. the trainer ranks, right after publishing version ``n`` and before the report of step ``n - 1``:
   :func:`save_trainer_state` (a collective) fills ``step_<n>.tmp/`` with ``dcp/``, ``trainer/`` and ``engine/``;
2. the launcher, once the orchestrator has booked that report (its metrics record of step ``n - 1`` is written):
   :func:`finalize_if_due` adds ``orchestrator.json`` (the counters then hold exactly ``n`` trained batches) and
   ``meta.json``, writes ``COMPLETE``, renames the folder to ``step_<n>`` (atomic) and keeps the newest
   ``trainer.keep_checkpoints``.

A run stopped at any moment thus leaves either a complete checkpoint or a ``.tmp`` folder that is ignored.

Resume (:func:`prepare_resume`, then :func:`load_engine` and :func:`restore_orchestrator` in the launcher,
:func:`load_trainer_state` in every trainer rank): the newest complete checkpoint ``n`` is checked against the new
config (:func:`config_differences`), whatever the interrupted segment did after it is set aside (batches, trainer
reports, announcements and weight folders of versions above ``n`` removed, its metrics lines moved to
``resume_discarded.jsonl``), fresh engines load version ``n`` before serving (the vLLM worker refuses any version
``<=`` the one it serves, so versions stay strictly increasing: the next one published is ``n + 1``), the trainer
loads the sharded state and continues at step ``n``, and the orchestrator continues the accounting: rollouts that
were in flight, queued or in an untrained batch at the checkpoint are counted as dropped (reason ``"resume"``), so
``started == trained + dropped + withheld + in flight`` holds across the resume.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import json
import os
import pickle
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINTS", "COMPLETE", "MUST_MATCH", "Resume", "ResumeRefused", "checkpoint_dir", "checkpoint_due",
    "complete_checkpoints", "config_differences", "finalize", "finalize_if_due", "latest_checkpoint",
    "load_engine", "load_trainer_state", "orchestrator_state", "prepare_resume", "prune", "restore_orchestrator",
    "resume_request", "save_trainer_state", "state_digest", "tmp_dir",
]

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
FORMAT = "moe_rl.checkpoint/1"
RESUME_REQUEST = "resume.json"
"""``<run>/trainer/resume.json``: written by the launcher of a resumed run, read by every trainer rank."""
DROP_REASON = "resume"

MUST_MATCH = (
    "seed", "alphabet", "model", "task", "env", "env_args", "inference.dtype", "orchestrator.batch_size",
    "orchestrator.group_size", "trainer.nproc_per_node", "trainer.parallel", "trainer.dtype", "trainer.fp8",
    "trainer.experts_backend",
)
"""Config fields (dotted prefixes) a resumed run must share with its checkpoint: the model's shape and numerics, the
trainer's layout (the sharded state is one file per rank), the data stream (seed, task or environment) and the batch
shape (the accounting counts ``batch_size`` samples per step). Everything else (``max_steps``, the learning rate,
timeouts, transports, sinks, ``checkpoint_every``) may change."""


class ResumeRefused(ValueError):
    """``--resume`` cannot continue this run directory: no complete checkpoint, a config that differs in a field of
    :data:`MUST_MATCH`, or nothing left to do. The message names the reason and the fix; nothing was changed."""


# ---------------------------------------------------------------------------------------------- layout
def checkpoint_dir(run_root: str | Path, step: int) -> Path:
    """``<run_root>/checkpoints/step_<step>`` (a complete checkpoint once it holds ``COMPLETE``)."""
    return Path(run_root) / CHECKPOINTS / f"step_{step}"


def tmp_dir(run_root: str | Path, step: int) -> Path:
    """``<run_root>/checkpoints/step_<step>.tmp``: where checkpoint ``step`` is assembled."""
    return Path(run_root) / CHECKPOINTS / f"step_{step}.tmp"


def _step_of(name: str, suffix: str = "", prefix: str = "step_") -> int | None:
    """``n`` of a name ``<prefix><n><suffix>``, else None."""
    if not name.startswith(prefix) or not name.endswith(suffix):
        return None
    core = name[len(prefix):len(name) - len(suffix)]
    return int(core) if core.isdigit() else None


def complete_checkpoints(run_root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``run_root`` (folders ``step_<n>`` holding ``COMPLETE``), ascending.
    A folder without its marker (a writer that stopped midway) or a ``.tmp`` folder is not one."""
    base = Path(run_root) / CHECKPOINTS
    if not base.is_dir():
        return []
    steps = [s for d in base.iterdir() if (s := _step_of(d.name)) is not None and (d / COMPLETE).is_file()]
    return sorted(steps)


def latest_checkpoint(run_root: str | Path) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    steps = complete_checkpoints(run_root)
    return steps[-1] if steps else None


def checkpoint_due(step: int, every: int, max_steps: int) -> bool:
    """Whether a checkpoint is written after ``step`` trainer steps: ``every > 0`` and (``step`` is a multiple of
    ``every`` or the last step ``max_steps``)."""
    return every > 0 and step > 0 and (step % every == 0 or step == max_steps)


def prune(run_root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and the ``.tmp`` folders of steps below the newest
    complete one (writers that stopped; a ``.tmp`` of a later step may still be written and is kept).

    Returns:
        The folders deleted.

    Raises:
        ValueError: ``keep < 1``.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune: keep={keep!r} must be an int >= 1 (trainer.keep_checkpoints)")
    steps = complete_checkpoints(run_root)
    gone = [checkpoint_dir(run_root, s) for s in steps[:-keep]]
    base = Path(run_root) / CHECKPOINTS
    if steps and base.is_dir():
        gone += [d for d in base.iterdir() if (s := _step_of(d.name, ".tmp")) is not None and s < steps[-1]]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- trainer side
def _feed(h: Any, name: str, value: Any) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    h.update(name.encode())
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())


def state_digest(model: Any, opt: Any) -> str:
    """SHA-256 (hex) of this rank's local model state (parameters and buffers; DTensors: the local shard) and
    optimizer state (per parameter in ``param_groups`` order), bit for bit: equal digests mean equal bytes."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        _feed(h, f"model.{k}", v)
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                _feed(h, f"optim.{i}.{k}", v)
            i += 1
    return h.hexdigest()


def save_trainer_state(st: Any, run_root: str | Path, step: int, *, hf_config: dict, extra_files: list[Path],
                       mcfg: Any, dtype: Any) -> Path:
    """Write the trainer's part of checkpoint ``step`` into :func:`tmp_dir` (a collective: every rank calls it).

    ``dcp/``: model and optimizer state through ``torch.distributed.checkpoint`` (FSDP2/EP DTensors saved as shards,
    each rank its own); ``trainer/rank_<r>.pt``: the scheduler state, the torch and Python RNG states and
    :func:`state_digest`; ``engine/step_<step>/``: the weights in the engines' sharded folder layout (``dtype``,
    ``hf_config`` and ``extra_files`` as the run's publisher writes them). Rank 0 writes ``trainer/trainer.json``
    last, after a barrier: its presence marks the trainer's part complete.

    Args:
        st: this rank's :class:`moe_rl.runtime.trainer.step.TrainerState` (``model``, ``opt``, ``sched``).
        run_root: the run directory.
        step: trainer steps done (= the weight version the model holds).
        hf_config, extra_files, mcfg, dtype: as for :class:`moe_rl.weights.filesystem.ShardedFilesystemPublisher`.

    Returns:
        The temporary folder.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from moe_rl.weights.filesystem import ShardedFilesystemPublisher

    on = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    tmp = tmp_dir(run_root, step)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "trainer").mkdir(parents=True)
    if on:
        dist.barrier()
    model_sd, optim_sd = get_state_dict(st.model, st.opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    digest = state_digest(st.model, st.opt)
    torch.save({"sched": st.sched.state_dict(), "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                "digest": digest, "step": step, "rank": rank, "world": world}, tmp / "trainer" / f"rank_{rank}.pt")
    ShardedFilesystemPublisher(tmp / "engine", hf_config, extra_files, mcfg=mcfg, dtype=dtype).publish(
        st.model, version=step)
    digests: list[Any] = [None] * world
    if on:
        dist.all_gather_object(digests, digest)
    else:
        digests = [digest]
    if rank == 0:
        _atomic_json(tmp / "trainer" / "trainer.json", {"format": FORMAT, "step": step, "world": world,
                                                        "digests": digests})
    if on:
        dist.barrier()
    return tmp


def resume_request(run_root: str | Path) -> dict | None:
    """The launcher's resume request for the trainer (``<run>/trainer/resume.json``: ``step``, ``path``), or None
    for a run that starts at step 0."""
    path = Path(run_root) / "trainer" / RESUME_REQUEST
    return json.loads(path.read_text()) if path.exists() else None


def load_trainer_state(st: Any, ckpt: str | Path) -> dict:
    """Load checkpoint ``ckpt`` (a ``checkpoints/step_<n>`` folder) into this rank's trainer state (a collective).

    Model and optimizer state come from ``dcp/`` (resharded onto this rank's DTensors by
    ``torch.distributed.checkpoint``), then the scheduler and RNG states of this rank; the state's digest is then
    recomputed and compared with the one saved.

    Returns:
        ``{"step", "digest_saved", "digest_loaded"}`` of this rank.

    Raises:
        RuntimeError: the checkpoint was written by a different number of ranks, or the loaded state's digest differs
            from the saved one (the checkpoint does not restore the state bit for bit).
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt = Path(ckpt)
    on = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    meta = json.loads((ckpt / "trainer" / "trainer.json").read_text())
    if meta["world"] != world:
        raise RuntimeError(f"checkpoint {ckpt} was written by {meta['world']} trainer ranks, this trainer has {world}; "
                           "resume with the checkpoint's trainer.nproc_per_node")
    model_sd, optim_sd = get_state_dict(st.model, st.opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
    set_state_dict(st.model, st.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    mine = torch.load(ckpt / "trainer" / f"rank_{rank}.pt", weights_only=False)
    st.sched.load_state_dict(mine["sched"])
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["py_rng"])
    loaded = state_digest(st.model, st.opt)
    if loaded != mine["digest"]:
        raise RuntimeError(f"rank {rank}: the state loaded from {ckpt} differs from the state saved there (digest "
                           f"{loaded[:16]} != {mine['digest'][:16]}); the checkpoint cannot be resumed bit for bit")
    return {"step": int(meta["step"]), "digest_saved": mine["digest"], "digest_loaded": loaded}


# ---------------------------------------------------------------------------------------------- orchestrator side
def orchestrator_state(orch: Any) -> dict:
    """What the orchestrator ``orch`` (:class:`moe_rl.runtime.orchestrator.Orchestrator`) needs to continue: the
    buffer's counters and staleness histogram, the prompt RNG state and next group id (the data-stream position),
    the prompts waiting to be re-queued (pickled; None when they cannot be, then counted as abandoned on resume),
    and the engine-error, episode and weight-load bookkeeping. JSON-serialisable."""
    st = orch.state
    retry = list(orch.buffer._retry)
    try:
        retry_blob: str | None = base64.b64encode(pickle.dumps(retry)).decode()
    except Exception:  # noqa: BLE001 - an environment's prompt objects need not pickle: counted on resume
        retry_blob = None
    version, internal, gauss = orch.rng.getstate()
    return {
        "counters": dataclasses.asdict(orch.buffer.counters),
        "staleness_hist": {str(k): v for k, v in sorted(orch.buffer.staleness_hist.items())},
        "prompt_rng": [version, list(internal), gauss],
        "next_group_id": orch._next_group_id,
        "retry_prompts": retry_blob,
        "retry_count": len(retry),
        "completion_tokens": st.completion_tokens,
        "errors": st.errors,
        "error_messages": dict(st.error_messages),
        "weights_loaded": {str(k): v for k, v in st.weights_loaded.items()},
        "weights_skipped": list(st.weights_skipped),
        "weights_failed": {str(k): v for k, v in st.weights_failed.items()},
        "weights_recovered": list(st.weights_recovered),
        "weight_load_fallbacks": st.weight_load_fallbacks,
        "weight_load_retries": st.weight_load_retries,
        "turns": dict(st.turns),
        "episodes": dict(st.episodes),
    }


def finalize(run_root: str | Path, step: int, orch_state: dict, config: dict, keep: int) -> Path:
    """Complete checkpoint ``step``: add ``orchestrator.json`` and ``meta.json`` to the trainer's part in
    :func:`tmp_dir`, write ``COMPLETE``, rename the folder to :func:`checkpoint_dir` and :func:`prune` to ``keep``.

    Raises:
        RuntimeError: the trainer's part is not complete (no ``trainer/trainer.json``).
    """
    tmp = tmp_dir(run_root, step)
    if not (tmp / "trainer" / "trainer.json").is_file():
        raise RuntimeError(f"checkpoint {step}: the trainer's part in {tmp} is not complete (no trainer/trainer.json); "
                           "the trainer writes it before its report of the step")
    _atomic_json(tmp / "orchestrator.json", orch_state)
    _atomic_json(tmp / "meta.json", {"format": FORMAT, "step": step, "version": step, "time": time.time(),
                                     "config": config})
    (tmp / COMPLETE).write_text(json.dumps({"step": step, "version": step}))
    final = checkpoint_dir(run_root, step)
    if final.exists():  # an earlier segment's checkpoint of the same step (resumed from an older one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(run_root, keep)
    return final


def finalize_if_due(run_root: str | Path, orch: Any, record: dict, cfg: Any) -> Path | None:
    """Launcher hook, called with each metrics record (step ``record["step"]``, so ``n = step + 1`` steps are
    done): complete checkpoint ``n`` when one is due (:func:`checkpoint_due` with ``cfg.trainer.checkpoint_every``).

    Returns:
        The complete checkpoint's folder, or None when none is due.
    """
    n = int(record["step"]) + 1
    if not checkpoint_due(n, cfg.trainer.checkpoint_every, cfg.max_steps):
        return None
    return finalize(run_root, n, orchestrator_state(orch), json.loads(cfg.model_dump_json()),
                    cfg.trainer.keep_checkpoints)


# ---------------------------------------------------------------------------------------------- resume
@dataclass
class Resume:
    """What :func:`prepare_resume` found and set aside; read by the launcher."""

    step: int
    """Steps done at the checkpoint (= the weight version the engines load first)."""
    path: Path
    """The checkpoint folder."""
    orchestrator: dict
    """``orchestrator.json`` of the checkpoint."""
    discarded_steps: list[int] = field(default_factory=list)
    """Steps the interrupted segment recorded after the checkpoint (their metrics are in ``resume_discarded.jsonl``;
    they are trained again)."""
    discarded_rollouts_started: int = 0
    """Rollouts the interrupted segment started after the checkpoint (from its ``summary.json``; 0 when unknown)."""
    dropped_at_resume: int = 0
    """Samples in flight, queued or in an untrained batch at the checkpoint, counted as dropped (``"resume"``)."""
    earlier: list[dict] = field(default_factory=list)
    """One entry per earlier segment: its ``exit`` and ``steps`` (from its ``summary.json``)."""
    logs_kept: str | None = None
    """``logs/segment_<k>``: where the earlier segment's logs were moved (None: there were none)."""

    def summary(self) -> dict:
        """The ``resume`` entry of ``summary.json``."""
        return {"from_step": self.step, "checkpoint": str(self.path), "discarded_steps": self.discarded_steps,
                "discarded_rollouts_started": self.discarded_rollouts_started,
                "dropped_at_resume": self.dropped_at_resume, "earlier_segments": self.earlier,
                "earlier_logs": self.logs_kept}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    if not d and prefix:
        out[prefix] = {}
    return out


def config_differences(saved: dict, now: dict, fields: tuple[str, ...] = MUST_MATCH) -> list[str]:
    """``"<field>: <saved> (checkpoint) != <now> (now)"`` for every leaf under ``fields`` (dotted prefixes) whose
    value differs between the two resolved configs (``RLConfig.model_dump(mode="json")``), sorted."""
    a, b = _flatten(saved), _flatten(now)

    def under(k: str) -> bool:
        return any(k == f or k.startswith(f + ".") for f in fields)

    keys = sorted(k for k in set(a) | set(b) if under(k))
    missing = object()
    out = []
    for k in keys:
        va, vb = a.get(k, missing), b.get(k, missing)
        if va != vb:
            out.append(f"{k}: {'(unset)' if va is missing else json.dumps(va)} (checkpoint) != "
                       f"{'(unset)' if vb is missing else json.dumps(vb)} (now)")
    return out


def _move_aside(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def _keep_segment_logs(logs: Path) -> str | None:
    """Move the earlier segment's logs (every entry of ``logs`` but the ``segment_<k>`` folders) into
    ``logs/segment_<k>/`` (``k`` = 1 + the folders already there), so the resumed segment's processes start fresh
    logs without overwriting them. Returns that folder, or None when there was nothing to keep."""
    if not logs.is_dir():
        return None
    entries = sorted(logs.iterdir())
    kept = [p for p in entries if _step_of(p.name, prefix="segment_") is None]
    if not kept:
        return None
    k = 1 + sum(1 for p in entries if _step_of(p.name, prefix="segment_") is not None)
    dest = logs / f"segment_{k}"
    dest.mkdir()
    for p in kept:
        os.replace(p, dest / p.name)
    return str(dest)


def prepare_resume(paths: Any, cfg: Any) -> Resume:
    """Check that the run in ``paths.root`` can continue under ``cfg`` and set aside what its interrupted segment did
    after its newest complete checkpoint ``n``.

    Removed: ``batches/step_<k>`` and ``trainer/step_<k>.json`` for ``k >= n`` (trained again), the weight folders
    and announcements of versions ``> n`` (and the transports' group files: the new trainer writes its own), the
    checkpoints' ``.tmp`` folders. ``metrics.jsonl`` keeps the lines of steps ``< n``; the others are appended to
    ``resume_discarded.jsonl``. When ``weights/step_<n>`` is not published (pruned, or another transport), the
    checkpoint's ``engine/step_<n>`` is copied there. The earlier segments' logs move to ``logs/segment_<k>/``
    (:attr:`Resume.logs_kept`). Writes the trainer's request (``trainer/resume.json``).

    Args:
        paths: the run's :class:`moe_rl.runtime.run_dir.RunPaths`.
        cfg: the new run's ``RLConfig`` (``output_dir`` = ``paths.root``).

    Raises:
        ResumeRefused: no complete checkpoint (the message lists what the directory holds), version 0's weights are
            missing, the config differs in a field of :data:`MUST_MATCH` (every difference named), or
            ``max_steps`` does not exceed the checkpoint's step. Nothing is changed then.
    """
    from moe_rl.weights.filesystem import is_published, version_dir

    root = Path(paths.root)
    step = latest_checkpoint(root)
    if step is None:
        found = sorted(p.name for p in (root / CHECKPOINTS).iterdir()) if (root / CHECKPOINTS).is_dir() else []
        why = (f"checkpoints/ holds only incomplete ones ({', '.join(found)}: no {COMPLETE} marker)" if found
               else "it has no checkpoints/ (trainer.checkpoint_every = 0, or the run stopped before its first one)")
        raise ResumeRefused(f"--resume: {root} has no complete checkpoint: {why}. Start the run again with "
                            "--overwrite, or choose another --output-dir.")
    ckpt = checkpoint_dir(root, step)
    meta = json.loads((ckpt / "meta.json").read_text())
    now = json.loads(cfg.model_dump_json())
    diffs = config_differences(meta["config"], now)
    if diffs:
        raise ResumeRefused(
            f"--resume: the config differs from checkpoint {ckpt}'s in fields that must match (the model, the "
            "trainer's layout, the data stream and the batch shape):\n  " + "\n  ".join(diffs) +
            "\nGive the checkpoint's values (its config is in meta.json), or start again with --overwrite.")
    if cfg.max_steps <= step:
        raise ResumeRefused(f"--resume: max_steps={cfg.max_steps} but checkpoint {ckpt} is already at step {step}: "
                            f"nothing to train; raise --max-steps above {step}")
    if not is_published(paths.weights, 0):
        raise ResumeRefused(f"--resume: {version_dir(paths.weights, 0)} (the run's version-0 weights, which the "
                            "engines and the trainer start from) is missing or incomplete; start again with --overwrite")
    res = Resume(step=step, path=ckpt, orchestrator=json.loads((ckpt / "orchestrator.json").read_text()))
    prev = root / "summary.json"
    if prev.exists():
        try:
            s = json.loads(prev.read_text())
            res.earlier = list(s.get("resume", {}).get("earlier_segments", [])) + [
                {"exit": s.get("exit"), "steps": s.get("steps")}]
            started = s.get("rollouts_started")
            if isinstance(started, int):
                res.discarded_rollouts_started = max(0, started - int(res.orchestrator["counters"]["started"]))
        except (ValueError, AttributeError):
            res.earlier = [{"exit": None, "steps": None}]
    # set aside what the interrupted segment did after the checkpoint
    for d in (paths.batches, paths.trainer):  # step_<k>.safetensors, step_<k>.json (and their .tmp files)
        if d.is_dir():
            for p in d.iterdir():
                base = p.name.split(".")[0]
                k = _step_of(base)
                if k is not None and k >= step:
                    _move_aside(p)
    ann = paths.weights / "announce"
    if ann.is_dir():
        for p in ann.iterdir():  # step_<v>.json, p2p_<v>.json, request_<v>.json, *group*.json
            base = p.name.split(".")[0]
            tail = base.rsplit("_", 1)[-1]
            if base.startswith("request_") or "group" in base or (tail.isdigit() and int(tail) > step):
                _move_aside(p)
    if paths.weights.is_dir():
        for p in paths.weights.iterdir():
            k = _step_of(p.name.split(".")[0])
            if k is not None and (k > step or p.name.endswith(".tmp")):
                _move_aside(p)
    if (root / CHECKPOINTS).is_dir():
        for p in (root / CHECKPOINTS).iterdir():
            if p.name.endswith(".tmp"):
                _move_aside(p)
    if paths.metrics.exists():
        keep, drop = [], []
        for line in paths.metrics.read_text().splitlines():
            if line.strip():
                (keep if json.loads(line)["step"] < step else drop).append(line)
        if drop:
            with (root / "resume_discarded.jsonl").open("a") as f:
                f.writelines(json.dumps({"resumed_from": step, **json.loads(line)}) + "\n" for line in drop)
        res.discarded_steps = [json.loads(line)["step"] for line in drop]
        tmp = paths.metrics.with_name(paths.metrics.name + ".part")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, paths.metrics)
    if not is_published(paths.weights, step):
        src = version_dir(ckpt / "engine", step)
        dst = version_dir(paths.weights, step)
        part = dst.with_name(dst.name + ".tmp")
        _move_aside(part)
        shutil.copytree(src, part)
        _move_aside(dst)
        os.replace(part, dst)
    res.logs_kept = _keep_segment_logs(Path(paths.logs))
    paths.trainer.mkdir(parents=True, exist_ok=True)
    _atomic_json(paths.trainer / RESUME_REQUEST, {"step": step, "path": str(ckpt)})
    c = res.orchestrator["counters"]
    res.dropped_at_resume = int(c["inflight"] + c["queued"] + c["in_batch"])
    return res


async def load_engine(client: Any, weights_root: str | Path, resume: Resume) -> dict:
    """Make the fresh engine behind ``client`` load the checkpoint's version before it serves anything
    (``load_sharded`` of ``weights/step_<n>``), and check it reports that version.

    Raises:
        RuntimeError: the engine serves another version after the load.
    """
    from moe_rl.weights.filesystem import version_dir

    info = await client.load_sharded(str(version_dir(weights_root, resume.step)), resume.step)
    served = await client.weight_version()
    if int(served) != resume.step:
        raise RuntimeError(f"--resume: the engine serves version {served} after loading checkpoint version "
                           f"{resume.step}")
    return info


def restore_orchestrator(orch: Any, resume: Resume) -> None:
    """Continue the accounting and the data stream of ``orch`` (a fresh
    :class:`moe_rl.runtime.orchestrator.Orchestrator`) from the checkpoint: counters (in flight / queued / in batch
    at the checkpoint become dropped with reason ``"resume"``), staleness histogram, prompt RNG and group ids,
    re-queued prompts, bookkeeping; the engine version, next batch and first step become the checkpoint's step.

    Raises:
        RuntimeError: the restored counters are inconsistent (``BufferCounters.check``).
    """
    from moe_rl.rl.buffer import BufferCounters

    s = resume.orchestrator
    c = BufferCounters(**s["counters"])
    lost = c.inflight + c.queued + c.in_batch
    c.inflight = c.queued = c.in_batch = 0
    if lost:
        c.dropped += lost
        c.dropped_by_reason[DROP_REASON] = c.dropped_by_reason.get(DROP_REASON, 0) + lost
    buf = orch.buffer
    if s.get("retry_prompts"):
        buf._retry.extend(pickle.loads(base64.b64decode(s["retry_prompts"])))  # noqa: S301 - the run's own file
    elif s.get("retry_count"):
        c.abandoned += int(s["retry_count"])
    c.check()
    buf.counters = c
    buf.staleness_hist = collections.Counter({int(k): v for k, v in s["staleness_hist"].items()})
    version, internal, gauss = s["prompt_rng"]
    orch.rng.setstate((version, tuple(internal), gauss))
    orch._next_group_id = int(s["next_group_id"])
    st = orch.state
    st.completion_tokens = s["completion_tokens"]
    st.errors = s["errors"]
    st.error_messages = dict(s["error_messages"])
    n = resume.step  # versions above the checkpoint's are published again by the resumed trainer
    st.weights_loaded = {int(k): v for k, v in s["weights_loaded"].items() if int(k) < n}
    st.weights_skipped = [v for v in s["weights_skipped"] if v < n]
    st.weights_failed = {int(k): v for k, v in s["weights_failed"].items() if int(k) < n}
    st.weights_recovered = [v for v in s["weights_recovered"] if v < n]
    st.weight_load_fallbacks = s["weight_load_fallbacks"]
    st.weight_load_retries = s["weight_load_retries"]
    st.turns = collections.Counter(s["turns"])
    st.episodes = collections.Counter(s["episodes"])
    st.weights_loaded[resume.step] = "checkpoint"
    st.engine_version = st.next_batch = resume.step
    orch.start_step = resume.step
