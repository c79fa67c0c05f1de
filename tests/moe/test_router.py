"""TopKRouter / topk_route against hand-computed values and a per-token float64 Python reference."""

from __future__ import annotations

import math

import pytest
import torch
from _tolerance import abs_matmul, assert_within, rounding_bound

from moe_rl.moe import TopKRouter, topk_route
from moe_rl.moe.router import select_experts

# Tolerances: router weights are a handful of fp32 element-wise ops (sigmoid or exp, a sum of <= K terms, a division,
# the scaling) on O(1) values, each rounding by <= eps32 relative: hand values (computed here in float64 from the
# formulas, not typed-in decimals) agree to HAND = 16 eps32 relative. Where the logits come from a GEMM, its
# rounding (tests/_tolerance.py rounding_bound) moves a sigmoid score by at most that much relative, a normalized
# weight by twice that.
F32_EPS = torch.finfo(torch.float32).eps
HAND = 16 * F32_EPS


def _close(actual: torch.Tensor, expected, rel: float = HAND, what: str = "") -> None:
    ref = torch.as_tensor(expected, dtype=torch.float64)
    assert_within(actual, ref, rel * ref.abs(), what)


def _softmax(v: list[float]) -> list[float]:
    e = [math.exp(x) for x in v]
    return [x / sum(e) for x in e]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def reference_route(
    logits: list[list[float]],
    top_k: int,
    *,
    score_func: str = "sigmoid",
    bias: list[float] | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[list[list[int]], list[list[float]]]:
    """Per-token float64 routing written from the DeepSeek-V3 description, independent of the library."""
    all_ids, all_weights = [], []
    for row in logits:
        num_experts = len(row)
        if score_func == "sigmoid":
            scores = [_sigmoid(v) for v in row]
        else:
            z = sum(math.exp(v) for v in row)
            scores = [math.exp(v) / z for v in row]
        choice = [s + (bias[e] if bias else 0.0) for e, s in enumerate(scores)]
        per = num_experts // n_group
        candidates = list(range(num_experts))
        if n_group > 1:
            group_score = [
                sum(sorted(choice[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(n_group)
            ]
            kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
            candidates = [e for e in range(num_experts) if e // per in kept]
        ids = sorted(candidates, key=lambda e: -choice[e])[:top_k]
        w = [scores[e] for e in ids]
        if norm_topk_prob:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        all_ids.append(ids)
        all_weights.append([v * routed_scaling_factor for v in w])
    return all_ids, all_weights


def test_bias_changes_selection_but_not_weights():
    # sigmoid([2, 1, 0, -1]) = [0.880797, 0.731059, 0.5, 0.268941]; bias +0.5 on expert 2 -> choice
    # [0.8808, 0.7311, 1.0, 0.2689] -> top-2 = {2, 0}; weights use the UNBIASED 0.5 and 0.8808:
    # 0.880797 / 1.380797 = 0.637890, 0.5 / 1.380797 = 0.362110.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0])
    ids, w, scores = topk_route(logits, 2, correction_bias_E=bias)
    assert ids.tolist() == [[2, 0]]
    s0, s1, s2 = _sigmoid(2.0), _sigmoid(1.0), _sigmoid(0.0)
    _close(w, [[s2 / (s0 + s2), s0 / (s0 + s2)]], what="biased selection")
    _close(scores, [[_sigmoid(v) for v in (2.0, 1.0, 0.0, -1.0)]], rel=4 * F32_EPS, what="scores")
    ids_nobias, w_nobias, _ = topk_route(logits, 2)
    assert ids_nobias.tolist() == [[0, 1]]
    _close(w_nobias, [[s0 / (s0 + s1), s1 / (s0 + s1)]], what="unbiased")


def test_group_limit_excludes_best_expert_of_a_weak_group():
    # 4 groups of 2. Group sums of the top-2: g0 = 0.95 + 0.05 = 1.0, g1 = 0.6 + 0.6 = 1.2,
    # g2 = 0.55 + 0.55 = 1.1, g3 = 0.2. topk_group=2 keeps g1, g2, so expert 0 (0.95, the best single
    # score) is excluded and the top-2 is {2, 3}.
    probs = [0.95, 0.05, 0.6, 0.6, 0.55, 0.55, 0.1, 0.1]
    logits = torch.tensor([[_logit(p) for p in probs]])
    ids, w, _ = topk_route(logits, 2, n_group=4, topk_group=2, norm_topk_prob=False)
    assert sorted(ids.tolist()[0]) == [2, 3]
    _close(w, [[0.6, 0.6]])  # sigmoid(logit(0.6)) in fp32
    ids_flat, _, _ = topk_route(logits, 2, norm_topk_prob=False)
    assert ids_flat.tolist()[0][0] == 0
    # topk_group=3 lets group 0 back in: 0.95 and one 0.6 win.
    ids3, _, _ = topk_route(logits, 2, n_group=4, topk_group=3)
    assert ids3.tolist()[0][0] == 0


def test_group_score_uses_biased_scores():
    # Without bias g0 (0.9 + 0.1 = 1.0) beats g1 (0.45 + 0.45 = 0.9); a +0.2 bias on expert 3 makes
    # g1 = 0.45 + 0.65 = 1.1 win, so selection moves to group 1.
    logits = torch.tensor([[_logit(p) for p in (0.9, 0.1, 0.45, 0.45)]])
    ids, _, _ = topk_route(logits, 1, n_group=2, topk_group=1)
    assert ids.tolist() == [[0]]
    ids_b, w_b, _ = topk_route(
        logits, 1, n_group=2, topk_group=1, correction_bias_E=torch.tensor([0.0, 0.0, 0.0, 0.2])
    )
    assert ids_b.tolist() == [[3]]
    assert w_b.tolist() == [[1.0]]  # normalized over K=1: s / s is exactly 1 in IEEE arithmetic


def test_masked_groups_lose_even_when_biased_scores_are_negative():
    # sigmoid ~ [0.9, 0.8, 0.5, 0.5], bias [-1, -1, -2, -2] -> choice [-0.1, -0.2, -1.5, -1.5]. Group 0
    # (sum -0.3) beats group 1 (-3.0), so the top-2 is {0, 1}. Filling the masked group with 0.0 instead of
    # -inf (as some older remote code did) would wrongly pick experts 2 and 3.
    logits = torch.tensor([[_logit(p) for p in (0.9, 0.8, 0.5, 0.5)]])
    bias = torch.tensor([-1.0, -1.0, -2.0, -2.0])
    ids, _, _ = topk_route(logits, 2, correction_bias_E=bias, n_group=2, topk_group=1)
    assert ids.tolist() == [[0, 1]]


@pytest.mark.parametrize("norm", [True, False])
def test_normalization_and_scaling(norm):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, w, _ = topk_route(logits, 2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    s0, s1 = _sigmoid(2.0), _sigmoid(1.0)
    expected = [s0 / (s0 + s1) * 2.5, s1 / (s0 + s1) * 2.5] if norm else [s0 * 2.5, s1 * 2.5]
    _close(w, [expected])


def test_softmax_score_func():
    # softmax([2, 1, 0.5, 0.1]) = [0.5745, 0.2114, 0.1282, 0.0859]; top-2 {0, 1} renormalized:
    # 0.5745 / 0.7859 = 0.7310, 0.2114 / 0.7859 = 0.2690.
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1]])
    ids, w, scores = topk_route(logits, 2, score_func="softmax")
    assert ids.tolist() == [[0, 1]]
    p = _softmax([2.0, 1.0, 0.5, 0.1])
    _close(scores, [p], what="softmax scores")
    _close(w, [[p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])]], what="renormalized")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=2),
        dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        dict(top_k=3, n_group=8, topk_group=3, norm_topk_prob=False),
        dict(top_k=4, score_func="softmax"),
        dict(top_k=6, n_group=2, topk_group=1, routed_scaling_factor=0.5),
    ],
)
def test_matches_float64_reference(kwargs):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts = 64, 16
    logits = torch.randn(num_tokens, num_experts, generator=gen, dtype=torch.float64)
    bias = 0.3 * torch.randn(num_experts, generator=gen, dtype=torch.float64)
    top_k = kwargs.pop("top_k")
    ref_ids, ref_w = reference_route(logits.tolist(), top_k, bias=bias.tolist(), **kwargs)
    ids, w, scores = topk_route(logits.float(), top_k, correction_bias_E=bias.float(), **kwargs)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and scores.dtype == torch.float32
    assert ids.tolist() == ref_ids  # same experts, same order (best biased score first)
    # the fp32 path sees logits rounded to fp32 (eps32/2 * |logit| absolute), which moves a sigmoid / softmax score
    # by <= |logit| eps32 relative (twice for softmax, twice again after normalizing), plus HAND for the ops
    rel = HAND + 4 * F32_EPS * float(logits.abs().max())
    _close(w, ref_w, rel=rel, what="weights")


