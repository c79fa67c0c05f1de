"""Sampling-mask replay block (``moe_rl.rl.sampling_mask``): record encoding, batch transport and the trainer's
renormalised log-probs against a float64 reference and against vLLM's own top-k / top-p filter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _tolerance import eps

from moe_rl.rl.sampling_mask import (
    DROP,
    FULL,
    KEEP,
    SamplingMask,
    batch_mask_tensors,
    dense_keep,
    encode_kept,
    encode_row,
    from_rows,
    masked_logprobs,
)


def _random_kept(rng: np.random.Generator, t: int, v: int) -> np.ndarray:
    """``[t, v]`` kept flags covering every kind: all kept, a few kept, most kept, exactly half, one kept."""
    kept = np.zeros((t, v), dtype=bool)
    for i in range(t):
        n = [v, 1, v // 2, v - 1, int(rng.integers(1, v + 1))][i % 5]
        kept[i, rng.choice(v, size=n, replace=False)] = True
    return kept


def test_encode_roundtrip_kinds_and_wire():
    rng = np.random.default_rng(0)
    kept = _random_kept(rng, 23, 32)
    m = encode_kept(kept)
    np.testing.assert_array_equal(m.to_dense(), kept)
    counts = kept.sum(1)
    expect_kind = np.where(counts == 32, FULL, np.where(counts <= 16, KEEP, DROP))
    np.testing.assert_array_equal(m.kind, expect_kind)
    # compact: never more than V/2 ids listed per position, nothing for FULL
    assert int(np.diff(m.offsets).max()) <= 16
    np.testing.assert_array_equal(m.kept_counts(), counts)
    rows = [encode_row(r) for r in kept]  # the engine's per-position encoding gives the same record
    same = from_rows(32, rows)
    for a, b in ((same.kind, m.kind), (same.offsets, m.offsets), (same.ids, m.ids)):
        np.testing.assert_array_equal(a, b)
    back = SamplingMask.from_wire(m.to_wire())
    np.testing.assert_array_equal(back.to_dense(), kept)
    tokens = [int(rng.choice(np.nonzero(row)[0])) for row in kept]
    assert m.contains(tokens).all()
    outside = [int(np.nonzero(~row)[0][0]) if (~row).any() else -1 for row in kept]
    has_out = np.array([o >= 0 for o in outside])
    assert not m.contains([max(o, 0) for o in outside])[has_out].any()


def test_encode_and_record_errors():
    with pytest.raises(ValueError, match="keeps no token"):
        encode_kept(np.zeros((2, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        encode_kept(np.ones(4, dtype=bool))
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingMask(4, np.array([KEEP], np.int8), np.array([0, 1]), np.array([7], np.int32))
    with pytest.raises(ValueError, match="keeps no token"):
        SamplingMask(2, np.array([DROP], np.int8), np.array([0, 2]), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="keeps no token"):
        encode_row(np.zeros(4, dtype=bool))
    with pytest.raises(ValueError, match="missing field"):
        SamplingMask.from_wire({"vocab_size": 3})
    m = encode_kept(np.ones((3, 4), dtype=bool))
    with pytest.raises(ValueError, match="one id per position"):
        m.contains([0, 1])


def _reference(logits: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float64 ``z_y - logsumexp_{kept} z`` with ``z = logits / T``."""
    z = logits.double() / temp.double()[..., None]
    z = torch.where(keep, z, torch.tensor(-math.inf, dtype=torch.float64))
    return (z.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1))


