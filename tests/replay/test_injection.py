"""Replay injection in the trainer: B15 (weights from full scores + gradient), B16 (pad fill), float64 refs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tolerance import assert_normwise_close

from moe_rl.models.glm4_moe import GlmMoeConfig, GlmMoeForCausalLM
from moe_rl.moe import MoE
from moe_rl.moe.router import topk_route
from moe_rl.replay import FILL_ROW, fill_ids, model_replay_ids, resolve_replay_ids


def test_b16_pad_fill_spread_over_experts_and_ep_ranks():
    """3 pad rows + 2 real rows, top_k=2, 4 experts over EP=2: pads get [0,1],[2,3],[0,1]; real rows untouched."""
    replay = torch.tensor([[3, 1], [-1, -1], [-1, -1], [2, 0], [-1, -1]], dtype=torch.int16)
    ids = resolve_replay_ids(replay, num_experts=4)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [[3, 1], [0, 1], [2, 3], [2, 0], [0, 1]]
    pad = ids[(replay == FILL_ROW).all(1)]
    assert all(len(set(r)) == 2 for r in pad.tolist())  # distinct within a row
    per_rank = torch.bincount(pad.flatten() // 2, minlength=2)  # experts 0,1 on rank 0; 2,3 on rank 1
    assert per_rank.tolist() == [4, 2]  # one full cycle (2 rows) is [2, 2]; the third row starts the next
    big = fill_ids(4096, 8, 256)
    counts = torch.bincount(big.flatten(), minlength=256)
    assert counts.min() == counts.max() == 4096 * 8 // 256  # every expert, every EP rank the same share
    assert (big.sort(-1).values.diff(dim=-1) > 0).all()


def test_replay_id_errors_name_the_rule():
    with pytest.raises(ValueError, match=r"replayed expert id 4 at token 0, slot 1 is outside \[0, 4\)"):
        resolve_replay_ids(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"id -1 at token 0, slot 1 is outside"):
        resolve_replay_ids(torch.tensor([[0, -1]]), 4)  # a row mixing ids and the sentinel
    with pytest.raises(ValueError, match="OWN_ROW"):
        resolve_replay_ids(torch.tensor([[-2, -2]]), 4)


def test_own_rows_use_trainer_selection():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8, generator=gen)
    own_ids, own_w, _ = topk_route(logits, 2, score_func="sigmoid", routed_scaling_factor=2.5)
    replay = torch.tensor([[1, 2], [-2, -2], [-1, -1], [-2, -2], [7, 0], [5, 6]])
    ids, w, _ = topk_route(logits, 2, score_func="sigmoid", routed_scaling_factor=2.5, replay_ids_TK=replay)
    assert ids[[1, 3]].tolist() == own_ids[[1, 3]].tolist()
    torch.testing.assert_close(w[[1, 3]], own_w[[1, 3]], atol=0, rtol=0)  # same ids, same scores: same ops
    assert ids[2].tolist() == [0, 1] and ids[[0, 4, 5]].tolist() == [[1, 2], [7, 0], [5, 6]]


def _moe_reference_f64(moe: MoE, x: torch.Tensor, ids: torch.Tensor, score_func: str, scale: float, norm: bool):
    """The MoE block in float64 with explicit loops, replaying ``ids`` ([T, K] int64)."""
    w_r = moe.router.weight.double()
    gate_up = moe.experts.gate_up_proj.double()
    down = moe.experts.down_proj.double()
    x64 = x.double()
    logits = x64 @ w_r.T
    scores = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
    out = []
    for t in range(x64.shape[0]):
        w = scores[t, ids[t]]
        if norm:
            w = w / (w.sum() + 1e-20)
        w = w * scale
        y = torch.zeros_like(x64[t])
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (x64[t] @ gate_up[e].T).chunk(2)
            y = y + w[j] * ((F.silu(gate) * up) @ down[e].T)
        out.append(y)
    out = torch.stack(out)
    sh = moe.shared_experts
    return out + F.linear(
        F.silu(F.linear(x64, sh.gate_proj.weight.double())) * F.linear(x64, sh.up_proj.weight.double()),
        sh.down_proj.weight.double(),
    )


@pytest.mark.parametrize(
    ("score_func", "norm", "scale"), [("sigmoid", True, 2.5), ("softmax", False, 1.0), ("softmax", True, 1.0)]
)
def test_moe_replay_matches_float64_reference_outputs_and_grads(score_func, norm, scale):
    torch.manual_seed(3)
    T, D, F_, E, K = 12, 16, 8, 8, 2
    moe = MoE(D, F_, E, K, n_shared_experts=1, score_func=score_func, norm_topk_prob=norm,
              routed_scaling_factor=scale, use_correction_bias=False)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.5)
        moe.experts.gate_up_proj.normal_(0, 0.3)
        moe.experts.down_proj.normal_(0, 0.3)
    x = torch.randn(T, D)
    own_ids, _, _ = moe.router(x)
    # Replay ids that disagree with the trainer's own choice on most tokens, pads in rows 10, 11.
    replay = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    replay[10:] = FILL_ROW
    assert (replay[:10].sort(-1).values != own_ids[:10].sort(-1).values).any(-1).sum() >= 5
    resolved = resolve_replay_ids(replay, E)
    g = torch.randn(T, D)
    g[10:] = 0  # pad rows carry no loss

    xr = x.clone().requires_grad_()
    out = moe(xr, replay_ids=replay)
    (out * g).sum().backward()

    params64 = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    ref_mod = MoE(D, F_, E, K, n_shared_experts=1, score_func=score_func, norm_topk_prob=norm,
                  routed_scaling_factor=scale, use_correction_bias=False)
    with torch.no_grad():
        for n, p in ref_mod.named_parameters():
            p.copy_(params64[n])
    ref_mod = ref_mod.double()
    x64 = x.double().requires_grad_()
    ref = _moe_reference_f64(ref_mod, x64, resolved, score_func, scale, norm)
    (ref * g.double()).sum().backward()

    # fp32 vs fp64 (tests/_tolerance.py): reductions of size <= max(D, F_, T) chained through router, gate_up,
    # down and combine (depth 4, 6 with the backward); a wrong replayed expert or weight is off by >1e-2 relative
    f32, kmax = torch.float32, max(D, F_, T)
    assert_normwise_close(out, ref, dtype=f32, k=kmax, depth=4, what="out")
    assert_normwise_close(xr.grad, x64.grad, dtype=f32, k=kmax, depth=6, what="x.grad")
    for n, p in moe.named_parameters():
        ref_grad = dict(ref_mod.named_parameters())[n].grad
        assert_normwise_close(p.grad, ref_grad, dtype=f32, k=kmax, depth=6, what=n)
    # B15: every replayed expert's router row gets gradient, including experts outside the trainer's top-k.
    replayed = set(resolved[:10].flatten().tolist())
    assert all(moe.router.weight.grad[e].abs().sum() > 0 for e in replayed)


def _tiny_model(seed: int = 0) -> GlmMoeForCausalLM:
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name or "experts" in name:
                p.normal_(0, 0.3)
    return model


def _masked_loss(model, ids, replay, mask):
    logp = model(ids, replay_ids=replay).log_softmax(-1)[:, :-1]
    tok = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return -(tok * mask).sum()


def test_pad_rows_are_excluded_from_the_loss_whatever_they_route_to():
    """Right-padded batch: changing the pad rows' ids changes no loss and no gradient (causal + masked)."""
    model = _tiny_model()
    cfg = model.config
    B, S, L, K, E = 2, 10, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.n_routed_experts
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (B, S), generator=gen)
    ids[1, 6:] = cfg.pad_token_id
    replay = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * S * L)]).view(B, S, L, K)
    replay[1, 6:] = FILL_ROW
    replay[0, 9] = FILL_ROW  # each sample's last token: a placeholder (never forwarded by the engine)
    replay[1, 5] = FILL_ROW
    mask = torch.zeros(B, S - 1)
    mask[0, 3:] = 1
    mask[1, 3:5] = 1
    grads = []
    for variant in range(2):
        r = replay.clone()
        if variant:
            pads = (r == FILL_ROW).all(-1)
            r[pads] = torch.tensor([E - 1, E - 2])  # different (valid) ids on every pad/placeholder row
        model.zero_grad()
        loss = _masked_loss(model, ids, r, mask)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    # fp32: the experts group tokens differently (other GEMM shapes), so reductions may run in another order.
    # Two fp32 paths through the whole model (tests/_tolerance.py): reductions <= kmax, depth ~8 per layer
    # (attention + MoE) plus the head, doubled for the backward and for comparing two paths. A pad row that
    # leaked into the loss changes it and the router/expert gradients by O(1) relative.
    kmax = max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.vocab_size, B * S)
    depth = 2 * 2 * (8 * L + 2)
    assert_normwise_close(l1, l0, dtype=torch.float32, k=kmax, depth=depth, what="loss")
    for n in g0:
        assert_normwise_close(g1[n], g0[n], dtype=torch.float32, k=kmax, depth=depth, what=n)


