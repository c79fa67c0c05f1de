"""One rank of the expert-parallel tests (launched once per rank by ``tests/moe/test_ep.py``).

Runs every scenario for its world size on a gloo group and writes ``{scenario: "ok" | traceback}`` to
``<out>/rank<r>.json``. Each scenario follows the global-reference-then-shard pattern: every rank builds the same
full :class:`moe_rl.moe.MoE` and the same global batch, runs the single-process reference on the full batch,
then runs :class:`moe_rl.moe.ep.ExpertParallelMoE` on its own slice and compares outputs and all gradients.

Usage: ``python _ep_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tolerance helpers
from _rank_worker import run_rank_worker  # noqa: E402
from _tolerance import assert_normwise_close  # noqa: E402

from moe_rl.fp8.quant import dequantize, quantize_1x128  # noqa: E402
from moe_rl.moe import MoE
from moe_rl.moe.ep import ExpertParallelMoE, combine, dispatch, local_experts_forward
from moe_rl.moe.ep._checks import FUSED_MAX_EXPERTS

_T0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
# fp32 EP vs the single-process MoE: two paths of the same reductions in other orders (per-rank expert GEMMs on
# other row counts, the combine's sums, gradients all-reduced over ranks). Normwise chain bound (tests/_tolerance.py):
# reductions of <= KMAX terms (D, FF, up to 512 tokens for weight gradients), DEPTH = 2 paths x 6 reductions
# (router, gate_up, down, combine; their backward). A token sent to the wrong expert or rank, a dropped slot that
# counts or a gradient not summed is off by O(1) relative on its rows, > 1e3 x the bound.
KMAX, DEPTH = 512, 12

def close(actual, expected, what):
    assert_normwise_close(actual, expected, dtype=torch.float32, k=KMAX, depth=DEPTH, what=what)


def all_counts_equal(value: int, what: str) -> list[int]:
    t = torch.tensor([value])
    out = torch.empty(dist.get_world_size(), dtype=t.dtype)
    dist.all_gather_single(out, t)
    vals = out.tolist()
    assert len(set(vals)) == 1, f"{what} differs across ranks: {vals}"
    return vals


def compare_with_reference(
    counts,
    *,
    E,
    K,
    D=8,
    FF=8,
    replay=None,
    align=1,
    chunk_size=None,
    backend="loop",
    expect_zero_experts=False,
    ep_backend="torch",
    deepep_buffer=None,
):
    """Reference MoE on the whole batch vs EP MoE on this rank's slice; outputs and every gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    moe = MoE(D, FF, E, K, n_shared_experts=1, backend=backend)
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)  # spread the routing
        moe.router.e_score_correction_bias.normal_(0, 0.1)
    total = sum(counts)
    x_full = torch.randn(total, D)
    g_full = torch.randn(total, D)
    replay_full = replay(total) if replay is not None else None
    ep = ExpertParallelMoE.from_full(
        moe, align=align, chunk_size=chunk_size, backend=ep_backend, deepep_buffer=deepep_buffer
    )

    x_ref = x_full.clone().requires_grad_()
    out_ref = moe(x_ref, replay_full)
    (out_ref * g_full).sum().backward()

    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    x = x_full[lo:hi].clone().requires_grad_()
    a2a, restore = count_calls("all_to_all_single")
    try:
        out = ep(x, None if replay_full is None else replay_full[lo:hi])
        (out * g_full[lo:hi]).sum().backward()
    finally:
        restore()
    all_counts_equal(a2a["calls"], "all_to_all_single calls (fwd+bwd)")

    replicated = {"router.weight": ep.router.weight}
    replicated.update({f"shared_experts.{n}": p for n, p in ep.shared_experts.named_parameters()})
    summed = {}
    for name, p in replicated.items():
        assert p.grad is not None, f"{name}.grad is None on rank {rank}"
        g = p.grad.clone()
        dist.all_reduce(g)
        summed[name] = g

    assert out.shape == (hi - lo, D), out.shape
    close(out, out_ref[lo:hi].detach(), "output")
    close(x.grad, x_ref.grad[lo:hi], "x.grad")
    ref_params = dict(moe.named_parameters())
    for name, g in summed.items():
        close(g, ref_params[name].grad, f"{name}.grad (summed over ranks)")
    local = E // world
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(ep.experts, name).grad
        assert grad is not None, f"experts.{name}.grad is None on rank {rank}"
        close(
            grad, getattr(moe.experts, name).grad[rank * local : (rank + 1) * local], f"experts.{name}.grad"
        )
        if expect_zero_experts and rank != 0:
            assert torch.count_nonzero(grad) == 0, f"experts.{name}.grad on rank {rank} should be all zeros"
    return ep


