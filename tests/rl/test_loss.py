"""RL losses against float64 per-token references written independently (plain Python ``math``), hand-computed
values on tiny inputs, and gradient checks (``torch.autograd.gradcheck`` plus closed-form gradients).

Tolerances: the references and the losses both run in float64 (no GEMM: element-wise ops and sums whose order
may differ). A sum of ``n`` terms, each from <= 16 roundings (exp, log, products), is within ``(n + 16) eps64`` of
the exact sum times the sum of the terms' absolute values (Higham eq. 3.5 worst case, ``F64`` below); the
reference accumulates those absolute sums (``abs_total``, ``abs_k3``). Gradients: one such chain per element,
times the sequence's log-ratio sum where a sequence ratio enters (GSPO, MIS sequence level): ``grad_bound``.
Hand-computed cases: <= 32 roundings of O(1) values without cancellation, ``HAND = 32 eps64`` relative.
Finite differences (gradcheck, eps 1e-6) need ~1e-6 (their truncation error, not rounding).
"""

import math

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.rl.loss import (
    AgeWeightConfig,
    GspoConfig,
    IcePopConfig,
    LossConfig,
    MisConfig,
    TisConfig,
    compute_loss,
    dppo_kl_loss,
    loss_normalizer,
    mismatch_kl,
    ratio_quantiles,
)

KINDS = ["dppo_kl", "tis", "mis", "icepop", "gspo"]
F64 = torch.finfo(torch.float64).eps
HAND = 32 * F64


def sum_bound(abs_sum: float, n: int) -> float:
    """Float64 error bound of a sum of ``n`` terms (each <= 16 roundings) with absolute sum ``abs_sum``."""
    return (n + 16) * F64 * abs_sum


def grad_bound(cfg, lp, lp_inf, adv, mask) -> torch.Tensor:
    """Per-element float64 bound on ``d loss_sum / d lp`` for inputs ``[B, T]``: the gradient's magnitude scale
    ``adv_tau |A| R + 2 kl_tau |log r|`` (``R``: the largest token ratio, bounding a clipped, truncated or sequence
    ratio), times ``(T + 16) eps64`` and the sequence log-ratio sum ``1 + sum_t |log r_t|`` (its rounding enters
    a sequence ratio through ``exp``)."""
    lr = (lp.detach() - lp_inf).where(mask, 0.0)
    a = adv.detach().abs()
    a = a[:, None] if a.dim() == 1 else a
    R = torch.exp(lr).where(mask, 0.0).max().clamp_min(1 + cfg.gspo.clip_high)
    scale = cfg.adv_tau * a * R + 2 * cfg.kl_tau * lr.abs()
    return (lp.shape[1] + 16) * F64 * scale * (1 + lr.abs().sum(-1, keepdim=True))


# ----------------------------------------------------------------------------- independent float64 reference
def _age_weight(cfg, versions, tv, b, t):
    if versions is None:
        return 1.0
    age = tv - versions[b][t]
    if cfg.age.max_age is not None and age > cfg.age.max_age:
        return 0.0
    return cfg.age.decay ** age