def test_b15_replay_weights_from_full_scores():
    """Replayed ids {0, 2}: weights come from the trainer's own full softmax gathered at the replayed ids.

    Trainer logits [2.0, 1.0, 0.5, 0.1]: softmax gives p0 = 0.5745, p2 = 0.1282; renormalized over {0, 2}:
    0.8176 / 0.1824. The trainer's own top-2 is {0, 1}, so expert 2's router row only gets gradient
    through the replay: d w0 / d logit2 = -w0 * w2 = -0.8176 * 0.1824 = -0.1491.
    """
    logits = [2.0, 1.0, 0.5, 0.1]
    router = TopKRouter(4, 4, 2, score_func="softmax", use_correction_bias=False)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor(logits)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    own_ids, _, _ = router(x)
    assert sorted(own_ids.tolist()[0]) == [0, 1]

    ids, w, scores = router(x, replay_ids_TK=torch.tensor([[0, 2]], dtype=torch.uint8))
    assert ids.tolist() == [[0, 2]] and ids.dtype == torch.int64
    p = _softmax(logits)
    w0, w2 = p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])
    _close(scores[0, [0, 2]], [p[0], p[2]], what="scores")
    _close(w, [[w0, w2]], what="weights")

    w[0, 0].backward()
    grad = router.weight.grad[:, 0]
    # d w0 / d logit_0 = w0 w2, d w0 / d logit_2 = -w0 w2, other logits: 0 (the full softmax's normalizer cancels,
    # to the rounding of terms of size <= w0 w2)
    assert_within(grad, torch.tensor([w0 * w2, 0.0, -w0 * w2, 0.0]), 2 * HAND * w0 * w2, "grad")
    assert grad[2].abs() > 0.1  # the replayed expert outside the trainer's top-k gets gradient
    assert router.weight.grad[:, 1:].abs().max() == 0


