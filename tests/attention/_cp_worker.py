"""One rank of the context-parallel attention tests (launched once per rank by ``tests/attention/test_cp.py``).

Runs every scenario for its world size on a gloo group and writes ``{scenario: "ok" | traceback}`` to
``<out>/rank<r>.json``. Each scenario follows the global-reference-then-shard pattern: every rank builds the same
global inputs (same seed), runs the single-process reference (:func:`attention_reference` /
:func:`dsa_attention`) on the whole stream, shards inputs and upstream gradients with the library's own
:class:`ShardPlan`, runs the CP function on its shard and compares the output and every gradient on its rows.

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
from _tolerance import assert_normwise_close  # noqa: E402

from moe_rl.attention import (  # noqa: E402
    MLAConfig,
    MultiheadLatentAttention,
    attention_reference,
    dsa_attention,
    dsa_cp_attention,
    indexer_kl_loss,
    indexer_kl_target,
    make_shard_plan,
    ring_attention,
    ulysses_attention,
    ulysses_head_plan,
)

_T0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
STATS: dict[str, object] = {}
# fp32 CP vs single process: two paths of the same reductions in other orders (blockwise softmax merges, all-gathers,
# reduce-scatters). Normwise chain bound (tests/_tolerance.py): reductions of <= KMAX terms (T <= 32 tokens, head
# and hidden sizes <= 16), DEPTH = 2 paths x ~10 reductions (the MLA module's projections, indexer, scores,
# weighted sum and output projection, and their backward). A missing block, a wrong mask or a gradient not
# summed over ranks is off by O(1 / cp) relative, > 1e3 x the bound.
KMAX, DEPTH = 64, 20
# bf16: every bf16 op rounds its output (u = eps_bf16 / 2 relative; the matmuls accumulate in fp32). Forward:
# scores, probabilities, output (3 roundings), + 2 per CP merge of partial results; backward: ~6, + 3 per rank
# (partial gradients rounded before the reduce-scatter). Normwise vs the float64 result of the same bf16 inputs.


def close(actual, expected, what):
    assert_normwise_close(actual, expected, dtype=torch.float32, k=KMAX, depth=DEPTH, what=what)


def bf16_close(actual, exact, what, *, grad: bool):
    cp = dist.get_world_size()
    depth = 6 + 3 * cp if grad else 3 + 2 * cp
    assert_normwise_close(actual, exact, dtype=torch.bfloat16, k=1, depth=depth, c=0.5, what=what)


def _inputs(T, H, Hkv, D, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, Dv, generator=g).to(dtype)
    go = torch.randn(T, H, Dv, generator=g).to(dtype)
    return q, k, v, go


def _ref(q, k, v, go, cu, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention_reference(q, k, v, causal=causal, cu_seqlens=cu)
    o.out.backward(go)
    return o.out.detach(), o.lse.detach(), q.grad, k.grad, v.grad


def _cp(fn, plan, rank, q, k, v, go, cu, causal):
    ql, kl, vl = (plan.shard(t, rank).detach().requires_grad_() for t in (q, k, v))
    o = fn(ql, kl, vl, token_idx=plan.local_token_idx(rank), cu_seqlens=cu, causal=causal)
    o.out.backward(plan.shard(go, rank))
    return o.out.detach(), o.lse, ql.grad, kl.grad, vl.grad


def compare_attention(fn, *, T, cu, layout, causal, H=4, Hkv=2, D=8, Dv=6, seed=0, tag=""):
    """fp32: CP output, lse and dq/dk/dv on this rank's rows == the single-process reference (``close``)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    plan = make_shard_plan(T, cp, layout)
    q, k, v, go = _inputs(T, H, Hkv, D, Dv, torch.float32, seed)
    cu = torch.tensor(cu)
    ref = _ref(q, k, v, go, cu, causal)
    got = _cp(fn, plan, rank, q, k, v, go, cu, causal)
    name = f"{fn.__name__} {tag} T={T} cu={cu.tolist()} {layout} causal={causal}"
    for what, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True):
        if what == "lse":
            valid = plan.valid(rank)
            close(a[valid], plan.shard(r, rank)[valid], f"{name} lse")
            assert bool(torch.isinf(a[~valid]).all()) and not bool(torch.isnan(a).any()), f"{name}: pad lse"
        else:
            close(a, plan.shard(r, rank), f"{name} {what}")


