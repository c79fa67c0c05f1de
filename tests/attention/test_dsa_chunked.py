"""The memory-bounded DSA path (``backend="torch"``, :mod:`moe_rl.attention.dsa_chunked`) against the dense
reference (``backend="dense"``), single process (the CP cases are in ``_cp_worker.py``: ``dsa_chunked_cp``).

Selection: the indexer inputs are small multiples of 1/4 (``_exact``), so every score ``sum_j w ReLU(q.k)`` is
computed exactly in fp32 whatever the summation order, and the streaming top-k must return *the same indices*
as ``select_topk`` on the dense scores; such inputs also produce many equal scores, which exercises the tie rule
(lower key index wins) in both paths.

Values and gradients: the same math in a different summation order (tiles of queries; per-tile softmax; dkv
scatter-added per tile rather than by one ``index_select`` backward). fp32 rounding of a K-term softmax-weighted
sum with O(1) terms is a few ``K * eps32`` ~ 1e-6 at K <= 16, so the acceptance bound atol 1e-5 between the two
fp32 paths holds with a margin; both are also compared to a float64 run of the dense reference with the bound
``8 * K * eps32 * max|ref|`` (K-term reductions, each term rounded once).
"""

from __future__ import annotations

import math

import pytest
import torch
from _tolerance import assert_normwise_close, decoder_chain

from moe_rl.attention import dsa_attention, key_windows, lightning_indexer, select_topk
from moe_rl.attention.dsa_chunked import chunked_indexer_topk, sparse_latent_attention_chunked

EPS32 = torch.finfo(torch.float32).eps


def _exact(shape, g):
    return torch.randint(-3, 4, shape, generator=g).float() / 4


def _inputs(T, H=3, Dk=12, Dv=8, HI=2, DI=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(T, H, Dk, generator=g), kv=torch.randn(T, Dk, generator=g),
                iq=_exact((T, HI, DI), g), iw=_exact((T, HI), g), ik=_exact((T, DI), g),
                go=torch.randn(T, H, Dv, generator=g), gl=torch.randn(T, H, generator=g), Dv=Dv)


def _run(x, backend, dtype=torch.float32, replay=None, **kw):
    q, kv = (x[n].to(dtype).detach().clone().requires_grad_() for n in ("q", "kv"))
    sel = dict(topk_indices=replay) if replay is not None else dict(
        index_q=x["iq"].to(dtype), index_weights=x["iw"].to(dtype), index_k=x["ik"].to(dtype))
    r = dsa_attention(q, kv, v_head_dim=x["Dv"], scale=0.35, backend=backend, **sel, **kw)
    # the LSE is differentiable in the reference: exercise that path too (rows without keys have lse -inf)
    lse = torch.where(torch.isfinite(r.lse), r.lse, torch.zeros_like(r.lse))
    ((r.out * x["go"].to(dtype)).sum() + (lse * x["gl"].to(dtype)).sum()).backward()
    return r, q.grad, kv.grad


def _compare(x, K, dense_kw=None, chunk_kw=None, replay=None, **kw):
    ref64, dq64, dkv64 = _run(x, "dense", torch.float64, replay=replay, **({} if replay is not None else
                                                                          dict(index_topk=K)), **kw)
    rd, dqd, dkvd = _run(x, "dense", replay=replay, **({} if replay is not None else dict(index_topk=K)), **kw)
    rc, dqc, dkvc = _run(x, "torch", replay=replay, **({} if replay is not None else dict(index_topk=K)),
                         **(chunk_kw or {}), **kw)
    assert torch.equal(rc.topk_indices, rd.topk_indices)
    assert torch.equal(rc.topk_indices, ref64.topk_indices)
    assert int(rc.num_dropped_indices) == int(rd.num_dropped_indices)
    assert torch.equal(torch.isneginf(rc.lse), torch.isneginf(rd.lse))
    fin = torch.isfinite(rd.lse)
    pairs = (("out", rc.out, rd.out, ref64.out), ("lse", rc.lse[fin], rd.lse[fin], ref64.lse[fin]),
             ("dq", dqc, dqd, dq64), ("dkv", dkvc, dkvd, dkv64))
    for what, c, d, e in pairs:
        bound = 8 * max(K, 1) * EPS32 * max(float(e.detach().abs().max()), 1.0)
        for name, a in (("chunked", c), ("dense", d)):
            err = float((a.double() - e).abs().max())
            assert err <= bound, f"{what} {name} vs float64: {err} > {bound}"
        # so the two fp32 paths agree within twice that (triangle inequality)
        assert float((c - d).abs().max()) <= 2 * bound, f"{what} chunked vs dense"
    return rc, rd


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("T", "cu", "K", "chunks"), [
    (37, [0, 37], 5, dict(q_chunk_size=8, k_chunk_size=6, attn_chunk_size=5)),  # T not a multiple of any chunk
    (40, [0, 13, 29, 40], 7, dict(q_chunk_size=1, k_chunk_size=1, attn_chunk_size=1)),  # chunk 1, packed
    (9, [0, 9], 16, dict(q_chunk_size=4, k_chunk_size=3, attn_chunk_size=2)),  # T < index_topk: -1 fill
    (33, [0, 20, 30], 4, dict(q_chunk_size=16, k_chunk_size=64, attn_chunk_size=64)),  # padding tail, big chunks
])
def test_chunked_equals_dense_outputs_and_gradients(T, cu, K, chunks, causal):
    x = _inputs(T, seed=T + K)
    rc, _ = _compare(x, K, chunk_kw=chunks, cu_seqlens=torch.tensor(cu), causal=causal)
    if T < K:
        assert bool((rc.topk_indices[:, T:] == -1).all())


