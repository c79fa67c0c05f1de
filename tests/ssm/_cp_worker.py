"""One rank of the Mamba-2 context-parallel tests (launched once per rank by ``tests/ssm/test_cp.py``).

Global-reference-then-shard: every rank builds the same global inputs (same seed), runs the single-process scan /
mixer on whole rows, takes its contiguous slice of the rows (``torch.tensor_split``: slices of unequal length when
the row does not divide), runs the CP path on it and compares the output and every gradient: per-token gradients
on its slice, gradients of shared tensors (``A``, ``D``, parameters) after summing over ranks, the initial state's
gradient on rank 0. Writes ``{scenario: "ok" | traceback}`` to ``<out>/rank<r>.json``; the measured max errors go
to ``_stats``.

Usage: ``python _cp_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tolerance helpers
from _rank_worker import run_rank_worker  # noqa: E402
from _ssd_inputs import ssd_inputs  # noqa: E402
from _tolerance import assert_normwise_close, assert_within  # noqa: E402

from moe_rl.ssm import Mamba2Mixer, Mamba2MixerConfig, ssd_scan, ssd_scan_cp  # noqa: E402

_T0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
STATS: dict[str, float] = {}
# CP vs one process, both fp32: the same reductions in other orders (each rank's chunks start at its own offset;
# the state enters through the correction term instead of the chunk recurrence; gradients of shared tensors are
# summed over ranks). Per element: the atol 1e-5 (values of unit scale, as tests/ssm/test_ssd.py); normwise
# chain bound (tests/_tolerance.py) with k = max(T N, b T P, the mixer's widths) and depth 2 paths x ~12
# reductions. A missing incoming state or a halo from the wrong rank changes the first tokens of a slice by O(1).
ATOL, KMAX, DEPTH = 1e-5, 1024, 24


def close(actual, expected, what, *, atol=True):
    err = float((actual.detach().double() - expected.detach().double()).abs().max()) if actual.numel() else 0.0
    STATS[what] = max(STATS.get(what, 0.0), err)
    assert_normwise_close(actual, expected, dtype=torch.float32, k=KMAX, depth=DEPTH, what=what)
    if atol:
        assert_within(actual, expected, ATOL, what + " (atol)")


def _all_sum(t):
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def _scan_case(T, chunk, with_init, seed):
    cp, rank = dist.get_world_size(), dist.get_rank()
    b, H, P, G, N = 2, 4, 8, 2, 16
    *ins, gy, gh = ssd_inputs(b, T, H, P, G, N, seed)
    tag = f"scan T={T} chunk={chunk} init={with_init}"

    ref_t = [t.clone().requires_grad_() for t in ins]
    ref = ssd_scan(*ref_t[:5], chunk_size=chunk, D=ref_t[5], initial_state=ref_t[6] if with_init else None)
    # the last rank's final state is the row's; every rank's loss term uses its own slice only
    ((ref.y * gy).sum() + (ref.final_state * gh).sum()).backward()

    sl = torch.tensor_split(torch.arange(T), cp)[rank]
    lo, hi = int(sl[0]), int(sl[-1]) + 1
    mine = [ins[0][:, lo:hi], ins[1][:, lo:hi], ins[2], ins[3][:, lo:hi], ins[4][:, lo:hi], ins[5], ins[6]]
    mine = [t.clone().requires_grad_() for t in mine]
    out = ssd_scan_cp(*mine[:5], chunk_size=chunk, D=mine[5], initial_state=mine[6] if with_init else None)
    loss = (out.y * gy[:, lo:hi]).sum()
    if rank == cp - 1:
        loss = loss + (out.final_state * gh).sum()
    loss.backward()

    close(out.y, ref.y[:, lo:hi], f"{tag} y")
    if rank == cp - 1:
        close(out.final_state, ref.final_state, f"{tag} final_state")
    for i, name in ((0, "x"), (1, "dt"), (3, "B"), (4, "C")):
        close(mine[i].grad, ref_t[i].grad[:, lo:hi], f"{tag} d{name}")
    for i, name in ((2, "A"), (5, "D")):  # shared: summed over ranks; sums of b T P terms, normwise only
        close(_all_sum(mine[i].grad), ref_t[i].grad, f"{tag} d{name}", atol=False)
    if with_init:
        g0 = mine[6].grad if mine[6].grad is not None else torch.zeros_like(mine[6])
        if rank == 0:
            close(g0, ref_t[6].grad, f"{tag} dh0")
        else:
            assert not bool(g0.any()), "ranks > 0 must not read initial_state"


def scan_cp():
    """ssd_scan_cp equals the single-process scan: lengths that do / do not divide over the ranks, chunks shorter
    and longer than a rank's slice, with and without an initial state; forward and backward."""
    for T, chunk, with_init, seed in ((48, 4, False, 1), (37, 8, True, 2), (37, 64, True, 3), (23, 5, False, 4)):
        _scan_case(T, chunk, with_init, seed)