GRID = [  # (T, cu_seqlens): one sequence, packed sequences, lengths not divisible by 2*cp
    (16, [0, 16]),
    (24, [0, 5, 13, 24]),
    (19, [0, 7, 19]),
]


def _grid(fn, **kw):
    """cp=2: the full grid; cp=4 (4 processes on the CI's 2 cores): packed causal in both layouts, plus the
    padded non-causal case."""
    if dist.get_world_size() == 2:
        cases = [(T, cu, lay, c) for T, cu in GRID for lay in ("zigzag", "contiguous") for c in (True, False)]
    else:
        cases = [(24, [0, 5, 13, 24], "zigzag", True), (24, [0, 5, 13, 24], "contiguous", True),
                 (19, [0, 7, 19], "zigzag", False)]
    for T, cu, layout, causal in cases:
        compare_attention(fn, T=T, cu=cu, layout=layout, causal=causal, **kw)


def ring_fp32():
    _grid(ring_attention)


def ulysses_fp32():
    _grid(ulysses_attention)  # cp=4: Hkv=2 < cp -> KV heads replicated 2x (B07c)


def b06_length_2999():
    """B06: 2999 tokens at cp=4 (zigzag needs 8 equal chunks): padded to 3000, equal to the non-CP reference;
    and 7 tokens (fewer than 2*cp)."""
    cp = dist.get_world_size()
    if cp == 4:
        plan = make_shard_plan(2999, cp, "zigzag")
        assert (plan.padded_len, plan.num_pad) == (3000, 1)
        compare_attention(ring_attention, T=2999, cu=[0, 2999], layout="zigzag", causal=True, H=1, Hkv=1, D=4,
                          Dv=4, tag="B06")
    for fn in (ring_attention, ulysses_attention):
        compare_attention(fn, T=7, cu=[0, 7], layout="zigzag", causal=True, H=4, Hkv=2, D=4, Dv=4, tag="B06 short")


