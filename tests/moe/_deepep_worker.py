"""One rank of the DeepEP-backend tests (launched once per rank by ``tests/moe/test_ep_deepep.py``).

``dispatch(..., backend="deep_ep", buffer=...)`` drives DeepEP's current ``deep_ep.ElasticBuffer`` API; here that
API is the CPU/gloo stand-in in ``tests/moe/fake_deep_ep`` (DeepEP 2.1's normal-mode semantics), put first on
``sys.path``. Each scenario creates its buffer with :func:`moe_rl.moe.ep.make_deepep_buffer` (the caller owns it)
and compares with the single-process :class:`moe_rl.moe.MoE` (outputs and all gradients, fp32, atol 1e-5) or with
the ``torch`` backend. Writes ``{scenario: "ok" | traceback}`` to ``<out>/rank<r>.json``.

Usage: ``python _deepep_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("fake_deep_ep")))
_T0 = time.perf_counter()

import deep_ep  # noqa: E402  (the stand-in)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _ep_worker import (  # noqa: E402
    SQNR_FLOOR_DB,
    check_dropped_slots,
    close,
    compare_with_reference,
    count_calls,
    qdq,
    sqnr_db,
    to_rank0_experts,
)

from moe_rl.moe import MoE  # noqa: E402
from moe_rl.moe.ep import DeepEPHandle, ExpertParallelMoE, combine, dispatch, make_deepep_buffer  # noqa: E402

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
MAX_TOKENS = 64


def make_buffer(hidden=8, top_k=8, deterministic=True):
    """The caller-owned DeepEP buffer of a scenario (collective: every rank calls it)."""
    return make_deepep_buffer(
        dist.group.WORLD, hidden=hidden, top_k=top_k, max_tokens_per_rank=MAX_TOKENS, deterministic=deterministic
    )


def moe_equals_reference():
    world = dist.get_world_size()
    buf = make_buffer()
    dep = dict(ep_backend="deep_ep", deepep_buffer=buf)
    counts = [5, 3] if world == 2 else [5, 3, 1, 7]
    compare_with_reference(counts, E=2 * world, K=2, **dep)
    compare_with_reference(counts, E=2 * world, K=3, backend="grouped_mm", **dep)
    compare_with_reference([4, 6] + [3] * (world - 2), E=2 * world, K=2 * world, **dep)
    compare_with_reference([6] * world, E=2 * world, K=2, replay=to_rank0_experts(2, 2), expect_zero_experts=True, **dep)
    compare_with_reference([5, 3] + [2] * (world - 2), E=2 * world, K=2, align=128, **dep)


def b04_zero_token_rank():
    world = dist.get_world_size()
    dep = dict(ep_backend="deep_ep", deepep_buffer=make_buffer())
    counts = [10] + [0] * (world - 1)
    compare_with_reference(counts, E=2 * world, K=2, **dep)
    compare_with_reference(counts, E=2 * world, K=2, replay=to_rank0_experts(2, 2), expect_zero_experts=True, **dep)


def nondeterministic_order():
    """A buffer without DeepEP's deterministic sort delivers tokens in another order (the stand-in scrambles it):
    the same expert-major counts and -1 layout, each expert's rows a permutation of the torch backend's, and the EP
    MoE still equals the reference (outputs and all gradients), since combine goes through the handle."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = make_buffer(deterministic=False)
    E = 2 * world
    torch.manual_seed(15 + rank)
    x = torch.randn(9, 8)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(9)])
    w = torch.rand(9, 3)
    ref, ref_counts, ref_h = dispatch(x, ids, w, num_experts=E, align=4)
    got, counts, h = dispatch(x, ids, w, num_experts=E, align=4, backend="deep_ep", buffer=buf)
    assert torch.equal(counts, ref_counts) and torch.equal(h.layout_P, ref_h.layout_P)
    start = 0
    for n in counts.tolist():
        a, b = got[start : start + n], ref[start : start + n]
        assert torch.equal(a[a[:, 0].argsort()], b[b[:, 0].argsort()]), "rows of one expert differ as a set"
        start += n
    close(combine(got, h), combine(ref, ref_h), "combine with scrambled receive order")
    counts = [5, 3] if world == 2 else [5, 3, 1, 7]
    compare_with_reference(counts, E=E, K=2, ep_backend="deep_ep", deepep_buffer=buf)


