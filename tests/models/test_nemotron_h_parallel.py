"""NemotronHForCausalLM under FSDP2 x EP x CP (:func:`moe_rl.models.nemotron_h.parallelize.parallelize_nemotron_h`) on
2 and 4 gloo ranks against the single-process model: this rank's logits, the loss and every gradient (the worker
gives the tolerance). CP splits every row into contiguous slices (the Mamba-2 state passes from rank to rank);
attention runs ring or Ulysses over the CP ranks.

World 2: ``fsdp2`` (FSDP over 2 data ranks), ``dp2_ep2_r3`` (experts split, a fixed routing replayed),
``cp2_ring_ac`` (ring CP, activation checkpointing), ``cp2_ulysses_ep2`` (Ulysses CP with EP borrowed from the CP
ranks), ``cp2_ring_r3_logprobs`` (ring CP, replay sharded like the ids, the loss from the chunked
``token_logprobs``), ``cp2_ring_padded`` (rows of 15 tokens: the last CP slice ends in a padding column),
``dp2_ep2_tied_no_latent_meta`` (EP without latent projections, lm_head tied to the embedding, built on the
meta device, parallelized, ``to_empty`` and loaded from the full state dict), ``validation_errors`` (a
DSA CP method, a non Nemotron-H model, a broken embedding tie, missing or zigzag positions and packed rows under CP
refused). World 4: ``cp4_ring``, ``dp2_cp2_ep2_ulysses_r3`` (FSDP x CP x EP with replay and activation
checkpointing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import check_scenario, ranks_fixture

WORKER = Path(__file__).with_name("_nemotron_h_parallel_worker.py")
world2 = ranks_fixture(WORKER, 2, 300)
world4 = ranks_fixture(WORKER, 4, 300)


@pytest.mark.parametrize("scenario", ["fsdp2", "dp2_ep2_r3", "cp2_ring_ac", "cp2_ulysses_ep2", "cp2_ring_r3_logprobs",
                                      "cp2_ring_padded", "dp2_ep2_tied_no_latent_meta", "validation_errors"])
def test_two_ranks_match_single_process(world2, scenario):
    check_scenario(world2, scenario)


@pytest.mark.parametrize("scenario", ["cp4_ring", "dp2_cp2_ep2_ulysses_r3"])
def test_four_ranks_match_single_process(world4, scenario):
    check_scenario(world4, scenario)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_local_experts_match_the_full_experts_and_keep_empty_ones_in_the_graph(backend):
    """The EP block's local squared-ReLU experts on expert-major rows equal the full block's experts on the same
    tokens (one process), and an expert that received no rows still gets a (zero) gradient."""
    import torch
    from _tolerance import assert_normwise_close

    from moe_rl.models.nemotron_h.ep import local_relu2_experts_forward
    from moe_rl.models.nemotron_h.moe import relu2_experts_forward

    gen = torch.Generator().manual_seed(3)
    E, L, F, T = 4, 16, 32, 9
    up = (torch.randn(E, F, L, generator=gen) / L**0.5).requires_grad_()
    down = (torch.randn(E, L, F, generator=gen) / F**0.5).requires_grad_()
    x = torch.randn(T, L, generator=gen)
    ids = torch.tensor([0, 2, 3, 0, 2, 2, 3, 0, 3])[:, None]  # expert 1 gets no token
    want = relu2_experts_forward(x, ids, up.detach(), down.detach(), backend="loop")[:, 0]  # [T, L]
    order = torch.argsort(ids[:, 0], stable=True)
    counts = torch.bincount(ids[:, 0], minlength=E)
    got = local_relu2_experts_forward(x[order], counts, up, down, backend=backend)
    assert_normwise_close(got, want[order], dtype=torch.float32, k=max(L, F), depth=4, what=backend)
    (got * torch.randn(got.shape, generator=gen)).sum().backward()  # a dense upstream gradient, as combine's
    assert up.grad is not None and down.grad is not None
    assert float(up.grad[1].abs().max()) == 0.0 and float(up.grad[0].abs().max()) > 0.0