def test_per_layer_list_equals_stacked_replay_and_errors():
    model = _tiny_model().eval()
    cfg = model.config
    B, S, L, K, E = 2, 7, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.n_routed_experts
    ids = torch.randint(3, cfg.vocab_size, (B, S))
    replay = torch.stack([torch.randperm(E)[:K] for _ in range(B * S * L)]).view(B, S, L, K).to(torch.uint8)
    per_layer = [replay[:, :, i] if model.layers[i].is_moe else None for i in range(L)]
    with torch.no_grad():  # bit-equal: the same ids in another container, the same arithmetic
        torch.testing.assert_close(model(ids, replay_ids=per_layer), model(ids, replay_ids=replay), atol=0, rtol=0)
    with pytest.raises(ValueError, match=rf"list of 1 per-layer tensors but the model has {L} decoder layers"):
        model(ids, replay_ids=per_layer[:1])
    with pytest.raises(ValueError, match=r"replay_ids has shape \(2, 6, .*\) but this MoE block expects \(2, 7, 2\)"):
        model(ids, replay_ids=[None if t is None else t[:, :6] for t in per_layer])


def test_duplicate_replay_ids_rejected_sentinel_rows_kept():
    """A non-sentinel row repeating an id would give that expert two gates: ValueError naming the row."""
    replay = torch.tensor([[0, 1], [-1, -1], [3, 3], [-2, -2]])
    with pytest.raises(ValueError, match=r"replayed expert ids \[3, 3\] at token 2 repeat an expert \(1 such"):
        resolve_replay_ids(replay, 4, own_ids_TK=torch.tensor([[0, 1]] * 4))
    with pytest.raises(ValueError, match=r"ids \[2, 0, 2\] at token 1 repeat"):
        topk_route(torch.randn(2, 8), 3, replay_ids_TK=torch.tensor([[0, 1, 2], [2, 0, 2]], dtype=torch.uint8))
    # the same rows without the duplicate pass; sentinel rows (all -1 / all -2) are not "duplicates"
    ok = resolve_replay_ids(replay[[0, 1, 3]], 4, own_ids_TK=torch.tensor([[9, 9], [9, 9], [2, 3]]))
    assert ok.tolist() == [[0, 1], [0, 1], [2, 3]]
    ids, w, scores = topk_route(torch.zeros(3, 4), 2, replay_ids_TK=replay[[0, 1, 3]])
    assert ids[:2].tolist() == [[0, 1], [0, 1]] and len(set(ids[2].tolist())) == 2
    torch.testing.assert_close(w, torch.full((3, 2), 0.5))  # equal sigmoid(0) scores, normalised


