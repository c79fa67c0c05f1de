"""One rank of the chunked-head trainer test (launched once per rank by ``tests/trainer/test_chunked_logprobs.py``).

For each scenario folder prepared by the test (``OUT_DIR/<scenario>/``: ``config.json`` with
``trainer.loss_chunk_tokens`` set, ``weights/step_0``, ``batches/step_<n>.safetensors``) runs the real trainer path
(:func:`moe_rl.runtime.trainer.step.build_trainer` -> FSDP2 via ``parallelize_model``, :func:`~moe_rl.runtime.trainer.step.train_step`,
:func:`~moe_rl.runtime.trainer.step.full_state_dict`; the shared ``_parallel_trainer_worker.run``). A pre-hook on the optimizer records every gradient (gathered, after
the clip). Rank 0 saves ``{"reports", "grads", "params"}`` to ``OUT_DIR/<scenario>/result.pt``. A folder with
``inputs.pt`` instead is a ``GlmMoeDsaForCausalLM.token_logprobs`` scenario (:func:`run_dsa`).

Writes ``{scenario: "ok" | traceback, "_seconds": {...}}`` to ``<out>/rank<r>.json``.

Usage: ``python _chunked_logprobs_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _parallel_trainer_worker import _full, main  # noqa: E402  (the shared trainer-scenario worker)


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


if __name__ == "__main__":
    main(special={"inputs.pt": run_dsa})
