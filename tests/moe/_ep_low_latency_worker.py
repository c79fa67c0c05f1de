"""One rank of the low-latency EP tests (launched once per rank by ``tests/moe/test_ep_low_latency.py``).

Every rank builds the same full :class:`moe_rl.moe.MoE` and the same global decode batch, runs the single-process
MoE on the whole batch (the reference), then runs the EP decode step on its own slice::

    ids, w = router(x)  ->  low_latency_dispatch  ->  masked_experts_forward(local experts)  ->  low_latency_combine
    + shared experts

with ``backend="torch"`` and with ``backend="deep_ep"`` (the CPU/gloo stand-in in ``tests/moe/fake_deep_ep``, put
first on ``sys.path``; it fills slab padding with NaN and reverses the row order inside each source block, as real
DeepEP gives no guarantee on either). For the torch backend the test itself overwrites every padding row of the
slabs (input and expert output) with NaN, so a single read of a padding row makes the result NaN.
Writes ``{scenario: "ok" | traceback}`` to ``<out>/rank<r>.json``.

Usage: ``python _ep_low_latency_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("fake_deep_ep")))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tolerance helpers
_T0 = time.perf_counter()

import deep_ep  # noqa: E402  (the stand-in)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _tolerance import assert_normwise_close  # noqa: E402

from moe_rl.fp8.quant import dequantize, quantize_1x128  # noqa: E402
from moe_rl.moe import MoE  # noqa: E402
from moe_rl.moe.ep.low_latency import (  # noqa: E402
    dequantize_masked,
    low_latency_combine,
    low_latency_dispatch,
    make_low_latency_buffer,
    masked_experts_forward,
)

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
# fp32 low-latency EP vs the single-process MoE: two paths of the same reductions in other orders; normwise chain
# bound as in tests/moe/_ep_worker.py (reductions <= KMAX terms, DEPTH = 2 paths x 6 reductions).
KMAX, DEPTH = 512, 12
SQNR_FLOOR_DB = 28.0
"""e4m3 with 1x128 scales: relative rounding error <= 2^-4 per value, ~31.8 dB on Gaussian rows (measured in
``tests/moe/_ep_worker.py``); the decode step adds bf16-free fp32 math only, so the same 28 dB floor applies."""


def close(actual, expected, what):
    assert_normwise_close(actual, expected, dtype=torch.float32, k=KMAX, depth=DEPTH, what=what)


def sqnr_db(ref, approx):
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def nan_padding(t_LSH, count_L):
    """Copy of the slabs with every row at or beyond count_L[l] set to NaN."""
    rows = torch.arange(t_LSH.shape[1])[None, :, None] >= count_L[:, None, None]
    return t_LSH.masked_fill(rows, float("nan"))


def build(E, K, D=8, FF=8, dtype=torch.float32, seed=1234):
    torch.manual_seed(seed)
    moe = MoE(D, FF, E, K, n_shared_experts=1, backend="loop")
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)
        moe.router.e_score_correction_bias.normal_(0, 0.1)
    return moe.to(dtype)


def decode_step(moe, x, replay, *, backend, M, masked="loop", use_fp8=False, nan_pad=True):
    """EP decode step of this rank's tokens; returns (out [T, D], recv_count [L])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E = moe.experts.num_experts
    L = E // world
    with torch.no_grad():
        ids, w, _ = moe.router(x, replay)
        buffer = (  # the caller owns DeepEP's low-latency buffer (collective: every rank makes it here)
            make_low_latency_buffer(None, max_tokens_per_rank=M, hidden=x.shape[1], num_experts=E)
            if backend == "deep_ep"
            else None
        )
        recv, count, h = low_latency_dispatch(
            x, ids, num_experts=E, max_tokens_per_rank=M, backend=backend, buffer=buffer, use_fp8=use_fp8
        )
        if use_fp8:
            codes, scales = recv
            assert codes.dtype == torch.float8_e4m3fn and codes.shape == (L, M * world, x.shape[1]), (
                codes.shape
            )
            assert scales.shape == (L, M * world, x.shape[1] // 128) and scales.stride(1) == 1, (
                scales.stride()
            )
            recv = dequantize_masked(codes, scales, x.dtype)
        assert recv.shape == (L, M * world, x.shape[1]), recv.shape
        assert count.dtype == torch.int32 and count.shape == (L,), (count.dtype, count.shape)
        if nan_pad:
            recv = nan_padding(recv, count)
        sl = slice(rank * L, (rank + 1) * L)
        y = masked_experts_forward(
            recv, count, moe.experts.gate_up_proj[sl], moe.experts.down_proj[sl], backend=masked
        )
        if nan_pad:
            y = nan_padding(y, count)
        out = low_latency_combine(y, w, h) + moe.shared_experts(x)
    return out, count, ids


