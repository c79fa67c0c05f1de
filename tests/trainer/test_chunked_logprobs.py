"""The chunked LM head + log-probs (``moe_rl.models.common.head``, ``trainer.loss_chunk_tokens``) equals the
full-logits path.

* :func:`chunked_label_logprobs` vs a float64 reference (values, ``dh``, ``dW``) for chunk sizes that divide N, do not
  divide it, 1 and > N, at temperature 1 and 0.7; bf16 inputs vs the unchunked bf16 path (same order of operations:
  bf16 matmul, then fp32);
* each model's ``token_logprobs`` (chunked and ``chunk_tokens=None``) vs ``step.token_logprobs(model(ids), ids)``:
  forward and every parameter gradient (tied and untied head, router replay / positions passed through);
* the trainer: ``train_step`` with ``loss_chunk_tokens`` on one process and on 2 gloo ranks under FSDP2
  (``parallelize_model`` via ``build_trainer``; activation checkpointing + tied embedding, and cp=2 ring) vs a
  single-process fp32 reference on full logits (reported loss, every gradient, parameters after 2 AdamW steps);
* ``GlmMoeDsaForCausalLM.token_logprobs`` under ``parallelize_model`` (2 ranks, FSDP2 + EP 2 + activation
  checkpointing) vs the single-process full-logits path (log-probs, every gradient);
* bad arguments raise ``TypeError`` / ``ValueError`` naming the argument.

Tolerances (``tests/_tolerance.py``). Head functions: every path vs the float64 result of the same inputs, per
element, with ``label_logprob_bounds`` (the rounding of the ``D``-term logits, the ``V``-term log-sum-exp and the
``V``- / ``N``-term gradient GEMMs in fp32; for bf16 also the bf16 rounding of the logits, of ``d logits`` and of each
chunk's partial product): the chunked and unchunked bf16 paths run GEMMs of other shapes, so their bf16 logits may
round differently and neither is compared bit for bit with the other. A wrong softmax term, a missing
1/temperature or a dropped chunk is O(|value|). Models: both paths vs the float64 model, per-tensor normwise chain
bound (``decoder_chain``). Trainer (fp32): ``assert_train_run_close`` (normwise gradients, log-prob error propagated
to the loss, AdamW with ``eps = lr`` to the parameters).

Runtime on the shared 2-core machine: ~30 s (2 ranks x 3 scenarios, references, unit cases).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _ranks import scenario_result
from _reference_trainer import write_run_inputs
from _rollout_groups import random_groups
from _tolerance import (
    assert_normwise_close,
    assert_train_run_close,
    assert_within,
    decoder_chain,
    label_logprob_bounds,
    logprob_error,
    train_step_bounds,
)

from moe_rl.models.common.head import chunked_label_logprobs, head_label_logprobs

N, D, V = 48, 32, 96


def _inputs(dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * (2.0 / D**0.5)  # logits ~ N(0, 4): a peaked, non-trivial softmax
    labels = torch.randint(0, V, (N,), generator=g)
    grad = torch.randn(N, generator=g)
    return h.to(dtype), w.to(dtype), labels, grad


def _reference64(h, w, labels, grad, temperature):
    """float64 ``log_softmax(h w^T / T)[labels]`` and its gradients w.r.t. h and w for the upstream ``grad``."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    lp = F.log_softmax(h64 @ w64.T / temperature, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    dh, dw = torch.autograd.grad(lp, (h64, w64), grad.double())
    return lp.detach(), dh, dw


def _run(fn, h, w, labels, grad):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(h, w, labels)
    dh, dw = torch.autograd.grad(out, (h, w), grad)
    return out.detach(), dh, dw