def test_masked_logprobs_matches_float64_reference_and_renormalises():
    g = torch.Generator().manual_seed(0)
    b, s, v = 3, 7, 32
    logits = torch.randn(b, s, v, generator=g) * 3
    temp = torch.tensor([0.7, 1.0, 1.3])[:, None].expand(b, s)
    keep = torch.from_numpy(_random_kept(np.random.default_rng(1), b * s, v)).view(b, s, v)
    labels = torch.stack([torch.multinomial(k.float(), 1, generator=g)[:, 0] for k in keep])  # kept labels
    got = masked_logprobs(logits, labels, temp, keep)
    ref = _reference(logits, labels, temp, keep)
    z = (logits.double() / temp.double()[..., None]).abs().amax(-1)
    # log_softmax in fp32: |z| and log(sum) each carry ~eps relative error; the sum over <= V terms adds V*eps
    tol = 4 * eps(torch.float32) * (2 * z + math.log(v) + v)
    assert (got.double() - ref).abs().le(tol).all(), (got.double() - ref).abs().max()
    # renormalisation: the kept probabilities sum to 1 (all labels)
    all_lp = masked_logprobs(logits[..., None, :].expand(b, s, v, v), torch.arange(v).expand(b, s, v),
                             temp[..., None].expand(b, s, v), keep[..., None, :].expand(b, s, v, v))
    total = torch.where(keep, all_lp.double().exp(), 0.0).sum(-1)
    assert (total - 1).abs().le(v * 4 * eps(torch.float32)).all()
    assert torch.isinf(all_lp[~keep]).all() and (all_lp[~keep] < 0).all()
    # without a mask: plain log_softmax
    plain = masked_logprobs(logits, labels, temp, None)
    ref_plain = _reference(logits, labels, temp, torch.ones_like(keep))
    assert (plain.double() - ref_plain).abs().le(tol).all()
    with pytest.raises(ValueError, match="must have logits' shape"):
        masked_logprobs(logits, labels, temp, keep[:, :2])


def test_gradients_flow_only_through_kept_tokens():
    g = torch.Generator().manual_seed(2)
    s, v, t = 9, 32, 0.8
    logits = (torch.randn(s, v, generator=g) * 2).requires_grad_()
    keep = torch.from_numpy(_random_kept(np.random.default_rng(3), s, v))
    labels = torch.stack([torch.multinomial(k.float(), 1, generator=g)[0] for k in keep])
    masked_logprobs(logits, labels, t, keep).sum().backward()
    grad = logits.grad
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))  # exactly zero: masked_fill's gradient
    # analytic float64 gradient at kept entries: (1[j = y] - p_j) / T, p the renormalised probabilities
    z = torch.where(keep, logits.detach().double() / t, torch.tensor(-math.inf, dtype=torch.float64))
    p = torch.softmax(z, dim=-1)
    ref = (torch.nn.functional.one_hot(labels, v).double() - p) / t
    assert (grad.double() - ref).abs().max() <= 8 * v * eps(torch.float32) / t


def test_matches_vllm_top_k_top_p_filter_including_ties():
    """The kept set of vLLM's own filter (0.32 ``apply_top_k_top_p_pytorch``), encoded and replayed, gives exactly
    vLLM's processed log-probs; ties at the top-k threshold are all kept (vLLM drops only ``logits < kth``)."""
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(4)
    n, v = 64, 32
    logits = torch.randn(n, v, generator=g) * 2
    logits[0, :4] = 5.0  # a 4-way tie at the top: top_k = 2 keeps all four
    temp = 0.9
    k = torch.tensor([2] + [int(x) for x in torch.randint(1, v + 1, (n - 1,), generator=g)])
    p = torch.rand(n, generator=g) * 0.7 + 0.3
    for kk, pp in ((None, p), (k, None), (k, p)):
        filtered = ops.apply_top_k_top_p_pytorch((logits / temp).clone(), kk, pp, allow_cpu_sync=True)
        kept = torch.isfinite(filtered)
        m = encode_kept(kept)
        np.testing.assert_array_equal(m.to_dense(), kept.numpy())
        if kk is not None:
            assert int(kept[0].sum()) >= 4  # the tie is kept whole
        engine_lp = filtered.log_softmax(-1)  # vLLM processed_logprobs
        labels = torch.stack([torch.multinomial(r.float(), 1, generator=g)[0] for r in kept])
        ids, kind = batch_mask_tensors([m], [0], n + 1).values()
        keep = dense_keep(ids[0], kind[0], v)
        got = masked_logprobs(logits, labels, temp, keep)
        want = engine_lp.gather(-1, labels[:, None])[:, 0]
        # same fp32 ops (scale, -inf fill, log_softmax) up to the order of the division: a few ulp of |z|
        tol = 4 * eps(torch.float32) * ((logits / temp).abs().amax(-1) + math.log(v))
        assert (got - want).abs().le(tol).all()