def reference(cfg, lp, lp_inf, adv, mask, versions=None, tv=None):
    """``(loss_sum, grad [B][T], counters)`` from the formulas of the papers, one token at a time."""
    B, T = len(lp), len(lp[0])
    grad = [[0.0] * T for _ in range(B)]
    cnt = {"masked": 0, "clipped": 0, "k3": 0.0, "masked_seq_tokens": 0, "abs_total": 0.0, "abs_k3": 0.0, "n": 0}
    total = 0.0
    for b in range(B):
        toks = [t for t in range(T) if mask[b][t]]
        lr = {t: lp[b][t] - lp_inf[b][t] for t in toks}
        for t in toks:
            r = math.exp(lr[t])
            cnt["k3"] += r - math.log(r) - 1
            cnt["abs_k3"] += r + abs(math.log(r)) + 1
            cnt["n"] += 1
        if not toks:
            continue
        if cfg.kind == "gspo":
            a = adv[b]
            ws = [_age_weight(cfg, versions, tv, b, t) for t in toks]
            kept = [t for t, w in zip(toks, ws, strict=True) if w > 0]
            if not kept:
                continue
            w_b = sum(ws) / len(toks)
            n = len(kept)
            s = math.exp(sum(lr[t] for t in kept) / n)
            lo, hi = 1 - cfg.gspo.clip_low, 1 + cfg.gspo.clip_high
            s_clip = min(max(s, lo), hi)
            use_clip = s_clip * a < s * a
            obj = s_clip * a if use_clip else s * a
            kl = sum(lr[t] ** 2 for t in kept) / n
            total += w_b * (-cfg.adv_tau * obj + cfg.kl_tau * kl)
            cnt["abs_total"] += w_b * (cfg.adv_tau * abs(obj) + cfg.kl_tau * kl) * (1 + sum(abs(lr[t]) for t in kept))
            if use_clip:
                cnt["clipped"] += len(toks)
            for t in kept:
                g_pg = 0.0 if use_clip else -cfg.adv_tau * a * s / n
                grad[b][t] = w_b * (g_pg + cfg.kl_tau * 2 * lr[t] / n)
            continue
        seq_out = False
        if cfg.kind == "mis" and cfg.mis.level in ("sequence", "both"):
            sl = sum(lr.values())
            s = math.exp(sl / len(toks) if cfg.mis.seq_ratio == "geometric" else sl)
            seq_out = not (cfg.mis.seq_low <= s <= cfg.mis.seq_high)
            cnt["masked_seq_tokens"] += len(toks) * seq_out
        for t in toks:
            r = math.exp(lr[t])
            a = adv[b] if not isinstance(adv[b], list) else adv[b][t]
            w = _age_weight(cfg, versions, tv, b, t)
            if cfg.kind == "dppo_kl":
                dp = math.exp(lp[b][t]) - math.exp(lp_inf[b][t])
                drop = (a > 0 and dp > cfg.dppo_mask_high) or (a < 0 and dp < -cfg.dppo_mask_low)
            elif cfg.kind == "icepop":
                drop = not (cfg.icepop.alpha <= r <= cfg.icepop.beta)
            elif cfg.kind == "mis":
                tok_out = cfg.mis.level in ("token", "both") and not (cfg.mis.token_low <= r <= cfg.mis.token_high)
                drop = tok_out or seq_out
            else:
                drop = False
            cnt["masked"] += drop
            if cfg.kind == "tis":
                c = min(r, cfg.tis.cap)
                cnt["clipped"] += r > cfg.tis.cap
                pg_val, pg_grad = -cfg.adv_tau * a * c, -cfg.adv_tau * a * c
            else:
                pg_val = 0.0 if drop else -cfg.adv_tau * a * r
                pg_grad = pg_val  # d(-A r)/dlogp = -A r
            total += w * (pg_val + cfg.kl_tau * lr[t] ** 2)
            cnt["abs_total"] += w * (abs(pg_val) + cfg.kl_tau * lr[t] ** 2)
            grad[b][t] = w * (pg_grad + cfg.kl_tau * 2 * lr[t])
    return total, grad, cnt


def _cfg(kind, **kw):
    base = dict(kind=kind, kl_tau=0.05, adv_tau=0.7,
                mis=MisConfig(level="both", token_low=0.6, token_high=1.6, seq_low=0.85, seq_high=1.15),
                icepop=IcePopConfig(alpha=0.7, beta=1.4), tis=TisConfig(cap=1.3),
                gspo=GspoConfig(clip_low=0.01, clip_high=0.015))
    base.update(kw)
    return LossConfig(**base)


