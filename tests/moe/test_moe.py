"""Routed experts and the MoE block against a float64 dense reference (every expert on every token, masked)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tolerance import assert_normwise_close

from moe_rl.moe import MoE, grouped_experts_forward

torch.set_num_threads(1)

T, D, FF, E, K = 24, 32, 16, 8, 2
# fp32 vs float64 tolerance (tests/_tolerance.py assert_normwise_close): reductions of size <= KMAX (D, FF or T
# tokens for weight gradients), chained through router, gate_up, down and combine (depth 4 forward, 6 with the
# backward). A wrong expert, weight or token moves the norm by >1e-2 relative, >1e3 times the bound.
KMAX, DEPTH_FWD, DEPTH_BWD = max(D, FF, T), 4, 6
F32 = torch.float32


def _swiglu64(x, gate_up, down):
    """One expert in float64: ``down @ (silu(gate @ x) * (up @ x))``."""
    inter = gate_up.shape[0] // 2
    return (F.silu(x @ gate_up[:inter].T) * (x @ gate_up[inter:].T)) @ down.T


def _reference_ids(scores, bias, top_k, n_group, topk_group):
    """Per-token selection with plain Python sorting (float64 scores)."""
    ids = []
    num_experts = scores.shape[1]
    per = num_experts // n_group
    for row in (scores + bias).tolist():
        cand = list(range(num_experts))
        if n_group > 1:
            gs = [sum(sorted(row[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
            kept = sorted(range(n_group), key=lambda g: -gs[g])[:topk_group]
            cand = [e for e in cand if e // per in kept]
        ids.append(sorted(cand, key=lambda e: -row[e])[:top_k])
    return torch.tensor(ids)


def dense_reference(x, p, *, top_k, n_group=1, topk_group=1, norm=True, scale=1.0, replay_ids=None):
    """float64 MoE: all experts on all tokens, combined through a [T, E] gate that is zero off the top-k."""
    scores = torch.sigmoid(x @ p["router.weight"].T)
    if replay_ids is None:
        ids = _reference_ids(scores.detach(), p["router.e_score_correction_bias"], top_k, n_group, topk_group)
    else:
        ids = replay_ids.long()
    mask = torch.zeros_like(scores).scatter(1, ids, 1.0)
    gate = scores * mask
    if norm:
        gate = gate / (gate.sum(-1, keepdim=True) + 1e-20)
    gate = gate * scale
    y = torch.stack(
        [
            _swiglu64(x, p["experts.gate_up_proj"][e], p["experts.down_proj"][e])
            for e in range(scores.shape[1])
        ]
    )  # [E, T, D]
    out = torch.einsum("te,etd->td", gate, y)
    if "shared_experts.gate_proj.weight" in p:
        gu = torch.cat([p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"]])
        out = out + _swiglu64(x, gu, p["shared_experts.down_proj.weight"])
    return out, ids


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for t in module.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
        if module.router.e_score_correction_bias is not None:
            module.router.e_score_correction_bias.copy_(0.5 * torch.randn(E, generator=gen))


CASES = {
    "plain": dict(n_shared_experts=1),
    "grouped_scaled": dict(n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "no_shared_unnormalized": dict(n_shared_experts=0, norm_topk_prob=False),
}


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_forward_backward_matches_float64_dense_reference(case, backend):
    kw = CASES[case]
    gen = torch.Generator().manual_seed(0)
    moe = MoE(D, FF, E, K, backend=backend, **kw)
    _randomize(moe, gen)
    x = torch.randn(2, T // 2, D, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, T // 2, D, generator=gen)

    out = moe(x)
    out.backward(grad_out)

    p64 = {n: t.detach().double().requires_grad_(True) for n, t in moe.named_parameters()}
    p64["router.e_score_correction_bias"] = moe.router.e_score_correction_bias.double()
    x64 = x.detach().double().reshape(T, D).requires_grad_(True)
    ref, ref_ids = dense_reference(
        x64,
        p64,
        top_k=K,
        n_group=kw.get("n_group", 1),
        topk_group=kw.get("topk_group", 1),
        norm=kw.get("norm_topk_prob", True),
        scale=kw.get("routed_scaling_factor", 1.0),
    )
    ref.backward(grad_out.double().reshape(T, D))

    ids, _, _ = moe.router(x.detach().reshape(T, D))
    assert torch.equal(ids, ref_ids), "selection differs from the float64 reference"
    assert ref_ids.unique().numel() > K  # several experts active
    assert_normwise_close(out.reshape(T, D), ref, dtype=F32, k=KMAX, depth=DEPTH_FWD, what="out")
    assert_normwise_close(x.grad.reshape(T, D), x64.grad, dtype=F32, k=KMAX, depth=DEPTH_BWD, what="x.grad")
    for name, param in moe.named_parameters():
        assert param.grad is not None, name
        assert_normwise_close(param.grad, p64[name].grad, dtype=F32, k=KMAX, depth=DEPTH_BWD, what=name)
    assert moe.router.weight.grad.abs().max() > 0


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_moe_replay_matches_reference_and_reaches_router(backend):
    gen = torch.Generator().manual_seed(3)
    moe = MoE(D, FF, E, K, backend=backend, routed_scaling_factor=2.5)
    _randomize(moe, gen)
    x = torch.randn(T, D, generator=gen)
    replay = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int16)
    out = moe(x, replay_ids=replay)
    out.square().sum().backward()

    p64 = {n: t.detach().double().requires_grad_(True) for n, t in moe.named_parameters()}
    ref, _ = dense_reference(x.double(), p64, top_k=K, scale=2.5, replay_ids=replay)
    ref.square().sum().backward()
    assert_normwise_close(out, ref, dtype=F32, k=KMAX, depth=DEPTH_FWD, what="out")
    # d(sum out^2)/d router: one more chain link (the squared output) than the plain backward
    assert_normwise_close(moe.router.weight.grad, p64["router.weight"].grad, dtype=F32, k=KMAX,
                          depth=DEPTH_BWD + 1, what="router.weight.grad")
    replayed = replay.long().unique()
    assert (moe.router.weight.grad[replayed].abs().sum(-1) > 0).all()

    with pytest.raises(
        ValueError, match=r"replay_ids has shape \(24, 3\) but this MoE block expects \(24, 2\)"
    ):
        moe(x, replay_ids=torch.zeros(T, 3, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_experts_match_float64_reference_with_empty_experts(backend):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    gate_up = (0.2 * torch.randn(E, 2 * FF, D, generator=gen)).requires_grad_(True)
    down = (0.2 * torch.randn(E, D, FF, generator=gen)).requires_grad_(True)
    ids = torch.randint(0, 3, (T, K), generator=gen)  # experts 3..7 get no tokens
    y = grouped_experts_forward(x, ids, gate_up, down, backend=backend)
    assert y.shape == (T, K, D)
    y.sum().backward()  # an expanded (stride-0) output grad must work for both backends

    x64, gu64, dn64 = (t.detach().double().requires_grad_(True) for t in (x, gate_up, down))
    ref = torch.stack(
        [torch.stack([_swiglu64(x64[t], gu64[e], dn64[e]) for e in ids[t].tolist()]) for t in range(T)]
    )
    ref.sum().backward()
    # experts only: gate_up and down GEMMs (depth 2 forward, 4 with the backward)
    assert_normwise_close(y, ref, dtype=F32, k=KMAX, depth=2, what="y")
    for name, got, want in (("x", x.grad, x64.grad), ("gate_up", gate_up.grad, gu64.grad), ("down", down.grad, dn64.grad)):
        assert_normwise_close(got, want, dtype=F32, k=KMAX, depth=4, what=f"{name}.grad")
    assert gate_up.grad[3:].abs().max() == 0 and down.grad[3:].abs().max() == 0


def test_loop_backend_runs_in_float64_and_grouped_mm_refuses():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * FF, D, generator=gen, dtype=torch.float64)
    down = torch.randn(E, D, FF, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, E, (T, K), generator=gen)
    y = grouped_experts_forward(x, ids, gate_up, down, backend="loop")
    ref = torch.stack(
        [torch.stack([_swiglu64(x[t], gate_up[e], down[e]) for e in ids[t].tolist()]) for t in range(T)]
    )
    assert_normwise_close(y, ref, dtype=torch.float64, k=KMAX, depth=2, what="float64 loop")
    with pytest.raises(
        ValueError, match=r"grouped_mm' needs float32/bfloat16/float16 inputs, got torch.float64"
    ):
        grouped_experts_forward(x, ids, gate_up, down, backend="grouped_mm")
    with pytest.raises(ValueError, match=r"backend='triton' is not supported"):
        grouped_experts_forward(x, ids, gate_up, down, backend="triton")  # type: ignore[arg-type]


def test_grouped_mm_alignment_error_names_sizes():
    x = torch.randn(4, 6)
    gate_up, down = torch.randn(2, 2 * 5, 6), torch.randn(2, 6, 5)
    ids = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"D=6 and expert intermediate size F=5 to be multiples of 4"):
        grouped_experts_forward(x, ids, gate_up, down, backend="grouped_mm")


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_moe_is_deterministic(backend):
    gen = torch.Generator().manual_seed(4)
    moe = MoE(D, FF, E, K, backend=backend)
    _randomize(moe, gen)
    x = torch.randn(T, D, generator=gen)
    grads = []
    for _ in range(2):
        moe.zero_grad()
        out = moe(x)
        out.square().sum().backward()
        grads.append((out.detach().clone(), [p.grad.clone() for p in moe.parameters()]))
    # bit-equal: the same code on the same inputs twice (same shapes, kernels, thread count, order)
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True))


def test_backends_agree_in_bf16():
    gen = torch.Generator().manual_seed(5)
    moe = MoE(D, FF, E, K, backend="loop")
    _randomize(moe, gen)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    out_loop = moe(x)
    moe.experts.backend = "grouped_mm"
    out_gmm = moe(x)
    assert out_gmm.dtype == torch.bfloat16
    # Both vs the float64 MoE of the same bf16 inputs and weights, on the experts the (shared, fp32) router picked:
    # every bf16 op rounds its output (u = eps/2 relative; GEMMs accumulate in fp32), ~2 roundings per link of the
    # DEPTH_FWD chain, so ||err|| <= 2 * DEPTH_FWD * u * ||ref|| (normwise, tests/_tolerance.py). A wrong expert or
    # weight on one token of T moves the norm by ~1/sqrt(T) = 0.2 relative, > 5x the bound.
    ids, _, _ = moe.router(x)
    p64 = {n: t.detach().double() for n, t in moe.named_parameters()}
    p64.update({n: t.detach().double() for n, t in moe.named_buffers()})
    ref, _ = dense_reference(x.double(), p64, top_k=K, replay_ids=ids)
    for name, out in (("loop", out_loop), ("grouped_mm", out_gmm)):
        assert_normwise_close(out, ref, dtype=torch.bfloat16, k=1, depth=2 * DEPTH_FWD, c=0.5, what=name)