def mixer_cp():
    """Mamba2Mixer under CP (conv halo + state passing) equals the single-process module: output, input gradient
    and every parameter gradient (summed over ranks)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    for T, chunk, seed in ((37, 8, 5), (16, 4, 6)):
        torch.manual_seed(seed)
        cfg = Mamba2MixerConfig(hidden_size=16, num_heads=8, head_dim=4, ssm_state_size=8, n_groups=2,
                                conv_kernel=4, chunk_size=chunk, norm_groups=2, dt_limit=(0.001, float("inf")))
        m = Mamba2Mixer(cfg)
        with torch.no_grad():
            m.D.normal_()
            m.dt_bias.normal_(-2.0, 1.0)
            m.conv1d.bias.normal_(0.0, 0.5)
        m_cp = Mamba2Mixer(cfg)
        m_cp.load_state_dict(m.state_dict())
        g = torch.Generator().manual_seed(seed)
        u = torch.randn(2, T, 16, generator=g)
        go = torch.randn(2, T, 16, generator=g)
        u_ref = u.clone().requires_grad_()
        (m(u_ref) * go).sum().backward()

        sl = torch.tensor_split(torch.arange(T), cp)[rank]
        lo, hi = int(sl[0]), int(sl[-1]) + 1
        u_mine = u[:, lo:hi].clone().requires_grad_()
        out = m_cp(u_mine, group=dist.group.WORLD)
        (out * go[:, lo:hi]).sum().backward()
        tag = f"mixer T={T} chunk={chunk}"
        with torch.no_grad():
            ref_out = m(u)[:, lo:hi]
        close(out, ref_out, f"{tag} out")
        close(u_mine.grad, u_ref.grad[:, lo:hi], f"{tag} d input")
        ref_p = dict(m.named_parameters())
        for name, p in m_cp.named_parameters():
            close(_all_sum(p.grad), ref_p[name].grad, f"{tag} d {name}", atol=False)


def validation_errors():
    """Sizes that differ across ranks raise the same ValueError on every rank (no hang); a slice shorter than the
    conv halo raises on every rank that holds one."""
    rank = dist.get_rank()
    b = 1 + rank  # differs
    *ins, _, _ = ssd_inputs(b, 6, 2, 2, 1, 4, 0)
    try:
        ssd_scan_cp(*ins[:5], chunk_size=4)
    except ValueError as e:
        assert "must be equal on every CP rank" in str(e) and "'b'" in str(e), str(e)
    else:
        raise AssertionError("ssd_scan_cp accepted row counts that differ across ranks")
    m = Mamba2Mixer(Mamba2MixerConfig(hidden_size=8, num_heads=2, head_dim=2, ssm_state_size=4, conv_kernel=4))
    try:
        m(torch.randn(1, 2, 8), group=dist.group.WORLD)  # 2 < conv_kernel - 1 on every rank
    except ValueError as e:
        assert "conv_kernel - 1" in str(e), str(e)
    else:
        raise AssertionError("the CP mixer accepted a slice shorter than its conv halo")


SCENARIOS = [scan_cp, mixer_cp, validation_errors]


def main() -> None:
    run_rank_worker(SCENARIOS, started=_T0, timeout_s=90, extras={"_stats": STATS})


if __name__ == "__main__":
    main()