def layout_matches_torch_backend():
    """Same expert-major rows, counts and -1 layout as the torch backend (one chunk), for align 1 and 128."""
    world, rank = dist.get_world_size(), dist.get_rank()
    E = 2 * world
    torch.manual_seed(5 + rank)
    T = 9
    x = torch.randn(T, 8)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(T)])
    ids[::3, 2] = -1
    w = torch.rand(T, 3)
    buf = make_buffer()
    for align in (1, 128):
        ref, ref_counts, ref_h = dispatch(x, ids, w, num_experts=E, align=align)
        got, counts, h = dispatch(x, ids, w, num_experts=E, align=align, backend="deep_ep", buffer=buf)
        # DeepEP's own per-expert counts (padded to expert_alignment) agree with the adapter's layout
        assert h.ep_handle.num_recv_tokens_per_expert_list == counts.tolist(), h.ep_handle.num_recv_tokens_per_expert_list
        assert isinstance(h, DeepEPHandle), type(h)
        assert torch.equal(counts, ref_counts), (counts, ref_counts)
        assert torch.equal(h.layout_P, ref_h.layout_P), (h.layout_P, ref_h.layout_P)
        assert torch.equal(got, ref), "deep_ep rows differ from the torch backend's"
        # identity experts: combine gives sum_k w x over valid slots, like the torch backend
        close(combine(got, h), combine(ref, ref_h), f"combine (align={align})")
    # DeepEP moves each token once per destination rank: N <= T * K slot rows of the torch backend
    assert h.num_recv_tokens <= int(ref_counts.sum()), (h.num_recv_tokens, ref_counts)


def dropped_slots_and_weight_grads():
    check_dropped_slots(2.0, backend="deep_ep", buffer=make_buffer())  # experts y = 2 x


def handle_reuse():
    """handle= skips the validation all_gather and the local sort; same rows/outputs, new gate weights used."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(31 + rank)
    T, E = 6, 2 * world
    x = torch.randn(T, 8)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    buf = make_buffer()
    recv, counts, h = dispatch(x, ids, w, num_experts=E, backend="deep_ep", buffer=buf)
    out = combine(recv, h)
    torch_h = dispatch(x, ids, w, num_experts=E)[2]
    gathers, restore = count_calls("all_gather_single")
    cached_before = deep_ep.CALLS["cached_dispatch"]
    try:
        recv2, counts2, h2 = dispatch(x, ids, w * 3.0, num_experts=E, backend="deep_ep", buffer=buf, handle=h)
        out2 = combine(recv2, h2)
    finally:
        restore()
    assert gathers["calls"] == 0, gathers
    assert deep_ep.CALLS["cached_dispatch"] == cached_before + 1, "a reused handle must run DeepEP's cached dispatch"
    assert h2.ep_handle is h.ep_handle
    assert torch.equal(recv2, recv) and torch.equal(counts2, counts)
    close(out2, 3.0 * out, "combine with reused handle and new weights")
    try:
        dispatch(x[:2], ids[:2], w[:2], num_experts=E, backend="deep_ep", buffer=buf, handle=h)
    except ValueError as err:
        assert "x_TD shape is (2, 8)" in str(err), str(err)
    else:
        raise AssertionError("a handle with the wrong shapes did not raise")
    other = make_buffer()
    for bad, msg in (
        (dict(chunk_size=4, buffer=buf), "chunk_size=4 is not supported"),
        (dict(buffer=None), "needs buffer="),
        (dict(buffer=other, handle=h), "not the buffer the handle was built with"),
        (dict(buffer=buf, handle=torch_h), "from the 'torch' backend"),
    ):
        try:
            dispatch(x, ids, w, num_experts=E, backend="deep_ep", **bad)
        except ValueError as err:
            assert msg in str(err), str(err)
        else:
            raise AssertionError(f"{bad} did not raise")


def validation_errors():
    rank = dist.get_rank()
    x, w = torch.randn(3, 8), torch.rand(3, 2)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = 99
    buf = make_buffer()
    before = dict(deep_ep.CALLS)
    try:
        dispatch(x, bad, w, num_experts=4, backend="deep_ep", buffer=buf)
    except ValueError as err:
        assert "rank(s) [1]" in str(err), str(err)
    else:
        raise AssertionError("out-of-range topk_ids did not raise")
    assert deep_ep.CALLS["dispatch"] == before["dispatch"], "tokens moved before validation"
    # more tokens than the buffer was made for, on rank 0 only: every rank raises, before any token moves
    n = MAX_TOKENS + 1 if rank == 0 else 3
    big_x, big_w, big_ids = torch.randn(n, 8), torch.rand(n, 2), torch.zeros(n, 2, dtype=torch.int64)
    try:
        dispatch(big_x, big_ids, big_w, num_experts=4, backend="deep_ep", buffer=buf)
    except ValueError as err:
        assert "rank(s) [0]" in str(err), str(err)
        assert rank != 0 or f"num_max_tokens_per_rank={MAX_TOKENS}" in str(err), str(err)
    else:
        raise AssertionError("more tokens than num_max_tokens_per_rank did not raise")
    assert deep_ep.CALLS["dispatch"] == before["dispatch"], "tokens moved before validation"
    dispatch(x, ids, w, num_experts=2 * dist.get_world_size(), backend="deep_ep", buffer=buf)  # the group still works


def buffer_is_sized_by_the_hint():
    """make_deepep_buffer sizes the caller's ElasticBuffer with ElasticBuffer.get_buffer_size_hint (no cache)."""
    before = deep_ep.CALLS["size_hints"], deep_ep.CALLS["buffers"]
    a = make_deepep_buffer(None, hidden=7168, top_k=8, max_tokens_per_rank=256)
    b = make_deepep_buffer(None, hidden=7168, top_k=8, max_tokens_per_rank=256, fp8_dispatch=True)
    assert (deep_ep.CALLS["size_hints"], deep_ep.CALLS["buffers"]) == (before[0] + 2, before[1] + 2)
    assert a is not b and a.group is dist.group.WORLD and a.num_max_tokens_per_rank == 256
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(dist.group.WORLD, 256, 7168, num_topk=8)
    assert a.num_bytes == hint and b.num_bytes < a.num_bytes, (a.num_bytes, b.num_bytes, hint)
    for kwargs, msg in ((dict(hidden=0), "hidden=0 must be a positive int"), (dict(num_bytes=1 << 21), "num_bytes")):
        args = dict(hidden=8, top_k=2, max_tokens_per_rank=4) | kwargs
        try:
            make_deepep_buffer(None, **args)
        except ValueError as err:
            assert msg in str(err), str(err)
        else:
            raise AssertionError(f"{kwargs} did not raise")


