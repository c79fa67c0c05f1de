"""Single-process attention: the reference core, DSA (indexer, top-k, sparse attention, KL), layouts, MLA.

References are independent: float64 dense softmax written out here, per-head Python loops for the indexer,
``torch.autograd.gradcheck`` in float64, hand-written expected index rows (B10), and Hugging Face
``transformers``' ``GlmMoeDsaAttention`` for the MLA/DSA module (same parameter names, loaded with
``strict=True``).
"""

from __future__ import annotations

import math

import pytest
import torch
from _tolerance import assert_normwise_close, assert_within, attention_bounds, eps, rounding_bound

from moe_rl.attention import (
    MLAConfig,
    MultiheadLatentAttention,
    attention_reference,
    dsa_attention,
    indexer_kl_loss,
    indexer_kl_target,
    key_windows,
    lightning_indexer,
    make_shard_plan,
    merge_attention,
    select_topk,
    ulysses_head_plan,
)

F64 = torch.float64
F32 = torch.float32


def _dense64(q, k, v, mask, scale):
    """Plain float64 attention with a boolean [Tq, Tk] mask (rows with no key -> 0)."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    s = s.masked_fill(~mask[None], -math.inf)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.einsum("hts,shd->thd", p, vv)


def _mask(q_idx, k_idx, seq_of, causal):
    same = seq_of[q_idx][:, None] == seq_of[k_idx][None, :]
    return same & (k_idx[None, :] <= q_idx[:, None]) if causal else same


# ----------------------------------------------------------------------------------------------- reference core


@pytest.mark.parametrize("causal", [True, False])
def test_attention_reference_packed_gqa_matches_float64_dense(causal):
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, D, Dv = 11, 6, 2, 8, 5
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, Dv, generator=g)
    cu = torch.tensor([0, 3, 3, 8, 11])  # includes an empty sequence
    seq_of = torch.tensor([0] * 3 + [2] * 5 + [3] * 3)
    out = attention_reference(q, k, v, causal=causal, cu_seqlens=cu)
    ref = _dense64(q, k, v, _mask(torch.arange(T), torch.arange(T), seq_of, causal), D**-0.5)
    # bounds from the dtype, head_dim and key count (tests/_tolerance.py attention_bounds): a wrong mask or a
    # dropped key moves outputs by ~max|v|/T, >1e3 times the fp32 bound
    assert_within(out.out, ref, attention_bounds(q, k, v, scale=D**-0.5, dtype=F32)[0], "fp32 out")
    # fp64 inputs are computed in fp64
    out64 = attention_reference(q.double(), k.double(), v.double(), causal=causal, cu_seqlens=cu)
    assert_within(out64.out, ref, attention_bounds(q, k, v, scale=D**-0.5, dtype=F64)[0], "fp64 out")


def test_attention_reference_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 3, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(5, 2, 3, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(5, 2, 2, generator=g, dtype=F64, requires_grad=True)
    cu = torch.tensor([0, 2, 5])
    assert torch.autograd.gradcheck(lambda a, b, c: attention_reference(a, b, c, cu_seqlens=cu).out, (q, k, v))


def test_b08_query_block_at_offset_is_bottom_right_aligned():
    """B08: queries are absolute positions 2 and 3 of a 4-key sequence: they see {0,1,2} and {0,1,2,3}."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 1, 4, generator=g), torch.randn(4, 1, 4, generator=g), torch.randn(4, 1, 3, generator=g)
    out = attention_reference(q, k, v, causal=True).out  # default q_token_idx = [2, 3]
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    wrong = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)  # index-anchored (top-left): the bug
    assert_within(out, _dense64(q, k, v, right, 0.5), attention_bounds(q, k, v, scale=0.5, dtype=F32)[0])
    assert (out.double() - _dense64(q, k, v, wrong, 0.5)).abs().max() > 1e-2


