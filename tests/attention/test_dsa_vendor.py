"""Vendor DSA backends (moe_rl.attention.dsa_vendor): FlashMLA sparse prefill/decode, DeepGEMM indexer logits.

On CPU the vendor packages are served by stand-ins that implement their documented contracts in plain torch with
the real signatures (``tests/attention/fake_flash_mla``, ``tests/attention/fake_deep_gemm_indexer``), put into
``sys.modules`` by monkeypatch; the adapters are checked against the dense reference through them. The ``gpu``
test runs the real kernels against the torch path.

Tolerances. Sparse attention runs in bf16 inputs with fp32 math and a bf16 output on both sides: the two fp32
results differ by summation order only (a few fp32 ulps over Dk = 576 and K terms), then each is rounded to bf16,
so outputs may differ by one bf16 ulp (at most 2^-7 |x|) plus that fp32 term; gradients, rounded the same way, by
two. ``lse`` is fp32 on both sides: bound ``sqrt(Dk K) eps32`` times the logit magnitude. The indexer checks use
inputs that FP8 and fp32 represent exactly (small integers, power-of-two weights), so every score is exact in any
summation order and the selections must be equal, ties included.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.attention import (
    dsa_attention,
    key_windows,
    lightning_indexer,
    select_topk,
    sparse_latent_attention,
)
from moe_rl.attention.dsa_chunked import DSA_BACKENDS, chunked_indexer_topk, sparse_latent_attention_chunked
from moe_rl.attention.dsa_vendor import (
    FLASHMLA_V32_FP8_BYTES_PER_TOKEN,
    deepgemm_indexer_topk,
    flashmla_sparse_attention,
    flashmla_sparse_decode,
    quantize_latent_kv_fp8_v32,
)

HERE = Path(__file__).parent
EPS32 = torch.finfo(torch.float32).eps
ULP_BF16 = torch.finfo(torch.bfloat16).eps  # 2^-7: one bf16 ulp is at most this times |x| (8 significant bits)


def _load_fake(monkeypatch, name: str, folder: str):
    spec = importlib.util.spec_from_file_location(name, HERE / folder / name / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # before exec: dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fake_flash_mla(monkeypatch):
    return _load_fake(monkeypatch, "flash_mla", "fake_flash_mla")


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    return _load_fake(monkeypatch, "deep_gemm", "fake_deep_gemm_indexer")


def _problem(T=48, H=4, Dk=576, K=40, seed=0, seqs=(20, 28)):
    """bf16 q/kv, packed sequences, indexer-selected indices with -1 fill (early queries see < K keys)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, Dk, generator=g) * 0.5).to(torch.bfloat16)
    kv = (torch.randn(T, Dk, generator=g) * 0.5).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()])
    ks, ke = key_windows(torch.arange(T), cu, causal=True)
    iq, iw, ik = torch.randn(T, 2, 16, generator=g), torch.rand(T, 2, generator=g), torch.randn(T, 16, generator=g)
    idx = chunked_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke)
    assert bool((idx == -1).any()) and bool((idx >= 0).any())
    return q, kv, idx


def _assert_bf16_close(got, ref, n_terms, ulps=1, what="out"):
    got, ref = got.float(), ref.float()
    tol = ulps * ULP_BF16 * ref.abs() + 4 * math.sqrt(n_terms) * EPS32 * ref.abs().max().clamp_min(1e-30)
    bad = (got - ref).abs() > tol
    assert not bool(bad.any()), f"{what}: max err {(got - ref).abs().max():.3e} at {bad.nonzero()[:3].tolist()}"


# --------------------------------------------------------------------------------------------- FlashMLA prefill


@pytest.mark.parametrize("H", [4, 72, 130])  # -> 64, 128, 128 + 64 (padded head groups)
def test_flashmla_prefill_equals_dense_reference(fake_flash_mla, H):
    q, kv, idx = _problem(H=H, K=40)  # K 40 -> 128 slots, 88 of them -1
    scale = 192 ** -0.5
    out, lse = flashmla_sparse_attention(q, kv, idx, v_head_dim=512, scale=scale)
    ref_out, ref_lse = sparse_latent_attention(q, kv, idx, v_head_dim=512, scale=scale)
    assert out.dtype == torch.bfloat16 and out.shape == (48, H, 512) and lse.shape == (48, H)
    _assert_bf16_close(out, ref_out, 576 * 40)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    bound = 8 * math.sqrt(576 * 40) * EPS32 * ref_lse[fin].abs().max().clamp_min(1.0)
    assert float((lse[fin] - ref_lse[fin]).abs().max()) <= bound


