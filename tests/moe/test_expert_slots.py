"""``moe_rl.moe.experts.expert_slots_forward``: slot order, zero tokens, and its argument checks."""

from __future__ import annotations

import pytest
import torch

from moe_rl.moe import grouped_experts_forward
from moe_rl.moe.experts import expert_slots_forward

E, K, D = 5, 2, 6


def _rows_plus_expert(x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """A stand-in expert bank: row i -> its first 3 features plus its expert's id (D' = 3)."""
    expert_N = torch.repeat_interleave(torch.arange(len(counts_E)), counts_E)
    return x_ND[:, :3] + expert_N[:, None].to(x_ND.dtype)


def test_slots_come_back_in_token_order():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, D, generator=gen)
    ids = torch.randint(0, E, (7, K), generator=gen)
    y = expert_slots_forward(x, ids, E, _rows_plus_expert)
    assert y.shape == (7, K, 3)
    want = x[:, None, :3] + ids[:, :, None].to(x.dtype)  # the same float op on the same values: bitwise equal
    assert torch.equal(y, want)


def test_zero_tokens_give_an_empty_result():
    y = expert_slots_forward(torch.randn(0, D), torch.zeros(0, K, dtype=torch.int64), E, _rows_plus_expert)
    assert y.shape == (0, K, 3)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_grouped_experts_forward_with_zero_tokens(backend):
    F_ = 8
    x = torch.randn(0, D * 2, requires_grad=True)  # D = 12: aligned for grouped_mm in float32
    gate_up = torch.randn(E, 2 * F_, D * 2, requires_grad=True)
    down = torch.randn(E, D * 2, F_, requires_grad=True)
    y = grouped_experts_forward(x, torch.zeros(0, K, dtype=torch.int64), gate_up, down, backend=backend)
    assert y.shape == (0, K, D * 2) and y.requires_grad
    y.sum().backward()  # an empty batch still backpropagates (all-zero gradients)
    assert x.grad.shape == (0, D * 2)
    assert gate_up.grad is not None and gate_up.grad.abs().max() == 0
    assert down.grad is not None and down.grad.abs().max() == 0


@pytest.mark.parametrize(
    ("rows_forward", "error", "match"),
    [
        (lambda x, c: x.sum(dim=1), ValueError, r"rows_forward returned shape \(14,\); it must return \[N, D'\] "
                                                r"with N = T\*K = 14"),
        (lambda x, c: x[:-1], ValueError, r"rows_forward returned shape \(13, 6\).*N = T\*K = 14"),
        (lambda x, c: x[:, None], ValueError, r"rows_forward returned shape \(14, 1, 6\)"),
        (lambda x, c: (x,), TypeError, r"rows_forward returned tuple, not a tensor"),
    ],
)
def test_bad_rows_forward_return_is_named(rows_forward, error, match):
    ids = torch.randint(0, E, (7, K))
    with pytest.raises(error, match=match):
        expert_slots_forward(torch.randn(7, D), ids, E, rows_forward)


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        (torch.zeros(7, K), TypeError, r"topk_ids_TK must be an int64 tensor of expert ids, got dtype torch.float32"),
        (torch.zeros(7, K, dtype=torch.int32), TypeError, r"got dtype torch.int32; .*cast with .long\(\)"),
        (torch.zeros(7, K, dtype=torch.bool), TypeError, r"got dtype torch.bool"),
        ([[0, 1]] * 7, TypeError, r"topk_ids_TK must be an int64 tensor of expert ids, got list"),
        (torch.zeros(7 * K, dtype=torch.int64), ValueError, r"topk_ids_TK must be 2-D \[T, K\], got shape \(14,\)"),
        (torch.zeros(7, K, 1, dtype=torch.int64), ValueError, r"got shape \(7, 2, 1\)"),
        (torch.zeros(6, K, dtype=torch.int64), ValueError, r"x_TD must be \[T, D\] with T = 6.*got shape \(7, 6\)"),
    ],
)
def test_bad_topk_ids_are_named(ids, error, match):
    with pytest.raises(error, match=match):
        expert_slots_forward(torch.randn(7, D), ids, E, _rows_plus_expert)