def test_rows_without_keys_give_zero_and_minus_inf_without_nan():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    k = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    v = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    # token 2 is padding beyond cu_seqlens[-1] = 2: empty window
    res = attention_reference(q, k, v, cu_seqlens=torch.tensor([0, 2]), q_token_idx=torch.arange(3))
    assert torch.equal(res.out[2], torch.zeros(2, 4)) and bool(torch.isneginf(res.lse[2]).all())
    (res.out.sum() + res.lse[:2].sum()).backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    assert torch.equal(k.grad[2], torch.zeros(2, 4))  # nobody sees the padding key


def test_batched_rows_equal_per_row_float64_dense_and_validation():
    """q [B, Tq, H, D]: every row is its own packed stream; shared [Tq] windows and per-row [B, Tq] windows both
    equal a float64 dense attention computed row by row (a row never sees another row's keys)."""
    from moe_rl.attention import ring_attention, windowed_attention

    g = torch.Generator().manual_seed(4)
    B, T, H, Hkv, D, Dv = 3, 9, 4, 2, 8, 5
    q, k, v = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, Hkv, D, generator=g), torch.randn(B, T, Hkv, Dv, generator=g)
    cu = torch.tensor([0, 4, 9])
    seq_of = torch.tensor([0] * 4 + [1] * 5)
    idx = torch.arange(T)
    ks, ke = key_windows(idx, cu, causal=True)
    res = windowed_attention(q, k, v, ks=ks, ke=ke, k_idx=idx)
    assert res.out.shape == (B, T, H, Dv) and res.lse.shape == (B, T, H)
    for b in range(B):
        ref = _dense64(q[b], k[b], v[b], _mask(idx, idx, seq_of, True), D**-0.5)
        ob, lb = attention_bounds(q[b], k[b], v[b], scale=D**-0.5, dtype=F32)
        assert_within(res.out[b], ref, ob, f"row {b} out")
        # two fp32 paths (batched vs single-row shapes: MKL may order sums differently): twice the bound
        assert_within(res.lse[b], attention_reference(q[b], k[b], v[b], cu_seqlens=cu).lse, 2 * lb, f"row {b} lse")
    # per-row windows: row b holds its tokens in its own order (a permutation of the stream)
    perms = torch.stack([torch.randperm(T, generator=g) for _ in range(B)])
    qp, kp, vp = (x.gather(1, perms[..., None, None].expand(-1, -1, *x.shape[2:])) for x in (q, k, v))
    ks, ke = (w.view(B, T) for w in key_windows(perms.reshape(-1), cu, causal=False))
    res = windowed_attention(qp, kp, vp, ks=ks, ke=ke, k_idx=perms)
    for b in range(B):
        ref = _dense64(q[b], k[b], v[b], _mask(idx, idx, seq_of, False), D**-0.5)
        ob = attention_bounds(q[b], k[b], v[b], scale=D**-0.5, dtype=F32)[0]
        assert_within(res.out[b], ref[perms[b]], ob, f"row {b} permuted out")
    # validation (raised before any communication)
    with pytest.raises(ValueError, match="same number of rows B"):
        windowed_attention(q, k[:2], v[:2], ks=ks, ke=ke, k_idx=perms)
    with pytest.raises(ValueError, match=r"must all be \[tokens, heads, head_dim\] or all \[rows"):
        windowed_attention(q, k[0], v[0], ks=ks, ke=ke, k_idx=perms)
    with pytest.raises(ValueError, match=r"token_idx \(2, 9\) must be \[Tl\] or \[B=3, Tl\]"):
        ring_attention(q, k, v, token_idx=perms[:2], cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"token_idx \(3, 9\) must be \[Tl\] for q \(9, 4, 8\)"):
        ring_attention(q[0], k[0], v[0], token_idx=perms, cu_seqlens=cu)
    with pytest.raises(TypeError, match="token_idx must be an integer tensor"):
        ring_attention(q, k, v, token_idx=idx.float(), cu_seqlens=cu)
    with pytest.raises(ValueError, match="token counts must be equal"):
        ring_attention(q, k, v, token_idx=idx[:5], cu_seqlens=cu)