def _inputs(seed, B=6, T=7, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    lp_inf = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = (lp_inf + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).clamp(max=-1e-3)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False  # one sequence without loss tokens
    versions = torch.randint(5, 9, (B, T), generator=g)
    versions[~mask] = -1
    return lp, lp_inf, adv, mask, versions


def _far_from_boundaries(cfg, lp, lp_inf, mask, margin=1e-4):
    """True when no masked/clipped decision is within ``margin`` of its threshold (so finite differences with
    eps=1e-6 never cross one)."""
    r = torch.exp(lp - lp_inf)[mask]
    edges = [cfg.tis.cap, cfg.icepop.alpha, cfg.icepop.beta, cfg.mis.token_low, cfg.mis.token_high]
    if any(torch.any((r - e).abs() < margin) for e in edges):
        return False
    dp = (torch.exp(lp) - torch.exp(lp_inf))[mask]
    return not any(torch.any((dp - e).abs() < margin) for e in (cfg.dppo_mask_high, -cfg.dppo_mask_low))


# ----------------------------------------------------------------------------- every kind vs the reference
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("age", [None, AgeWeightConfig(decay=0.6), AgeWeightConfig(decay=0.8, max_age=2)])
def test_compute_loss_matches_float64_reference(kind, seed, age):
    spread = 0.05 if kind == "gspo" else 0.5  # keep GSPO sequence ratios near its clip band
    lp, lp_inf, adv, mask, versions = _inputs(seed, spread=spread)
    cfg = _cfg(kind) if age is None else _cfg(kind, age=age)
    tv = 8
    lp = lp.requires_grad_(True)
    out = compute_loss(cfg, lp, lp_inf, adv, mask, token_versions=versions, trainer_version=tv)
    ref_v = versions.tolist() if age is not None else None
    total, grad, cnt = reference(cfg, lp.tolist(), lp_inf.tolist(), adv.tolist(), mask.tolist(), ref_v, tv)
    assert abs(out.loss_sum.item() - total) <= sum_bound(cnt["abs_total"], cnt["n"])
    assert abs(out.mismatch_kl_sum.item() - cnt["k3"]) <= sum_bound(cnt["abs_k3"], cnt["n"])
    assert int(out.masked_sum) == cnt["masked"]
    assert int(out.metrics["clipped_tokens"]) == cnt["clipped"]
    assert int(out.metrics["masked_sequences_tokens"]) == cnt["masked_seq_tokens"]
    assert out.num_tokens == int(mask.sum()) and out.num_sequences == int(mask.any(-1).sum())
    assert out.normalizer == ("sequences" if kind == "gspo" else "tokens")
    age_ref = sum(tv - versions[b, t].item() for b in range(6) for t in range(7) if mask[b, t])
    assert out.metrics["age_sum"].item() == age_ref
    out.loss_sum.backward()
    assert ((lp.grad - torch.tensor(grad, dtype=torch.float64)).abs() <= grad_bound(cfg, lp, lp_inf, adv, mask)).all()
    assert torch.all(lp.grad[~mask] == 0)
    if kind in ("dppo_kl", "mis", "icepop", "tis"):
        assert cnt["masked"] + cnt["clipped"] > 0, "the data should exercise the mask / cap"


def test_inputs_exercise_gspo_both_branches():
    """GSPO's clip must be hit for some sequences and not for others with the test data (else the reference
    comparison above would not test the clipping)."""
    hits = set()
    for seed in (0, 1, 2):
        lp, lp_inf, adv, mask, _ = _inputs(seed, spread=0.05)
        _, _, cnt = reference(_cfg("gspo"), lp.tolist(), lp_inf.tolist(), adv.tolist(), mask.tolist())
        hits.add(0 < cnt["clipped"] < int(mask.sum()))
    assert True in hits


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind):
    lp, lp_inf, adv, mask, versions = _inputs(3, B=4, T=5, spread=0.05 if kind == "gspo" else 0.5)
    cfg = _cfg(kind, age=AgeWeightConfig(decay=0.7))
    assert _far_from_boundaries(cfg, lp, lp_inf, mask)
    if kind != "tis":  # TIS's gradient is by construction not the derivative of its value (stop-gradient)
        assert torch.autograd.gradcheck(
            lambda x: compute_loss(cfg, x, lp_inf, adv, mask, versions, 8).loss_sum, (lp.clone().requires_grad_(),),
            eps=1e-6, atol=1e-6, rtol=1e-5)
    else:
        # below the cap TIS is plain IS: there the value's derivative is the gradient
        below = _cfg(kind, tis=TisConfig(cap=1e9), age=AgeWeightConfig(decay=0.7))
        assert torch.autograd.gradcheck(
            lambda x: compute_loss(below, x, lp_inf, adv, mask, versions, 8).loss_sum,
            (lp.clone().requires_grad_(),), eps=1e-6, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- hand-computed values
def _one(lp_vals, lpi_vals, dtype=torch.float64):
    lp = torch.log(torch.tensor([lp_vals], dtype=dtype)).requires_grad_(True)
    lpi = torch.log(torch.tensor([lpi_vals], dtype=dtype))
    return lp, lpi, torch.ones(1, len(lp_vals), dtype=torch.bool)


def test_tis_hand_values():
    # r = 0.6/0.2 = 3 > C = 2: value -A*2, gradient -A*2 (truncated weight, not 0); r = 0.3/0.6 = 0.5: -A*0.5
    lp, lpi, mask = _one([0.6, 0.3], [0.2, 0.6])
    cfg = LossConfig(kind="tis", kl_tau=0.0, tis=TisConfig(cap=2.0))
    out = compute_loss(cfg, lp, lpi, torch.tensor([1.5], dtype=torch.float64), mask)
    assert out.loss_sum.item() == pytest.approx(-1.5 * (2.0 + 0.5), rel=HAND)
    out.loss_sum.backward()
    assert lp.grad[0].tolist() == pytest.approx([-3.0, -0.75], rel=HAND)
    assert int(out.metrics["clipped_tokens"]) == 1 and int(out.masked_sum) == 0


def test_icepop_hand_values():
    # ratios 0.4 (< alpha 0.5), 1.0, 6.0 (> beta 5): only the middle token trains
    lp, lpi, mask = _one([0.2, 0.5, 0.6], [0.5, 0.5, 0.1])
    cfg = LossConfig(kind="icepop", kl_tau=0.0)
    out = compute_loss(cfg, lp, lpi, torch.tensor([2.0], dtype=torch.float64), mask)
    assert out.loss_sum.item() == pytest.approx(-2.0, rel=HAND)
    out.loss_sum.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2.0, 0.0], rel=HAND)  # masked tokens: exact zeros
    assert (int(out.metrics["masked_low"]), int(out.metrics["masked_high"])) == (1, 1)


