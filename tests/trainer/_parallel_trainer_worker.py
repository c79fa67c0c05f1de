"""One rank of the multi-rank RL-trainer tests (launched once per rank by ``tests/trainer/test_rl_trainer_parallel.py``,
``test_micro_batch.py`` and, through ``_chunked_logprobs_worker.py``, ``test_chunked_logprobs.py``).

Runs the real trainer code path (:func:`moe_rl.runtime.trainer.step.build_trainer`, :func:`moe_rl.runtime.trainer.step.train_step`,
:func:`moe_rl.runtime.trainer.step.full_state_dict`) for each scenario prepared by the test in ``OUT_DIR/<scenario>/``
(``config.json``, ``weights/step_0``, ``batches/step_<n>.safetensors``). A pre-hook on the optimizer records every
gradient (gathered full tensors, after the clip) right before each AdamW step. Rank 0 saves
``{"reports": [...], "grads": [...], "params": {...}}`` to ``OUT_DIR/<scenario>/result.pt``; the test compares it
with a single-process reference. Every folder of ``OUT_DIR`` holding a ``config.json`` is a scenario (name order); an
optional ``micro_batch.json`` in it sets ``StepSettings.micro_batch`` (the one-machine config has no such field).

Writes ``{scenario: "ok" | traceback, "_seconds": {...}}`` to ``<out>/rank<r>.json``.

Usage: ``python _parallel_trainer_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

_T0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(scenario_dir: Path, rank: int) -> None:
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.runtime.config import RLConfig
    from moe_rl.runtime.trainer.step import build_trainer, full_state_dict, train_step

    cfg = RLConfig.model_validate_json((scenario_dir / "config.json").read_text())
    st = build_trainer(cfg, scenario_dir / "weights" / "step_0")
    assert st.settings.loss_chunk_tokens == cfg.trainer.loss_chunk_tokens  # the config reaches the step
    if (scenario_dir / "micro_batch.json").exists():
        st.settings = replace(st.settings, micro_batch=json.loads((scenario_dir / "micro_batch.json").read_text()))
    grads: list[dict[str, torch.Tensor]] = []

    def capture(opt, args, kwargs):  # every rank runs it (full_tensor is a collective)
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad).clone()
                      for n, p in st.model.named_parameters()})

    st.opt.register_step_pre_hook(capture)
    reports = [train_step(st, read_batch(batch_path(scenario_dir / "batches", s)), s) for s in range(cfg.max_steps)]
    params = full_state_dict(st.model)
    if rank == 0:
        torch.save({"reports": reports, "grads": grads, "params": params}, scenario_dir / "result.pt")


def main(special: dict[str, Callable[[Path, int, int], None]] | None = None) -> None:
    """Run every scenario folder of ``OUT_DIR`` (argv); ``special`` maps a marker file name to the runner of the
    folders holding it instead of a ``config.json`` (called as ``runner(folder, rank, world)``)."""
    special = special or {}
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results: dict[str, object] = {"_seconds": {"startup": round(time.perf_counter() - _T0, 2)}}
    for d in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        runner = next((r for marker, r in special.items() if (d / marker).exists()), None)
        if runner is None and not (d / "config.json").exists():
            continue
        t0 = time.perf_counter()
        try:
            if runner is not None:
                runner(d, rank, world)
            else:
                run(d, rank)
            results[d.name] = "ok"
        except BaseException:
            results[d.name] = traceback.format_exc()
        results["_seconds"][d.name] = round(time.perf_counter() - t0, 2)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