def test_merge_attention_of_disjoint_key_sets_equals_full():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(6, 2, 4, generator=g), torch.randn(6, 2, 4, generator=g), torch.randn(6, 2, 3, generator=g)
    full = attention_reference(q, k, v, causal=False, q_token_idx=torch.arange(6))
    ks, ke = key_windows(torch.arange(6), torch.tensor([0, 6]), causal=False)
    from moe_rl.attention import windowed_attention

    a = windowed_attention(q, k[:2], v[:2], ks=ks, ke=ke, k_idx=torch.arange(2))
    b = windowed_attention(q, k[2:], v[2:], ks=ks, ke=ke, k_idx=torch.arange(2, 6))
    out, lse = merge_attention(a.out.float(), a.lse, b.out.float(), b.lse)
    # fp32 on both sides: the merged output carries both halves' out errors plus their lse errors (through the
    # weights exp(lse_i - lse)) and a few roundings of the merge: 2 * (out_b + 2 lse_b max|v|) + 4 eps max|v|;
    # merging with a wrong weight moves outputs by ~max|v| (>1e4 times this).
    ob, lb = attention_bounds(q, k, v, scale=4**-0.5, dtype=F32)
    vmax = float(v.abs().max())
    assert_within(out, full.out, 2 * (ob + 2 * lb * vmax) + 4 * eps(F32) * vmax, "merged out")
    assert_within(lse, full.lse, 3 * lb, "merged lse")
    # an empty side (-inf) is a no-op, two empty sides stay 0 / -inf
    ninf = torch.full_like(a.lse, -math.inf)
    o2, l2 = merge_attention(a.out.float(), a.lse, torch.zeros_like(a.out), ninf)
    assert torch.equal(o2, a.out.float()) and torch.equal(l2, a.lse)
    # stability: a gap of 200 nats would overflow exp() without the max shift
    big = torch.full_like(a.lse, 200.0)
    o4, l4 = merge_attention(a.out.float(), torch.zeros_like(a.lse), b.out.float(), big)
    # exp(-200) underflows in fp32: the result is b's up to a few roundings of the merge arithmetic
    assert_within(o4, b.out.float(), 4 * eps(F32) * b.out.abs(), "o4")
    assert_within(l4, big, 4 * eps(F32) * big, "l4")
    o3, l3 = merge_attention(torch.zeros_like(a.out), ninf, torch.zeros_like(a.out), ninf)
    assert not bool(o3.isnan().any()) and bool(torch.isneginf(l3).all()) and not bool(o3.any())


def test_key_windows_docstring_example_and_padding():
    ks, ke = key_windows(torch.arange(7), torch.tensor([0, 3, 5]), causal=True)
    assert ks.tolist() == [0, 0, 0, 3, 3, 0, 0] and ke.tolist() == [1, 2, 3, 4, 5, 0, 0]
    ks, ke = key_windows(torch.arange(5), torch.tensor([0, 3, 5]), causal=False)
    assert ks.tolist() == [0, 0, 0, 3, 3] and ke.tolist() == [3, 3, 3, 5, 5]
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        key_windows(torch.arange(3), torch.tensor([1, 3]), causal=True)
    with pytest.raises(TypeError, match="token_idx must be a 1-D integer tensor"):
        key_windows(torch.arange(3.0), torch.tensor([0, 3]), causal=True)


# ---------------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 7, 16, 2999])
def test_shard_unshard_is_identity(layout, cp, T):
    plan = make_shard_plan(T, cp, layout)
    x = torch.arange(T * 2).view(T, 2)
    parts = [plan.shard(x, r) for r in range(cp)]
    assert all(p.shape == (plan.local_len, 2) for p in parts)
    assert torch.equal(plan.unshard(parts), x)
    assert sorted(plan.token_idx.reshape(-1).tolist()) == list(range(plan.padded_len))
    assert sum(int(plan.valid(r).sum()) for r in range(cp)) == T