def global_expert_counts(ids, E):
    """Slots routed to each expert, summed over all ranks (an independent count of recv_count)."""
    c = torch.bincount(ids[ids >= 0].reshape(-1), minlength=E)
    dist.all_reduce(c)
    return c


def compare(counts, *, E, K, M, backend, replay=None, masked="loop", dtype=torch.float32, use_fp8=False, D=8):
    rank, world = dist.get_rank(), dist.get_world_size()
    moe = build(E, K, D=D, dtype=dtype)
    total = sum(counts)
    x_full = torch.randn(total, D).to(dtype)
    replay_full = replay(total) if replay is not None else None
    with torch.no_grad():
        ref = moe(x_full, replay_full)
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    out, count, ids = decode_step(
        moe,
        x_full[lo:hi],
        None if replay_full is None else replay_full[lo:hi],
        backend=backend,
        M=M,
        masked=masked,
        use_fp8=use_fp8,
    )
    assert out.shape == (hi - lo, D) and out.dtype == dtype, (out.shape, out.dtype)
    assert torch.isfinite(out).all(), "a NaN padding row reached the output"
    L = E // world
    assert torch.equal(count.long(), global_expert_counts(ids, E)[rank * L : (rank + 1) * L]), count
    return out, ref[lo:hi], count


def _replay_all_to(expert_ids):
    def make(total):
        return torch.tensor(expert_ids, dtype=torch.int64).expand(total, len(expert_ids)).clone()

    return make


def _cases(world):
    E = 2 * world
    return [
        # (counts, E, K, M, replay)
        ([3, 2] + [4, 1][: world - 2] + [2] * max(0, world - 4), E, 2, 4, None),  # uneven
        ([5] + [0] * (world - 1), E, 2, 5, None),  # B04: zero tokens on every rank but 0
        ([0, 3] + [1] * (world - 2), E, E, 3, None),  # top_k = E, rank 0 empty
        (
            [4] * world,
            E,
            1,
            4,
            _replay_all_to([0]),
        ),  # all tokens to one expert: slab 0 of rank 0 exactly full
        (
            [2, 3] + [2] * (world - 2),
            E,
            2,
            3,
            _replay_all_to([E - 1, E - 2]),
        ),  # all to the last rank's experts
    ]


def decode_equals_reference_torch():
    world = dist.get_world_size()
    for i, (counts, E, K, M, replay) in enumerate(_cases(world)):
        for masked in ("loop", "bmm"):
            out, ref, count = compare(counts, E=E, K=K, M=M, backend="torch", replay=replay, masked=masked)
            close(out, ref, f"torch backend case {i} masked={masked}")
            if i == 3 and dist.get_rank() == 0:
                assert count.tolist() == [4 * world, 0], count  # the whole S = M * R slab is used


def decode_equals_reference_deep_ep():
    world = dist.get_world_size()
    before = dict(deep_ep.CALLS)
    for i, (counts, E, K, M, replay) in enumerate(_cases(world)):
        out, ref, _ = compare(counts, E=E, K=K, M=M, backend="deep_ep", replay=replay, masked="bmm")
        close(out, ref, f"deep_ep backend case {i}")
    n = len(_cases(world))
    assert deep_ep.CALLS["ll_dispatch"] - before["ll_dispatch"] == n, deep_ep.CALLS
    assert deep_ep.CALLS["ll_combine"] - before["ll_combine"] == n, deep_ep.CALLS