def test_mis_sequence_hand_values():
    # sequence 0: ratios 2 and 2 -> geometric mean 2 > 1.5: masked whole; product 4.
    # sequence 1: ratios 2 and 0.5 -> geometric mean 1, product 1: kept; loss -A*(2 + 0.5) with A=1
    lp = torch.log(torch.tensor([[0.4, 0.4], [0.4, 0.25]], dtype=torch.float64))
    lpi = torch.log(torch.tensor([[0.2, 0.2], [0.2, 0.5]], dtype=torch.float64))
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    cfg = LossConfig(kind="mis", kl_tau=0.0, mis=MisConfig(level="sequence", seq_low=0.5, seq_high=1.5))
    out = compute_loss(cfg, lp, lpi, adv, mask)
    assert out.loss_sum.item() == pytest.approx(-2.5, rel=HAND)
    assert int(out.metrics["masked_sequences_tokens"]) == 2 and int(out.masked_sum) == 2
    # token level with band [0.6, 1.5]: every token of ratio 2 or 0.5 is masked
    cfg_t = LossConfig(kind="mis", kl_tau=0.0, mis=MisConfig(level="token", token_low=0.6, token_high=1.5))
    assert compute_loss(cfg_t, lp, lpi, adv, mask).loss_sum.item() == 0.0
    # product ratio with band [0.5, 3]: sequence 0 (4) masked, sequence 1 (1) kept
    cfg_p = LossConfig(kind="mis", kl_tau=0.0,
                       mis=MisConfig(level="sequence", seq_ratio="product", seq_low=0.5, seq_high=3.0))
    assert compute_loss(cfg_p, lp, lpi, adv, mask).loss_sum.item() == pytest.approx(-2.5, rel=HAND)


def test_gspo_hand_values():
    # log r = [0.001, 0] -> s = exp(0.0005) = 1.000500125 > 1 + 4e-4
    lp = torch.tensor([[-1.0 + 0.001, -2.0]], dtype=torch.float64, requires_grad=True)
    lpi = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = LossConfig(kind="gspo", kl_tau=0.0)
    s = math.exp(0.0005)
    out = compute_loss(cfg, lp, lpi, torch.tensor([1.0], dtype=torch.float64), mask)
    assert out.loss_sum.item() == pytest.approx(-(1 + 4e-4), rel=HAND)  # clipped branch: no gradient
    out.loss_sum.backward()
    assert lp.grad.abs().max().item() == 0.0 and int(out.metrics["clipped_tokens"]) == 2
    lp.grad = None
    out = compute_loss(cfg, lp, lpi, torch.tensor([-1.0], dtype=torch.float64), mask)
    # log r = (-1 + 0.001) - (-1): off by the input's rounding (eps64 / 2 absolute), which exp turns into a
    # relative error of the same size: within HAND
    assert out.loss_sum.item() == pytest.approx(s, rel=HAND)  # min(-s, -1.0004) = -s: unclipped
    out.loss_sum.backward()
    assert lp.grad[0].tolist() == pytest.approx([s / 2, s / 2], rel=HAND)  # d(s)/dlogp_t = s / |y|
    assert loss_normalizer(cfg, torch.tensor([[True, False], [False, False], [True, True]])) == 2


