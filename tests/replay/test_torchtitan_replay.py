"""Router replay in torchtitan's deepseek_v3 debug model (CPU): same replay input as moe_rl's models."""

from __future__ import annotations

import pytest
import torch
from _tolerance import assert_normwise_close

pytest.importorskip("torchtitan")

from moe_rl.replay import FILL_ROW  # noqa: E402


def _router(score_func="softmax", route_norm=True, route_scale=2.0, e=8, k=3, d=16):
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    cfg = TokenChoiceTopKRouter.Config(
        num_experts=e, gate=Linear.Config(in_features=d, out_features=e, bias=False), top_k=k,
        score_func=score_func, route_norm=route_norm, route_scale=route_scale,
    )
    r = cfg.build()
    with torch.no_grad():
        r.gate.weight.normal_(0, 1.0)
    return r


@pytest.mark.parametrize(("score_func", "route_norm"), [("softmax", True), ("sigmoid", True), ("softmax", False)])
def test_router_replay_weights_and_gradient_match_float64(score_func, route_norm):
    from moe_rl.replay.torchtitan import ReplayTokenChoiceTopKRouter, convert_routers_for_replay

    torch.manual_seed(0)
    router = _router(score_func, route_norm)
    holder = torch.nn.Sequential(router)
    assert convert_routers_for_replay(holder) == 1 and isinstance(router, ReplayTokenChoiceTopKRouter)
    x = torch.randn(2, 5, 16)
    _, own_ids, _ = router(x)  # replay off: torchtitan's own routing
    replay = torch.stack([torch.randperm(8)[:3] for _ in range(10)]).view(2, 5, 3)
    replay[1, 4] = FILL_ROW  # a pad token
    router.replay_ids_BLK = replay
    w, ids, scores = router(x)
    expected_ids = replay.clone()
    expected_ids[1, 4] = torch.tensor([0, 1, 2])  # first pad row: (0*K + j) mod E
    assert torch.equal(ids, expected_ids)
    w64_gate = router.gate.weight.detach().double().requires_grad_()
    logits64 = x.double() @ w64_gate.T
    s64 = logits64.softmax(-1) if score_func == "softmax" else logits64.sigmoid()
    ref = s64.gather(-1, expected_ids)
    if route_norm:
        ref = ref / (ref.sum(-1, keepdim=True) + 1e-20)
    ref = 2.0 * ref
    # fp32 gate vs fp64 (tests/_tolerance.py): a 16-term logit GEMM, softmax/sigmoid, normalization (depth 3);
    # a wrong gathered expert changes weights by O(1) relative
    assert_normwise_close(w, ref, dtype=torch.float32, k=16, depth=3, what="weights")
    (w[0, 0] * torch.arange(1.0, 4.0)).sum().backward()
    (ref[0, 0] * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
    assert_normwise_close(router.gate.weight.grad, w64_gate.grad, dtype=torch.float32, k=16, depth=6,
                          what="gate.weight.grad")
    grad_rows = set(router.gate.weight.grad.abs().sum(-1).nonzero().flatten().tolist())
    assert set(replay[0, 0].tolist()) <= grad_rows  # every replayed expert's gate row gets gradient (B15)
    if score_func == "sigmoid":
        assert grad_rows == set(replay[0, 0].tolist())  # and, for sigmoid scores, only those
    assert set(replay[0, 0].tolist()) != set(own_ids[0, 0].tolist())  # the replay overrides the own choice
    router.replay_ids_BLK = torch.zeros(2, 4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"shape \(2, 4, 3\) but this router's input \(2, 5, 16\) needs"):
        router(x)


@pytest.mark.slow
def test_deepseek_v3_debug_model_replay():
    """Replaying the model's own routing reproduces its logits; other ids change them; counts are checked."""
    from torchtitan.models.deepseek_v3 import model_registry

    from moe_rl.replay.torchtitan import convert_routers_for_replay, moe_routers, replay_routing

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_registry("debugmodel", attn_backend="flex").model.build()
    model.init_weights()
    model.eval()
    num_moe = convert_routers_for_replay(model)
    assert num_moe == 5  # 6 layers, 1 dense
    tokens = torch.randint(0, 2048, (2, 12))
    pos = torch.arange(12).repeat(2, 1)
    masks = model.get_attention_masks(pos)
    own = []
    hooks = [r.register_forward_hook(lambda m, a, o: own.append(o[1].clone())) for r in moe_routers(model)]
    with torch.no_grad():  # flex attention has no CPU backward
        base = model(tokens, positions=pos, attention_masks=masks)
    for h in hooks:
        h.remove()
    routed = torch.stack(own, dim=2)  # [B, L, M, K]
    with torch.no_grad(), replay_routing(model, routed):
        same = model(tokens, positions=pos, attention_masks=masks)
    # the same routing, experts combined in another order within a token: two fp32 paths of the debug model's chain
    # (tests/_tolerance.py normwise: reductions <= its width 256 / vocab 2048, 6 layers x ~8 reductions + head,
    # doubled); other experts change the logits by O(1) relative (checked below)
    layers = len(model.layers)
    assert_normwise_close(same, base, dtype=torch.float32, k=2048, depth=2 * (8 * layers + 2), what="replayed logits")
    other = (routed + 1) % 8
    with torch.no_grad(), replay_routing(model, other):
        changed = model(tokens, positions=pos, attention_masks=masks)
    assert (changed - base).abs().max() > 1e-3
    assert all(r.replay_ids_BLK is None for r in moe_routers(model))  # the context restores own routing
    with pytest.raises(ValueError, match=r"gives 4 MoE layers but the model has 5 routers"):
        with replay_routing(model, routed[:, :, :4]):
            pass