def slab_layout():
    """recv_count, block order by source rank, row contents: torch backend vs an independent all_gather view; the
    deep_ep stand-in holds the same rows per (expert, source rank) block (in its own order within a block)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E, K, M, D = 2 * world, 2, 5, 8
    L = E // world
    torch.manual_seed(50 + rank)
    T = [5, 2, 0, 4][rank]
    x = torch.randn(T, D)
    ids = (
        torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    )
    if T:
        ids[0, 1] = -1
    xs = [torch.empty(M, D) for _ in range(world)]
    dist.all_gather(xs, torch.cat([x, x.new_zeros(M - T, D)]))
    ii = [torch.empty(M, K, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(ii, torch.cat([ids, ids.new_full((M - T, K), -1)]))
    with torch.no_grad():
        recv, count, _ = low_latency_dispatch(x, ids, num_experts=E, max_tokens_per_rank=M)
        buffer = make_low_latency_buffer(None, max_tokens_per_rank=M, hidden=D, num_experts=E)
        recv_d, count_d, hd = low_latency_dispatch(
            x, ids, num_experts=E, max_tokens_per_rank=M, backend="deep_ep", buffer=buffer
        )
    assert torch.equal(count, count_d), (count, count_d)
    src_info, layout_range = hd.deep_handle[0], hd.deep_handle[1]
    for le in range(L):
        e = rank * L + le
        expected = torch.cat(
            [xs[j][(ii[j] == e).any(1)] for j in range(world)]
        )  # by source rank, token order
        n = expected.shape[0]
        assert int(count[le]) == n, (count, n)
        assert torch.equal(recv[le, :n], expected), f"slab {le}: rows are not (source rank, token) ordered"
        assert torch.count_nonzero(recv[le, n:]) == 0, "torch backend padding rows are not zero"
        for j in range(world):
            begin, c = int(layout_range[le, j]) >> 32, int(layout_range[le, j]) & 0xFFFFFFFF
            toks = (ii[j] == e).any(1).nonzero().flatten()
            assert c == toks.numel(), (le, j, c, toks)
            got = recv_d[le, begin : begin + c]
            assert torch.equal(got, xs[j][src_info[le, begin : begin + c].long()]), (
                "src_info does not name the rows"
            )
            assert sorted(src_info[le, begin : begin + c].tolist()) == toks.tolist()
        assert torch.isnan(recv_d[le, n:]).all(), "stand-in padding is not NaN (test would be weaker)"


def bf16_decode():
    """bf16 decode step vs the fp32 single-process MoE on the same (bf16-representable) weights and inputs.

    Bound: each value goes through ~4 bf16 roundings (gate/up output, SwiGLU product, down output, final cast), each
    <= 2^-9 relative (round to nearest, 8-bit significand), plus fp32 accumulation; 4 * 2^-8 * max|ref| leaves 2x
    margin on that and is still ~60x smaller than the outputs' spread, so a wrong row or weight fails it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts, E, K, M, D = [3, 2] + [2] * (world - 2), 2 * world, 2, 3, 16
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    for backend in ("torch", "deep_ep"):
        moe_b = build(E, K, D=D, dtype=torch.bfloat16)
        xb = torch.randn(sum(counts), D).to(torch.bfloat16)
        moe32 = copy.deepcopy(moe_b).float()
        with torch.no_grad():
            replay = moe32.router(xb.float())[0]  # same routing for both (no tie flips between dtypes)
            ref = moe32(xb.float(), replay)
        out, _, _ = decode_step(moe_b, xb[lo:hi], replay[lo:hi], backend=backend, M=M)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        bound = 4 * 2**-8 * ref.abs().max().item()
        err = (out.float() - ref[lo:hi]).abs().max().item() if hi > lo else 0.0
        assert err <= bound, f"{backend}: bf16 decode error {err:.3g} > bound {bound:.3g}"