def test_age_weighting_hand_values():
    # on-policy tokens (r = 1), A = 1: each token contributes -w; versions 3, 2, 1 at trainer version 3
    lp, lpi, mask = _one([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    versions = torch.tensor([[3, 2, 1]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    cfg = LossConfig(kind="icepop", age=AgeWeightConfig(decay=0.5))
    out = compute_loss(cfg, lp, lpi, adv, mask, versions, trainer_version=3)
    assert out.loss_sum.item() == pytest.approx(-(1 + 0.5 + 0.25), rel=HAND)
    assert out.metrics["age_sum"].item() == 3 and out.metrics["age_weight_sum"].item() == 1.75
    cfg = LossConfig(kind="icepop", age=AgeWeightConfig(decay=0.5, max_age=1))
    out = compute_loss(cfg, lp, lpi, adv, mask, versions, trainer_version=3)
    assert out.loss_sum.item() == pytest.approx(-1.5, rel=HAND)
    assert int(out.metrics["age_masked_tokens"]) == 1
    out.loss_sum.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -0.5, 0.0], rel=HAND)  # age-masked token: exact zero


# ----------------------------------------------------------------------------- normalisation, metrics
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_sums_equal_whole_batch(kind):
    """Two data-parallel shards: sum of shard loss_sums / global normaliser == whole-batch loss."""
    lp, lp_inf, adv, mask, versions = _inputs(4, B=6, T=5)
    cfg = _cfg(kind)
    whole = compute_loss(cfg, lp, lp_inf, adv, mask, versions, 8)
    parts = [compute_loss(cfg, lp[s], lp_inf[s], adv[s], mask[s], versions[s], 8) for s in (slice(0, 3), slice(3, 6))]
    norm = loss_normalizer(cfg, mask)
    assert norm == (int(mask.any(-1).sum()) if kind == "gspo" else int(mask.sum()))
    _, _, cnt = reference(cfg, lp.tolist(), lp_inf.tolist(), adv.tolist(), mask.tolist(), versions.tolist(), 8)
    # two sums of the same terms in other orders: each within sum_bound of the exact sum
    assert abs(sum(p.loss_sum for p in parts).item() - whole.loss_sum.item()) <= 2 * sum_bound(cnt["abs_total"],
                                                                                                cnt["n"])
    for k in whole.metrics:  # sums of non-negative terms: the absolute sum is the value
        v = whole.metrics[k].item()
        assert abs(sum(p.metrics[k] for p in parts).item() - v) <= 2 * sum_bound(abs(v), cnt["n"]), k
    assert torch.equal(torch.cat([p.ratios for p in parts]), whole.ratios)


def test_ratio_quantiles():
    r = torch.tensor([0.5, 1.0, 2.0, 4.0, 1.0], dtype=torch.float64)
    q = ratio_quantiles(r, (0.0, 0.5, 1.0, 0.25))
    assert q == {"ratio_p00": 0.5, "ratio_p50": 1.0, "ratio_p100": 4.0, "ratio_p25": 1.0}
    q = ratio_quantiles(torch.tensor([1.0, 3.0]), (0.01, 0.99))
    assert q["ratio_p01"] == pytest.approx(1.02, rel=HAND) and q["ratio_p99"] == pytest.approx(2.98, rel=HAND)
    assert math.isnan(ratio_quantiles(torch.tensor([]))["ratio_p50"])
    lp, lpi, mask = _one([0.6, 0.3], [0.2, 0.6])
    out = compute_loss(LossConfig(), lp, lpi, torch.tensor([1.0], dtype=torch.float64), mask)
    assert out.ratios.tolist() == pytest.approx([3.0, 0.5], rel=HAND)


# ----------------------------------------------------------------------------- backward compatibility
@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_kl_loss_is_compute_loss_default(seed):
    lp, lp_inf, adv, mask, _ = _inputs(seed)
    a = dppo_kl_loss(lp, lp_inf, adv, mask, LossConfig(kl_tau=0.05))
    b = compute_loss(LossConfig(kl_tau=0.05), lp, lp_inf, adv, mask)
    assert a.loss_sum.item() == b.loss_sum.item() and int(a.masked_sum) == int(b.masked_sum)
    total, _, cnt = reference(LossConfig(kl_tau=0.05), lp.tolist(), lp_inf.tolist(), adv.tolist(), mask.tolist())
    assert abs(a.loss_sum.item() - total) <= sum_bound(cnt["abs_total"], cnt["n"]) and int(a.masked_sum) == cnt["masked"]


def test_on_policy_has_zero_mismatch_and_plain_pg_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64)).requires_grad_(True)
    out = dppo_kl_loss(lp, lp.detach(), torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool))
    assert out.mismatch_kl_sum.item() == 0.0
    out.loss_sum.backward()
    # r = 1 on-policy: d/dlogp (-A r) = -A
    assert lp.grad[0].tolist() == pytest.approx([-2.0, -2.0], rel=HAND)