def test_flashmla_prefill_query_without_keys_and_valid_mask(fake_flash_mla):
    q, kv, idx = _problem(H=4, K=8)
    idx[5] = -1  # no key: FlashMLA gives lse = +inf, out 0; the adapter returns lse = -inf as the reference
    valid = torch.rand(idx.shape, generator=torch.Generator().manual_seed(3)) > 0.3
    out, lse = flashmla_sparse_attention(q, kv, idx, v_head_dim=512, scale=0.05, valid=valid)
    ref_out, ref_lse = sparse_latent_attention(q, kv, idx, v_head_dim=512, scale=0.05, valid=valid)
    assert torch.isneginf(lse[5]).all() and torch.isneginf(ref_lse[5]).all()
    assert float(out[5].abs().max()) == 0.0
    _assert_bf16_close(out, ref_out, 576 * 8)


def test_flashmla_prefill_gradients_equal_dense_reference(fake_flash_mla):
    q, kv, idx = _problem(H=4, K=40, seed=1)
    g = torch.Generator().manual_seed(5)
    d_out = torch.randn(48, 4, 512, generator=g).to(torch.bfloat16)
    d_lse = torch.randn(48, 4, generator=g)
    grads = []
    for fn in (flashmla_sparse_attention, sparse_latent_attention):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, lse = fn(qq, kk, idx, v_head_dim=512, scale=0.06)
        fin = torch.isfinite(lse)
        ((out.float() * d_out.float()).sum() + (torch.where(fin, lse, 0.0) * d_lse).sum()).backward()
        grads.append((qq.grad, kk.grad))
    for name, got, ref in zip(("dq", "dkv"), grads[0], grads[1], strict=True):
        assert got.dtype == torch.bfloat16
        _assert_bf16_close(got, ref, 576 * 40 * 4, ulps=2, what=name)


def test_flashmla_prefill_refuses_unsupported_shapes(fake_flash_mla):
    q, kv, idx = _problem(H=4, K=8)
    with pytest.raises(ValueError, match=r"Dk=128 .*576"):
        flashmla_sparse_attention(q[..., :128], kv[:, :128], idx, v_head_dim=64, scale=0.1)
    with pytest.raises(ValueError, match=r"v_head_dim=256 .*512"):
        flashmla_sparse_attention(q, kv, idx, v_head_dim=256, scale=0.1)
    with pytest.raises(TypeError, match=r"q is torch.float32; .*bfloat16"):
        flashmla_sparse_attention(q.float(), kv, idx, v_head_dim=512, scale=0.1)
    with pytest.raises(ValueError, match=r"topk_indices must lie in \[-1, Tk=48\)"):
        flashmla_sparse_attention(q, kv, idx + 48, v_head_dim=512, scale=0.1)
    with pytest.raises(ValueError, match=r"attn_chunk_size=0"):
        flashmla_sparse_attention(q, kv, idx, v_head_dim=512, scale=0.1, chunk_size=0)


def test_flashmla_missing_raises_importerror_with_instructions(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # makes `import flash_mla` raise ImportError
    q, kv, idx = _problem(H=4, K=8)
    with pytest.raises(ImportError, match=r"backend='flashmla' needs FlashMLA .*pip install -v \..*backend='torch'"):
        flashmla_sparse_attention(q, kv, idx, v_head_dim=512, scale=0.1)
    with pytest.raises(ImportError, match=r"FlashMLA"):
        flashmla_sparse_decode(q, quantize_latent_kv_fp8_v32(kv), idx, scale=0.1)


# --------------------------------------------------------------------------------------------- FlashMLA decode


def _dequant_reference(kv: torch.Tensor) -> torch.Tensor:
    """The documented V3.2 layout read independently: e4m3 latent * per-128 scale, bf16 rope."""
    nope = kv[:, :512].float().view(-1, 4, 128)
    sf = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1).clamp_min(1e-4) / 448.0)))
    deq = (nope / sf[..., None]).to(torch.float8_e4m3fn).float() * sf[..., None]
    return torch.cat([deq.reshape(-1, 512), kv[:, 512:].float()], dim=1)