def fp8_decode():
    """use_fp8: torch backend rows are exactly dequantize(quantize_1x128(x)) (same quantizer as normal-mode FP8);
    the decode step (both backends) stays above the e4m3 SQNR floor against the unquantized fp32 reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E, K, M, D = 2 * world, 2, 4, 256
    counts = [4, 3] + [1] * (world - 2)
    for backend, cnt in (("torch", counts), ("deep_ep", counts), ("torch", [3] + [0] * (world - 1))):
        out, ref, _ = compare(cnt, E=E, K=K, M=M, backend=backend, use_fp8=True, D=D)
        if out.shape[0]:
            db = sqnr_db(ref, out)
            assert db > SQNR_FLOOR_DB, f"{backend}: fp8 decode SQNR {db:.1f} dB <= {SQNR_FLOOR_DB}"
    torch.manual_seed(60 + rank)
    x = torch.randn(counts[rank], D)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(x.shape[0])])
    with torch.no_grad():
        (codes, scales), count, _ = low_latency_dispatch(
            x, ids, num_experts=E, max_tokens_per_rank=M, use_fp8=True
        )
        qdq = dequantize(*quantize_1x128(x), (1, 128), out_dtype=x.dtype)
        ref_rows, ref_count, _ = low_latency_dispatch(qdq, ids, num_experts=E, max_tokens_per_rank=M)
    assert torch.equal(count, ref_count)
    got = dequantize_masked(codes, scales, torch.float32)
    assert torch.equal(got, ref_rows), "fp8 rows != dispatch of dequantize(quantize_1x128(x))"


def validation_errors():
    rank, world = dist.get_rank(), dist.get_world_size()
    E, M = 2 * world, 4
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 1], [1, 2], [-1, 0]])

    def expect(msg, fn):
        try:
            fn()
        except ValueError as err:
            assert msg in str(err), f"expected {msg!r} in: {err}"
        else:
            raise AssertionError(f"no ValueError ({msg})")

    kw = dict(num_experts=E, max_tokens_per_rank=M)
    expect(
        "T=5 tokens but max_tokens_per_rank=4",
        lambda: low_latency_dispatch(torch.randn(5, 8), ids[:1].expand(5, 2), **kw),
    )
    expect(
        "max_tokens_per_rank=300 must be in [1, 256]",
        lambda: low_latency_dispatch(x, ids, num_experts=E, max_tokens_per_rank=300),
    )
    expect(
        f"num_experts={E + 1} must be a positive multiple",
        lambda: low_latency_dispatch(x, ids, num_experts=E + 1, max_tokens_per_rank=M),
    )
    expect(
        f"ids [{E}] outside [-1, num_experts={E})",
        lambda: low_latency_dispatch(x, torch.tensor([[0, E]] * 3), **kw),
    )
    expect("names an expert twice", lambda: low_latency_dispatch(x, torch.tensor([[1, 1]] * 3), **kw))
    expect("multiple of 128", lambda: low_latency_dispatch(x, ids, use_fp8=True, **kw))
    x_inf = torch.randn(3, 128)
    x_inf[1, 7] = float("inf")
    expect("x_TH has 1 non-finite values", lambda: low_latency_dispatch(x_inf, ids, use_fp8=True, **kw))
    expect(
        "x_TH must be a float32/bfloat16/float16", lambda: low_latency_dispatch(ids.float().long(), ids, **kw)
    )
    expect("backend='nccl' is not supported", lambda: low_latency_dispatch(x, ids, backend="nccl", **kw))
    expect("x_TH requires grad", lambda: low_latency_dispatch(x.clone().requires_grad_(), ids, **kw))
    with torch.no_grad():
        recv, count, h = low_latency_dispatch(x, ids, **kw)
    expect("y_LSH has shape", lambda: low_latency_combine(recv[:, :1], torch.rand(3, 2), h))
    expect("topk_weights_TK has shape", lambda: low_latency_combine(recv, torch.rand(3, 3), h))
    expect(
        "topk_weights_TK requires grad",
        lambda: low_latency_combine(recv, torch.rand(3, 2, requires_grad=True), h),
    )
    # a data error on rank 1 only: with check_across_ranks every rank raises and names it
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = 99
    expect("bad input on rank(s) [1]", lambda: low_latency_dispatch(x, bad, check_across_ranks=True, **kw))
    with torch.no_grad():  # the group still works afterwards
        recv2, _, h2 = low_latency_dispatch(x, ids, check_across_ranks=True, **kw)
        out = low_latency_combine(recv2, torch.ones(3, 2), h2)
    valid = (ids >= 0).sum(1, keepdim=True).float()
    close(out, valid * x, "identity experts, unit weights")


SCENARIOS = {
    2: [
        decode_equals_reference_torch,
        decode_equals_reference_deep_ep,
        slab_layout,
        bf16_decode,
        fp8_decode,
        validation_errors,
    ],
    4: [decode_equals_reference_torch, decode_equals_reference_deep_ep, slab_layout],
}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the launch_ranks protocol
    from _rank_worker import run_rank_worker

    run_rank_worker(lambda world: SCENARIOS[world], started=_T0)


if __name__ == "__main__":
    main()
