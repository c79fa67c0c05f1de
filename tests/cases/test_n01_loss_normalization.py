"""N01: loss normalization across micro-batches, gradient accumulation and data-parallel ranks.

The library's contract (``moe_rl.rl.loss``): :func:`compute_loss` returns *sums* and the caller divides by
:func:`loss_normalizer` of the **global** batch (``moe_rl.runtime.trainer.step.train_step`` does exactly that per
micro-batch, then accumulates gradients; ``tests/trainer/test_micro_batch.py`` and
``tests/trainer/test_rl_trainer_parallel.py`` check ``train_step`` against one process for micro-batches, FSDP2
data ranks and CP). Here the case's numbers go through those two functions.

Per-token losses: with ``logprobs == inference_logprobs`` (ratio 1) a token's loss is ``-A`` (``dppo_kl``: ``-A r``,
the KL term ``(log r)^2`` is 0), so ``A = -loss`` sets it, and ``d objective / d loss_i = -d objective / d A_i``.

* micro-batch A = [1, 3], B = [2, 2, 2, 6]: objective 16 / 6 = 2.666667 (the mean of means would be 2.5), gradient
  1/6 for all six tokens (the mean of means gives 0.25 and 0.125), equal for 1 micro-batch, 2 micro-batches and the
  same split over 2 data ranks (each rank's share of the gradient, summed);
* variant 2: 4 micro-batches of 2 tokens of loss 1 with the global denominator 8: the summed objective is 1.0 (not
  0.25), with or without accumulation;
* a window with no loss token: loss 0, gradient 0, never NaN.
* mixed SFT + RL: A as an RL row, B as a supervised row (cross-entropy): one normalizer, the same 16 / 6 and
  weights 1/6 for every split.

Tolerance: fp64 here, so the checks are at 1e-12 (six O(1) terms); the faulty values are >= 0.04 away.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.rl.loss import LossConfig, compute_loss, loss_normalizer

CFG = LossConfig(kind="dppo_kl")
A_LOSSES = [1.0, 3.0]
B_LOSSES = [2.0, 2.0, 2.0, 6.0]


def _rows(losses: list[list[float]], width: int):
    """``[B, width]`` tensors with the given per-token losses left-aligned (the rest off the mask)."""
    b = len(losses)
    mask = torch.zeros(b, width, dtype=torch.bool)
    adv = torch.zeros(b, width, dtype=torch.float64)
    for i, row in enumerate(losses):
        mask[i, : len(row)] = True
        adv[i, : len(row)] = -torch.tensor(row, dtype=torch.float64)
    adv.requires_grad_(True)
    lp = torch.full((b, width), -0.7, dtype=torch.float64)
    return lp, lp.clone(), adv, mask


def _objective(parts: list[list[list[float]]], width: int = 4):
    """Sum over ``parts`` (micro-batches or ranks) of ``loss_sum / loss_normalizer(global mask)``; returns the
    objective and each part's per-token weights ``d objective / d loss``."""
    tensors = [_rows(p, width) for p in parts]
    global_mask = torch.cat([t[3] for t in tensors])
    norm = loss_normalizer(CFG, global_mask)
    total = torch.zeros((), dtype=torch.float64)
    for lp, inf, adv, mask in tensors:
        out = compute_loss(CFG, lp, inf, adv, mask)
        part = out.loss_sum / norm
        part.backward()  # one backward per micro-batch: gradients accumulate
        total = total + part.detach()
    weights = [(-adv.grad)[mask].tolist() for _, _, adv, mask in tensors]
    return total.item(), weights


@pytest.mark.parametrize("split", ["one_micro_batch", "two_micro_batches", "two_dp_ranks"])
def test_n01_global_token_mean_over_micro_batches_and_ranks(split):
    if split == "one_micro_batch":
        parts = [[A_LOSSES, B_LOSSES]]
    else:  # a data rank holds its rows and divides by the global count exactly like a micro-batch does
        parts = [[A_LOSSES], [B_LOSSES]]
    obj, weights = _objective(parts)
    assert obj == pytest.approx(16 / 6, abs=1e-12)
    assert obj == pytest.approx(2.666667, abs=5e-7)
    flat = [w for part in weights for w in part]
    assert flat == pytest.approx([1 / 6] * 6, abs=1e-12)


