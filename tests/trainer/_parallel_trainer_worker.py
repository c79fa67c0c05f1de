"""One rank of the parallel RL-trainer test (launched once per rank by ``tests/trainer/test_rl_trainer_parallel.py``).

Runs the real trainer code path (:func:`moe_rl.trainer.step.build_trainer`, :func:`moe_rl.trainer.step.train_step`,
:func:`moe_rl.trainer.step.full_state_dict`) for each scenario prepared by the test in ``OUT_DIR/<scenario>/``
(``config.json``, ``weights/step_0``, ``batches/step_<n>.safetensors``). A pre-hook on the optimizer records every
gradient (gathered full tensors, after the clip) right before each AdamW step. Rank 0 saves
``{"reports": [...], "grads": [...], "params": {...}}`` to ``OUT_DIR/<scenario>/result.pt``; the test compares it
with a single-process reference.

Writes ``{scenario: "ok" | traceback, "_seconds": {...}}`` to ``<out>/rank<r>.json``.

Usage: ``python _parallel_trainer_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

_T0 = time.perf_counter()
torch.set_num_threads(1)

SCENARIOS = ("dp2_cp2_ep2_ring_replay", "hsdp2_cp2_ulysses_ac_gspo_replay")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(scenario_dir: Path, rank: int) -> None:
    from moe_rl.entrypoints.rl import RLConfig
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.trainer.step import build_trainer, full_state_dict, train_step

    cfg = RLConfig.model_validate_json((scenario_dir / "config.json").read_text())
    st = build_trainer(cfg, scenario_dir / "weights" / "step_0")
    grads: list[dict[str, torch.Tensor]] = []

    def capture(opt, args, kwargs):  # every rank runs it (full_tensor is a collective)
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad).clone()
                      for n, p in st.model.named_parameters()})

    st.opt.register_step_pre_hook(capture)
    reports = [train_step(st, read_batch(batch_path(scenario_dir / "batches", s)), s) for s in range(cfg.max_steps)]
    params = full_state_dict(st.model)
    if rank == 0:
        torch.save({"reports": reports, "grads": grads, "params": params}, scenario_dir / "result.pt")


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results: dict[str, object] = {"_seconds": {"startup": round(time.perf_counter() - _T0, 2)}}
    for name in SCENARIOS:
        t0 = time.perf_counter()
        try:
            run(out_dir / name, rank)
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        results["_seconds"][name] = round(time.perf_counter() - t0, 2)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