# ------------------------------------------------------------------------------------------- functional core


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])  # 7 does not divide N=48; 1000 > N: one chunk
def test_matches_float64_reference(chunk, temperature):
    h, w, labels, grad = _inputs()
    ref, ref_dh, ref_dw = _reference64(h, w, labels, grad, temperature)
    out, dh, dw = _run(lambda a, b, lab: chunked_label_logprobs(a, b, lab, temperature, chunk), h, w, labels, grad)
    assert out.dtype == torch.float32 and out.shape == (N,)
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    assert ref.abs().max() > 1.0 and ref_dw.abs().max() > 0.5  # not a degenerate (uniform) softmax
    b_lp, b_dh, b_dw = label_logprob_bounds(h, w, labels, grad, temperature)
    assert_within(out, ref, b_lp, "lp")
    assert_within(dh, ref_dh, b_dh, "dh")
    assert_within(dw, ref_dw, b_dw, "dW")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_bf16_matches_unchunked_bf16_path(chunk, temperature):
    h, w, labels, grad = _inputs(torch.bfloat16, seed=1)

    def unchunked(a, b, lab):  # today's trainer: lm_head(h).float(), then step.token_logprobs' log-softmax
        from moe_rl.runtime.trainer.step import _label_logprobs

        return _label_logprobs(F.linear(a, b).float(), lab, temperature)

    u, u_dh, u_dw = _run(unchunked, h, w, labels, grad)
    c, c_dh, c_dw = _run(lambda a, b, lab: chunked_label_logprobs(a, b, lab, temperature, chunk), h, w, labels, grad)
    assert c.dtype == torch.float32 and c_dh.dtype == torch.bfloat16 and c_dw.dtype == torch.bfloat16
    # both paths vs the float64 result of the same bf16 inputs (bf16 logits, d logits and gradients, fp32 softmax)
    ref = _reference64(h, w, labels, grad.float(), temperature)
    bounds = label_logprob_bounds(h, w, labels, grad.float(), temperature, logits_dtype=torch.bfloat16,
                                  grad_dtype=torch.bfloat16)
    for name, got in (("chunked", (c, c_dh, c_dw)), ("unchunked", (u, u_dh, u_dw))):
        for what, x, r, b in zip(("lp", "dh", "dW"), got, ref, bounds, strict=True):
            assert_within(x, r, b, f"{name} {what}")


def test_head_label_logprobs_none_is_the_full_logits_path():
    h, w, labels, _ = _inputs()
    h3, lab2 = h.view(4, 12, D), labels.view(4, 12)
    full = F.log_softmax(F.linear(h3, w).float() / 0.9, dim=-1).gather(-1, lab2[..., None]).squeeze(-1)
    assert torch.equal(head_label_logprobs(h3, w, lab2, 0.9, None), full)  # bit-for-bit: the same ops, same shapes
    ref = _reference64(h, w, labels, torch.zeros(N), 0.9)[0].view(4, 12)
    b_lp = label_logprob_bounds(h, w, labels, torch.zeros(N), 0.9)[0].view(4, 12)
    assert_within(head_label_logprobs(h3, w, lab2, 0.9, 5), ref, b_lp, "chunked")  # other GEMM shapes: bound
    assert_within(full, ref, b_lp, "full")