def test_batch_tensors_dense_keep_and_positions():
    rng = np.random.default_rng(5)
    v = 16
    m0 = encode_kept(_random_kept(rng, 4, v))
    m2 = encode_kept(_random_kept(rng, 2, v))
    out = batch_mask_tensors([m0, None, m2], [1, 0, 3], length=7)
    ids, kind = out["sampling_mask_ids"], out["sampling_mask_kind"]
    assert ids.shape[:2] == (3, 6) and kind.dtype == torch.int8 and ids.dtype == torch.int32
    keep = dense_keep(ids, kind, v).numpy()
    full = np.ones(v, dtype=bool)
    np.testing.assert_array_equal(keep[0, 1:5], m0.to_dense())
    np.testing.assert_array_equal(keep[2, 3:5], m2.to_dense())
    for r, c in [(0, 0), (0, 5), (1, 2), (2, 0), (2, 5)]:
        np.testing.assert_array_equal(keep[r, c], full)  # not recorded: the whole vocabulary
    assert batch_mask_tensors([None, None], [0, 0], 5) == {}
    with pytest.raises(ValueError, match="runs past"):
        batch_mask_tensors([m0], [4], 7)
    with pytest.raises(ValueError, match="vocab sizes"):
        batch_mask_tensors([m0, encode_kept(np.ones((1, 8), bool))], [0, 0], 7)
    with pytest.raises(ValueError, match="vocab_size"):
        dense_keep(ids, kind, 4)


def test_build_batch_carries_masks_through_transport(tmp_path):
    from moe_rl.rl.batch import build_batch, read_batch, write_batch
    from moe_rl.rl.buffer import RolloutGroup, Sample

    rng = np.random.default_rng(6)
    v = 32
    kept = _random_kept(rng, 3, v)
    comp = [int(np.nonzero(r)[0][0]) for r in kept]
    m = encode_kept(kept)
    s0 = Sample([1, 5, 6], comp, [-0.5] * 3, reward=1.0, sampling_mask=m)
    s1 = Sample([1, 7], [8, 9], [-0.1, -0.2], reward=0.0)
    with pytest.raises(ValueError, match="one kept set per sampled token"):
        Sample([1], [3, 4], [-0.1, -0.1], sampling_mask=m)
    batch = build_batch([RolloutGroup(0, 0, "s", [s0, s1])], step=0, pad_id=0)
    keep = dense_keep(batch.sampling_mask_ids, batch.sampling_mask_kind, v).numpy()
    np.testing.assert_array_equal(keep[0, 2:5], kept)  # prompt of 3: positions 2..4 predict the completion
    assert keep[0, :2].all() and keep[1].all()
    back = read_batch(write_batch(batch, tmp_path))
    assert torch.equal(back.sampling_mask_ids, batch.sampling_mask_ids)
    assert torch.equal(back.sampling_mask_kind, batch.sampling_mask_kind)
    padded = batch.pad_rows(4, pad_id=0)
    assert padded.sampling_mask_kind.shape[0] == 4 and (padded.sampling_mask_kind[2:] == FULL).all()
    assert torch.equal(padded.shard(0, 2).sampling_mask_ids, batch.sampling_mask_ids)


