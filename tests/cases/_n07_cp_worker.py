"""One rank of the N07 context-parallel loss scenarios (launched by ``tests/cases/test_n07_cp_loss_normalization.py``).

Every rank is one CP rank of a single data rank (world = cp). Per scenario it cuts the row of 8 per-token
log-probs with :func:`moe_rl.distributed.parallelize.shard_for_context_parallel`, gathers whole rows with
:func:`moe_rl.runtime.trainer.step.gather_context_parallel`, evaluates :func:`moe_rl.rl.loss.compute_loss` on them and
backpropagates ``loss_sum * world / loss_normalizer(global mask)`` (``train_step``'s rule, step 4 of its docstring);
the gradients of the ranks are then summed and divided by the world size (FSDP2's reduction) and compared with the
CP = 1 reference computed on the whole row.

Usage: ``python _n07_cp_worker.py RANK WORLD INIT_FILE OUT_DIR`` -> ``OUT_DIR/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.attention.layout import make_shard_plan
from moe_rl.distributed.parallelize import shard_for_context_parallel
from moe_rl.rl.loss import LossConfig, compute_loss, loss_normalizer
from moe_rl.runtime.trainer.step import gather_context_parallel

torch.set_num_threads(1)
S = 8
CFG = LossConfig(kind="dppo_kl")
MASKS = {
    "case": [6, 7],
    "all_ones": list(range(S)),
    "single_last": [7],
    "one_per_shard": [1, 3, 5, 7],
    "all_zeros": [],
}


def _inputs(valid: list[int]):
    mask = torch.zeros(1, S, dtype=torch.bool)
    mask[0, valid] = True
    losses = torch.zeros(1, S)
    losses[0, 6], losses[0, 7] = 2.0, 4.0
    for p in valid:
        if p < 6:
            losses[0, p] = 1.0 + p
    lp = torch.full((1, S), -0.25)  # ratio 1: a token's loss is -A
    return lp, lp.clone(), -losses, mask, losses


def _reference(valid: list[int]):
    lp, inf, adv, mask, losses = _inputs(valid)
    lp.requires_grad_(True)
    out = compute_loss(CFG, lp, inf, adv, mask)
    obj = out.loss_sum / loss_normalizer(CFG, mask)
    obj.backward()
    return obj.item(), lp.grad[0], losses[0]


def scenario(layout: str, name: str, report: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    valid = MASKS[name]
    lp, inf, adv, mask, losses = _inputs(valid)
    shard = shard_for_context_parallel(lp, world, rank, layout=layout)
    local = shard.local.clone().requires_grad_(True)
    plan = make_shard_plan(S, world, layout)
    full = gather_context_parallel(local, plan, dist.group.WORLD, rank)
    out = compute_loss(CFG, full, inf, adv, mask)
    norm = loss_normalizer(CFG, mask)
    (out.loss_sum * world / norm).backward()
    # FSDP2's reduction of a parameter gradient: sum over ranks, divide by the world size
    grad = torch.zeros(S)
    idx = plan.local_token_idx(rank, local.device)
    keep = plan.valid(rank)
    grad[idx[keep]] = local.grad[0][keep]
    dist.all_reduce(grad)
    grad /= world
    obj = out.loss_sum.item() / norm
    ref_obj, ref_grad, ref_losses = _reference(valid)
    assert torch.isfinite(grad).all(), f"{name}: non-finite gradient {grad.tolist()}"
    # fp32, no reduction reaches a gradient element (the backward of a sum broadcasts): each path rounds a gradient
    # element a few times (the loss's element-wise ops, * world, / norm, / world), <= 4 roundings of eps32 |g| each,
    # x2 for two paths. The objective is a sum of <= S terms: worst case S eps32 sum|terms| / norm per path. A
    # wrong normaliser (CP-local count, missing * world) changes them by >= 1/8 relative, >= 1e5 times these bounds.
    e32 = torch.finfo(torch.float32).eps
    bad = (grad - ref_grad).abs() > 2 * 4 * e32 * ref_grad.abs()
    assert not bool(bad.any()), f"{name}: gradient {grad.tolist()} vs CP=1 {ref_grad.tolist()}"
    obj_bound = 2 * S * e32 * float(losses[mask].abs().sum()) / float(norm)
    assert abs(obj - ref_obj) <= obj_bound, (obj, ref_obj, obj_bound)
    # d objective / d loss_i (ratio 1: d loss_i / d logprob_i = loss_i); 0 off the mask
    weight = torch.where(mask[0], grad / torch.where(mask[0], losses[0], 1.0), grad)
    report[f"{layout}/{name}"] = {"objective": obj, "weights": weight.tolist()}


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results: dict[str, object] = {}
    report: dict[str, object] = {}
    for layout in ("contiguous", "zigzag"):
        for name in MASKS:
            key = f"{layout}/{name}"
            try:
                scenario(layout, name, report)
                results[key] = "ok"
            except Exception:
                results[key] = traceback.format_exc()
    results["report"] = report
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