def b07_heads():
    """B07: (a) per-call head plan after a different module; (b) 28Q/7KV at cp=2 (pad KV to 8, Q to 32);
    (c) 8Q/2KV at cp=4 (replicate KV 2x on the head axis); output and grads equal non-CP attention."""
    cp = dist.get_world_size()
    # (a) a 3-KV-head call first, then a 12-head MHA call: the second plan depends on its own heads only
    compare_attention(ulysses_attention, T=8, cu=[0, 8], layout="zigzag", causal=True, H=12, Hkv=3, D=4, Dv=4,
                      tag="B07a-first")
    plan = ulysses_head_plan(12, 12, cp)
    expect = [(r * 12 // cp, (r + 1) * 12 // cp) for r in range(cp)]
    assert plan.q_head_ranges() == expect, (plan, plan.q_head_ranges(), expect)
    compare_attention(ulysses_attention, T=8, cu=[0, 8], layout="zigzag", causal=True, H=12, Hkv=12, D=4, Dv=4,
                      tag="B07a")
    if cp == 2:
        p = ulysses_head_plan(28, 7, 2)
        assert (p.kv_heads_padded, p.q_heads_padded, p.q_heads_per_rank, p.kv_heads_per_rank) == (8, 32, 16, 4), p
        compare_attention(ulysses_attention, T=8, cu=[0, 8], layout="contiguous", causal=True, H=28, Hkv=7, D=4,
                          Dv=4, tag="B07b")
    if cp == 4:
        p = ulysses_head_plan(8, 2, 4)
        assert (p.kv_replicas, p.kv_heads_padded, p.q_heads_per_rank) == (2, 4, 2), p
        compare_attention(ulysses_attention, T=8, cu=[0, 8], layout="zigzag", causal=True, H=8, Hkv=2, D=4, Dv=4,
                          tag="B07c")


def b08_ring_offsets():
    """B08: contiguous layout with 4 tokens per rank: rank r's queries at absolute positions 4r..4r+3 against
    earlier blocks (unmasked), its own (causal triangle), later ones (skipped); == dense key_pos <= query_pos."""
    cp = dist.get_world_size()
    compare_attention(ring_attention, T=4 * cp, cu=[0, 4 * cp], layout="contiguous", causal=True, tag="B08")


def _bf16_check(fn, T, cu, causal, layout="zigzag"):
    """bf16: the CP path and the single-process bf16 reference are each within ``bf16_close`` of the float64
    result of the same bf16 inputs."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    plan = make_shard_plan(T, cp, layout)
    q, k, v, go = _inputs(T, 4, 2, 16, 16, torch.bfloat16, 7)
    cu = torch.tensor(cu)
    exact = _ref(*(t.double() for t in (q, k, v, go)), cu, causal)
    single = _ref(q, k, v, go, cu, causal)
    got = _cp(fn, plan, rank, q, k, v, go, cu, causal)
    errs = {}
    for i, what in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        e_single = (plan.shard(single[i].double(), rank) - plan.shard(exact[i], rank)).abs().max().item()
        e_cp = (got[i].double() - plan.shard(exact[i], rank)).abs().max().item()
        errs[what] = (e_cp, e_single)
        bf16_close(got[i], plan.shard(exact[i], rank), f"{fn.__name__} bf16 cp {what}", grad=i > 0)
        bf16_close(plan.shard(single[i], rank), plan.shard(exact[i], rank), f"bf16 single {what}", grad=i > 0)
    STATS[f"bf16_{fn.__name__}"] = errs


def bf16():
    for fn in (ring_attention, ulysses_attention):
        _bf16_check(fn, 32, [0, 11, 32], True)
    _bf16_dsa()


def _dsa_inputs(T, H, Dk, HI, DI, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(T, H, Dk, generator=g).to(dtype),
        kv=torch.randn(T, Dk, generator=g).to(dtype),
        iq=torch.randn(T, HI, DI, generator=g).to(dtype),
        iw=torch.randn(T, HI, generator=g).to(dtype),
        ik=torch.randn(T, DI, generator=g).to(dtype),
        go=torch.randn(T, H, 8, generator=g).to(dtype),
    )


def _dsa_run_single(x, cu, topk, causal, replay=None):
    q, kv, ik = (x[n].detach().clone().requires_grad_() for n in ("q", "kv", "ik"))
    kw = dict(topk_indices=replay) if replay is not None else dict(
        index_q=x["iq"], index_weights=x["iw"], index_k=ik, index_topk=topk)
    r = dsa_attention(q, kv, v_head_dim=8, scale=0.25, causal=causal, cu_seqlens=cu,
                      return_index_scores=replay is None, **kw)
    loss = (r.out * x["go"].to(r.out.dtype)).sum()
    if replay is None:
        loss = loss + indexer_kl_loss(r.index_scores, indexer_kl_target(q, kv, scale=0.25, causal=causal,
                                                                        cu_seqlens=cu))
    loss.backward()
    return r, q.grad, kv.grad, ik.grad


def _dsa_run_cp(x, plan, rank, cu, topk, causal, replay=None):
    q, kv, ik = (plan.shard(x[n], rank).detach().requires_grad_() for n in ("q", "kv", "ik"))
    tok = plan.local_token_idx(rank)
    kw = dict(topk_indices=replay) if replay is not None else dict(
        index_q=plan.shard(x["iq"], rank), index_weights=plan.shard(x["iw"], rank), index_k=ik, index_topk=topk)
    r = dsa_cp_attention(q, kv, v_head_dim=8, token_idx=tok, cu_seqlens=cu, scale=0.25, causal=causal,
                         return_index_scores=replay is None, **kw)
    loss = (r.out * plan.shard(x["go"], rank).to(r.out.dtype)).sum()
    if replay is None:
        # the KL target needs every key: the dense target of the local queries over the gathered latent
        from moe_rl.attention.comm import all_gather_rows

        kv_full = all_gather_rows(kv.detach(), None).index_select(0, torch.argsort(
            all_gather_rows(tok, None)))
        tgt = indexer_kl_target(q.detach(), kv_full, scale=0.25, causal=causal, cu_seqlens=cu, q_token_idx=tok)
        loss = loss + indexer_kl_loss(r.index_scores, tgt)
    loss.backward()
    return r, q.grad, kv.grad, ik.grad


def _dsa_compare(T, cu, topk, causal, layout):
    rank, cp = dist.get_rank(), dist.get_world_size()
    plan = make_shard_plan(T, cp, layout)
    x = _dsa_inputs(T, 3, 12, 2, 8, torch.float32, 11)
    cu = torch.tensor(cu)
    tag = f"dsa T={T} cu={cu.tolist()} topk={topk} causal={causal} {layout}"
    r_s, dq_s, dkv_s, dik_s = _dsa_run_single(x, cu, topk, causal)
    r_c, dq_c, dkv_c, dik_c = _dsa_run_cp(x, plan, rank, cu, topk, causal)
    sel_ref = plan.shard(r_s.topk_indices, rank, pad_value=-1)
    assert torch.equal(r_c.topk_indices, sel_ref), f"{tag}: top-k indices differ from single-process"
    close(r_c.out, plan.shard(r_s.out.detach(), rank), f"{tag} out")
    close(dq_c, plan.shard(dq_s, rank), f"{tag} dq")
    close(dkv_c, plan.shard(dkv_s, rank), f"{tag} dkv (reduce-scattered to owners)")
    close(dik_c, plan.shard(dik_s, rank), f"{tag} d index_k (indexer KL, reduce-scattered)")
    # replay: the same indices (global coordinates) under CP give the same result as the indexer path
    replay = r_s.topk_indices
    r_s2, dq_s2, dkv_s2, _ = _dsa_run_single(x, cu, topk, causal, replay=replay)
    r_c2, dq_c2, dkv_c2, _ = _dsa_run_cp(x, plan, rank, cu, topk, causal,
                                         replay=plan.shard(replay, rank, pad_value=-1))
    close(r_c2.out, plan.shard(r_s2.out.detach(), rank), f"{tag} replay out")
    close(dq_c2, plan.shard(dq_s2, rank), f"{tag} replay dq")
    close(dkv_c2, plan.shard(dkv_s2, rank), f"{tag} replay dkv")
    assert int(r_c2.num_dropped_indices) == 0


def dsa_cp():
    for T, cu in GRID if dist.get_world_size() == 2 else GRID[1:]:
        for layout in ("zigzag", "contiguous"):
            _dsa_compare(T, cu, 4, True, layout)
    _dsa_compare(19, [0, 7, 19], 4, False, "zigzag")
    _dsa_compare(16, [0, 16], 64, True, "zigzag")  # index_topk > keys (B10 under CP)


def _dsa_chunked_compare(T, cu, topk, causal, layout, chunks):
    """backend='torch' under CP == the dense single-process reference: indices, out, dq, dkv (fp32, atol 1e-5).
    The indexer inputs are multiples of 1/4 so every score is exact in fp32 (selection independent of the
    summation order; many ties, resolved by the lower key index in both paths)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    plan = make_shard_plan(T, cp, layout)
    x = _dsa_inputs(T, 3, 12, 2, 8, torch.float32, 17)
    g = torch.Generator().manual_seed(T)
    for n in ("iq", "iw", "ik"):
        x[n] = torch.randint(-3, 4, x[n].shape, generator=g).float() / 4
    cu = torch.tensor(cu)
    tag = f"dsa chunked T={T} cu={cu.tolist()} topk={topk} causal={causal} {layout} {chunks}"
    q, kv = (x[n].detach().clone().requires_grad_() for n in ("q", "kv"))
    ref = dsa_attention(q, kv, v_head_dim=8, scale=0.25, causal=causal, cu_seqlens=cu, index_q=x["iq"],
                        index_weights=x["iw"], index_k=x["ik"], index_topk=topk, backend="dense")
    (ref.out * x["go"]).sum().backward()
    ql, kvl = (plan.shard(x[n], rank).detach().requires_grad_() for n in ("q", "kv"))
    got = dsa_cp_attention(ql, kvl, v_head_dim=8, token_idx=plan.local_token_idx(rank), cu_seqlens=cu, scale=0.25,
                           causal=causal, index_q=plan.shard(x["iq"], rank), index_weights=plan.shard(x["iw"], rank),
                           index_k=plan.shard(x["ik"], rank), index_topk=topk, backend="torch", **chunks)
    (got.out * plan.shard(x["go"], rank)).sum().backward()
    assert torch.equal(got.topk_indices, plan.shard(ref.topk_indices, rank, pad_value=-1)), f"{tag}: indices"
    close(got.out, plan.shard(ref.out.detach(), rank), f"{tag} out")
    close(ql.grad, plan.shard(q.grad, rank), f"{tag} dq")
    close(kvl.grad, plan.shard(kv.grad, rank), f"{tag} dkv (reduce-scattered to owners)")
    # replayed indices through the chunked CP path
    rep = dsa_cp_attention(ql.detach(), kvl.detach(), v_head_dim=8, token_idx=plan.local_token_idx(rank),
                           cu_seqlens=cu, scale=0.25, causal=causal, backend="torch",
                           topk_indices=plan.shard(ref.topk_indices, rank, pad_value=-1), **chunks)
    close(rep.out, plan.shard(ref.out.detach(), rank), f"{tag} replay out")


def dsa_chunked_cp():
    """Memory-bounded DSA (backend='torch') under all-gather CP equals the dense single-process reference."""
    small = dict(q_chunk_size=3, k_chunk_size=5, attn_chunk_size=2)
    for T, cu in ((16, [0, 16]), (19, [0, 7, 19]), (29, [0, 5, 20, 27])):  # 29: not divisible by 2*cp (padding)
        for layout in ("zigzag", "contiguous"):
            _dsa_chunked_compare(T, cu, 4, True, layout, small)
    _dsa_chunked_compare(19, [0, 7, 19], 4, False, "zigzag", dict(q_chunk_size=1, k_chunk_size=1, attn_chunk_size=1))
    _dsa_chunked_compare(16, [0, 16], 64, True, "zigzag", small)  # index_topk > keys: -1 fill


def _bf16_dsa():
    rank, cp = dist.get_rank(), dist.get_world_size()
    T, cu = 32, torch.tensor([0, 11, 32])
    plan = make_shard_plan(T, cp, "zigzag")
    x = _dsa_inputs(T, 3, 12, 2, 8, torch.bfloat16, 5)
    sel = _dsa_run_single({k: v.double() for k, v in x.items()}, cu, 6, True)[0].topk_indices  # one selection
    x64 = {k: v.double() for k, v in x.items()}
    exact = _dsa_run_single(x64, cu, 6, True, replay=sel)
    single = _dsa_run_single(x, cu, 6, True, replay=sel)
    got = _dsa_run_cp(x, plan, rank, cu, 6, True, replay=plan.shard(sel, rank, pad_value=-1))
    errs = {}
    for i, what in ((0, "out"), (1, "dq"), (2, "dkv")):
        a, s, e = (got[i], single[i], exact[i]) if i else (got[0].out, single[0].out, exact[0].out)
        e_single = (plan.shard(s.double(), rank) - plan.shard(e, rank)).abs().max().item()
        e_cp = (a.double() - plan.shard(e, rank)).abs().max().item()
        errs[what] = (e_cp, e_single)
        # d(kv) is reduce-scattered in bf16: each rank's partial sum is rounded once more (in bf16_close's depth)
        bf16_close(a, plan.shard(e, rank), f"dsa_cp bf16 cp {what}", grad=i > 0)
        bf16_close(plan.shard(s, rank), plan.shard(e, rank), f"dsa_cp bf16 single {what}", grad=i > 0)
    STATS["bf16_dsa_cp"] = errs


def mla_module_cp():
    """MultiheadLatentAttention: DSA layer under dsa_allgather CP and a dense MLA layer under ring / Ulysses
    equal the single-process module (outputs and all parameter gradients, summed over ranks)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    T, cu = 19, torch.tensor([0, 7, 19])
    plan = make_shard_plan(T, cp, "zigzag")
    for index_topk, methods in ((4, ("dsa_allgather",)), (None, ("ring", "ulysses"))):
        torch.manual_seed(3)
        cfg = MLAConfig(hidden_size=16, num_attention_heads=cp, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4,
                        qk_rope_head_dim=4, v_head_dim=4, index_topk=index_topk, index_n_heads=2, index_head_dim=8)
        m = MultiheadLatentAttention(cfg)
        x = torch.randn(T, 16)
        go = torch.randn(T, 16)
        ref = m(x, cu_seqlens=cu)
        ref.hidden.backward(go)
        ref_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        for method in methods:
            m.zero_grad(set_to_none=True)
            out = m(plan.shard(x, rank), cu_seqlens=cu, token_idx=plan.local_token_idx(rank), cp_group=dist.group.WORLD,
                    cp_method=method)
            close(out.hidden, plan.shard(ref.hidden.detach(), rank), f"MLA {method} out")
            out.hidden.backward(plan.shard(go, rank))
            for n, p in m.named_parameters():
                if n in ref_grads:
                    g = p.grad.clone()
                    dist.all_reduce(g)
                    close(g, ref_grads[n], f"MLA {method} grad {n}")


def _batched_case(fn, *, B, T, cu, H, Hkv, layouts, causal, seed):
    """B rows, row b sharded with ``layouts[b % len(layouts)]``; the CP call on [B, Tl, ...] (token indices [Tl]
    when every row has the same layout, else [B, Tl]) == the single-process reference run on each row alone."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    D, Dv = 8, 6
    cu = torch.tensor(cu)
    rows = [_inputs(T, H, Hkv, D, Dv, torch.float32, seed + b) for b in range(B)]
    plans = [make_shard_plan(T, cp, layouts[b % len(layouts)]) for b in range(B)]
    q, k, v, go = (torch.stack([plans[b].shard(rows[b][i], rank) for b in range(B)]) for i in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    idx = torch.stack([p.local_token_idx(rank) for p in plans])
    token_idx = idx[0] if len(layouts) == 1 else idx
    o = fn(q, k, v, token_idx=token_idx, cu_seqlens=cu, causal=causal)
    o.out.backward(go)
    name = f"{fn.__name__} batched B={B} T={T} cu={cu.tolist()} H={H}/{Hkv} {layouts} causal={causal}"
    for b in range(B):
        ref = _ref(*rows[b], cu, causal)
        p, valid = plans[b], plans[b].valid(rank)
        for what, a, r in zip(("out", "dq", "dk", "dv"), (o.out, q.grad, k.grad, v.grad), (ref[0], *ref[2:]),
                              strict=True):
            close(a[b], p.shard(r, rank), f"{name} row {b} {what}")
        close(o.lse[b][valid], p.shard(ref[1], rank)[valid], f"{name} row {b} lse")
        assert bool(torch.isinf(o.lse[b][~valid]).all()), f"{name} row {b}: pad lse"


def batched_rows():
    """Batched rows q [B, Tl, H, D] (the trainer's call): every row equals the per-row single-process reference;
    shared [Tl] and per-row [B, Tl] token indices; packed sequences and padding inside a row; Ulysses with
    padded KV heads (3 KV heads at cp=2 and cp=4)."""
    for fn in (ring_attention, ulysses_attention):
        _batched_case(fn, B=3, T=19, cu=[0, 7, 19], H=4, Hkv=2, layouts=("zigzag",), causal=True, seed=20)
        _batched_case(fn, B=3, T=16, cu=[0, 5, 16], H=6, Hkv=3, layouts=("zigzag", "contiguous"), causal=False,
                      seed=30)


def validation_errors():
    """Sizes that differ across ranks raise the same ValueError on every rank (no hang)."""
    rank = dist.get_rank()
    Tl = 4 + rank  # differs
    q = torch.randn(Tl, 2, 4)
    for fn in (ring_attention, ulysses_attention):
        try:
            fn(q, q, q, token_idx=torch.arange(Tl), cu_seqlens=torch.tensor([0, 4]))
        except ValueError as e:
            assert "must be equal on every CP rank" in str(e) and "Tl" in str(e), str(e)
        else:
            raise AssertionError(f"{fn.__name__} accepted per-rank sizes that differ")
    # token indices that are not a permutation: same error on every rank
    try:
        dsa_cp_attention(torch.randn(4, 2, 8), torch.randn(4, 8), v_head_dim=4, token_idx=torch.arange(4),
                         cu_seqlens=torch.tensor([0, 4]), topk_indices=torch.zeros(4, 2, dtype=torch.long))
    except ValueError as e:
        assert "permutation" in str(e), str(e)
    else:
        raise AssertionError("dsa_cp_attention accepted duplicate token indices")


SCENARIOS = {
    2: [ulysses_fp32, ring_fp32, dsa_cp, dsa_chunked_cp, b06_length_2999, b07_heads, b08_ring_offsets, bf16, mla_module_cp,
        batched_rows, validation_errors],
    4: [ring_fp32, ulysses_fp32, dsa_cp, dsa_chunked_cp, b06_length_2999, b07_heads, b08_ring_offsets, bf16, mla_module_cp,
        batched_rows, validation_errors],
}


def main() -> None:
    run_rank_worker(lambda world: SCENARIOS[world], started=_T0, timeout_s=90, extras={"_stats": STATS})


if __name__ == "__main__":
    main()
