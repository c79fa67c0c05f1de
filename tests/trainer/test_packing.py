"""Sequence packing in the trainer step (``moe_rl.runtime.trainer.step`` with ``StepSettings.packing``): packed
training equals unpacked training, truncation cuts routed-expert rows with the tokens, per-sample temperatures, mixed
SFT + RL samples with one loss normalization, and the packed forward of the GLM model.

Reference: the single-process fp32 unpacked path (the whole padded batch in one forward, ``token_logprobs`` with each
row's temperature, ``compute_loss`` with the ``sft`` rows, ``loss_normalizer`` of the batch), as
``test_micro_batch.py``'s reference. Packed runs use the real :func:`accumulate_gradients` on a plain fp32 model.

Tolerances (``tests/_tolerance.py``): both are fp32 chains of the same reductions in other shapes and orders (one
packed row ``[1, T]`` with one causal SDPA per sample vs padded rows ``[B, L]``), so gradients are compared per tensor
with :func:`assert_normwise_close` over the decoder chain (forward + backward, two paths: ``depth = 2 * depth + 2``,
as ``assert_train_run_close``) and the loss within :func:`train_step_bounds` (the log-prob error bound propagated
through ``d loss / d lp``). Measured differences are printed (~1e-8, far below the issue's 1e-5); a sample attending
across a boundary, a position not restarted, a wrong temperature or a normalizer per micro-batch moves the loss or a
gradient by O(1e-2) relative here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _ranks import scenario_result
from _reference_trainer import assert_step_matches_reference, launch_one_step_scenarios, spread_router_model
from _tolerance import assert_normwise_close, decoder_chain, eps, train_step_bounds

from moe_rl.runtime.config import RLConfig

GSPO = {"kind": "gspo", "kl_tau": 0.01, "gspo": {"clip_low": 0.9, "clip_high": 9.0}}
DPPO = {"kind": "dppo_kl", "kl_tau": 0.01}
# (prompt, completion, temperature, sft)
SAMPLES = [(4, 3, 1.0, False), (6, 5, 0.7, False), (3, 2, 1.3, False), (4, 4, 1.0, True), (2, 9, 0.5, False),
           (5, 5, 1.0, False), (3, 1, 1.0, True)]


def _cfg(loss: dict) -> RLConfig:
    return RLConfig(output_dir=Path("/tmp/unused"), trainer={"nproc_per_node": 1, "router_replay": True,
                                                             "loss": loss})


def _init_state(cfg: RLConfig) -> dict[str, torch.Tensor]:
    # spread router scores: the trainer-routed sample has no near-tie top-k choice
    return {k: v.clone() for k, v in spread_router_model(cfg.model).state_dict().items()}


def _samples(cfg: RLConfig, seed: int = 7, cut: int | None = None):
    """Two groups of samples with routed-expert records (sample 1 has none: the trainer routes it), per-sample
    temperatures and SFT samples; ``cut``: each sample truncated to its first ``cut`` tokens (tokens, log-probs and
    routed rows), as the packed trainer truncates."""
    from moe_rl.replay import RoutedExperts
    from moe_rl.rl.buffer import RolloutGroup, Sample

    m = cfg.model
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    rng = np.random.default_rng(seed)
    out = []
    for k, (p, c, temp, sft) in enumerate(SAMPLES):
        prompt = [1] + rng.integers(3, m.vocab_size, size=p - 1).tolist()
        comp = rng.integers(3, m.vocab_size, size=c).tolist()
        lps = [0.0] * c if sft else (-rng.random(c) * 2.0).tolist()
        rec = None
        ids = np.argsort(rng.random((p + c, moe, m.n_routed_experts)), axis=-1)[..., : m.num_experts_per_tok]
        if cut is not None and p + c > cut:
            comp, lps, ids = comp[: cut - p], lps[: cut - p], ids[:cut]
        if k != 1:
            ids[-1] = -1  # the last token's row: a placeholder
            rec = RoutedExperts.from_array(ids, m.n_routed_experts)
        out.append(Sample(prompt, comp, lps, reward=float(rng.random()), routed_experts=rec, temperature=temp,
                          sft=sft))
    return [RolloutGroup(0, 0, "s", out[:4]), RolloutGroup(1, 0, "s", out[4:])]


def _batch(cfg: RLConfig, **kw):
    from moe_rl.rl.batch import build_batch

    b = build_batch(_samples(cfg, **kw), 0, pad_id=cfg.pad_id, temperature=cfg.orchestrator.temperature)
    assert b.sft is not None and b.temperatures is not None and b.routed_experts is not None
    return b


def _reference(cfg: RLConfig, init: dict, b) -> dict:
    """Single process, fp32, the whole padded batch in one forward/backward."""
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.replay import model_replay_ids
    from moe_rl.rl.loss import compute_loss, loss_normalizer
    from moe_rl.runtime.trainer.step import token_logprobs

    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(init)
    lcfg = cfg.trainer.loss
    replay = model_replay_ids(b.routed_experts, b.routed_experts_state, [layer.is_moe for layer in model.layers])
    logits = model(b.input_ids, replay_ids=replay)
    lp = token_logprobs(logits, b.input_ids, b.temperatures)
    lp.retain_grad()
    out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, 0, sft=b.sft)
    norm = loss_normalizer(lcfg, b.loss_mask)
    (out.loss_sum / norm).backward()
    k, depth = decoder_chain(cfg.model, b.input_ids.numel())
    return {"loss": out.loss_sum.item() / norm, "loss_tokens": int(b.loss_mask.sum()),
            "bounds": train_step_bounds(lp, logits, out, k=k, depth=2 * depth), "tokens": b.input_ids.numel(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _packed(cfg: RLConfig, init: dict, b, seq_len: int | None, **settings) -> dict:
    from dataclasses import replace

    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.runtime.trainer.step import (
        StepSettings,
        TrainerState,
        accumulate_gradients,
        make_optimizer,
        uses_packing,
    )

    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(init)
    model.train()
    opt, sched = make_optimizer(model, cfg.trainer.optim)
    st = TrainerState(replace(StepSettings.from_rl_config(cfg), seq_len=seq_len, **settings), model, opt, sched,
                      cfg.trainer.dims, None, 0, 1)
    out, norm, loss_tokens = accumulate_gradients(st, b, 0)
    return {"loss": out.loss_sum.item() / norm, "loss_tokens": loss_tokens, "packed": uses_packing(st),
            "out": out, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _assert_close(got: dict, ref: dict, cfg: RLConfig, label: str) -> dict:
    assert got["loss_tokens"] == ref["loss_tokens"], label
    bound = ref["bounds"]["loss"] + eps(torch.float32) * abs(ref["loss"])
    assert abs(got["loss"] - ref["loss"]) <= bound, (label, got["loss"], ref["loss"], bound)
    k, depth = decoder_chain(cfg.model, ref["tokens"], backward=True)
    err = 0.0
    for n, g in ref["grads"].items():
        assert_normwise_close(got["grads"][n], g, dtype=torch.float32, k=k, depth=2 * depth + 2, what=f"{label} {n}")
        err = max(err, (got["grads"][n] - g).abs().max().item())
    return {"loss": abs(got["loss"] - ref["loss"]), "grad": err}


@pytest.mark.parametrize("loss, full", [(DPPO, True), (GSPO, False)], ids=["dppo_kl", "gspo"])
def test_packed_training_equals_unpacked(loss, full):
    """Packed rows (one row; one sample per row; several rows of mixed samples; the chunked head with per-token
    temperatures) and the padded-row path all equal the unpacked reference (``gspo``: its sequence-level terms on
    several packed rows)."""
    cfg = _cfg(loss)
    init = _init_state(cfg)
    b = _batch(cfg)
    ref = _reference(cfg, init, b)
    longest = max(b.lengths.tolist())
    runs = [("several rows", longest + 3, {})]
    if full:
        runs += [("one row", None, {}), ("one sample per row", longest, {}),
                 ("chunked head", longest + 3, {"loss_chunk_tokens": 4}), ("padded rows", None, {"packing": False})]
    for label, seq_len, extra in runs:
        got = _packed(cfg, init, b, seq_len, **extra)
        assert got["packed"] == extra.get("packing", True)
        err = _assert_close(got, ref, cfg, label)
        print(f"\n{loss['kind']} {label} (seq_len={seq_len}): max abs error vs unpacked {err}")


def test_truncation_cuts_tokens_loss_and_routed_rows():
    cfg = _cfg(DPPO)
    init = _init_state(cfg)
    cut = 7
    full = _batch(cfg)
    assert max(full.lengths.tolist()) > cut
    ref = _reference(cfg, init, _batch(cfg, cut=cut))  # every sample cut to 7 tokens before the batch is built
    got = _packed(cfg, init, full, cut)
    err = _assert_close(got, ref, cfg, "truncated")
    print(f"\ntruncation to {cut}: max abs error vs pre-truncated samples {err}")


def test_per_sample_temperature_is_applied():
    """A batch whose temperatures are all replaced by 1.0 trains differently (the temperatures reach the loss), and a
    batch without the field uses the configured temperature."""
    from dataclasses import replace

    cfg = _cfg(DPPO)
    init = _init_state(cfg)
    b = _batch(cfg)
    a = _packed(cfg, init, b, None)
    ones = _packed(cfg, init, replace(b, temperatures=torch.ones_like(b.temperatures)), None)
    none = _packed(cfg, init, replace(b, temperatures=None), None)
    k, depth = decoder_chain(cfg.model, b.input_ids.numel(), backward=True)
    beta = (2 * depth + 2) * 4.0 * math.sqrt(k) * eps(torch.float32)  # assert_normwise_close's relative bound
    rel = max(float((a["grads"][n] - g).norm() / g.norm()) for n, g in ones["grads"].items() if g.norm() > 0)
    assert rel > 10 * beta, (rel, beta)  # the temperatures move the gradient far outside the rounding bound
    assert none["loss"] == ones["loss"]  # the same arithmetic (configured temperature 1.0 is exact)


def test_mixed_sft_rl_one_normalization_any_split():
    """N01 with SFT rows: the objective is sum of per-token losses over ALL loss tokens (RL and SFT) / their count,
    the same whether the batch runs in one packed row, several, or padded row micro-batches."""
    cfg = _cfg(DPPO)
    init = _init_state(cfg)
    b = _batch(cfg)
    sft_tokens = int(b.loss_mask[b.sft].sum())
    assert 0 < sft_tokens < int(b.loss_mask.sum())
    ref = _reference(cfg, init, b)
    lengths = b.lengths.tolist()
    for label, seq_len, extra in (("one row", None, {}), ("rows of one sample", max(lengths), {}),
                                  ("row micro-batches of 2", None, {"micro_batch": 2})):
        got = _packed(cfg, init, b, seq_len, **extra)
        _assert_close(got, ref, cfg, label)
        assert got["out"].metrics["sft_tokens"].item() == sft_tokens
        assert got["out"].num_tokens == int(b.loss_mask.sum())


def test_packed_forward_matches_rows_and_validates_cu_seqlens():
    from moe_rl.models import GlmMoeForCausalLM

    cfg = _cfg(DPPO)
    model = GlmMoeForCausalLM(cfg.model)
    model.load_state_dict(_init_state(cfg))
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3]
    seqs = [torch.randint(3, cfg.model.vocab_size, (n,), generator=gen) for n in lengths]
    rows = torch.zeros(len(seqs), max(lengths), dtype=torch.int64)
    for i, s in enumerate(seqs):
        rows[i, : len(s)] = s
    cu = [0, 5, 14, 17]
    with torch.no_grad():
        a = model(rows)
        b = model(torch.cat(seqs)[None], cu_seqlens=torch.tensor(cu))
        c = model(torch.cat(seqs)[None])  # no boundaries: later samples attend to earlier ones
    k, depth = decoder_chain(cfg.model, rows.numel())
    for i, n in enumerate(lengths):
        assert_normwise_close(b[0, cu[i]:cu[i + 1]], a[i, :n], dtype=torch.float32, k=k, depth=2 * depth,
                              what=f"sample {i}")
    assert (c[0, 5:14] - a[1, :9]).abs().max() > 1e-3  # the check above can fail
    for bad, match in (([0, 5, 14], "end at S=17"), ([1, 5, 17], "start at 0"), ([0, 9, 5, 17], "not decrease")):
        with pytest.raises(ValueError, match=match):
            model(torch.cat(seqs)[None], cu_seqlens=bad)
    with pytest.raises(ValueError, match=r"must be \[1, S\]"):
        model(rows, cu_seqlens=[0, 9])


def test_batch_fields_round_trip(tmp_path):
    from moe_rl.rl.batch import read_batch, write_batch

    cfg = _cfg(DPPO)
    b = _batch(cfg)
    assert b.lengths.tolist() == [p + c for p, c, _, _ in SAMPLES]
    assert b.temperatures.tolist() == pytest.approx([t for _, _, t, _ in SAMPLES])
    assert b.sft.tolist() == [s for _, _, _, s in SAMPLES]
    assert all(b.advantages[i] == 0 for i in range(len(SAMPLES)) if SAMPLES[i][3])  # SFT: no baseline
    rl0 = [i for i in range(4) if not SAMPLES[i][3]]
    assert math.isclose(float(b.advantages[rl0].sum()), 0.0, abs_tol=1e-6)  # baseline over the group's RL samples
    r = read_batch(write_batch(b, tmp_path))
    for name in ("lengths", "temperatures", "sft"):
        assert torch.equal(getattr(r, name), getattr(b, name)), name
    assert torch.equal(b.sample_lengths(cfg.pad_id), b.lengths)
    from dataclasses import replace

    assert torch.equal(replace(b, lengths=None).sample_lengths(cfg.pad_id), b.lengths)  # derived from the padding
    p = b.pad_rows(4, cfg.pad_id)
    assert p.lengths[-1] == 0 and p.temperatures[-1] == 1.0 and not p.sft[-1]


# ---------------------------------------------------------------------------------- 2 gloo ranks (FSDP2)

WORLD = 2
SCENARIOS = {  # name: (samples of SAMPLES by index, trainer.batch.seq_len)
    "pack_mixed": (list(range(len(SAMPLES))), None),  # SFT + RL, per-sample temperatures, rows split over 2 ranks
    "pack_filler": ([0, 1, 2], 11),  # 3 single-sample rows for 2 ranks: rank 1 runs one no-loss filler
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_ranks):
    from moe_rl.rl.batch import build_batch
    from moe_rl.rl.buffer import RolloutGroup

    def prepare(name, folder):
        keep, seq_len = SCENARIOS[name]
        cfg = RLConfig(output_dir=folder, max_steps=1, trainer={
            "nproc_per_node": WORLD, "router_replay": True, "loss": DPPO, "batch": {"seq_len": seq_len},
            "optim": {"max_grad_norm": 1e9}})
        samples = [s for g in _samples(cfg) for s in g.samples]
        b = build_batch([RolloutGroup(0, 0, "s", [samples[i] for i in keep])], 0, pad_id=cfg.pad_id,
                        temperature=1.0)
        return cfg, _init_state(cfg), b

    return launch_one_step_scenarios(tmp_path_factory.mktemp("packing"), SCENARIOS, prepare, launch_ranks, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_packed_match_single_process(world2, scenario):
    from moe_rl.rl.packing import plan_packing

    (cfg, init, b), got = scenario_result(world2, scenario)
    ref = _reference(cfg, init, b)
    assert got["reports"][0]["loss_tokens"] == ref["loss_tokens"]
    assert_step_matches_reference(got, ref, cfg.model, scenario)
    plan = plan_packing(b.lengths.tolist(), SCENARIOS[scenario][1] or 10**9, WORLD)
    if scenario == "pack_filler":
        assert sum(mb.is_filler for r in plan.ranks for mb in r) == 1  # the filler ran and added nothing
