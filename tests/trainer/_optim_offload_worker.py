"""One rank of ``test_optim_offload.py``'s FSDP2 scenario: a model sharded with ``fully_shard`` over 2 gloo ranks,
trained with ``OffloadedOptimizer(AdamW)``, must equal the single-process AdamW run on the full batch up to the
reduce-scatter's summation order (fp32, a few ulps of O(1) weights: atol 1e-6; a lost or stale moment after a
restore changes the update by O(lr) = 1e-2).

Usage: ``python _optim_offload_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    report: dict = {}
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from moe_rl.distributed.optim_offload import OffloadedOptimizer

        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(4 * world, 16, generator=g)
            ref(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            mine = x.chunk(world)[rank]
            model(mine).square().mean().backward()  # FSDP2 averages gradients over the ranks
            opt.step()
            opt.zero_grad()
        moments = [st["exp_avg"] for st in opt.state.values()]
        assert moments and all(isinstance(m, DTensor) for m in moments), "moments should be DTensors"
        assert all(m._local_tensor.untyped_storage().size() == 0 for m in moments), "storage not released"
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            full = p.full_tensor()
            err = float((full - q).abs().max())
            assert err <= 1e-6, f"{name}: max |diff| {err:.3e} > 1e-6"
        report["fsdp2_offload"] = "ok"
    except Exception:  # noqa: BLE001 - reported to the test
        report["fsdp2_offload"] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