def test_replay_sigmoid_weights_and_gradient():
    gen = torch.Generator().manual_seed(1)
    router = TopKRouter(8, 6, 2, n_group=3, topk_group=1, routed_scaling_factor=2.5)
    router.e_score_correction_bias.copy_(torch.randn(6, generator=gen))
    x = torch.randn(5, 8, generator=gen)
    replay = torch.tensor([[5, 4], [0, 1], [2, 0], [3, 5], [1, 2]], dtype=torch.int32)
    ids, w, scores = router(x, replay_ids_TK=replay)
    assert torch.equal(ids, replay.long())
    x64, w64 = x.double(), router.weight.detach().double()
    s = torch.sigmoid(x64 @ w64.T)
    picked = s.gather(1, replay.long())
    # the 8-term logit GEMM's rounding moves each sigmoid score by <= that much relative (sigmoid' / sigmoid <= 1)
    gemm = rounding_bound(abs_matmul(x, router.weight.T).gather(1, replay.long()), 8, torch.float32)
    expected = 2.5 * picked / picked.sum(-1, keepdim=True)
    assert_within(w, expected, (2 * gemm.max() + HAND) * expected, "replayed weights")
    (w * torch.arange(1.0, 3.0)).sum().backward()
    assert (router.weight.grad.abs().sum(-1) > 0).all()  # every expert was replayed somewhere
    assert router.e_score_correction_bias.grad is None