def to_rank0_experts(K, local):
    def make(total):
        g = torch.Generator().manual_seed(7)
        return (
            torch.stack([torch.randperm(local, generator=g)[:K] for _ in range(total)])
            if total
            else (torch.zeros(0, K, dtype=torch.int64))
        )

    return make


# ----------------------------------------------------------------------------------------------- scenarios


def uneven_splits():
    world = dist.get_world_size()
    counts = [5, 3] if world == 2 else [5, 3, 1, 7]
    compare_with_reference(counts, E=2 * world, K=2)
    compare_with_reference(counts, E=2 * world, K=3, backend="grouped_mm")


def all_tokens_to_one_rank():
    world = dist.get_world_size()
    compare_with_reference(
        [6] * world, E=2 * world, K=2, replay=to_rank0_experts(2, 2), expect_zero_experts=True
    )


def top_k_equals_num_experts():
    world = dist.get_world_size()
    compare_with_reference([4, 6] + [3] * (world - 2), E=world * 2, K=world * 2)


def b04_zero_token_rank():
    """B04: rank 1 has 0 tokens, chunk_size 4, E=4 on EP=2 (2 per rank), K=2, D=8."""
    world = dist.get_world_size()
    counts = [10] + [0] * (world - 1)
    E = 2 * world
    ep = compare_with_reference(counts, E=E, K=2, chunk_size=4)
    compare_with_reference(
        counts, E=E, K=2, chunk_size=4, replay=to_rank0_experts(2, 2), expect_zero_experts=True
    )
    compare_with_reference(counts, E=E, K=2)  # zero tokens without chunking
    # Every rank runs max over ranks of ceil(T / 4) = 3 chunks.
    rank = dist.get_rank()
    T = counts[rank]
    x = torch.randn(T, 8, requires_grad=True)
    w = torch.rand(T, 2, requires_grad=True)
    ids = to_rank0_experts(2, 2)(T)
    recv, counts_L, handle = dispatch(x, ids, w, num_experts=E, chunk_size=4)
    assert handle.num_chunks == 3, handle.num_chunks
    y = local_experts_forward(recv, counts_L, ep.experts)
    out = combine(y, handle)
    assert out.shape == (T, 8), out.shape
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (T, 8)
    all_counts_equal(handle.num_chunks, "num_chunks")


def chunked_dispatch():
    world = dist.get_world_size()
    compare_with_reference([7, 2] + [5] * (world - 2), E=2 * world, K=2, chunk_size=3)
    compare_with_reference([7, 2] + [5] * (world - 2), E=2 * world, K=2, chunk_size=3, align=4)