def test_query_block_at_offset_equals_dense():
    """Queries that are the last Tq of Tk tokens (the CP / chunked-prefill call shape)."""
    T, Tq, K = 30, 11, 6
    x = _inputs(T, seed=3)
    xq = {n: (v[T - Tq:] if n in ("q", "iq", "iw", "go", "gl") else v) for n, v in x.items()}
    _compare(xq, K, chunk_kw=dict(q_chunk_size=4, k_chunk_size=7, attn_chunk_size=3),
             cu_seqlens=torch.tensor([0, 12, 30]))


def test_replayed_indices_with_minus_one_and_out_of_window_entries():
    T, K = 21, 6
    x = _inputs(T, seed=5)
    g = torch.Generator().manual_seed(1)
    sel = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(T)])
    sel[::3, -2:] = -1  # padding slots
    rc, rd = _compare(x, K, replay=sel, chunk_kw=dict(attn_chunk_size=4), cu_seqlens=torch.tensor([0, 10, 21]))
    assert int(rc.num_dropped_indices) > 0  # future / other-sequence keys were given and ignored


def test_topk_ties_lower_key_index_wins_in_both_paths():
    T, K, DI = 12, 4, 4
    ks, ke = key_windows(torch.arange(T), torch.tensor([0, 5, T]), causal=True)
    # all scores equal: the K lowest visible key indices, in ascending order
    iq, iw, ik = torch.ones(T, 1, DI), torch.ones(T, 1), torch.ones(T, DI)
    dense = select_topk(lightning_indexer(iq, iw, ik, cu_seqlens=torch.tensor([0, 5, T])).scores, K, ks=ks, ke=ke)
    for qc, kc in ((1, 1), (3, 2), (16, 16)):
        got = chunked_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke, q_chunk_size=qc, k_chunk_size=kc)
        assert torch.equal(got, dense)
    for t in range(T):
        n = min(K, int(ke[t] - ks[t]))
        assert dense[t, :n].tolist() == list(range(int(ks[t]), int(ks[t]) + n))
        assert dense[t, n:].tolist() == [-1] * (K - n)
    # two tie groups: keys 1 and 3 score 2, keys 0, 2, 4, 5 score 1; K=4 -> [1, 3, 0, 2] for the last query
    ik2 = torch.tensor([1.0, 2, 1, 2, 1, 1])[:, None].expand(6, DI).contiguous()
    iq2, iw2 = torch.full((6, 1, DI), 0.25), torch.ones(6, 1)
    ks2, ke2 = key_windows(torch.arange(6), torch.tensor([0, 6]), causal=True)
    d2 = select_topk(lightning_indexer(iq2, iw2, ik2).scores, 4, ks=ks2, ke=ke2)
    c2 = chunked_indexer_topk(iq2, iw2, ik2, 4, ks=ks2, ke=ke2, q_chunk_size=2, k_chunk_size=2)
    assert d2[-1].tolist() == [1, 3, 0, 2] and torch.equal(c2, d2)
    # float64 (stable-sort path) and the -0.0 == +0.0 case
    c64 = chunked_indexer_topk(iq2.double(), iw2.double(), ik2.double(), 4, ks=ks2, ke=ke2, q_chunk_size=4,
                               k_chunk_size=1)
    assert torch.equal(c64, d2)
    negz = chunked_indexer_topk(iq2, -torch.zeros(6, 1), ik2, 3, ks=ks2, ke=ke2, k_chunk_size=2)
    assert negz[-1].tolist() == [0, 1, 2]