def test_zigzag_assignment_and_b06_padding_or_error():
    plan = make_shard_plan(8, 2, "zigzag")
    assert plan.token_idx.tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    p = make_shard_plan(2999, 4, "zigzag")  # B06: 8 equal chunks need 3000
    assert (p.padded_len, p.num_pad, p.local_len) == (3000, 1, 750)
    assert make_shard_plan(7, 4, "zigzag").padded_len == 8  # fewer tokens than 2*cp
    with pytest.raises(ValueError, match=r"sequence length 2999 must be a multiple of 2\*cp=8 .*pad it to 3000"):
        make_shard_plan(2999, 4, "zigzag", pad=False)
    with pytest.raises(ValueError, match="layout='striped' is not supported"):
        make_shard_plan(8, 2, "striped")  # type: ignore[arg-type]
    # padding rows get the empty key window: masked from attention and marked invalid for the loss
    ks, ke = key_windows(p.local_token_idx(0), torch.tensor([0, 2999]), causal=True)  # chunk 7 is rank 0's
    pad = ~p.valid(0)
    assert int(pad.sum()) == 1 and int(ke[pad]) == 0 and int(ks[pad]) == 0


# ------------------------------------------------------------------------------------------------------- DSA


def _indexer_loop64(iq, iw, ik, q_idx, cu, causal):
    """I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s]) by explicit loops, float64, -inf outside windows."""
    Tq, HI, _ = iq.shape
    Tk = ik.shape[0]
    ks, ke = key_windows(q_idx, cu, causal=causal)
    out = torch.full((Tq, Tk), -math.inf, dtype=F64)
    for t in range(Tq):
        for s in range(int(ks[t]), min(int(ke[t]), Tk)):
            out[t, s] = sum(float(iw[t, j]) * max(0.0, float(iq[t, j].double() @ ik[s].double())) for j in range(HI))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_lightning_indexer_matches_loop_reference(causal):
    g = torch.Generator().manual_seed(5)
    T, HI, DI = 9, 3, 4
    iq, iw, ik = torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g), torch.randn(T, DI, generator=g)
    cu = torch.tensor([0, 4, 9])
    res = lightning_indexer(iq, iw, ik, cu_seqlens=cu, causal=causal, index_topk=3)
    ref = _indexer_loop64(iq, iw, ik, torch.arange(T), cu, causal)
    assert torch.equal(torch.isinf(res.scores), torch.isinf(ref))
    fin = torch.isfinite(ref)
    # DI-term dots then an HI-term weighted sum, on scale sum_h |w| (|q|.|k|) (tests/_tolerance.py); a wrong key
    # window or head weight moves a score by ~|score| (>1e4 times the bound)
    scale = torch.einsum("th,ths->ts", iw.double().abs(),
                         torch.einsum("thd,sd->ths", iq.double().abs(), ik.double().abs()))
    bound = rounding_bound(scale, DI, F32) + rounding_bound(scale, HI, F32)
    assert_within(res.scores, ref, bound, "indexer vs float64 loop")
    one = lightning_indexer(iq, iw, ik, cu_seqlens=cu, causal=causal, chunk_size=1)
    assert_within(one.scores, ref, bound, "chunk_size=1 vs float64 loop")  # other einsum shapes, other order
    # top-k: the 3 best visible keys in descending score order
    for t in range(T):
        vis = fin[t].nonzero().flatten().tolist()
        best = sorted(vis, key=lambda s: (-float(ref[t, s]), s))[:3]
        assert res.topk_indices[t].tolist() == best + [-1] * (3 - len(best))