def test_n01_variant2_global_denominator_is_not_divided_again():
    parts = [[[1.0, 1.0]] for _ in range(4)]
    obj, weights = _objective(parts, width=2)
    assert obj == pytest.approx(1.0, abs=1e-12)  # not 0.25
    assert [w for part in weights for w in part] == pytest.approx([1 / 8] * 8, abs=1e-12)
    obj_one, _ = _objective([[[1.0, 1.0]] * 4], width=2)  # no accumulation: the same objective
    assert obj_one == pytest.approx(obj, abs=1e-12)


def test_n01_window_without_loss_tokens_gives_zero_not_nan():
    lp, inf, adv, _ = _rows([[1.0, 2.0]], 4)
    mask = torch.zeros(1, 4, dtype=torch.bool)
    lp[0, 2:] = float("nan")  # padding may hold anything
    norm = loss_normalizer(CFG, mask)
    assert norm == 1
    out = compute_loss(CFG, lp, inf, adv, mask)
    (out.loss_sum / norm).backward()
    assert out.loss_sum.item() == 0.0
    assert torch.equal(adv.grad, torch.zeros_like(adv))


@pytest.mark.parametrize("split", ["one_micro_batch", "two_micro_batches", "two_dp_ranks"])
def test_n01_mixed_sft_and_rl_rows_share_one_normalizer(split):
    """Micro-batch A is an RL row (per-token losses [1, 3] set by the advantage), B a supervised row whose
    cross-entropy ``-log p`` is [2, 2, 2, 6] (``compute_loss(..., sft=)``): the objective is still the global token mean
    16 / 6 with weight 1/6 on every token, whatever the split (not (4/2 + 12/4)/2, and not one normalizer per kind)."""
    width = 4
    lp_rl, inf_rl, adv_rl, mask_rl = _rows([A_LOSSES], width)
    lp_sft = torch.zeros(1, width, dtype=torch.float64)
    lp_sft[0, : len(B_LOSSES)] = -torch.tensor(B_LOSSES, dtype=torch.float64)
    lp_sft.requires_grad_(True)
    mask_sft = torch.zeros(1, width, dtype=torch.bool)
    mask_sft[0, : len(B_LOSSES)] = True
    parts = [(lp_rl, inf_rl, adv_rl, mask_rl, False), (lp_sft, lp_sft.detach().clone(),
                                                        torch.zeros(1, width, dtype=torch.float64), mask_sft, True)]
    if split == "one_micro_batch":
        parts = [tuple(torch.cat([a[i], b[i]]) for i in range(4)) + (None,) for a, b in [parts]]
    norm = loss_normalizer(CFG, torch.cat([mask_rl, mask_sft]))
    total = 0.0
    for lp, inf, adv, mask, is_sft in parts:
        sft = torch.tensor([False, True]) if is_sft is None else torch.tensor([is_sft])
        out = compute_loss(CFG, lp, inf, adv, mask, sft=sft)
        (out.loss_sum / norm).backward()
        total += out.loss_sum.item() / norm
    assert norm == 6
    # float64: the objective sums <= 8 terms (6 token losses, 2 micro-batches) of absolute sum 16 / 6, worst case
    # 8 eps64 * 16 / 6; a gradient element is 1 / norm after <= 4 element-wise roundings (no reduction):
    # 4 eps64 / 6. A per-kind or per-micro-batch normaliser is off by >= 1/12 (1e14 times these bounds).
    e64 = torch.finfo(torch.float64).eps
    assert total == pytest.approx(16 / 6, abs=8 * e64 * 16 / 6)
    assert (-adv_rl.grad)[mask_rl].tolist() == pytest.approx([1 / 6] * 2, abs=4 * e64 / 6)
    assert (-lp_sft.grad)[mask_sft].tolist() == pytest.approx([1 / 6] * 4, abs=4 * e64 / 6)