def test_random_normal_selection_matches_where_scores_are_separated():
    """fp32 random-normal inputs: the chunked selection equals the dense one for every query whose K-th and
    (K+1)-th best dense scores differ by more than the fp32 rounding of the score (DI * HI terms)."""
    T, HI, DI, K = 64, 4, 16, 8
    g = torch.Generator().manual_seed(7)
    iq, iw, ik = torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g), torch.randn(T, DI, generator=g)
    ks, ke = key_windows(torch.arange(T), torch.tensor([0, T]), causal=True)
    scores = lightning_indexer(iq.double(), iw.double(), ik.double()).scores
    dense = select_topk(scores.float(), K, ks=ks, ke=ke)
    got = chunked_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke, q_chunk_size=5, k_chunk_size=9)
    srt = scores.sort(dim=-1, descending=True).values
    tol = 4 * DI * HI * EPS32 * float(iw.abs().max() * iq.abs().max() * ik.abs().max() * DI)
    separated = ~torch.isfinite(srt[:, K]) | ((srt[:, K - 1] - srt[:, K]) > tol)
    assert int(separated.sum()) > T // 2
    assert torch.equal(got[separated], dense[separated])


def test_bf16_inputs_match_dense_bf16():
    x = _inputs(25, seed=9)
    for backend in ("dense", "torch"):
        r, dq, dkv = _run(x, backend, torch.bfloat16, index_topk=5, cu_seqlens=torch.tensor([0, 25]))
        assert r.out.dtype == torch.bfloat16 and dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16
        if backend == "dense":
            ref = (r.out.float(), dq.float(), dkv.float(), r.topk_indices)
        else:
            assert torch.equal(r.topk_indices, ref[3])
            for a, b in zip((r.out, dq, dkv), ref[:3], strict=True):
                # both round the same fp32 values to bf16 once: at most one bf16 ulp apart
                assert float((a.float() - b).abs().max()) <= 2.0**-7 * max(float(b.abs().max()), 1.0)


def test_gradcheck_float64():
    x = _inputs(7, H=2, Dk=5, Dv=3, seed=11)
    sel = torch.tensor([[0, -1, 1], [1, 0, -1], [2, 1, 0], [3, 2, 1], [4, 2, -1], [5, 0, 3], [6, 1, 2]])
    q = x["q"][:, :2, :5].double().requires_grad_()
    kv = x["kv"][:, :5].double().requires_grad_()

    def f(a, b):
        out, lse = sparse_latent_attention_chunked(a, b, sel, v_head_dim=3, scale=0.5, chunk_size=3)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, kv))


def test_rows_without_keys_give_zero_output_and_no_nan_gradient():
    x = _inputs(6, seed=2)
    sel = torch.full((6, 3), -1)
    sel[3] = torch.tensor([0, 2, -1])
    q, kv = x["q"].clone().requires_grad_(), x["kv"].clone().requires_grad_()
    r = dsa_attention(q, kv, v_head_dim=8, topk_indices=sel, backend="torch", attn_chunk_size=2)
    (r.out * x["go"]).sum().backward()
    assert bool((r.out[[0, 1, 2, 4, 5]] == 0).all()) and bool(torch.isneginf(r.lse[0]).all())
    assert bool(torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all())
    assert bool((q.grad[[0, 1, 2, 4, 5]] == 0).all())


@pytest.mark.parametrize("backend", ["torch", "dense"])
@pytest.mark.parametrize("name", ["q_chunk_size", "k_chunk_size", "attn_chunk_size"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, None])
def test_chunk_sizes_are_validated(name, bad, backend):
    """Every backend checks them, the dense one too (it ignores the value, but a bad one is a caller bug)."""
    x = _inputs(8)
    with pytest.raises(ValueError, match=rf"{name}={bad!r} must be a positive int"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_q=x["iq"], index_weights=x["iw"], index_k=x["ik"],
                      index_topk=3, backend=backend, **{name: bad})
    with pytest.raises(ValueError, match=rf"{name}={bad!r} must be a positive int"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, topk_indices=torch.zeros(8, 2, dtype=torch.int64),
                      backend=backend, **{name: bad})


