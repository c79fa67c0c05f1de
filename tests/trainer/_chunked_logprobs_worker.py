"""One rank of the chunked-head trainer test (launched once per rank by ``tests/trainer/test_chunked_logprobs.py``).

For each scenario folder prepared by the test (``OUT_DIR/<scenario>/``: ``config.json`` with
``trainer.loss_chunk_tokens`` set, ``weights/step_0``, ``batches/step_<n>.safetensors``) runs the real trainer path
(:func:`moe_rl.trainer.step.build_trainer` -> FSDP2 via ``parallelize_model``, :func:`~moe_rl.trainer.step.train_step`,
:func:`~moe_rl.trainer.step.full_state_dict`). A pre-hook on the optimizer records every gradient (gathered, after
the clip). Rank 0 saves ``{"reports", "grads", "params"}`` to ``OUT_DIR/<scenario>/result.pt``. A folder with
``inputs.pt`` instead is a ``GlmMoeDsaForCausalLM.token_logprobs`` scenario (:func:`run_dsa`).

Writes ``{scenario: "ok" | traceback, "_seconds": {...}}`` to ``<out>/rank<r>.json``.

Usage: ``python _chunked_logprobs_worker.py RANK WORLD INIT_FILE OUT_DIR``
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


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(scenario_dir: Path, rank: int) -> None:
    from moe_rl.entrypoints.rl import RLConfig
    from moe_rl.rl.batch import batch_path, read_batch
    from moe_rl.trainer.step import build_trainer, full_state_dict, train_step

    cfg = RLConfig.model_validate_json((scenario_dir / "config.json").read_text())
    st = build_trainer(cfg, scenario_dir / "weights" / "step_0")
    assert st.settings.loss_chunk_tokens == cfg.trainer.loss_chunk_tokens is not None
    grads: list[dict[str, torch.Tensor]] = []

    def capture(opt, args, kwargs):  # every rank runs it (full_tensor is a collective)
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad).clone()
                      for n, p in st.model.named_parameters()})

    st.opt.register_step_pre_hook(capture)
    reports = [train_step(st, read_batch(batch_path(scenario_dir / "batches", s)), s) for s in range(cfg.max_steps)]
    params = full_state_dict(st.model)
    if rank == 0:
        torch.save({"reports": reports, "grads": grads, "params": params}, scenario_dir / "result.pt")


def run_dsa(d: Path, rank: int, world: int) -> None:
    """``GlmMoeDsaForCausalLM.token_logprobs`` under ``parallelize_model`` (dp_shard = world, ep = 2, activation
    checkpointing): each rank takes its rows of ``inputs.pt``, backpropagates ``world * sum(lp * upstream)`` (FSDP2
    divides the summed gradient by the world), and rank 0 saves the gathered log-probs and full gradients."""
    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.distributed.parallelize import parallelize_model
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
    from moe_rl.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

    inp = torch.load(d / "inputs.pt", weights_only=True)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.tiny_debug())
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    dims = ParallelDims(dp_shard=world, ep=2)
    parallelize_model(model, dims, dims.build_mesh("cpu"), activation_checkpointing=True)
    rows = slice(rank * inp["ids"].shape[0] // world, (rank + 1) * inp["ids"].shape[0] // world)
    lp = model.token_logprobs(inp["ids"][rows], inp["labels"][rows], temperature=inp["temperature"],
                              chunk_tokens=inp["chunk"])
    (lp * inp["upstream"][rows]).sum().mul(world).backward()
    parts = [torch.empty_like(lp) for _ in range(world)]
    dist.all_gather(parts, lp.detach())
    grads = {n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"lp": torch.cat(parts), "grads": grads}, d / "result.pt")


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results: dict[str, object] = {"_seconds": {"startup": round(time.perf_counter() - _T0, 2)}}
    for d in sorted(p for p in out_dir.iterdir() if (p / "config.json").exists() or (p / "inputs.pt").exists()):
        t0 = time.perf_counter()
        try:
            if (d / "inputs.pt").exists():
                run_dsa(d, rank, world)
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