def align_128_layout():
    world = dist.get_world_size()
    rank = dist.get_rank()
    E, L = 2 * world, 2
    compare_with_reference([5, 3] + [2] * (world - 2), E=E, K=2, align=128)
    torch.manual_seed(5 + rank)
    T = 9
    x = torch.randn(T, 8)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    plain, counts_plain, _ = dispatch(x, ids, w, num_experts=E)
    padded, counts_pad, h = dispatch(x, ids, w, num_experts=E, align=128)
    assert torch.equal(counts_pad, (counts_plain + 127) // 128 * 128), (counts_pad, counts_plain)
    assert padded.shape == (int(counts_pad.sum()), 8)
    assert h.layout_P.shape == (padded.shape[0],)
    start = 0
    for e in range(L):
        n, p = int(counts_plain[e]), int(counts_pad[e])
        assert p % 128 == 0
        assert torch.equal(h.layout_P[start : start + n], torch.full((n,), e)), h.layout_P[start : start + n]
        assert torch.equal(h.layout_P[start + n : start + p], torch.full((p - n,), -1))
        assert torch.equal(padded[start : start + n], plain[int(counts_plain[:e].sum()) :][:n])
        assert torch.count_nonzero(padded[start + n : start + p]) == 0
        start += p


def validation_errors():
    rank = dist.get_rank()
    x, w = torch.randn(3, 8), torch.rand(3, 2)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    try:
        dispatch(x, ids, w, num_experts=4 if rank == 0 else 8)
    except ValueError as err:
        assert "disagree on num_experts" in str(err) and "[4, 8" in str(err), str(err)
    else:
        raise AssertionError("mismatched num_experts did not raise")
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = 99
    try:
        dispatch(x, bad, w, num_experts=4)
    except ValueError as err:
        assert "rank(s) [1]" in str(err), str(err)
        if rank == 1:
            assert "[0, 99]" in str(err) and "num_experts - 1 = 3" in str(err), str(err)
    else:
        raise AssertionError("out-of-range topk_ids did not raise")
    world = dist.get_world_size()
    try:
        dispatch(x, ids, w, num_experts=world + 1)
    except ValueError as err:
        assert f"num_experts={world + 1} must be a positive multiple" in str(err), str(err)
    else:
        raise AssertionError("num_experts not divisible by ep did not raise")
    # the group still works after the errors
    dispatch(x, ids, w, num_experts=2 * world)


def check_dropped_slots(scale: float = 1.0, **dispatch_kwargs) -> None:
    """Slots with expert id -1 go nowhere (DeepEP convention): experts ``y = scale * x`` give
    ``scale * sum over valid k of w x``, and the gradients of x and the gate weights follow; ``dispatch_kwargs``
    pick the backend (and its buffer) or the chunking."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(21 + rank)
    T, E = 7, 2 * world
    x = torch.randn(T, 8, requires_grad=True)
    w = torch.rand(T, 3, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(T)])
    ids[::2, 1] = -1
    ids[3] = -1
    g = torch.randn(T, 8)
    recv, counts_L, h = dispatch(x, ids, w, num_experts=E, **dispatch_kwargs)
    assert recv.shape[0] == int(counts_L.sum())
    out = combine(recv * scale, h)
    (out * g).sum().backward()
    valid = (ids >= 0).float()
    close(out, scale * torch.einsum("tk,td->td", w.detach() * valid, x.detach()), "output with dropped slots")
    close(x.grad, scale * (w.detach() * valid).sum(1, keepdim=True) * g, "x.grad with dropped slots")
    close(w.grad, scale * valid * (x.detach() * g).sum(1, keepdim=True), "topk_weights.grad with dropped slots")


def dropped_slots():
    """Dropped (-1) slots through the chunked torch backend, identity experts."""
    check_dropped_slots(chunk_size=3)


def float8_rows():
    """float8 rows travel as uint8 through gloo and arrive bit-identical."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(11 + rank)
    x = torch.randn(6, 8).to(torch.float8_e4m3fn)
    ids = torch.stack([torch.randperm(2 * world)[:2] for _ in range(6)])
    w = torch.rand(6, 2)
    recv, _, h = dispatch(x, ids, w, num_experts=2 * world)
    ref, _, _ = dispatch(x.view(torch.uint8), ids, w, num_experts=2 * world)
    assert recv.dtype == torch.float8_e4m3fn and torch.equal(recv.view(torch.uint8), ref)


def count_calls(name: str):
    """Count calls of ``dist.<name>`` (and bytes sent to other ranks, for ``all_to_all_single``) until restored."""
    real = getattr(dist, name)
    stats = {"calls": 0, "remote_bytes": 0}

    def wrapper(out, inp, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        stats["calls"] += 1
        if name == "all_to_all_single" and inp.dim() > 0 and inp.shape[0]:
            row_bytes = inp[0].numel() * inp.element_size()
            splits = input_split_sizes or [inp.shape[0] // dist.get_world_size()] * dist.get_world_size()
            stats["remote_bytes"] += row_bytes * (sum(splits) - splits[dist.get_rank()])
        if output_split_sizes is None and input_split_sizes is None:
            return real(out, inp, *args, **kwargs)
        return real(out, inp, output_split_sizes, input_split_sizes, *args, **kwargs)

    setattr(dist, name, wrapper)
    return stats, lambda: setattr(dist, name, real)


def handle_reuse():
    """dispatch(handle=h) reuses the layout: no count collective, bit-identical rows, outputs and gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(31 + rank)
    T, E, K = 9 + 2 * rank, 2 * world, 3
    x0, w0, g = torch.randn(T, 8), torch.rand(T, K), torch.randn(T, 8)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[::3, 2] = -1
    for align, chunk_size in ((1, None), (4, 3)):
        results = []
        cached = None
        for reuse in (False, True):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            gathers, restore_g = count_calls("all_gather_single")
            a2a, restore_a = count_calls("all_to_all_single")
            try:
                recv, counts_L, h = dispatch(
                    x,
                    ids,
                    w,
                    num_experts=E,
                    align=align,
                    chunk_size=chunk_size,
                    handle=cached if reuse else None,
                )
                out = combine(recv * 2.0, h)
                (out * g).sum().backward()
            finally:
                restore_g()
                restore_a()
            if reuse:
                assert gathers["calls"] == 0, f"reused handle ran {gathers['calls']} all_gather(s)"
            else:
                assert gathers["calls"] in (1, 2), gathers
            assert a2a["calls"] == 4 * h.num_chunks, (a2a, h.num_chunks)  # rows only: fwd + bwd, both ways
            cached = h
            results.append((recv.detach(), counts_L, h.layout_P, out.detach(), x.grad, w.grad))
        for name, a, b in zip(
            ("recv_x", "counts", "layout", "out", "x.grad", "w.grad"), *results, strict=True
        ):
            assert torch.equal(a, b), (
                f"{name} differs with a reused handle (align={align}, chunk={chunk_size})"
            )
    try:
        dispatch(x0[:-1], ids[:-1], w0[:-1], num_experts=E, align=4, chunk_size=3, handle=cached)
    except ValueError as err:
        assert "x_TD shape" in str(err) and "handle=None" in str(err), str(err)
    else:
        raise AssertionError("a handle reused with other shapes did not raise")


def many_experts():
    """E above FUSED_MAX_EXPERTS: counts travel in a second all_gather; identity experts give sum_k w x."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(41 + rank)
    E = (FUSED_MAX_EXPERTS // world + 1) * world
    T, K = 6, 3
    x, w = torch.randn(T, 8), torch.rand(T, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    gathers, restore = count_calls("all_gather_single")
    try:
        recv, counts_L, h = dispatch(x, ids, w, num_experts=E)
    finally:
        restore()
    assert gathers["calls"] == 2, gathers
    assert counts_L.shape == (E // world,) and recv.shape[0] == int(counts_L.sum())
    close(combine(recv, h), w.sum(1, keepdim=True) * x, "identity experts with many experts")


SQNR_FLOOR_DB = 28.0
"""Floor for e4m3 with 1x128 scales. Round-to-nearest with 3 mantissa bits bounds each normal value's relative
error by 2^-4, so SQNR >= 20 log10(16) = 24.1 dB in the worst case; the error is spread over [-2^-4, 2^-4] times a
mantissa-dependent factor, which gives about 31.8 dB on Gaussian rows (measured, fp32 and bf16 inputs). 28 dB keeps
~4 dB of margin yet fails for e5m2 (2 mantissa bits, ~6 dB less: ~25.8 dB)."""


def sqnr_db(ref, approx):
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def qdq(x):
    """The quantizer the fp8 dispatch applies: dequantize(quantize_1x128(x)) in x's dtype."""
    return dequantize(*quantize_1x128(x), (1, 128), out_dtype=x.dtype)


def fp8_dispatch():
    """fp8 payload: bit-identical to dispatching qdq(x), SQNR floor vs the unquantized path, (codes, scales) output,
    straight-through gradients, fp8 combine backward, handle reuse."""
    world, rank = dist.get_world_size(), dist.get_rank()
    E, K, D = 2 * world, 2, 320  # D = 2 full 128-blocks + a 64-wide tail block: G = 3 scales per row
    for dtype, align, chunk_size in ((torch.float32, 1, None), (torch.bfloat16, 4, 3)):
        torch.manual_seed(61 + rank)
        T = 7 + 3 * rank
        x0 = torch.randn(T, D).to(dtype)
        w0 = torch.rand(T, K)
        g = torch.randn(T, D).to(dtype)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        ids[::4, 1] = -1
        kw = dict(num_experts=E, align=align, chunk_size=chunk_size)
        what = f"({dtype}, align={align}, chunk={chunk_size})"

        def expert(r):
            return torch.tanh(r) * 2.0  # nonlinear, so the gradient depends on the (quantized) point

        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        recv, counts_L, h = dispatch(x, ids, w, fp8=True, **kw)
        assert recv.dtype == dtype and recv.shape == (int(counts_L.sum()), D), (recv.dtype, recv.shape)
        out = combine(expert(recv), h)
        (out * g).sum().backward()

        # straight-through reference: the unquantized-dtype dispatch of the quantized input, as a leaf
        xq = qdq(x0).requires_grad_()
        wq = w0.clone().requires_grad_()
        recv_ref, counts_ref, h_ref = dispatch(xq, ids, wq, **kw)
        out_ref = combine(expert(recv_ref), h_ref)
        (out_ref * g).sum().backward()
        assert torch.equal(counts_L, counts_ref)
        assert torch.equal(recv, recv_ref), f"fp8 dispatch != dispatch(qdq(x)) {what}"
        assert torch.equal(out, out_ref), f"fp8 combine output {what}"
        assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all(), what
        assert x.grad.dtype == dtype
        assert torch.equal(x.grad, xq.grad), f"x.grad is not the straight-through gradient {what}"
        assert torch.equal(w.grad, wq.grad), f"topk_weights.grad {what}"

        # SQNR vs the unquantized path, over the real (non-padding) rows, pooled over ranks
        plain, _, _ = dispatch(x0, ids, w0, **kw)
        valid = h.layout_P >= 0
        err = torch.tensor(
            [
                plain[valid].double().pow(2).sum(),
                (plain[valid].double() - recv.detach()[valid].double()).pow(2).sum(),
            ]
        )
        dist.all_reduce(err)
        db = 10 * math.log10(err[0].item() / err[1].item())
        assert db > SQNR_FLOOR_DB, f"fp8 dispatch SQNR {db:.1f} dB <= {SQNR_FLOOR_DB} dB {what}"
        FP8_STATS[f"sqnr_db_{str(dtype).split('.')[-1]}"] = round(db, 2)

        # (codes, scales) for an FP8 grouped GEMM
        (codes, scales), counts_c, _ = dispatch(x0, ids, w0, fp8=True, fp8_output="codes", handle=h, **kw)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == (recv.shape[0], D), (
            codes.dtype,
            codes.shape,
        )
        assert scales.dtype == torch.float32 and scales.shape == (recv.shape[0], 3), (
            scales.dtype,
            scales.shape,
        )
        assert torch.equal(dequantize(codes, scales, (1, 128), out_dtype=dtype), recv.detach()), what
        assert (
            torch.count_nonzero(scales[~valid]) == 0
            and torch.count_nonzero(codes[~valid].view(torch.uint8)) == 0
        )

        # handle reuse with the fp8 payload: no count collective, bit-identical rows and gradients
        x2 = x0.clone().requires_grad_()
        gathers, restore = count_calls("all_gather_single")
        try:
            recv2, _, h2 = dispatch(x2, ids, w0, fp8=True, handle=h, **kw)
            combine(expert(recv2), h2).mul(g).sum().backward()
        finally:
            restore()
        assert gathers["calls"] == 0, gathers
        assert torch.equal(recv2, recv) and torch.equal(x2.grad, x.grad), f"fp8 dispatch with a handle {what}"

        # fp8 backward of combine: y.grad is the straight-through dispatch of the FP8 per-slot gradients
        y = recv.detach().float().requires_grad_()
        y_ref = y.detach().clone().requires_grad_()
        combine(y, h, fp8_backward=True).mul(g.float()).sum().backward()
        combine(y_ref, h).mul(g.float()).sum().backward()
        assert torch.isfinite(y.grad).all()
        assert torch.count_nonzero(y.grad[~valid]) == 0
        gerr = torch.tensor(
            [y_ref.grad.double().pow(2).sum(), (y_ref.grad.double() - y.grad.double()).pow(2).sum()]
        )
        dist.all_reduce(gerr)
        gdb = 10 * math.log10(gerr[0].item() / gerr[1].item())
        assert gdb > SQNR_FLOOR_DB, f"fp8 combine-backward SQNR {gdb:.1f} dB {what}"
        assert not torch.equal(y.grad, y_ref.grad), "fp8_backward did not quantize the gradients"

    # a non-finite x on one rank raises on every rank, before any token moves
    x = torch.randn(4, D)
    if rank == 1:
        x[2, 5] = float("nan")
    try:
        dispatch(x, torch.zeros(4, K, dtype=torch.int64), torch.rand(4, K), num_experts=E, fp8=True)
    except ValueError as err:
        assert "rank(s) [1]" in str(err), str(err)
        if rank == 1:
            assert "non-finite" in str(err), str(err)
    else:
        raise AssertionError("non-finite x with fp8=True did not raise")

    # ... and with a reused handle (no validation all_gather) it still raises on EVERY rank, so no peer is left
    # waiting in the row exchange; the message names the bad rank
    ids = torch.zeros(4, K, dtype=torch.int64)
    _, _, h = dispatch(torch.randn(4, D), ids, torch.rand(4, K), num_experts=E, fp8=True)
    try:
        dispatch(x, ids, torch.rand(4, K), num_experts=E, fp8=True, handle=h)
    except ValueError as err:
        assert "non-finite" in str(err) and "rank(s) [1]" in str(err), str(err)
    else:
        raise AssertionError("non-finite x with fp8=True and handle= did not raise")

    # a non-finite gradient reaching combine(fp8_backward=True) raises on every rank too
    y = torch.randn(int(h.num_recv_rows), D, requires_grad=True)
    gbad = torch.randn(4, D)
    if rank == 1:
        gbad[0, 0] = float("inf")
    try:
        combine(y, h, fp8_backward=True).mul(gbad).sum().backward()
    except ValueError as err:
        assert "non-finite" in str(err) and "rank(s) [1]" in str(err), str(err)
    else:
        raise AssertionError("non-finite gradient with fp8_backward=True did not raise")
    # the group still works afterwards
    dispatch(torch.randn(4, D), ids, torch.rand(4, K), num_experts=E, fp8=True, handle=h)


FP8_STATS: dict[str, float] = {}


def fp8_wire_bytes():
    """Bytes on the wire of an fp8 dispatch = codes + scales: (D + 4 * ceil(D / 128)) / (2 * D) of bf16."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(71 + rank)
    T, E, K = 64, 4 * world, 4
    for D in (128, 320):
        x = torch.randn(T, D).bfloat16()
        ids = torch.rand(T, E).topk(K, dim=-1).indices
        w = torch.rand(T, K)
        sent = {}
        for fp8 in (False, True):
            a2a, restore = count_calls("all_to_all_single")
            try:
                dispatch(x, ids, w, num_experts=E, fp8=fp8)
            finally:
                restore()
            assert a2a["calls"] == 1, a2a  # codes and scales travel packed in the same exchange
            sent[fp8] = a2a["remote_bytes"]
        G = math.ceil(D / 128)
        assert sent[False] > 0
        assert sent[True] * 2 * D == sent[False] * (D + 4 * G), (sent, D)
        FP8_STATS[f"wire_ratio_D{D}"] = round(sent[True] / sent[False], 4)


def fp8_ep_moe():
    """ExpertParallelMoE(fp8_dispatch=True): close to the bf16-payload block, and handle= replays the layout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(81)
    D, FF, E, K = 256, 16, 2 * world, 2
    moe = MoE(D, FF, E, K, n_shared_experts=1, backend="loop")
    ep = ExpertParallelMoE.from_full(moe)
    ep8 = ExpertParallelMoE.from_full(moe, fp8_dispatch=True, fp8_combine_backward=True)
    assert "fp8_dispatch=True" in repr(ep8)
    torch.manual_seed(82 + rank)
    T = 6 + rank
    x0, g = torch.randn(T, D), torch.randn(T, D)
    x, x8 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    out = ep(x)
    (out * g).sum().backward()
    out8 = ep8(x8)
    (out8 * g).sum().backward()
    assert sqnr_db(out, out8) > SQNR_FLOOR_DB, sqnr_db(out, out8)
    assert torch.isfinite(x8.grad).all() and sqnr_db(x.grad, x8.grad) > SQNR_FLOOR_DB - 3, sqnr_db(
        x.grad, x8.grad
    )
    # replayed routing reuses the layout: no count collective, same output
    replay = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    first = ep8(x0, replay)
    gathers, restore = count_calls("all_gather_single")
    try:
        again = ep8(x0, replay, handle=ep8.last_handle)
    finally:
        restore()
    assert gathers["calls"] == 0, gathers
    assert torch.equal(first, again)


WIRE: dict[str, float] = {}


def wire_bytes():
    """Bytes the torch backend sends to other ranks (dispatch + combine, fwd + bwd) vs the per-slot ideal
    ``4 * T * K * (ep - 1) / ep * D * bytes`` for uniform routing, and vs DeepEP-style per-(token, rank) dedup."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(51 + rank)
    T, E, K, D = 512, 4 * world, 4, 64
    x = torch.randn(T, D, generator=g, requires_grad=True)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices  # uniform top-K without replacement
    a2a, restore = count_calls("all_to_all_single")
    try:
        recv, _, h = dispatch(x, ids, w, num_experts=E)
        combine(recv, h).sum().backward()
    finally:
        restore()
    row = D * x.element_size()
    remote_slots = int(((ids // (E // world)) != rank).sum())
    totals = torch.tensor([a2a["remote_bytes"], T, remote_slots], dtype=torch.float64)
    dist.all_reduce(totals)
    # exactly one row per remote slot in each of the 4 exchanges (summed over ranks: sent = received)
    assert totals[0].item() == 4 * totals[2].item() * row, (totals, row)
    ideal = 4 * totals[1].item() * K * (world - 1) / world * row
    local = E // world
    distinct_remote = (world - 1) * (1 - math.comb(E - local, K) / math.comb(E, K))
    dedup = 4 * totals[1].item() * distinct_remote * row
    WIRE.update(
        measured_bytes=totals[0].item(),
        ideal_per_slot_bytes=ideal,
        ratio_to_per_slot_ideal=totals[0].item() / ideal,
        ideal_dedup_bytes=dedup,
        ratio_to_dedup_ideal=totals[0].item() / dedup,
    )
    assert 0.9 < WIRE["ratio_to_per_slot_ideal"] < 1.1, WIRE


def replay_sentinel_rows():
    """Router replay with sentinel rows through EP: pad rows (-1, filled by pad ordinal) on rank 0's slice and
    own-routing rows (-2) on both ranks; outputs and every gradient equal the single-process MoE's."""
    world = dist.get_world_size()
    counts = [6, 5] + [3] * (world - 2)
    E, K = 2 * world, 2

    def make(total):
        g = torch.Generator().manual_seed(11)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(total)])
        ids[[1, 4, 5]] = -1  # pads: rank 0's rows, so local and global pad ordinals agree
        ids[[2, counts[0] + 1]] = -2  # the trainer routes these itself
        return ids

    compare_with_reference(counts, E=E, K=K, replay=make)


def one_expert_per_rank():
    """E = world (one local expert): the received rank-major rows are already expert-major, so dispatch and combine
    skip their expert-side gathers; outputs and gradients still equal the single-process MoE."""
    world = dist.get_world_size()
    counts = [5, 3] + [4] * (world - 2)
    compare_with_reference(counts, E=world, K=1)
    compare_with_reference(counts, E=world, K=world)  # top_k = E
    compare_with_reference(counts, E=world, K=1, chunk_size=3)  # chunked: the skip must not apply
    compare_with_reference(counts, E=world, K=1, align=4)  # padded: the skip must not apply


def fp8_zero_token_rank():
    """fp8 dispatch + fp8 combine-backward with a rank that has no tokens (its empty fp8 scales used to fail to pack,
    leaving the peers waiting in the exchange): every rank's result equals dispatching the quantize-dequantized
    input, and the backward runs, chunked and unchunked, for one and several 128-column blocks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    E, K = 2 * world, 2
    for D, chunk_size in ((128, 4), (256, None)):
        torch.manual_seed(71 + rank)
        T = 6 if rank == 0 else 0
        x0 = torch.randn(T, D)
        w0 = torch.rand(T, K)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        recv, counts_L, h = dispatch(x, ids, w, num_experts=E, fp8=True, chunk_size=chunk_size)
        recv_ref, counts_ref, _ = dispatch(qdq(x0), ids, w0, num_experts=E, chunk_size=chunk_size)
        what = f"(D={D}, chunk={chunk_size})"
        assert torch.equal(counts_L, counts_ref), (counts_L, counts_ref)
        assert torch.equal(recv.detach(), recv_ref), f"fp8 dispatch with a zero-token rank {what}"
        out = combine(recv * 2, h, fp8_backward=True)
        assert out.shape == (T, D), out.shape
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == (T, D) and torch.isfinite(x.grad).all(), what


SCENARIOS = {
    2: [
        replay_sentinel_rows,
        uneven_splits,
        all_tokens_to_one_rank,
        top_k_equals_num_experts,
        b04_zero_token_rank,
        chunked_dispatch,
        align_128_layout,
        validation_errors,
        dropped_slots,
        float8_rows,
        handle_reuse,
        many_experts,
        wire_bytes,
        fp8_dispatch,
        fp8_wire_bytes,
        fp8_ep_moe,
        one_expert_per_rank,
        fp8_zero_token_rank,
    ],
    4: [uneven_splits, b04_zero_token_rank, chunked_dispatch, handle_reuse, wire_bytes],
}


def main() -> None:
    run_rank_worker(lambda world: SCENARIOS[world], started=_T0, extras={"_wire_bytes": WIRE, "_fp8": FP8_STATS})


if __name__ == "__main__":
    main()