@pytest.mark.parametrize("backend", ["torch", "dense"])
@pytest.mark.parametrize("bad", [True, False, 0, -1, 2.0])
def test_index_topk_bool_and_non_positive_refused_by_every_backend(bad, backend):
    x = _inputs(8)
    with pytest.raises(ValueError, match=rf"index_topk={bad!r} must be an int >= 1"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_q=x["iq"], index_weights=x["iw"], index_k=x["ik"],
                      index_topk=bad, backend=backend)
    with pytest.raises(ValueError, match=rf"index_topk={bad!r} must be an int >= 1"):
        lightning_indexer(x["iq"], x["iw"], x["ik"], index_topk=bad)
    with pytest.raises(ValueError, match=rf"index_topk={bad!r} must be an int >= 1"):
        ks, ke = torch.zeros(8, dtype=torch.int64), torch.arange(1, 9)
        select_topk(torch.zeros(8, 8), bad, ks=ks, ke=ke)


@pytest.mark.parametrize("backend", ["torch", "dense"])
def test_index_q_rows_must_match_q_rows(backend):
    x = _inputs(8)
    with pytest.raises(ValueError, match=r"index_q \(6, 2, 8\) has 6 rows but q \(8, 3, 12\) has 8"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_q=x["iq"][:6], index_weights=x["iw"][:6],
                      index_k=x["ik"], index_topk=3, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "dense"])
def test_q_kv_dtype_mismatch_refused(backend):
    x = _inputs(8)
    with pytest.raises(TypeError, match=r"q torch.float32 and kv torch.bfloat16"):
        dsa_attention(x["q"], x["kv"].bfloat16(), v_head_dim=8, index_q=x["iq"], index_weights=x["iw"],
                      index_k=x["ik"], index_topk=3, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "dense"])
def test_more_queries_than_keys_needs_explicit_token_indices(backend):
    """By default the queries are the last Tq of Tk tokens: Tq > Tk would leave Tq - Tk queries with a negative
    token index and a silent zero output, so it is refused. Padding rows named by ``q_token_idx`` stay legal."""
    x, y = _inputs(8), _inputs(5, seed=1)
    kw = dict(index_q=x["iq"], index_weights=x["iw"], index_k=y["ik"], index_topk=3, backend=backend)
    with pytest.raises(ValueError, match=r"q has 8 rows but kv only 5: .*Tq <= Tk"):
        dsa_attention(x["q"], y["kv"], v_head_dim=8, **kw)
    with pytest.raises(ValueError, match=r"index_q has 8 rows but index_k only 5"):
        lightning_indexer(x["iq"], x["iw"], y["ik"])
    with pytest.raises(ValueError, match=r"q_token_idx must be a \[Tq=8\] integer tensor"):
        dsa_attention(x["q"], y["kv"], v_head_dim=8, q_token_idx=torch.arange(5), **kw)
    # explicit: rows 0-4 are tokens 0-4, rows 5-7 padding (index >= cu_seqlens[-1]): equal to the 5 real rows alone
    tok = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    r = dsa_attention(x["q"], y["kv"], v_head_dim=8, q_token_idx=tok, **kw)
    ref = dsa_attention(x["q"][:5], y["kv"], v_head_dim=8, index_q=x["iq"][:5], index_weights=x["iw"][:5],
                        index_k=y["ik"], index_topk=3, backend=backend)
    assert torch.equal(r.out[:5], ref.out) and torch.equal(r.topk_indices[:5], ref.topk_indices)
    assert bool((r.out[5:] == 0).all()) and bool(torch.isneginf(r.lse[5:]).all())
    assert bool((r.topk_indices[5:] == -1).all())


def test_bad_backend_topk_and_unsupported_combinations():
    x = _inputs(8)
    kw = dict(index_q=x["iq"], index_weights=x["iw"], index_k=x["ik"])
    with pytest.raises(ValueError, match=r"backend='flash' is not a DSA backend; use 'torch'.*or 'dense'"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_topk=3, backend="flash", **kw)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"index_topk={bad} must be an int >= 1"):
            dsa_attention(x["q"], x["kv"], v_head_dim=8, index_topk=bad, backend="torch", **kw)
    with pytest.raises(ValueError, match="index_topk=0 must be an int >= 1"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_topk=0, backend="dense", **kw)
    with pytest.raises(ValueError, match="return_index_scores=True needs the \\[Tq, Tk\\]"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_topk=3, backend="torch", return_index_scores=True, **kw)
    with pytest.raises(ValueError, match="indexer_backend='cuda' is not supported"):
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_topk=3, backend="torch", indexer_backend="cuda", **kw)
    with pytest.raises(ValueError, match="NaN inside a key window"):
        iq = x["iq"].clone()
        iq[5, 0, 0] = math.nan
        dsa_attention(x["q"], x["kv"], v_head_dim=8, index_topk=3, backend="torch", index_q=iq,
                      index_weights=x["iw"], index_k=x["ik"])