def test_b10_topk_larger_than_keys_fills_minus_one():
    """B10: index_topk=8, one packed sequence of 5 tokens: width 8, row i has min(8, i+1) unique keys <= i."""
    g = torch.Generator().manual_seed(6)
    scores = torch.randn(5, 5, generator=g)
    ks, ke = key_windows(torch.arange(5), torch.tensor([0, 5]), causal=True)
    scores = scores.masked_fill(torch.arange(5)[None, :] > torch.arange(5)[:, None], -math.inf)
    sel = select_topk(scores, 8, ks=ks, ke=ke)
    assert sel.shape == (5, 8) and sel[0].tolist() == [0] + [-1] * 7
    for i in range(5):
        row = sel[i][sel[i] >= 0].tolist()
        assert sorted(row) == list(range(i + 1)) and (sel[i][i + 1 :] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_topk_tie_break_lower_key_index_wins(dtype):
    scores = torch.tensor([[1.0, 2.0, 2.0, -0.0, 0.0, 2.0], [0.0] * 6], dtype=dtype)
    ks, ke = torch.tensor([0, 0]), torch.tensor([6, 6])
    sel = select_topk(scores, 4, ks=ks, ke=ke)
    assert sel.tolist() == [[1, 2, 5, 0], [0, 1, 2, 3]]


def test_b10_sparse_attention_with_every_visible_key_equals_dense_and_backward_ignores_minus_one():
    g = torch.Generator().manual_seed(7)
    T, H, Dk, Dv, HI, DI = 5, 2, 6, 4, 2, 3
    q = torch.randn(T, H, Dk, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(T, Dk, generator=g, dtype=F64, requires_grad=True)
    iq, iw, ik = torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g), torch.randn(T, DI, generator=g)
    res = dsa_attention(q, kv, v_head_dim=Dv, scale=0.4, index_q=iq, index_weights=iw, index_k=ik, index_topk=8)
    assert res.topk_indices.shape == (5, 8) and res.topk_indices[0].tolist() == [0] + [-1] * 7
    dense = attention_reference(q, kv[:, None], kv[:, None, :Dv], scale=0.4)
    # two float64 paths (gathered sparse vs dense): per-element attention bounds for two paths, normwise chain
    # bounds for the gradients (depth 2 paths x 2 backward x 3 reductions); a wrong gathered key is O(1) off
    ob, lb = attention_bounds(q, kv[:, None], kv[:, None, :Dv], scale=0.4, dtype=F64)
    assert_within(res.out, dense.out, 2 * ob, "out")
    assert_within(res.lse, dense.lse, 2 * lb, "lse")
    gq, gkv = torch.autograd.grad(res.out.sum(), (q, kv))
    dq, dkv = torch.autograd.grad(dense.out.sum(), (q, kv))
    assert_normwise_close(gq, dq, dtype=F64, k=max(T, Dk), depth=12, what="dq")
    assert_normwise_close(gkv, dkv, dtype=F64, k=max(T, Dk), depth=12, what="dkv")


def test_sparse_attention_subset_matches_masked_dense_gradcheck():
    g = torch.Generator().manual_seed(8)
    T, H, Dk, Dv = 6, 2, 4, 3
    q = torch.randn(T, H, Dk, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(T, Dk, generator=g, dtype=F64, requires_grad=True)
    sel = torch.tensor([[0, -1], [1, 0], [2, 0], [1, 3], [4, 2], [5, -1]])
    res = dsa_attention(q, kv, v_head_dim=Dv, scale=0.5, topk_indices=sel)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        mask[t, sel[t][sel[t] >= 0]] = True
    assert_within(res.out, _dense64(q, kv[:, None], kv[:, None, :Dv], mask, 0.5),
                  2 * attention_bounds(q, kv[:, None], kv[:, None, :Dv], scale=0.5, dtype=F64)[0], "sparse out")
    assert torch.autograd.gradcheck(lambda a, b: dsa_attention(a, b, v_head_dim=Dv, scale=0.5, topk_indices=sel).out,
                                    (q, kv))


def test_replayed_indices_equal_indexer_path_and_validation():
    g = torch.Generator().manual_seed(9)
    T, H, Dk, HI, DI = 8, 2, 6, 2, 4
    q, kv = torch.randn(T, H, Dk, generator=g), torch.randn(T, Dk, generator=g)
    iq, iw, ik = torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g), torch.randn(T, DI, generator=g)
    cu = torch.tensor([0, 3, 8])
    a = dsa_attention(q, kv, v_head_dim=4, index_q=iq, index_weights=iw, index_k=ik, index_topk=4, cu_seqlens=cu)
    b = dsa_attention(q, kv, v_head_dim=4, topk_indices=a.topk_indices.int(), cu_seqlens=cu)
    assert torch.equal(a.out, b.out) and int(b.num_dropped_indices) == 0
    # a future key / other-sequence key in a replayed row is ignored and counted
    bad = a.topk_indices.clone()
    bad[0, 1], bad[3, 3] = 5, 1  # token 0 cannot see 5; token 3 (sequence 2) cannot see token 1
    c = dsa_attention(q, kv, v_head_dim=4, topk_indices=bad, cu_seqlens=cu)
    assert int(c.num_dropped_indices) == 2 and torch.equal(c.out[0], a.out[0])
    with pytest.raises(ValueError, match="repeats a key index"):
        dsa_attention(q, kv, v_head_dim=4, topk_indices=torch.zeros(T, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[-1, Tk=8\)"):
        dsa_attention(q, kv, v_head_dim=4, topk_indices=torch.full((T, 2), 8))
    with pytest.raises(TypeError, match="topk_indices must be an int32/int64 tensor"):
        dsa_attention(q, kv, v_head_dim=4, topk_indices=torch.zeros(T, 2))
    with pytest.raises(ValueError, match="not both"):
        dsa_attention(q, kv, v_head_dim=4, topk_indices=a.topk_indices, index_q=iq)
    with pytest.raises(ValueError, match="needs topk_indices, or all of"):
        dsa_attention(q, kv, v_head_dim=4, index_q=iq)


def _kl_bound(p: torch.Tensor, scores: torch.Tensor) -> float:
    """Two float64 evaluations of ``sum_{t,s} p (log p - log_softmax(scores)_s)`` (any order) differ by at most
    ``2 (N + 8) eps64 * sum p (|log p| + 2 |s| + 2 |lse_t| + Tk)`` (worst case, ``N`` terms summed, each term's
    log / log-softmax a few roundings of its operands' magnitudes, the ``Tk``-term log-sum-exp; tests/_tolerance.py).
    A wrong target, a missing renormalisation or a dropped row changes the loss by ~ its value (>= 1e10 times)."""
    s = scores.detach()
    lse = torch.logsumexp(s, -1, keepdim=True).abs()
    sup = p > 0
    terms = torch.where(sup, p * (p.clamp_min(1e-300).log().abs() + 2 * s.abs() + 2 * lse + s.shape[-1]),
                        torch.zeros_like(p))
    return 2 * (int(sup.sum()) + 8) * torch.finfo(F64).eps * float(terms.sum())


def test_indexer_kl_loss_matches_float64_formula_and_vanishes_at_target():
    g = torch.Generator().manual_seed(10)
    T, H, Dk = 6, 2, 4
    q, kv = torch.randn(T, H, Dk, generator=g, dtype=F64), torch.randn(T, Dk, generator=g, dtype=F64)
    p = indexer_kl_target(q, kv, scale=0.5)
    assert torch.allclose(p.sum(-1), torch.ones(T, dtype=F64))
    scores = torch.randn(T, T, generator=g, dtype=F64).masked_fill(p == 0, -math.inf).requires_grad_()
    loss = indexer_kl_loss(scores, p)
    ref = sum(
        sum(float(p[t, s]) * (math.log(float(p[t, s])) - float(torch.log_softmax(scores[t].detach(), -1)[s]))
            for s in range(T) if p[t, s] > 0)
        for t in range(T)
    )
    assert abs(float(loss.detach()) - ref) <= _kl_bound(p, scores)
    loss.backward()
    assert bool(torch.isfinite(scores.grad).all())
    log_p = torch.log(p).masked_fill(p == 0, -math.inf)
    at_target = indexer_kl_loss(log_p, p)
    assert abs(float(at_target)) <= _kl_bound(p, log_p)  # exact value 0
    # sparse stage: restricted to the selected keys, renormalised
    sel = torch.tensor([[0, -1], [0, 1], [2, 1], [3, 0], [4, 2], [5, 1]])
    sparse = indexer_kl_loss(scores.detach(), p, topk_indices=sel)
    ref_s = 0.0
    p_sel = torch.zeros_like(p)  # the renormalised targets and the scores on the selected keys, for the bound
    s_sel = torch.full_like(p, -math.inf)
    for t in range(T):
        keys = [int(s) for s in sel[t] if s >= 0]
        pt = p[t, keys] / p[t, keys].sum()
        lq = torch.log_softmax(scores[t, keys].detach(), -1)
        ref_s += float((pt * (pt.log() - lq)).sum())
        p_sel[t, keys], s_sel[t, keys] = pt, scores[t, keys].detach()
    assert abs(float(sparse) - ref_s) <= _kl_bound(p_sel, s_sel)


# ------------------------------------------------------------------------------------------------------ Ulysses


@pytest.mark.parametrize(
    "H, Hkv, cp, expect",
    [
        (12, 12, 4, (1, 12, 12)),  # B07a
        (28, 7, 2, (1, 8, 32)),  # B07b: pad KV to 8, Q to 32
        (8, 2, 4, (2, 4, 8)),  # B07c: replicate KV 2x
        (4, 1, 4, (4, 4, 4)),  # MQA replicated to every rank
        (2, 1, 4, (1, 4, 8)),  # replication would split a group unevenly: pad instead
    ],
)
def test_ulysses_head_plan(H, Hkv, cp, expect):
    p = ulysses_head_plan(H, Hkv, cp)
    assert (p.kv_replicas, p.kv_heads_padded, p.q_heads_padded) == expect
    assert p.kv_heads_padded % cp == 0 and p.q_heads_padded % cp == 0
    covered = [h for a, b in p.q_head_ranges() for h in range(a, b)]
    assert covered == list(range(H))


def test_ulysses_head_plan_is_per_call_b07a():
    ulysses_head_plan(12, 3, 4)  # another module's plan first: nothing is cached
    assert ulysses_head_plan(12, 12, 4).q_head_ranges() == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        ulysses_head_plan(6, 4, 2)


# -------------------------------------------------------------------------------------------------------- MLA


def _tiny_cfg(**kw):
    base = dict(hidden_size=32, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, index_topk=5, index_head_dim=8, index_n_heads=3)
    return MLAConfig(**{**base, **kw})


def test_mla_absorbed_sparse_form_equals_dense_form_when_all_keys_selected():
    torch.manual_seed(0)
    dense = MultiheadLatentAttention(_tiny_cfg(index_topk=None)).double()
    dsa = MultiheadLatentAttention(_tiny_cfg(index_topk=64)).double()
    missing, unexpected = dsa.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("indexer.") for k in missing)
    x = torch.randn(10, 32, dtype=F64)
    cu = torch.tensor([0, 4, 10])
    a, b = dense(x, cu_seqlens=cu), dsa(x, cu_seqlens=cu)
    # two float64 paths (dense vs absorbed: other GEMMs, other orders; MKL's DGEMM order depends on the CPU and
    # MKL_CBWR): normwise chain bound with reductions <= 32 (hidden) and ~8 per path (projections, scores,
    # softmax-weighted sum, output), x2 for two paths, x2 again for the backward (tests/_tolerance.py). A
    # missing key, wrong absorption or RoPE split is off by O(1) relative.
    k = 32
    assert_normwise_close(b.hidden, a.hidden, dtype=F64, k=k, depth=2 * 8, what="hidden")
    ga = torch.autograd.grad(a.hidden.sum(), list(dense.parameters()))
    gb = torch.autograd.grad(b.hidden.sum(), [p for n, p in dsa.named_parameters() if not n.startswith("indexer.")])
    for x1, x2 in zip(ga, gb, strict=True):
        assert_normwise_close(x2, x1, dtype=F64, k=k, depth=2 * 2 * 8, what="grad")


def test_mla_dsa_matches_transformers_glm_moe_dsa(monkeypatch):
    """Same weights (HF names, strict load) -> same output and same top-k sets as transformers' GLM-5 layer.

    Tolerance: everything is float64 except HF's eager softmax, which runs in fp32 (``dtype=torch.float32``) and
    rounds the weights back. Per query row: the scores are rounded to fp32 (``u |s|``), shifted by the row max
    (``u (|s| + max|s|)``), exponentiated (``u``), summed over ``Tk`` keys (worst case ``Tk u``), divided (``u``) and
    rounded (``u``): each weight is off by a relative ``delta <= eps32 (2 max|s| + Tk + 3)`` (``eps = 2u``, a
    factor 2 of slack that also covers the fp64 roundings, ~1e-9 of this). So each attention output element moves
    by ``<= delta * (p @ |v|)`` and the hidden output by that times ``|W_o|``. A wrong mask, rope or head moves it by
    ``~ |value|`` (>= 1e4 times the bound here)."""
    mod = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    seen = {}
    hf_eager = mod.eager_attention_forward

    def recording_eager(module, query, key, value, attention_mask, scaling, **kw):
        seen.update(q=query, k=key, v=value, mask=attention_mask, scaling=scaling)
        return hf_eager(module, query, key, value, attention_mask, scaling, **kw)

    monkeypatch.setattr(mod, "eager_attention_forward", recording_eager)
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    torch.manual_seed(0)
    hc = GlmMoeDsaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_topk=5,
                         index_head_dim=8, index_n_heads=3, num_hidden_layers=1, vocab_size=10, rms_norm_eps=1e-5)
    hc._attn_implementation = "eager"
    hf = mod.GlmMoeDsaAttention(hc, 0).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = MultiheadLatentAttention(_tiny_cfg(rms_norm_eps=1e-5)).double()
    ours.load_state_dict(hf.state_dict(), strict=True)
    S = 12
    x = torch.randn(1, S, 32, dtype=F64)
    pos = torch.arange(S)[None]
    cos, sin = mod.GlmMoeDsaRotaryEmbedding(hc)(x, pos)
    mask = torch.full((S, S), torch.finfo(F64).min, dtype=F64).triu(1)[None, None]
    out_hf, _, idx_hf = hf(x, (cos.double(), sin.double()), mask, position_ids=pos)
    res = ours(x[0])
    assert seen, "HF's eager attention was not called: the fp32-softmax bound below does not apply"
    kr = mod.repeat_kv(seen["k"], hf.num_key_value_groups)
    vr = mod.repeat_kv(seen["v"], hf.num_key_value_groups).abs()
    scores = seen["q"] @ kr.transpose(2, 3) * seen["scaling"]  # [1, H, S, Tk]
    visible = seen["mask"] == 0
    s_max = torch.where(visible, scores.abs(), torch.zeros_like(scores)).amax(-1, keepdim=True)  # per row
    delta = 2 * eps(torch.float32) * (2 * s_max + S + 3)
    p = torch.softmax(scores + seen["mask"], -1)  # the exact weights (float64)
    attn_err = (delta * (p @ vr)).transpose(1, 2).reshape(1, S, -1)  # [1, S, H * Dv]
    bound = attn_err @ hf.o_proj.weight.detach().abs().T  # [1, S, hidden]
    assert_within(res.hidden, out_hf[0], bound[0], "MLA+DSA vs transformers (fp32 softmax)")
    # rows with >= index_topk visible keys select the same set (HF also picks masked keys in shorter rows)
    assert torch.equal(idx_hf[0, 4:].sort(-1).values.long(), res.topk_indices[4:].sort(-1).values)


def test_mla_rope_positions_restart_per_packed_sequence():
    """Packing two sequences gives each the same output as running it alone (RoPE and masks per sequence)."""
    torch.manual_seed(1)
    m = MultiheadLatentAttention(_tiny_cfg()).double()
    x = torch.randn(9, 32, dtype=F64)
    packed = m(x, cu_seqlens=torch.tensor([0, 4, 9]))
    first, second = m(x[:4]), m(x[4:])
    # two float64 paths (packed vs alone: other shapes), normwise chain bound (reductions <= 32, ~8 per path)
    assert_normwise_close(packed.hidden[:4], first.hidden, dtype=F64, k=32, depth=16, what="first")
    assert_normwise_close(packed.hidden[4:], second.hidden, dtype=F64, k=32, depth=16, what="second")
    sel = second.topk_indices
    assert torch.equal(packed.topk_indices[4:], torch.where(sel >= 0, sel + 4, sel))
    with pytest.raises(ValueError, match="only 'dsa_allgather'"):
        m(x, cp_method="ring", cp_group=None)