def test_mismatch_kl_k3_value():
    lp = torch.tensor([[math.log(0.5)]])
    lp_inf = torch.tensor([[math.log(0.25)]])
    r = 2.0
    # float32 inputs: log(0.5) - log(0.25) = log 2 rounded (eps32 relative), r = 2 (1 + O(eps32)); k3 = r - log r - 1 =
    # 0.307 amplifies it by <= (r + 1) / 0.307 ~ 10
    k3 = r - math.log(r) - 1
    assert mismatch_kl(lp, lp_inf, torch.ones(1, 1, dtype=torch.bool)).item() == pytest.approx(
        k3, rel=16 * torch.finfo(torch.float32).eps * (r + 1) / k3)


def test_loss_selectable_from_recipe_config(tmp_path):
    from moe_rl.runtime.config import RLConfig

    cfg = load_config(RLConfig, ["@", "recipes/debug_cpu/rl.toml", "--output-dir", str(tmp_path)])
    assert cfg.trainer.loss.kind == "dppo_kl"
    cfg = load_config(RLConfig, ["@", "recipes/debug_cpu/rl.toml", "--output-dir", str(tmp_path), "--trainer.loss.kind", "gspo",
                                 "--trainer.loss.gspo.clip-high", "0.001", "--trainer.loss.age.max-age", "2"])
    assert cfg.trainer.loss.kind == "gspo" and cfg.trainer.loss.gspo.clip_high == 0.001
    assert cfg.trainer.loss.age.max_age == 2
    with pytest.raises(ConfigError, match="kind"):
        load_config(RLConfig, ["@", "recipes/debug_cpu/rl.toml", "--output-dir", str(tmp_path), "--trainer.loss.kind", "ppo"])


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        dppo_kl_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="loss_mask must be torch.bool"):
        mismatch_kl(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    lp, lpi, mask = _one([0.5, 0.5], [0.5, 0.5])
    adv = torch.tensor([1.0], dtype=torch.float64)
    aged = LossConfig(age=AgeWeightConfig(decay=0.9))
    with pytest.raises(ValueError, match="token_versions=None"):
        compute_loss(aged, lp, lpi, adv, mask)
    with pytest.raises(ValueError, match=r"token_version 5 > trainer_version=4"):
        compute_loss(aged, lp, lpi, adv, mask, torch.tensor([[4, 5]]), 4)
    with pytest.raises(ValueError, match=r"token_version -1 < 0"):
        compute_loss(aged, lp, lpi, adv, mask, torch.tensor([[4, -1]]), 4)
    with pytest.raises(ValueError, match="without trainer_version"):
        compute_loss(aged, lp, lpi, adv, mask, torch.tensor([[4, 4]]))
    with pytest.raises(ValueError, match=r"gspo .* must be \[B\]"):
        compute_loss(LossConfig(kind="gspo"), lp, lpi, torch.ones(1, 2, dtype=torch.float64), mask)
    with pytest.raises(ValueError, match="low <= high"):
        MisConfig(token_low=2.0, token_high=1.0)
    with pytest.raises(ValueError, match="alpha"):
        IcePopConfig(alpha=3.0, beta=2.0)


def test_extreme_ratios_stay_finite():
    """A token the trainer finds impossible (log ratio -800: r underflows to 0 in float64) or near-certain."""
    lp = torch.tensor([[-800.0, -1e-6]], dtype=torch.float64, requires_grad=True)
    lpi = torch.tensor([[-0.1, -5.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for kind in KINDS:
        out = compute_loss(LossConfig(kind=kind), lp, lpi, torch.tensor([1.0], dtype=torch.float64), mask)
        (g,) = torch.autograd.grad(out.loss_sum, lp)
        assert torch.isfinite(out.loss_sum) and torch.isfinite(g).all(), kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("garbage", [float("nan"), float("-inf"), float("inf")])
def test_off_mask_non_finite_values_change_neither_loss_nor_gradient(kind, garbage):
    spread = 0.05 if kind == "gspo" else 0.5
    lp, lp_inf, adv, mask, versions = _inputs(3, spread=spread)
    cfg = _cfg(kind, age=AgeWeightConfig(decay=0.7))
    total, grad, cnt = reference(cfg, lp.tolist(), lp_inf.tolist(), adv.tolist(), mask.tolist(), versions.tolist(), 8)
    lp_bad = lp.clone()
    lp_bad[~mask] = garbage
    lp_bad.requires_grad_(True)
    inf_bad = lp_inf.clone()
    inf_bad[~mask] = garbage
    adv_bad = adv.clone()
    adv_bad[0] = garbage  # sequence 0 has no loss token
    adv_tok = None if kind == "gspo" else adv[:, None].expand_as(lp).clone()
    if adv_tok is not None:
        adv_tok[~mask] = garbage
    for a in [adv_bad] if adv_tok is None else [adv_bad, adv_tok]:
        if lp_bad.grad is not None:
            lp_bad.grad = None
        out = compute_loss(cfg, lp_bad, inf_bad, a, mask, token_versions=versions, trainer_version=8)
        out.loss_sum.backward()
        assert abs(out.loss_sum.item() - total) <= sum_bound(cnt["abs_total"], cnt["n"])
        assert abs(out.mismatch_kl_sum.item() - cnt["k3"]) <= sum_bound(cnt["abs_k3"], cnt["n"])
        assert int(out.masked_sum) == cnt["masked"]
        gb = grad_bound(cfg, lp, lp_inf, adv, mask)
        assert ((lp_bad.grad - torch.tensor(grad, dtype=torch.float64)).abs() <= gb).all()
        assert torch.all(lp_bad.grad[~mask] == 0)
        assert all(torch.isfinite(v) for v in out.metrics.values())
    n = int(mask.sum())
    assert abs(mismatch_kl(lp_bad.detach(), inf_bad, mask).item() - cnt["k3"] / n) <= sum_bound(cnt["abs_k3"], n) / n


@pytest.mark.parametrize("kind", KINDS)
def test_on_mask_non_finite_values_raise_naming_the_tensor(kind):
    lp, lp_inf, adv, mask, _ = _inputs(4)
    cfg = _cfg(kind)
    b, t = mask.nonzero()[0].tolist()
    for name in ("logprobs", "inference_logprobs", "advantages"):
        args = {"logprobs": lp.clone(), "inference_logprobs": lp_inf.clone(), "advantages": adv.clone()}
        if name == "advantages":
            args[name][b] = float("nan")
            n = int(mask[b].sum())  # [B] advantages are expanded over the row's loss tokens
        else:
            args[name][b, t] = float("-inf")
            n = 1
        with pytest.raises(ValueError, match=rf"^{name} has {n} non-finite value\(s\)"):
            compute_loss(cfg, args["logprobs"], args["inference_logprobs"], args["advantages"], mask)


def test_group_advantages_rejects_non_finite_rewards():
    from moe_rl.rl.advantage import group_advantages

    with pytest.raises(ValueError, match=r"rewards has 1 non-finite value\(s\), first rewards\[1\]=nan"):
        group_advantages([1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match=r"first rewards\[0\]=inf"):
        group_advantages([float("inf"), 0.0])
    assert group_advantages([1.0, 0.0]) == [0.5, -0.5]


def test_loss_normalizer_checks_the_mask():
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert loss_normalizer(LossConfig(), mask) == 2
    assert loss_normalizer(LossConfig(kind="gspo"), mask) == 1
    with pytest.raises(TypeError, match="loss_mask must be a torch.bool tensor, got torch.float32"):
        loss_normalizer(LossConfig(), mask.float() * 0.5)
    with pytest.raises(ValueError, match=r"loss_mask must be \[B, T\], got shape \(3,\)"):
        loss_normalizer(LossConfig(kind="gspo"), mask[0])