def test_mla_module_and_glm5_model_torch_backend_equal_dense():
    """The model's default attention (``attn_backend="torch"``) equals the dense reference: MLA module outputs
    and every parameter gradient, and the tiny GLM-5's logits and DSA selections."""
    from moe_rl.attention import MLAConfig, MultiheadLatentAttention
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    assert GlmMoeDsaConfig().attn_backend == "torch"
    assert "attn_backend" not in GlmMoeDsaConfig.tiny_debug().to_hf_config_dict()
    T, cu = 23, torch.tensor([0, 9, 23])
    mods, outs = {}, {}
    for be in ("dense", "torch"):
        torch.manual_seed(4)
        cfg = MLAConfig(hidden_size=16, num_attention_heads=3, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4,
                        qk_rope_head_dim=4, v_head_dim=4, index_topk=5, index_n_heads=2, index_head_dim=8,
                        dsa_backend=be)
        mods[be] = MultiheadLatentAttention(cfg)
        x = torch.randn(T, 16, generator=torch.Generator().manual_seed(1))
        res = mods[be](x, cu_seqlens=cu)
        res.hidden.backward(torch.randn(T, 16, generator=torch.Generator().manual_seed(2)))
        outs[be] = res
    assert torch.equal(outs["torch"].topk_indices, outs["dense"].topk_indices)
    # two fp32 paths of the same module (chunked vs dense attention: other orders): normwise chain bound
    # (tests/_tolerance.py), reductions <= 32 terms (T = 23, widths <= 16), 2 paths x ~10 reductions (projections,
    # indexer, scores, weighted sum, output; and their backward); a wrong key or chunk is O(1) relative
    assert_normwise_close(outs["torch"].hidden, outs["dense"].hidden, dtype=torch.float32, k=32, depth=20,
                          what="hidden")
    for (n, a), (_, b) in zip(mods["torch"].named_parameters(), mods["dense"].named_parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, n
            continue
        assert_normwise_close(a.grad, b.grad, dtype=torch.float32, k=32, depth=20, what=f"grad {n}")
    logits = {}
    for be in ("dense", "torch"):
        torch.manual_seed(0)
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.tiny_debug(attn_backend=be, index_topk=6))
        ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            logits[be] = (model(ids), model.hidden_states(ids, return_topk_indices=True)[1])
    k, depth = decoder_chain(GlmMoeDsaConfig.tiny_debug(index_topk=6), 40)
    assert_normwise_close(logits["torch"][0], logits["dense"][0], dtype=torch.float32, k=k, depth=2 * depth,
                          what="logits")
    assert all(torch.equal(a, b) for a, b in zip(logits["torch"][1], logits["dense"][1], strict=True))


def test_cp_entry_validates_backend_and_chunks_before_any_communication():
    """No process group exists here: the checks must raise before the first collective."""
    from moe_rl.attention import dsa_cp_attention

    q, kv, tok, cu = torch.randn(4, 2, 8), torch.randn(4, 8), torch.arange(4), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="backend='triton' is not a DSA backend"):
        dsa_cp_attention(q, kv, v_head_dim=4, token_idx=tok, cu_seqlens=cu, backend="triton")
    with pytest.raises(ValueError, match=r"k_chunk_size=0 must be a positive int"):
        dsa_cp_attention(q, kv, v_head_dim=4, token_idx=tok, cu_seqlens=cu, backend="torch", k_chunk_size=0)
    with pytest.raises(ValueError, match=r"attn_chunk_size=0 must be a positive int"):
        dsa_cp_attention(q, kv, v_head_dim=4, token_idx=tok, cu_seqlens=cu, backend="dense", attn_chunk_size=0)


@pytest.mark.parametrize("case", ["causal_packed", "noncausal_offset", "dsa_entry"])
def test_chunked_indexer_triton_blocks_in_interpreter(case, tmp_path_factory):
    """``indexer_backend="triton"`` with ``backend="torch"``: each block scored by the Triton kernel (in the
    CPU interpreter, ``_triton_chunked_worker.py``), merged by the streaming top-k; exact inputs, so the
    indices must equal the dense reference's."""
    pytest.importorskip("triton")
    import json
    from pathlib import Path

    from _triton_interp import run_interpreter_worker

    out = tmp_path_factory.getbasetemp() / "triton_chunked.json"
    if not out.exists():
        run_interpreter_worker(Path(__file__).with_name("_triton_chunked_worker.py"), out)
    res = json.loads(out.read_text())
    assert res.get(case) == "ok", res.get(case, f"case {case!r} did not run")
