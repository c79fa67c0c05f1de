"""Router replay and the trainer-side recorder on tiny ``transformers`` MoE models (no hub, no downloads).

Families: Qwen3-MoE (``norm_topk_prob`` on and off), Mixtral, DeepSeek-V3 (sigmoid, bias, 4 groups of 2, top-2
groups, ``routed_scaling_factor``) and GLM-4.5 MoE, each with 2 MoE layers, in fp32.

Checked per family:
- replaying the model's own recorded routing gives bit-identical logits (same ids in the same order: the same
  gather, normalising sum and expert loop, so ``torch.equal`` is the right comparison);
- replaying *foreign* ids (random, distinct per token): the routers dispatch exactly those ids (100% of tokens)
  and the weights handed to the experts equal a float64 reference of the family's normalisation computed from the
  router's own fp32 logits;
- the router's own selection equals a float64 reference selection (softmax / sigmoid + bias + group top-k) for
  every token whose top-k margin is far above fp32 rounding;
- gradients reach the gate row of every replayed expert; sentinel rows (-1 fill, -2 own routing) work.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _tiny_hf_moe import FAMILIES, VOCAB, build
from _tolerance import abs_matmul, assert_within, eps, rounding_bound

pytest.importorskip("transformers")

from moe_rl.replay.hf import (  # noqa: E402
    SUPPORTED_HF_ROUTERS,
    convert_hf_moe_routers,
    hf_moe_routers,
    record_hf_routing,
    replay_hf_routing,
)

torch.set_num_threads(1)
B, L = 2, 7


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def _foreign(num_layers: int, num_experts: int, top_k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(B * L * num_layers)]).view(
        B, L, num_layers, top_k
    )


def _capture(model):
    """Hooks recording each router's (input, logits) and each experts module's (ids, weights) per call."""
    routers = hf_moe_routers(model)
    seen = {"router": [], "experts": []}
    handles = []
    for r in routers:
        handles.append(r.register_forward_hook(lambda m, a, out: seen["router"].append((a[0].detach(), out[0].detach()))))
        experts = next(mod for mod in model.modules() if getattr(mod, "gate", None) is r).experts
        handles.append(experts.register_forward_pre_hook(
            lambda m, a: seen["experts"].append((a[1].detach(), a[2].detach()))))
    return seen, handles


def _ref_weights(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """The family's weights at ``ids`` in float64 from the router's fp32 logits (our reference, not the model's)."""
    z = logits_TE.double()
    name = type(router).__mro__[1].__name__
    if name in ("Qwen3MoeTopKRouter", "MixtralTopKRouter"):
        w = torch.softmax(z, dim=-1).gather(1, ids_TK)
        if name == "MixtralTopKRouter" or router.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w
    w = torch.sigmoid(z).gather(1, ids_TK)
    if router.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _ref_selection(router, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 reference top-k ids (as a sorted set per token) and the margin between the k-th and (k+1)-th key."""
    z = x_TD.double() @ router.weight.double().T
    k = router.top_k
    name = type(router).__mro__[1].__name__
    if name in ("Qwen3MoeTopKRouter", "MixtralTopKRouter"):
        key = z  # softmax is monotone: the same selection, margins in logit units
        margin = torch.full(key.shape[:1], float("inf"), dtype=torch.float64)
    else:
        key = torch.sigmoid(z) + router.e_score_correction_bias.double()
        groups = key.view(key.shape[0], router.num_group, -1)
        gscore = groups.topk(2, dim=-1).values.sum(-1)
        gs = gscore.sort(dim=-1, descending=True).values
        margin = gs[:, router.topk_group - 1] - gs[:, router.topk_group]
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter(1, gscore.topk(router.topk_group, -1).indices, True)
        key = key.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    srt = key.sort(dim=-1, descending=True).values
    margin = torch.minimum(margin, srt[:, k - 1] - srt[:, k])
    return key.topk(k, dim=-1).indices.sort(-1).values, margin


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_own_routing_is_bit_identical(family):
    model = build(family)
    m = convert_hf_moe_routers(model)
    assert m == 2 and all(type(r).__name__.startswith("Replay") for r in hf_moe_routers(model))
    ids = _ids()
    with torch.no_grad():
        plain = model(ids).logits
        with record_hf_routing(model) as rec:
            recorded_logits = model(ids).logits
        own = rec.routed_experts((B, L))
        assert own.shape == (B, L, 2, model.config.num_experts_per_tok) and own.dtype == torch.int64
        with replay_hf_routing(model, own), record_hf_routing(model) as rec2:
            replayed = model(ids).logits
    assert torch.equal(recorded_logits, plain)  # recording changes nothing
    assert torch.equal(replayed, plain)  # same ids, same order: the same arithmetic
    assert torch.equal(rec2.routed_experts((B, L)), own)  # 100% of tokens and layers
    # The [T, M, K] form and the per-layer list form replay the same way.
    with torch.no_grad(), replay_hf_routing(model, [own[:, :, j] for j in range(2)]):
        assert torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_foreign_ids_dispatches_them_with_reference_weights(family):
    model = build(family)
    convert_hf_moe_routers(model)
    routers = hf_moe_routers(model)
    k, e = routers[0].top_k, routers[0].num_experts
    replay = _foreign(len(routers), e, k)
    seen, handles = _capture(model)
    with torch.no_grad(), replay_hf_routing(model, replay), record_hf_routing(model) as rec:
        replayed = model(_ids()).logits
    for h in handles:
        h.remove()
    assert torch.equal(rec.routed_experts((B, L)), replay)  # 100%: every token, every layer
    for j, r in enumerate(routers):
        _, logits = seen["router"][j]
        ids_TK, w_TK = seen["experts"][j]
        assert torch.equal(ids_TK, replay[:, :, j].reshape(-1, k))
        ref = _ref_weights(r, logits, ids_TK)
        # softmax over E (or sigmoid) then a K-term normalising sum, in fp32: relative error <= (E + K + 4) eps.
        assert_within(w_TK, ref, (e + k + 4) * eps(torch.float32) * ref.abs(), f"{family} layer {j} weights")
    with torch.no_grad():
        assert not torch.equal(replayed, model(_ids()).logits)  # foreign routing does change the output


@pytest.mark.parametrize("family", FAMILIES)
def test_own_selection_matches_float64_reference(family):
    model = build(family)
    convert_hf_moe_routers(model)
    seen, handles = _capture(model)
    with torch.no_grad(), record_hf_routing(model) as rec:
        model(_ids(3))
    for h in handles:
        h.remove()
    got = rec.routed_experts()
    checked = 0
    for j, r in enumerate(hf_moe_routers(model)):
        x = seen["router"][j][0].reshape(-1, r.hidden_dim)  # DeepSeek-V3/GLM pass [B, L, D], the others [T, D]
        ref, margin = _ref_selection(r, x)
        # Each fp32 gate logit is off by at most rounding_bound (a D-term dot product); two keys that differ by
        # more than twice that cannot swap (sigmoid's slope <= 1/4 only shrinks the error of the biased scores).
        bound = 2 * rounding_bound(abs_matmul(x, r.weight.T).max(-1).values, x.shape[1], torch.float32)
        ok = margin > bound
        assert ok.float().mean() >= 0.9, f"{family}: too many near-ties ({int((~ok).sum())}) for a meaningful check"
        assert torch.equal(got[:, j].sort(-1).values[ok], ref[ok]), family
        checked += int(ok.sum())
    assert checked >= 0.9 * 2 * B * L


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_replay_gradient_reaches_every_replayed_gate_row(family):
    model = build(family)
    convert_hf_moe_routers(model)
    routers = hf_moe_routers(model)
    replay = _foreign(len(routers), routers[0].num_experts, routers[0].top_k, seed=5)
    with replay_hf_routing(model, replay):
        model(_ids()).logits.square().mean().backward()
    for j, r in enumerate(routers):
        rows = r.weight.grad.abs().sum(-1) > 0
        used = torch.zeros_like(rows).index_fill(0, replay[:, :, j].reshape(-1).unique(), True)
        assert rows[used].all(), f"{family} layer {j}: a replayed expert's gate row got no gradient"


def test_sentinel_rows_fill_and_own_routing():
    model = build("qwen3_moe")
    convert_hf_moe_routers(model)
    ids = _ids()
    with torch.no_grad(), record_hf_routing(model) as rec:
        model(ids)
    own = rec.routed_experts((B, L))
    replay = _foreign(2, 8, 2, seed=7)
    replay[0, 3] = -2  # trainer routes this token itself in every layer
    replay[1, -2:] = -1  # pad tokens: spread fill
    with torch.no_grad(), replay_hf_routing(model, replay), record_hf_routing(model) as rec2:
        model(ids)
    got = rec2.routed_experts((B, L))
    assert torch.equal(got[0, :3], replay[0, :3]) and torch.equal(got[0, 4:], replay[0, 4:])
    assert torch.equal(got[1, :-2], replay[1, :-2])
    assert torch.equal(got[0, 3, 0], own[0, 3, 0])  # layer 0's input is unchanged by the replay of other tokens
    fill = got[1, -2:]
    assert ((fill >= 0) & (fill < 8)).all() and (fill[..., 0] != fill[..., 1]).all()


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match=r"Sequential has no supported transformers MoE router.*Qwen3-MoE"):
        convert_hf_moe_routers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="nn.Module"):
        convert_hf_moe_routers("model")
    model = build("mixtral")
    with pytest.raises(ValueError, match="convert_hf_moe_routers"):
        with replay_hf_routing(model, torch.zeros(B, L, 2, 2, dtype=torch.long)):
            pass
    assert convert_hf_moe_routers(model) == 2 == convert_hf_moe_routers(model)  # idempotent
    with pytest.raises(ValueError, match="3 MoE layers but the model has 2"):
        with replay_hf_routing(model, torch.zeros(B, L, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="saw T=14 tokens with top_k=2"):
        with replay_hf_routing(model, torch.zeros(B, L + 1, 2, 2, dtype=torch.long)):
            model(_ids())
    bad = _foreign(2, 8, 2)
    bad[0, 0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"expert id 8 .* outside \[0, 8\)"):
        with replay_hf_routing(model, bad):
            model(_ids())
    with pytest.raises(TypeError, match="float"):
        with replay_hf_routing(model, _foreign(2, 8, 2).float()):
            model(_ids())
    with record_hf_routing(model) as rec:
        pass
    with pytest.raises(ValueError, match="recorded no forward"):
        rec.routed_experts()
    with torch.no_grad(), record_hf_routing(model) as rec:
        model(_ids())
    with pytest.raises(ValueError, match=r"batch_shape=\(3, 5\) holds 15 tokens"):
        rec.routed_experts((3, 5))
    # Contexts leave no state behind: the routers are plain transformers routers again.
    assert all("replay_ids_TK" not in r.__dict__ and "routing_record" not in r.__dict__ for r in hf_moe_routers(model))


def test_conversion_keeps_state_dict_and_supported_table():
    model = build("glm4_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_hf_moe_routers(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert set(SUPPORTED_HF_ROUTERS) == {"Qwen3MoeTopKRouter", "MixtralTopKRouter", "DeepseekV3TopkRouter",
                                         "Glm4MoeTopkRouter"}


def test_import_does_not_load_transformers():
    code = ("import sys, moe_rl, moe_rl.replay, moe_rl.replay.hf, moe_rl.fp8, moe_rl.fp8.hf; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