def test_replay_shape_and_dtype_errors():
    router = TopKRouter(8, 4, 2)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"replay_ids has shape \(4, 2\).*\[T, K\] = \(3, 2\)"):
        router(x, replay_ids_TK=torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"replay_ids has shape \(3, 3\).*\(3, 2\)"):
        router(x, replay_ids_TK=torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer tensor"):
        router(x, replay_ids_TK=torch.zeros(3, 2))


def test_router_runs_in_fp32_for_bf16_inputs():
    router = TopKRouter(16, 8, 2).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    ids, w, scores = router(x)
    assert scores.dtype == torch.float32 and w.dtype == torch.float32
    ref = torch.sigmoid(x.double() @ router.weight.double().T)  # the bf16 values, exactly, in float64
    gemm = rounding_bound(abs_matmul(x, router.weight.T), 16, torch.float32)  # fp32 projection
    assert_within(scores, ref, (gemm + 4 * F32_EPS) * ref, "fp32 scores of bf16 inputs")
    assert router.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32  # kept fp32 through .to(bf16)


def test_select_experts_has_no_grad_and_sorted_order():
    scores = torch.rand(10, 8, requires_grad=True)
    ids = select_experts(scores, 3)
    assert not ids.requires_grad
    picked = scores.detach().gather(1, ids)
    assert (picked[:, :-1] >= picked[:, 1:]).all()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(num_experts=8, top_k=9), r"top_k=9 must be in \[1, num_experts=8\]"),
        (dict(num_experts=8, top_k=2, n_group=3), r"n_group=3 must be >= 1 and divide num_experts=8"),
        (dict(num_experts=8, top_k=2, n_group=8), r"n_group=8 leaves 1 expert\(s\) per group"),
        (dict(num_experts=8, top_k=2, n_group=2, topk_group=3), r"topk_group=3 must be in \[1, n_group=2\]"),
        (dict(num_experts=8, top_k=3, n_group=4, topk_group=1), r"top_k=3 exceeds .* topk_group=1 x 2"),
        (dict(num_experts=8, top_k=2, score_func="relu"), r"score_func='relu' is not supported"),
    ],
)
def test_router_validation_messages(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        TopKRouter(16, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(top_k=9), r"top_k=9 must be in \[1, num_experts=8\]"),
        (dict(top_k=0), r"top_k=0 must be in \[1, num_experts=8\]"),
        (dict(top_k=2, n_group=3), r"n_group=3 must be >= 1 and divide num_experts=8"),
        (dict(top_k=2, n_group=2, topk_group=3), r"topk_group=3 must be in \[1, n_group=2\]"),
        (dict(top_k=2, score_func="relu"), r"score_func='relu' is not supported"),
        (dict(top_k=2, correction_bias_E=torch.zeros(7)), r"correction_bias_E has shape \(7,\); expected \[E\] = \(8,\)"),
    ],
)
def test_functional_topk_route_validates_like_the_module(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        topk_route(torch.randn(3, 8), **kwargs)


def test_functional_topk_route_type_errors():
    logits = torch.randn(3, 8)
    with pytest.raises(TypeError, match="integer tensor"):
        topk_route(logits, 2, replay_ids_TK=torch.tensor([[3.0, 4.0], [1, 2], [-1, -1]]))
    with pytest.raises(TypeError, match=r"top_k=2.0 must be an int"):
        topk_route(logits, 2.0)
    with pytest.raises(TypeError, match=r"top_k=True must be an int"):
        topk_route(logits, True)