def test_quantize_latent_kv_fp8_v32_layout():
    kv = (torch.randn(70, 576, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    cache = quantize_latent_kv_fp8_v32(kv, page_block_size=32)
    assert cache.shape == (3, 32, 1, FLASHMLA_V32_FP8_BYTES_PER_TOKEN) and cache.dtype == torch.float8_e4m3fn
    raw = cache.view(torch.uint8).reshape(96, 656)
    assert torch.equal(raw[:70, 528:].contiguous().view(torch.bfloat16), kv[:, 512:])  # rope stored as is
    sf = raw[:70, 512:528].contiguous().view(torch.float32)
    assert torch.equal(sf, torch.exp2(torch.round(torch.log2(sf))))  # powers of two
    deq = raw[:70, :512].contiguous().view(torch.float8_e4m3fn).float().view(70, 4, 128) * sf[..., None]
    assert torch.equal(deq.reshape(70, 512), _dequant_reference(kv)[:, :512])
    # e4m3 rounding: half an ulp (2^-4 relative) for normal codes, 2^-10 * scale absolute below 2^-6 * scale
    x = kv[:, :512].float().view(70, 4, 128)
    err = (deq - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2.0**-4, sf[..., None] * 2.0**-10)).all())
    assert float(raw[70:].float().abs().max()) == 0.0
    with pytest.raises(ValueError, match=r"\[Tk, 576\]"):
        quantize_latent_kv_fp8_v32(kv[:, :512])


@pytest.mark.parametrize("H", [16, 128])
def test_flashmla_decode_equals_dense_reference_on_dequantized_cache(fake_flash_mla, H):
    q, kv, idx = _problem(H=H, K=40, seed=4)
    cache = quantize_latent_kv_fp8_v32(kv, page_block_size=64)
    out, lse = flashmla_sparse_decode(q, cache, idx, scale=0.05)
    ref_out, ref_lse = sparse_latent_attention(q, _dequant_reference(kv).to(torch.bfloat16), idx, v_head_dim=512,
                                               scale=0.05)
    # the stand-in dequantises in fp32 (rope bf16 exact; fp8 * pow2 scale exact in bf16 too: 4 significant bits)
    _assert_bf16_close(out, ref_out, 576 * 40)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert float((lse[fin] - ref_lse[fin]).abs().max()) <= 8 * math.sqrt(576 * 40) * EPS32 * \
        float(ref_lse[fin].abs().max().clamp_min(1.0))


def test_flashmla_decode_refuses_bad_cache(fake_flash_mla):
    q, kv, idx = _problem(H=4, K=8)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_pages, page_block_size, 1, 656\]"):
        flashmla_sparse_decode(q, kv, idx, scale=0.1)
    with pytest.raises(ValueError, match=r"q must be \[Tq, H, 576\]"):
        flashmla_sparse_decode(q[..., :512], quantize_latent_kv_fp8_v32(kv), idx, scale=0.1)


# --------------------------------------------------------------------------------------------- DeepGEMM indexer


def _int_indexer(T, HI, DI, seed, seqs):
    """Integer-valued inputs: exact in FP8 after a power-of-two scale and exact in fp32 in any order; many ties."""
    g = torch.Generator().manual_seed(seed)
    iq = torch.randint(-3, 4, (T, HI, DI), generator=g).float()
    ik = torch.randint(-2, 3, (T, DI), generator=g).float()
    ik[3] = 0.0  # an all-zero key row (scale clamp path)
    iw = torch.exp2(torch.randint(-2, 2, (T, HI), generator=g).float())
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()])
    ks, ke = key_windows(torch.arange(T), cu, causal=True)
    return iq, iw, ik, ks, ke, cu


@pytest.mark.parametrize(("HI", "DI", "cq", "seqs"), [(4, 32, 7, (30, 50)), (40, 64, 512, (80,)),
                                                      (32, 128, 16, (10, 0, 45, 25))])
def test_deepgemm_indexer_equals_torch_and_dense_topk(fake_deep_gemm, HI, DI, cq, seqs):
    T, K = 80, 24
    iq, iw, ik, ks, ke, cu = _int_indexer(T, HI, DI, HI + DI, seqs)
    got = deepgemm_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke, q_chunk_size=cq)
    dense = lightning_indexer(iq, iw, ik, index_topk=K, cu_seqlens=cu).topk_indices
    torch_path = chunked_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke, q_chunk_size=5, k_chunk_size=11)
    assert torch.equal(got, dense) and torch.equal(got, torch_path)
    scores = lightning_indexer(iq, iw, ik, cu_seqlens=cu).scores
    sel = scores.gather(1, got.clamp(min=0))
    assert bool(((sel[:, 1:] == sel[:, :-1]) & (got[:, 1:] >= 0)).any()), "the case must contain exact ties"