def test_trainer_label_logprobs_use_the_mask_only_on_loss_positions():
    """``step._sampling_mask`` + ``_label_logprobs``: renormalised at loss positions, plain elsewhere."""
    from moe_rl.rl.batch import build_batch
    from moe_rl.rl.buffer import RolloutGroup, Sample
    from moe_rl.rl.loss import LossConfig
    from moe_rl.runtime.trainer.step import StepSettings, _label_logprobs, _sampling_mask

    rng = np.random.default_rng(7)
    v = 32
    kept = _random_kept(rng, 4, v)
    kept[:, 3] = True  # token 3 is kept everywhere; it is the sampled token
    s = Sample([1, 2], [3, 3, 3, 3], [-1.0] * 4, reward=1.0, sampling_mask=encode_kept(kept))
    batch = build_batch([RolloutGroup(0, 0, "s", [s])], step=0, pad_id=0)
    batch.loss_mask[0, 2] = False  # a position taken off the loss (e.g. staleness mask): whole vocabulary there
    settings = StepSettings(loss=LossConfig(), max_grad_norm=1.0, temperature=1.0, pad_id=0, sampling_mask_replay=True)
    ids, kind = _sampling_mask(settings, batch)
    assert ids.shape[1] == batch.input_ids.shape[1] and int(kind[0, -1]) == FULL and int(kind[0, 2]) == FULL
    logits = torch.randn(1, batch.input_ids.shape[1], v, generator=torch.Generator().manual_seed(8))
    lp = _label_logprobs(logits[:, :-1], batch.input_ids[:, 1:], 1.0, (ids[:, :-1], kind[:, :-1]))
    keep = torch.ones(1, 5, v, dtype=torch.bool)
    keep[0, 1:5] = torch.from_numpy(kept)
    keep[0, 2] = True
    ref = _reference(logits[:, :-1], batch.input_ids[:, 1:], torch.ones(1, 5), keep)
    assert (lp.double() - ref).abs().max() <= 4 * eps(torch.float32) * (2 * logits.abs().max() + math.log(v) + v)
    off = StepSettings(loss=LossConfig(), max_grad_norm=1.0, temperature=1.0, pad_id=0)
    assert _sampling_mask(off, batch) is None
    chunked = StepSettings(loss=LossConfig(), max_grad_norm=1.0, temperature=1.0, pad_id=0,
                           sampling_mask_replay=True, loss_chunk_tokens=8)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        _sampling_mask(chunked, batch)


def test_trainer_step_replays_masks_packed_and_padded_rows():
    """``accumulate_gradients`` with ``sampling_mask_replay``: packed rows (several, one) and padded rows give the
    loss of a float32 reference that renormalises each loss position over its kept set (tolerance: the log-prob
    error bound propagated through the loss, ``train_step_bounds``, as ``tests/trainer/test_packing.py``); with replay
    off the loss moves by far more than that bound (the masks reach the loss)."""
    from dataclasses import replace
    from pathlib import Path

    from _reference_trainer import sampling_mask_batch, sampling_mask_reference, spread_router_model

    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.runtime.config import RLConfig
    from moe_rl.runtime.trainer.step import StepSettings, TrainerState, accumulate_gradients, make_optimizer

    cfg = RLConfig(output_dir=Path("/tmp/unused"), trainer={"nproc_per_node": 1, "sampling_mask_replay": True,
                                                             "loss": {"kind": "dppo_kl", "kl_tau": 0.01}})
    init = {k: v.clone() for k, v in spread_router_model(cfg.model).state_dict().items()}
    b = sampling_mask_batch(cfg, 9, lambda rng, k, c, v: _random_kept(rng, c, v))
    reference = sampling_mask_reference(cfg, init, b)
    ref = reference["loss"]
    bound = reference["bounds"]["loss"] + eps(torch.float32) * abs(ref)

    def run(**settings):
        m = GlmMoeForCausalLM(cfg.model)
        m.load_state_dict(init)
        opt, sched = make_optimizer(m, cfg.trainer.optim)
        st = TrainerState(replace(StepSettings.from_rl_config(cfg), **settings), m, opt, sched, cfg.trainer.dims,
                          None, 0, 1)
        o, n, _ = accumulate_gradients(st, b, 0)
        return o.loss_sum.item() / n

    longest = int(b.lengths.max())
    for label, settings in [("several rows", {"seq_len": longest + 2}), ("one row", {}),
                            ("padded rows", {"packing": False})]:
        got = run(**settings)
        assert abs(got - ref) <= bound, (label, got, ref, bound)
    off = run(sampling_mask_replay=False)
    assert abs(off - ref) > 100 * bound, (off, ref, bound)