def test_weight_without_grad_and_empty_input():
    h, w, labels, grad = _inputs()
    hh = h.clone().requires_grad_()
    out = chunked_label_logprobs(hh, w, labels, 1.0, 5)  # frozen head: only dh
    (dh,) = torch.autograd.grad(out, (hh,), grad)
    assert_within(dh, _reference64(h, w, labels, grad, 1.0)[1], label_logprob_bounds(h, w, labels, grad, 1.0)[1], "dh")
    e = chunked_label_logprobs(h[:0].requires_grad_(), w, labels[:0], 1.0, 4)
    assert e.shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"temperature": 0.0}, ValueError, r"temperature=0.0 must be a finite number > 0"),
        ({"temperature": math.nan}, ValueError, r"temperature=nan must be a finite number > 0"),
        ({"temperature": True}, TypeError, r"temperature=True must be a float"),
        ({"chunk_tokens": 0}, ValueError, r"chunk_tokens=0 must be >= 1"),
        ({"chunk_tokens": 2.5}, TypeError, r"chunk_tokens=2.5 must be an int >= 1"),
        ({"chunk_tokens": True}, TypeError, r"chunk_tokens=True must be an int"),
        ({"hidden": torch.zeros(2, N, D)}, ValueError, r"hidden must be \[N, D\] and weight \[V, D\]"),
        ({"weight": torch.zeros(V, D + 1)}, ValueError, r"hidden has D=32 but weight \(96, 33\) has D=33"),
        ({"weight": torch.zeros(V, D, dtype=torch.bfloat16)}, ValueError, r"same floating dtype"),
        ({"labels": torch.zeros(N, dtype=torch.int32)}, ValueError, r"labels must be \[N\] = \[48\] int64"),
        ({"labels": torch.zeros(N - 1, dtype=torch.int64)}, ValueError, r"labels must be \[N\] = \[48\] int64"),
        ({"labels": [0] * N}, TypeError, r"labels must be a torch.Tensor"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    h, w, labels, _ = _inputs()
    args = {"hidden": h, "weight": w, "labels": labels, "temperature": 1.0, "chunk_tokens": 8, **kwargs}
    with pytest.raises(exc, match=match):
        chunked_label_logprobs(**args)


def test_bad_label_shape_and_config():
    from pydantic import ValidationError

    from moe_rl.runtime.trainer.config import TrainerConfig

    h, w, labels, _ = _inputs()
    with pytest.raises(ValueError, match=r"labels must be \[B, S\] = \(4, 12\) like input_ids, got \(48,\)"):
        head_label_logprobs(h.view(4, 12, D), w, labels, 1.0, 4)
    with pytest.raises(ValueError, match=r"temperature=-1.0 must be a finite number > 0"):
        head_label_logprobs(h.view(4, 12, D), w, labels.view(4, 12), -1.0, None)
    with pytest.raises(ValidationError, match=r"loss_chunk_tokens"):
        TrainerConfig(loss_chunk_tokens=0)
    assert TrainerConfig().loss_chunk_tokens is None and TrainerConfig(loss_chunk_tokens=64).loss_chunk_tokens == 64


# ------------------------------------------------------------------------------------------------- models


def _model(kind: str):
    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
    from moe_rl.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    if kind == "glm4_moe_tied":
        return GlmMoeForCausalLM(GlmMoeConfig.tiny_debug(tie_word_embeddings=True))
    if kind == "glm4_moe":
        return GlmMoeForCausalLM(GlmMoeConfig.tiny_debug())
    return GlmMoeDsaForCausalLM(GlmMoeDsaConfig.tiny_debug())


@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_tied", "glm_moe_dsa"])
def test_model_token_logprobs_matches_full_logits(kind):
    """fp32 ``model.token_logprobs`` (chunks of None, 1 and 5 tokens) vs ``token_logprobs(model(ids), ids)`` (today's
    trainer path), each vs the float64 model (the x20 head gives O(1) logits and gradients up to ~250): log-probs
    per element within ``logprob_error`` of the forward chain, every gradient within the per-tensor normwise bound
    of the forward + backward chain (``tests/_tolerance.py``). A wrong head gradient (missing 1/T, a dropped
    chunk, the tie not summed) is O(1) relative."""
    import copy

    from moe_rl.runtime.trainer.step import token_logprobs

    model = _model(kind)
    with torch.no_grad():  # O(1) logits so the log-softmax is not near-uniform
        model.lm_head.weight.mul_(20.0)
    model64 = copy.deepcopy(model).double()
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # last column: any valid id
    upstream = torch.randn(2, 8, generator=g)
    kw = {}
    if kind == "glm4_moe":  # replay and explicit positions reach hidden_states unchanged
        scores = torch.rand(2, 9, cfg.num_hidden_layers, cfg.n_routed_experts, generator=g)
        kw["replay_ids"] = scores.argsort(dim=-1)[..., : cfg.num_experts_per_tok]  # K distinct experts per token
        kw["positions"] = torch.arange(9)
    names = [n for n, p in model.named_parameters()]
    params, params64 = list(model.parameters()), list(model64.parameters())

    logits64 = model64(ids, **kw)
    ref64 = token_logprobs(logits64, ids, 0.8)
    ref64_g = torch.autograd.grad((ref64 * upstream.double()).sum(), params64, allow_unused=True)
    ref = token_logprobs(model(ids, **kw), ids, 0.8)  # [2, 8]
    ref_g = torch.autograd.grad((ref * upstream).sum(), params, allow_unused=True)
    assert ref.min() < -1.0
    k, depth = decoder_chain(cfg, ids.numel())
    lp_bound = logprob_error(logits64 / 0.8, k=k, depth=depth + 1)  # + the division by the temperature
    k_b, depth_b = decoder_chain(cfg, ids.numel(), backward=True)
    for chunk in (None, 1, 5):
        got = model.token_logprobs(ids, labels, temperature=0.8, chunk_tokens=chunk, **kw)
        assert got.shape == (2, 9) and got.dtype == torch.float32
        got_g = torch.autograd.grad((got[:, :-1] * upstream).sum(), params, allow_unused=True)
        if chunk is None:  # the same ops on the same shapes as forward + log-softmax: bit-for-bit
            assert torch.equal(got[:, :-1], ref)
        assert_within(got[:, :-1], ref64, lp_bound, f"chunk {chunk} log-probs")
        for n, a, b, c in zip(names, got_g, ref_g, ref64_g, strict=True):
            assert (a is None) == (b is None) == (c is None), n
            if a is not None:
                assert_normwise_close(a, c, dtype=torch.float32, k=k_b, depth=depth_b, what=f"chunk {chunk} {n}")
    assert_within(ref, ref64, lp_bound, "full-logits log-probs")
    for n, b, c in zip(names, ref_g, ref64_g, strict=True):
        if b is not None:
            assert_normwise_close(b, c, dtype=torch.float32, k=k_b, depth=depth_b, what=f"full logits {n}")
    assert model.lm_head.weight.grad is None  # autograd.grad: nothing accumulated


def test_model_token_logprobs_refuses_a_non_linear_head():
    model = _model("glm4_moe")
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    ids = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"token_logprobs needs lm_head to be a bias-free nn.Linear"):
        model.token_logprobs(ids, ids, chunk_tokens=2)