def test_deepgemm_indexer_legacy_name_and_padding_queries(fake_deep_gemm, monkeypatch):
    monkeypatch.delattr(fake_deep_gemm, "fp8_fp4_mqa_logits")  # older DeepGEMM: fp8_mqa_logits only
    iq, iw, ik, ks, ke, cu = _int_indexer(40, 8, 32, 1, (25,))  # tokens 25..39 are padding: empty windows
    got = deepgemm_indexer_topk(iq, iw, ik, 16, ks=ks, ke=ke, q_chunk_size=8)
    assert torch.equal(got, select_topk(lightning_indexer(iq, iw, ik, cu_seqlens=cu).scores, 16, ks=ks, ke=ke))
    assert bool((got[25:] == -1).all())


def test_deepgemm_indexer_refusals(fake_deep_gemm, monkeypatch):
    iq, iw, ik, ks, ke, _ = _int_indexer(16, 4, 32, 0, (16,))
    with pytest.raises(ValueError, match=r"index_topk=0 must be an int >= 1"):
        deepgemm_indexer_topk(iq, iw, ik, 0, ks=ks, ke=ke)
    with pytest.raises(ValueError, match=r"q_chunk_size=-1"):
        deepgemm_indexer_topk(iq, iw, ik, 4, ks=ks, ke=ke, q_chunk_size=-1)
    with pytest.raises(ValueError, match=r"65 indexer heads; .*at most 64"):
        deepgemm_indexer_topk(torch.zeros(16, 65, 32), torch.zeros(16, 65), ik, 4, ks=ks, ke=ke)
    with pytest.raises(ValueError, match=r"DI=48; .*32, 64 or 128"):
        deepgemm_indexer_topk(torch.zeros(16, 4, 48), iw, torch.zeros(16, 48), 4, ks=ks, ke=ke)
    monkeypatch.delattr(fake_deep_gemm, "fp8_fp4_mqa_logits")
    monkeypatch.delattr(fake_deep_gemm, "fp8_mqa_logits")
    with pytest.raises(ImportError, match=r"exports none of .*DeepGEMM"):
        deepgemm_indexer_topk(iq, iw, ik, 4, ks=ks, ke=ke)


