"""One rank of the FSDP2 Fp8BlockLinear test (``test_fp8_fsdp_compile.py``): gloo on CPU, file:// init.

Usage: ``python _fsdp_worker.py RANK WORLD INIT_FILE OUT_DIR`` (``launch_ranks`` of ``tests/conftest.py``); writes
``OUT_DIR/rank{RANK}.json`` = ``{"fsdp2_matches_single_process": "ok" | traceback, ...}``.

Each rank builds the same 2-layer MLP of ``Fp8BlockLinear`` (fp32 master weights) twice: a plain single-process
reference that sees the whole global batch, and a copy under ``fully_shard`` that sees this rank's half. The
batch split is along tokens in 128-token halves, which are exactly the Wgrad's 128x1 quantization groups, and the
per-rank mean loss differs from the global one by a factor 2 (exact for quantization: scales scale by 2, codes are
unchanged), so the two must agree up to fp32 summation order (FSDP's reduce-scatter average vs one GEMM).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the rank protocol and tolerance helpers
from _rank_worker import run_rank_worker  # noqa: E402
from _tolerance import assert_sqnr_at_least  # noqa: E402

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
# FSDP vs single process, both FP8 (E4M3, 1x128 / 128x128 / 128x1 blocks) on the same values: the fp32 GEMMs of the
# dequantized operands run on other row counts (MKL may order the sums differently), so an activation or gradient
# element near an E4M3 rounding boundary may round to the neighbouring code in one path: a difference of at most
# one code, <= 2x that element's own quantization error. The two paths then differ by at most twice the
# quantization noise, i.e. their SQNR is >= the E4M3 floor (28 dB for one quantized GEMM, tests/_tolerance.py)
# minus 6 dB. A gradient not summed over ranks or a wrong 1/world factor gives <= 6 dB.
PATHS_SQNR_DB = 28.0 - 6.0

T_PER_RANK, D, H, N = 128, 256, 256, 128


def _model() -> nn.Module:
    from moe_rl.fp8.linear import Fp8BlockLinear

    torch.manual_seed(0)
    return nn.Sequential(Fp8BlockLinear(D, H), nn.ReLU(), Fp8BlockLinear(H, N))


def fsdp2_matches_single_process() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * T_PER_RANK, D, generator=g)
    target = torch.randn(world * T_PER_RANK, N, generator=g)

    ref = _model()
    ref_loss = nn.functional.mse_loss(ref(x), target)
    ref_loss.backward()

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sl = slice(rank * T_PER_RANK, (rank + 1) * T_PER_RANK)
    loss = nn.functional.mse_loss(model(x[sl]), target[sl])
    loss.backward()

    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss /= world
    assert_sqnr_at_least(ref_loss.detach().reshape(1), global_loss.reshape(1), PATHS_SQNR_DB, "loss")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full_grad = p.grad.full_tensor()  # DTensor (sharded on dim 0) -> full
        assert_sqnr_at_least(ref_params[name].grad, full_grad, PATHS_SQNR_DB, f"grad {name}")
        # no optimizer step: both hold the same initial values (a copy, sharded and gathered)
        assert torch.equal(p.full_tensor(), ref_params[name].detach()), f"param {name} differs"


def main() -> None:
    run_rank_worker([fsdp2_matches_single_process], started=_T0)


if __name__ == "__main__":
    main()