def test_replay_ids_type_and_rank_errors():
    with pytest.raises(TypeError, match="dtype torch.float32"):
        resolve_replay_ids(torch.tensor([[0.0, 1.0]]), 4)
    with pytest.raises(TypeError, match="dtype torch.bool"):
        resolve_replay_ids(torch.ones(1, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"shape \(2,\); expected \[T, K\]"):
        resolve_replay_ids(torch.tensor([0, 1]), 4)


@pytest.mark.parametrize("bad", [5, -3, 1])
def test_model_replay_ids_rejects_unknown_states(bad):
    routed = torch.zeros(1, 3, 1, 2, dtype=torch.uint8)
    routed[..., 1] = 1
    state = torch.tensor([[0, bad, -1]], dtype=torch.int8)
    with pytest.raises(ValueError, match=rf"state\[0, 1\] = {bad} is not a row state .*0 \(replay\), -1 \(fill\), -2"):
        model_replay_ids(routed, state, [True])
    with pytest.raises(TypeError, match="integer tensor"):
        model_replay_ids(routed, state.float(), [True])


def test_model_replay_ids_documented_states_map_to_rows():
    routed = torch.tensor([[[[3, 1]], [[0, 2]], [[1, 0]]]], dtype=torch.uint8)  # [B=1, S=3, M=1, K=2]
    state = torch.tensor([[0, -1, -2]], dtype=torch.int8)
    out = model_replay_ids(routed, state, [False, True])
    assert out[0] is None
    assert out[1].tolist() == [[[3, 1], [-1, -1], [-2, -2]]]