def fp8_payload():
    """fp8=True: rows equal dispatching dequantize(quantize_1x128(x)); codes equal the torch backend's codes;
    the EP MoE stays within the FP8 SQNR floor of the unquantized one; straight-through gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(41 + rank)
    T, D, E = 7, 256, 2 * world
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    buf = make_buffer(hidden=D)
    got, _, _ = dispatch(x, ids, w, num_experts=E, backend="deep_ep", buffer=buf, fp8=True)
    ref, _, _ = dispatch(qdq(x), ids, w, num_experts=E, backend="deep_ep", buffer=buf)
    assert torch.equal(got, ref), "fp8 deep_ep dispatch != dispatch of the quantized rows"
    (codes, scales), _, _ = dispatch(
        x, ids, w, num_experts=E, backend="deep_ep", buffer=buf, fp8=True, fp8_output="codes"
    )
    (tc, ts), _, _ = dispatch(x, ids, w, num_experts=E, fp8=True, fp8_output="codes")
    assert torch.equal(codes.view(torch.uint8), tc.view(torch.uint8)) and torch.equal(scales, ts)
    torch.manual_seed(81)
    moe = MoE(D, 16, E, 2, n_shared_experts=1, backend="loop")
    ep = ExpertParallelMoE.from_full(moe, backend="deep_ep", deepep_buffer=buf)
    ep8 = ExpertParallelMoE.from_full(
        moe, backend="deep_ep", deepep_buffer=buf, fp8_dispatch=True, fp8_combine_backward=True
    )
    x0, g = torch.randn(T, D), torch.randn(T, D)
    a, b = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    out, out8 = ep(a), ep8(b)
    (out * g).sum().backward()
    (out8 * g).sum().backward()
    assert sqnr_db(out, out8) > SQNR_FLOOR_DB, sqnr_db(out, out8)
    assert torch.isfinite(b.grad).all() and sqnr_db(a.grad, b.grad) > SQNR_FLOOR_DB - 3, sqnr_db(a.grad, b.grad)


SCENARIOS = {
    2: [
        moe_equals_reference,
        b04_zero_token_rank,
        layout_matches_torch_backend,
        dropped_slots_and_weight_grads,
        handle_reuse,
        validation_errors,
        buffer_is_sized_by_the_hint,
        nondeterministic_order,
        fp8_payload,
    ],
    4: [moe_equals_reference, b04_zero_token_rank, layout_matches_torch_backend, nondeterministic_order],
}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the launch_ranks protocol
    from _rank_worker import run_rank_worker

    run_rank_worker(lambda world: SCENARIOS[world], started=_T0)


if __name__ == "__main__":
    main()
