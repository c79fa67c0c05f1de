"""One rank of the DeepEP-backend tests (launched once per rank by ``tests/moe/test_ep_deepep.py``).

``dispatch(..., backend="deep_ep")`` drives the ``deep_ep.Buffer`` API; here that API is the CPU/gloo stand-in in
``tests/moe/fake_deep_ep`` (DeepEP's documented normal-mode semantics), put first on ``sys.path``. Every scenario
compares with the single-process :class:`moe_rl.moe.MoE` (outputs and all gradients, fp32, atol 1e-5) or with the
``torch`` backend. Writes ``{scenario: "ok" | traceback}`` to ``<out>/rank<r>.json``.

Usage: ``python _deepep_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

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
    close,
    compare_with_reference,
    qdq,
    sqnr_db,
    to_rank0_experts,
)

from moe_rl.moe import MoE  # noqa: E402
from moe_rl.moe.ep import combine, dispatch  # noqa: E402
from moe_rl.moe.ep_deepep import DeepEPHandle  # noqa: E402
from moe_rl.moe.ep_moe import ExpertParallelMoE  # noqa: E402

torch.set_num_threads(1)


def moe_equals_reference():
    world = dist.get_world_size()
    counts = [5, 3] if world == 2 else [5, 3, 1, 7]
    compare_with_reference(counts, E=2 * world, K=2, ep_backend="deep_ep")
    compare_with_reference(counts, E=2 * world, K=3, backend="grouped_mm", ep_backend="deep_ep")
    compare_with_reference([4, 6] + [3] * (world - 2), E=2 * world, K=2 * world, ep_backend="deep_ep")
    compare_with_reference(
        [6] * world, E=2 * world, K=2, replay=to_rank0_experts(2, 2), expect_zero_experts=True, ep_backend="deep_ep"
    )
    compare_with_reference([5, 3] + [2] * (world - 2), E=2 * world, K=2, align=128, ep_backend="deep_ep")


def b04_zero_token_rank():
    world = dist.get_world_size()
    counts = [10] + [0] * (world - 1)
    compare_with_reference(counts, E=2 * world, K=2, ep_backend="deep_ep")
    compare_with_reference(
        counts, E=2 * world, K=2, replay=to_rank0_experts(2, 2), expect_zero_experts=True, ep_backend="deep_ep"
    )


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
    for align in (1, 128):
        ref, ref_counts, ref_h = dispatch(x, ids, w, num_experts=E, align=align)
        got, counts, h = dispatch(x, ids, w, num_experts=E, align=align, backend="deep_ep")
        assert isinstance(h, DeepEPHandle), type(h)
        assert torch.equal(counts, ref_counts), (counts, ref_counts)
        assert torch.equal(h.layout_P, ref_h.layout_P), (h.layout_P, ref_h.layout_P)
        assert torch.equal(got, ref), "deep_ep rows differ from the torch backend's"
        # identity experts: combine gives sum_k w x over valid slots, like the torch backend
        close(combine(got, h), combine(ref, ref_h), f"combine (align={align})")
    # DeepEP moves each token once per destination rank: N <= T * K slot rows of the torch backend
    assert h.num_recv_tokens <= int(ref_counts.sum()), (h.num_recv_tokens, ref_counts)


def dropped_slots_and_weight_grads():
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(21 + rank)
    T, E = 7, 2 * world
    x = torch.randn(T, 8, requires_grad=True)
    w = torch.rand(T, 3, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(T)])
    ids[::2, 1] = -1
    ids[3] = -1
    g = torch.randn(T, 8)
    recv, counts_L, h = dispatch(x, ids, w, num_experts=E, backend="deep_ep")
    assert recv.shape[0] == int(counts_L.sum())
    out = combine(recv * 2.0, h)  # experts y = 2 x
    (out * g).sum().backward()
    valid = (ids >= 0).float()
    close(out, 2.0 * torch.einsum("tk,td->td", w.detach() * valid, x.detach()), "output with dropped slots")
    close(x.grad, 2.0 * (w.detach() * valid).sum(1, keepdim=True) * g, "x.grad with dropped slots")
    close(w.grad, 2.0 * valid * (x.detach() * g).sum(1, keepdim=True), "topk_weights.grad with dropped slots")


def handle_reuse():
    """handle= skips the validation all_gather and the local sort; same rows/outputs, new gate weights used."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(31 + rank)
    T, E = 6, 2 * world
    x = torch.randn(T, 8)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    recv, counts, h = dispatch(x, ids, w, num_experts=E, backend="deep_ep")
    out = combine(recv, h)
    calls = {"n": 0}
    real = dist.all_gather_single

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    dist.all_gather_single = counting
    try:
        recv2, counts2, h2 = dispatch(x, ids, w * 3.0, num_experts=E, backend="deep_ep", handle=h)
        out2 = combine(recv2, h2)
    finally:
        dist.all_gather_single = real
    assert calls["n"] == 0, calls
    assert torch.equal(recv2, recv) and torch.equal(counts2, counts)
    close(out2, 3.0 * out, "combine with reused handle and new weights")
    try:
        dispatch(x[:2], ids[:2], w[:2], num_experts=E, backend="deep_ep", handle=h)
    except ValueError as err:
        assert "x_TD shape is (2, 8)" in str(err), str(err)
    else:
        raise AssertionError("a handle with the wrong shapes did not raise")
    for bad, msg in ((dict(chunk_size=4), "chunk_size=4 is not supported"),):
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
    before = dict(deep_ep.CALLS)
    try:
        dispatch(x, bad, w, num_experts=4, backend="deep_ep")
    except ValueError as err:
        assert "rank(s) [1]" in str(err), str(err)
    else:
        raise AssertionError("out-of-range topk_ids did not raise")
    assert deep_ep.CALLS["dispatch"] == before["dispatch"], "tokens moved before validation"
    dispatch(x, ids, w, num_experts=2 * dist.get_world_size(), backend="deep_ep")  # the group still works


def fp8_payload():
    """fp8=True: rows equal dispatching dequantize(quantize_1x128(x)); codes equal the torch backend's codes;
    the EP MoE stays within the FP8 SQNR floor of the unquantized one; straight-through gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(41 + rank)
    T, D, E = 7, 256, 2 * world
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    got, _, _ = dispatch(x, ids, w, num_experts=E, backend="deep_ep", fp8=True)
    ref, _, _ = dispatch(qdq(x), ids, w, num_experts=E, backend="deep_ep")
    assert torch.equal(got, ref), "fp8 deep_ep dispatch != dispatch of the quantized rows"
    (codes, scales), _, _ = dispatch(x, ids, w, num_experts=E, backend="deep_ep", fp8=True, fp8_output="codes")
    (tc, ts), _, _ = dispatch(x, ids, w, num_experts=E, fp8=True, fp8_output="codes")
    assert torch.equal(codes.view(torch.uint8), tc.view(torch.uint8)) and torch.equal(scales, ts)
    torch.manual_seed(81)
    moe = MoE(D, 16, E, 2, n_shared_experts=1, backend="loop")
    ep = ExpertParallelMoE.from_full(moe, backend="deep_ep")
    ep8 = ExpertParallelMoE.from_full(moe, backend="deep_ep", fp8_dispatch=True, fp8_combine_backward=True)
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
        fp8_payload,
    ],
    4: [moe_equals_reference, b04_zero_token_rank, layout_matches_torch_backend],
}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the launch_ranks protocol
    from _rank_worker import run_rank_worker

    run_rank_worker(lambda world: SCENARIOS[world], started=_T0)


if __name__ == "__main__":
    main()