# ----------------------------------------------------------------------------------- trainer: 1 and 2 ranks

WORLD = 2
SCENARIOS = {  # name: (trainer overrides, model overrides)
    "fsdp2_ac_tied_chunk5": ({"loss_chunk_tokens": 5, "parallel": {"activation_checkpointing": True}},
                             {"tie_word_embeddings": True}),
    "cp2_ring_chunk3": ({"loss_chunk_tokens": 3, "parallel": {"dp_shard": 1, "cp": 2, "cp_method": "ring"}}, {}),
}
LENGTHS = [(4, 3), (6, 5), (5, 2), (4, 1), (7, 4), (5, 5), (4, 2), (6, 3)]  # (prompt, completion): L = 11
DSA = "dsa_fsdp2_ep2_ac_chunk3"  # GlmMoeDsaForCausalLM.token_logprobs under parallelize_model


def _groups(step: int, vocab: int):
    return random_groups(np.random.default_rng(700 + step), LENGTHS, vocab)


def _init_model(cfg):
    from moe_rl.models import GlmMoeForCausalLM

    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg.model)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # O(1) logits (a tied head scales the embedding too: fine)
    return model


def _prepare(d, nproc: int, trainer: dict, model: dict):
    from moe_rl.rl.batch import build_batch
    from moe_rl.runtime.config import RLConfig

    kw = {"output_dir": d, "max_steps": 2, "orchestrator": {"batch_size": 8, "group_size": 4},
          "trainer": {"nproc_per_node": nproc, "optim": {"lr": 1e-3, "eps": 1e-3, "warmup_steps": 0}, **trainer}}
    cfg = RLConfig(**kw)
    if model:  # the default tiny model with overrides
        cfg = RLConfig(**kw, model={**cfg.model.model_dump(), **model})
    d.mkdir(parents=True)
    init = _init_model(cfg).state_dict()
    batches = [build_batch(_groups(s, cfg.model.vocab_size), s, pad_id=cfg.pad_id) for s in range(2)]
    write_run_inputs(cfg, init, batches)
    return cfg, batches