def test_deepgemm_missing_raises_importerror_with_instructions(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    iq, iw, ik, ks, ke, _ = _int_indexer(16, 4, 32, 0, (16,))
    with pytest.raises(ImportError, match=r"indexer_backend='deep_gemm' needs DeepGEMM .*indexer_backend='torch'"):
        deepgemm_indexer_topk(iq, iw, ik, 4, ks=ks, ke=ke)


# --------------------------------------------------------------------------------------------- dsa_attention hook


@pytest.mark.skipif("flashmla" not in DSA_BACKENDS, reason="dsa_attention(backend='flashmla') is not wired yet")
def test_dsa_attention_flashmla_deep_gemm_equals_dense(fake_flash_mla, fake_deep_gemm):
    """dsa_attention(backend="flashmla", indexer_backend="deep_gemm") vs backend="dense": equal indices (exact
    integer indexer inputs), outputs and gradients within the bf16 bounds above."""
    T, H, K = 48, 4, 24
    q, kv, _ = _problem(T=T, H=H, K=K, seed=7)
    iq, iw, ik, _, _, cu = _int_indexer(T, 8, 32, 7, (20, 28))
    res = {}
    for backend, ib in (("flashmla", "deep_gemm"), ("dense", "torch")):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        r = dsa_attention(qq, kk, v_head_dim=512, scale=0.05, index_q=iq, index_weights=iw, index_k=ik,
                          index_topk=K, cu_seqlens=cu, backend=backend, indexer_backend=ib)
        r.out.float().square().sum().backward()
        res[backend] = (r, qq.grad, kk.grad)
    (r, dq, dkv), (r0, dq0, dkv0) = res["flashmla"], res["dense"]
    assert torch.equal(r.topk_indices, r0.topk_indices)
    _assert_bf16_close(r.out, r0.out, 576 * K)
    _assert_bf16_close(dq, dq0, 576 * K * 4, ulps=2, what="dq")
    _assert_bf16_close(dkv, dkv0, 576 * K * 4, ulps=2, what="dkv")
    with pytest.raises(TypeError, match=r"bfloat16"):
        dsa_attention(q.float(), kv.float(), v_head_dim=512, topk_indices=r0.topk_indices, backend="flashmla")
    with pytest.raises(ValueError, match=r"return_index_scores=True"):
        dsa_attention(q, kv, v_head_dim=512, index_q=iq, index_weights=iw, index_k=ik, index_topk=K,
                      return_index_scores=True, backend="flashmla")


# --------------------------------------------------------------------------------------------- real kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (SM90/SM100)")
def test_vendor_kernels_match_torch_path_on_gpu():
    """Real FlashMLA + DeepGEMM vs the torch path at GLM-5 head sizes (T = 4096, K = 2048, H = 64)."""
    pytest.importorskip("flash_mla")
    pytest.importorskip("deep_gemm")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T, H, K, HI, DI = 4096, 64, 2048, 32, 128
    q = (torch.randn(T, H, 576, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    kv = (torch.randn(T, 576, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    iq = torch.randn(T, HI, DI, device=dev, generator=g).to(torch.bfloat16)
    iw = torch.rand(T, HI, device=dev, generator=g) * (HI * DI) ** -0.5
    ik = torch.randn(T, DI, device=dev, generator=g).to(torch.bfloat16)
    ks, ke = key_windows(torch.arange(T, device=dev), torch.tensor([0, T], device=dev), causal=True)
    # indexer: the same selection as the torch top-k on the FP8-rounded inputs up to near-ties, so the sorted
    # selected scores (fp64 from those inputs) agree within the kernel's error. Hopper's FP8 MMA accumulates with
    # about 14 mantissa bits (DeepSeek-V3 report, arXiv 2412.19437 §3.3.2): per logit at most DI * 2^-14 + HI eps32
    # times the absolute-value sum sum_h w |q_h| . |k| (worst case, linear growth).
    idx = deepgemm_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke)
    qs = torch.exp2(torch.ceil(torch.log2(iq.float().abs().amax(-1).clamp_min(1e-4) / 448.0)))
    ksf = torch.exp2(torch.ceil(torch.log2(ik.float().abs().amax(-1).clamp_min(1e-4) / 448.0)))
    iq8 = (iq.float() / qs[..., None]).to(torch.float8_e4m3fn).double() * qs[..., None]
    ik8 = (ik.float() / ksf[:, None]).to(torch.float8_e4m3fn).double() * ksf[:, None]
    ref_idx = chunked_indexer_topk(iq8, iw.double(), ik8, K, ks=ks, ke=ke)
    assert torch.equal(idx < 0, ref_idx < 0)

    def scores(qq, kk):  # [T, T] fp64 in blocks of 256 queries (128 MiB)
        return torch.cat([torch.einsum("ths,th->ts", torch.relu(torch.einsum("thd,sd->ths", qq[c:c + 256], kk)),
                                       iw[c:c + 256].double()) for c in range(0, T, 256)])

    s64 = scores(iq8, ik8)
    s_abs = float(scores(iq8.abs(), ik8.abs()).max())
    a = s64.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, 0).sort(1).values
    b = s64.gather(1, ref_idx.clamp(min=0)).masked_fill(ref_idx < 0, 0).sort(1).values
    assert float((a - b).abs().max()) <= 2 * (DI * 2.0**-14 + HI * EPS32) * s_abs
    # attention: FlashMLA rounds the probabilities to bf16 before P V (its rS tile is bf16), so out may differ by
    # 2^-8 max|v| (the probabilities sum to 1) on top of the final bf16 rounding
    v_max = float(kv[:, :512].float().abs().max())
    # FlashMLA forward vs the torch path on the same indices (the backward is the torch one: CPU tests)
    out, lse = flashmla_sparse_attention(q, kv, idx, v_head_dim=512, scale=192 ** -0.5)
    ref_out, ref_lse = sparse_latent_attention_chunked(q, kv, idx, v_head_dim=512, scale=192 ** -0.5)
    assert float(((out.float() - ref_out.float()).abs() - ULP_BF16 * ref_out.float().abs()).max()) <= 2.0**-8 * v_max
    assert float((lse - ref_lse).abs().max()) <= 8 * math.sqrt(576 * K) * EPS32 * float(ref_lse.abs().max())
    # decode on the FP8 cache vs the torch path on the dequantized cache
    cache = quantize_latent_kv_fp8_v32(kv)
    dout, dlse = flashmla_sparse_decode(q[-64:], cache, idx[-64:], scale=192 ** -0.5)
    deq = _dequant_reference(kv.cpu()).to(dev).to(torch.bfloat16)
    rout, rlse = sparse_latent_attention_chunked(q[-64:], deq, idx[-64:], v_head_dim=512, scale=192 ** -0.5)
    assert float(((dout.float() - rout.float()).abs() - ULP_BF16 * rout.float().abs()).max()) <= 2.0**-8 * v_max
    assert float((dlse - rlse).abs().max()) <= 8 * math.sqrt(576 * K) * EPS32 * float(rlse.abs().max())