def _reference(cfg, batches):
    """Single process, full fp32 logits (today's path): per step (loss, gradients after the clip), final params."""
    from moe_rl.models.glm4_moe import load_hf_state_dict
    from moe_rl.rl.loss import compute_loss, loss_normalizer
    from moe_rl.runtime.trainer.step import token_logprobs

    model = _init_model(cfg)
    model.load_state_dict(load_hf_state_dict(cfg.output_dir / "weights" / "step_0"))
    o, lcfg = cfg.trainer.optim, cfg.trainer.loss
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    steps = []
    for step, b in enumerate(batches):
        logits = model(b.input_ids)
        lp = token_logprobs(logits, b.input_ids, cfg.orchestrator.temperature)
        lp.retain_grad()
        out = compute_loss(lcfg, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, step)
        (out.loss_sum / loss_normalizer(lcfg, b.loss_mask)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        k, depth = decoder_chain(cfg.model, b.input_ids.numel())
        steps.append({"loss": out.loss_sum.item() / loss_normalizer(lcfg, b.loss_mask), "grad_norm": grad_norm.item(),
                      "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                      "bounds": train_step_bounds(lp, logits, out, k=k, depth=2 * depth),
                      "chain_tokens": b.input_ids.numel()})
        opt.step()
        opt.zero_grad()
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(cfg, reports, grads, params, ref_steps, ref_params):
    k, depth = decoder_chain(cfg.model, max(r["chain_tokens"] for r in ref_steps), backward=True)
    o = cfg.trainer.optim
    assert_train_run_close(reports, grads, params, ref_steps, ref_params, k=k, depth=2 * depth + 2, lr=o.lr,
                           adam_eps=o.eps, smooth={"loss": "loss"})


def test_single_process_train_step_with_chunks_matches_full_logits(tmp_path):
    from moe_rl.runtime.trainer.step import build_trainer, train_step

    cfg, batches = _prepare(tmp_path / "one", 1, {"loss_chunk_tokens": 7}, {})
    st = build_trainer(cfg, tmp_path / "one" / "weights" / "step_0")
    assert st.settings.loss_chunk_tokens == 7 and st.mesh is None
    grads = []
    st.opt.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.clone() for n, p in st.model.named_parameters()}))
    reports = [train_step(st, b, s) for s, b in enumerate(batches)]
    ref_steps, ref_params = _reference(cfg, batches)
    _compare(cfg, reports, grads, {k: v.detach() for k, v in st.model.state_dict().items()}, ref_steps, ref_params)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_ranks):
    from pathlib import Path

    root = tmp_path_factory.mktemp("chunked2")
    prepared = {name: _prepare(root / name, WORLD, t, m) for name, (t, m) in SCENARIOS.items()}
    (root / DSA).mkdir()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (4, 10), generator=g)  # tiny_debug vocabulary: 64
    upstream = torch.randn(4, 10, generator=g)
    upstream[:, -1] = 0.0  # the last column has no next token (its label is a placeholder)
    torch.save({"ids": ids, "labels": torch.cat([ids[:, 1:], ids[:, :1]], dim=1), "upstream": upstream,
                "temperature": 0.8, "chunk": 3}, root / DSA / "inputs.pt")
    results = launch_ranks(Path(__file__).with_name("_chunked_logprobs_worker.py"), WORLD, root, 300)
    print("\nseconds:", results[0]["_seconds"])
    return root, prepared, results


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fsdp2_train_step_with_chunks_matches_single_process(world2, scenario):
    (cfg, batches), got = scenario_result(world2, scenario)
    assert cfg.trainer.loss_chunk_tokens is not None
    ref_steps, ref_params = _reference(cfg, batches)
    _compare(cfg, got["reports"], got["grads"], got["params"], ref_steps, ref_params)


def test_dsa_token_logprobs_under_fsdp2_ep_matches_single_process(world2, check_scenario):
    """The DSA model's registered ``token_logprobs`` under FSDP2 + EP 2 + activation checkpointing (2 ranks, one
    row block each) vs the single-process full-logits path on all rows: log-probs and every gradient (two fp32
    paths, summation order only: ``logprob_error`` and the per-tensor normwise chain bound, each doubled)."""
    from moe_rl.runtime.trainer.step import token_logprobs

    root, _, results = world2
    check_scenario(results, DSA)
    inp = torch.load(root / DSA / "inputs.pt", weights_only=True)
    got = torch.load(root / DSA / "result.pt", weights_only=True)
    model = _model("glm_moe_dsa")
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    ids = inp["ids"]
    logits = model(ids)
    ref = token_logprobs(logits, ids, inp["temperature"])  # [4, 9]
    (ref * inp["upstream"][:, :-1]).sum().backward()
    k, depth = decoder_chain(model.config, ids.numel())
    assert_within(got["lp"][:, :-1], ref, logprob_error(logits / inp["temperature"], k=k, depth=2 * depth + 2), "lp")
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got["grads"]) == set(ref_grads), sorted(set(got["grads"]) ^ set(ref_grads))
    gmax = max(g.abs().max().item() for g in ref_grads.values())
    assert gmax > 10.0  # the x20 head: large gradients
    k, depth = decoder_chain(model.config, ids.numel(), backward=True)
    for n, g in ref_grads.items():
        assert_normwise_close(got["grads"][n], g, dtype=torch.float32, k=k, depth=2 * depth + 1, what=n)
