"""The cluster trainer entry point (``torchrun -m moe_rl.entrypoints.cluster_trainer``) equals one process.

A tiny GLM-5 (``glm_moe_dsa``: MLA + DSA indexer, 1 dense + 2 MoE layers, an MTP layer) checkpoint; the real entry
point under ``torchrun`` on 2 gloo ranks with dp_shard=2 and ep=2 borrowed from them, meta-device build + sharded
checkpoint load, AdamW moments offloaded to the host between steps, head + log-probs in chunks of 5 tokens,
micro-batches of 1 row (each rank's 2 rows in 2 forward/backward passes). It
trains two batches written in the orchestrator's format and publishes versions 1 and 2 as HF folders.

Reference: the unsharded model loaded with ``load_hf_state_dict``, the same ``train_step`` on one process, plain
AdamW, unchunked log-probs. Compared: each step's reported loss, mismatch_kl and grad_norm, and every published
tensor of version 2. Tolerances (fp32, ``tests/_tolerance.py``): the runs differ in summation order only (FSDP
reduce-scatter, EP combine, chunked log-sum-exp, micro-batch accumulation), so loss and mismatch_kl are bounded by
``train_step_bounds`` of the reference's log-probs, grad_norm by the normwise relative error ``beta`` of a decoder
chain's gradient (two paths: ``2 * depth + 2`` reductions of size ``k``, :func:`_tolerance.decoder_chain`), and each
published tensor, per tensor in the Frobenius norm, by AdamW's ``2 (lr / eps) sum_s beta ||g_s||`` plus the
rounding of each update (as in tests/trainer/test_rl_trainer_fsdp.py). AdamW runs with ``eps = lr``: a wrong shard
loaded, a lost moment after the offload, or a missing expert gradient moves a tensor by ``~ lr`` per element,
orders of magnitude above these bounds.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tolerance import C_PROB, assert_within, decoder_chain, eps, train_step_bounds

from moe_rl.rl.batch import build_batch, write_batch
from moe_rl.rl.buffer import RolloutGroup, Sample

REPO = Path(__file__).resolve().parents[2]


def _tiny_overrides() -> dict:
    from moe_rl.models import GlmMoeDsaConfig

    return GlmMoeDsaConfig.tiny_debug().model_dump(mode="json")


def cluster_config(ckpt: Path, *, max_steps: int, ep: int = 2, gpus_per_node: int = 2, **trainer) -> dict:
    """A ClusterConfig dict for a CPU run of the tiny GLM-5 checkpoint ``ckpt`` (1 trainer node of
    ``gpus_per_node`` ranks + 1 colocated engine node)."""
    t = {"num_nodes": 1, "ep": ep, "seq_len": 64, "activation_checkpointing": "none", "dtype": "float32",
         "optimizer_offload": True, "loss_chunk_tokens": 5, "micro_batch": 1,
         "optim": {"lr": 1e-3, "eps": 1e-3, "warmup_steps": 0, "max_grad_norm": 1e9}}
    t.update(trainer)
    return {
        "name": "cpu_smoke", "max_steps": max_steps, "seed": 0,
        "cluster": {"num_nodes": 2, "gpus_per_node": gpus_per_node},
        "model": {"architecture": "glm_moe_dsa", "trainer_checkpoint": str(ckpt), "inference_checkpoint": str(ckpt),
                  "config": _tiny_overrides()},
        "trainer": t,
        "inference": {"mode": "colocated", "max_model_len": 64, "engine": {"nodes_per_replica": 1}},
        "orchestrator": {"batch_size": 4, "group_size": 2, "max_inflight": 8},
        "weights": {"kind": "filesystem", "quantize_fp8": False, "dtype": "float32"},
        "task": {"tokenizer": "char"},
    }


def _routed_experts(rng: random.Random, tokens: int, routing: tuple[int, int, int]):
    """A random engine record ``[tokens, moe_layers, top_k]`` of distinct experts per slot (``routing`` = ``(moe
    layers, experts, top_k)``); the last sampled token is never forwarded by the engine: a placeholder row."""
    from moe_rl.replay import RoutedExperts

    layers, experts, top_k = routing
    ids = [[rng.sample(range(experts), top_k) for _ in range(layers)] for _ in range(tokens - 1)]
    return RoutedExperts.from_array(ids + [[[-1] * top_k] * layers], experts)


def _batches(n: int, vocab: int, seed: int = 0, routing: tuple[int, int, int] | None = None):
    """``n`` batches of 2 groups x 2 samples; with ``routing`` every sample carries a routed-experts record (router
    replay, :func:`_routed_experts`)."""
    rng = random.Random(seed)
    out = []
    for step in range(n):
        groups = []
        for g in range(2):
            prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
            samples = []
            for _ in range(2):
                k = rng.randint(2, 7)
                comp = [rng.randrange(3, vocab) for _ in range(k - 1)] + [2]
                samples.append(Sample(prompt, comp, [-rng.uniform(0.5, 3.0) for _ in range(k)], float(rng.random() < 0.5),
                                      "stop"))
                if routing is not None:
                    samples[-1].routed_experts = _routed_experts(rng, len(prompt) + k, routing)
            groups.append(RolloutGroup(step * 2 + g, step, "salt", samples, version_end=step, problem=None))
        out.append(build_batch(groups, step=step, pad_id=0))
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from moe_rl.models import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from moe_rl.models.glm_moe_dsa.state_dict import save_hf_checkpoint

    torch.manual_seed(0)
    cfg = GlmMoeDsaConfig.tiny_debug()
    model = GlmMoeDsaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("ckpt") / "glm5_tiny"
    save_hf_checkpoint(model, cfg, out)
    return out


MODEL_CLASSES = {  # model.architecture -> its causal LM class in moe_rl.models.<architecture>
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}


def family(arch: str):
    """``(module, model class)`` of ``moe_rl.models.<arch>`` (the module has the family's checkpoint functions)."""
    import importlib

    mod = importlib.import_module(f"moe_rl.models.{arch}")
    return mod, getattr(mod, MODEL_CLASSES[arch])


def reference_run(ckpt: Path, batches, cfg_dict: dict):
    """The cluster run of ``cfg_dict`` on one process: the unsharded model of ``model.architecture`` loaded from
    ``ckpt``, ``train_step`` on each batch, plus each step's error bounds and per-tensor gradient norms.

    Returns:
        ``(reports, final Hugging Face state dict)``.
    """
    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.launch.config import ClusterConfig
    from moe_rl.rl.loss import compute_loss, loss_normalizer
    from moe_rl.runtime.trainer.step import (
        StepSettings,
        TrainerState,
        make_optimizer,
        token_logprobs,
        train_step,
    )

    cfg = ClusterConfig.model_validate(cfg_dict)
    mcfg = cfg.model.model_config_obj()
    mod, model_cls = family(cfg_dict["model"]["architecture"])
    to_hf_state_dict = mod.to_hf_state_dict
    model = model_cls(mcfg)
    model.load_state_dict(mod.load_hf_state_dict(ckpt, mcfg), strict=True)
    if cfg.trainer.fp8:  # what the cluster trainer converts (FP8 linears and routed experts), same backend
        from moe_rl.fp8 import Fp8Config
        from moe_rl.moe.fp8_convert import convert_model_to_fp8

        convert_model_to_fp8(model, Fp8Config(enabled=True))
    model.train()
    opt, sched = make_optimizer(model, cfg.trainer.optim)
    settings = StepSettings(loss=cfg.trainer.loss, max_grad_norm=cfg.trainer.optim.max_grad_norm,
                            temperature=cfg.orchestrator.temperature, pad_id=0,
                            router_replay=cfg.trainer.router_replay)
    st = TrainerState(settings, model, opt, sched, ParallelDims(dp_shard=1), None, 0, 1)
    moe_layers = [layer.is_moe for layer in model.layers]
    reports = []
    for i, b in enumerate(batches):
        # the same loss once more, unchunked in one pass, for the error bounds (train_step_bounds needs the
        # log-probs' gradient) and the per-tensor gradient norms (max_grad_norm = 1e9: no clip); train_step then
        # recomputes the same gradients from zero
        replay = None
        if cfg.trainer.router_replay and b.routed_experts is not None:
            from moe_rl.replay import model_replay_ids

            replay = model_replay_ids(b.routed_experts, b.routed_experts_state, moe_layers)
        logits = model(b.input_ids, replay_ids=replay)
        lp = token_logprobs(logits, b.input_ids, settings.temperature)
        lp.retain_grad()
        out = compute_loss(settings.loss, lp, b.inference_logprobs, b.advantages, b.loss_mask, b.token_versions, i)
        # the reported mismatch_kl = mean over the loss tokens of k3 = r - log r - 1, r = exp(lp - lp_inf):
        # d mismatch_kl / d lp = (r - 1) / n on the mask; its per-tensor gradient norms bound how far it moves
        # with the weights
        mask = b.loss_mask
        r = torch.exp(torch.where(mask, lp.detach() - b.inference_logprobs, 0.0))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        kl = torch.autograd.grad(lp, [p for _, p in named], grad_outputs=torch.where(mask, r - 1, 0.0) / mask.sum().clamp(min=1),
                                 retain_graph=True, allow_unused=True)
        (out.loss_sum / loss_normalizer(settings.loss, b.loss_mask)).backward()
        k, depth = decoder_chain(mcfg, b.input_ids.numel())

        def norms(tensors: dict) -> dict[str, float]:
            full = {n: torch.zeros_like(t) for n, t in model.state_dict().items()}  # buffers: zero
            full.update(tensors)
            return {n: float(g.double().norm()) for n, g in to_hf_state_dict(full, mcfg).items()}

        extra = {"bounds": train_step_bounds(lp, logits, out, k=k, depth=2 * depth),
                 "chain_tokens": b.input_ids.numel(),
                 "grad_norms": norms({n: p.grad.detach().clone() for n, p in named if p.grad is not None}),
                 "kl_grad_norms": norms({n: g for (n, _), g in zip(named, kl, strict=True) if g is not None})}
        opt.zero_grad(set_to_none=True)
        del logits, lp, out, kl
        reports.append({**train_step(st, b, i), **extra})
    return reports, to_hf_state_dict(model.state_dict(), mcfg)


def _run_cluster_trainer(tmp_path: Path, cfg: dict, steps: int, routing: tuple[int, int, int] | None = None,
                         ) -> tuple[Path, list, subprocess.CompletedProcess]:
    """Write ``cfg`` and ``steps`` batches (with routed-experts records when ``routing`` is given, see
    :func:`_batches`) into a fresh run folder and run the real entry point under ``torchrun`` on 2 ranks; returns
    ``(run folder, batches, finished process)`` after asserting it exited 0."""
    run = tmp_path / "run"
    (run / "configs").mkdir(parents=True)
    (run / "configs" / "cluster.json").write_text(json.dumps(cfg))
    batches = _batches(steps, vocab=64, routing=routing)
    for b in batches:
        write_batch(b, run / "batches")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "moe_rl.entrypoints.cluster_trainer", "--config", str(run / "configs" / "cluster.json"),
         "--run-dir", str(run)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return run, batches, proc


@pytest.mark.multirank  # torchrun inside _run_cluster_trainer (the source scan sees only this function)
def test_cluster_trainer_two_ranks_equals_one_process(tmp_path, tiny_checkpoint):
    from moe_rl.models import GlmMoeDsaConfig
    from moe_rl.weights.announce import read_announcement
    from moe_rl.weights.filesystem import version_dir

    steps = 2
    cfg = cluster_config(tiny_checkpoint, max_steps=steps)
    run, batches, proc = _run_cluster_trainer(tmp_path, cfg, steps)
    assert_matches_reference(run, cfg, tiny_checkpoint, batches, GlmMoeDsaConfig.tiny_debug())
    for step in range(steps):
        got = json.loads((run / "trainer" / f"step_{step}.json").read_text())
        assert got["weight_transport"]["mode"] == "filesystem"
        assert got["weight_update"]["bytes"] > 0 and got["weight_update"]["blocking_s"] > 0
    vdir = version_dir(run / "weights", steps)
    # every rank wrote its own shards, no gather: the folder is read back like an engine does
    assert sorted({f.name.split("-")[0] for f in vdir.glob("*.safetensors")}) == ["rank_00000", "rank_00001"]
    assert read_announcement(run / "weights", steps)["layout"] == "sharded"


def assert_matches_reference(run: Path, cfg: dict, ckpt: Path, batches, tiny_cfg, grad_rel_err: float = 0.0) -> None:
    """The cluster run in ``run`` equals :func:`reference_run` within the module docstring's bounds: each step's loss,
    mismatch_kl and grad_norm, and every tensor of the last published version; and the weights moved.

    ``grad_rel_err``: a normwise relative gradient difference the two runs may have beyond summation order, added to
    the gradients' ``beta`` (FP8: the Wgrad operands are quantized in groups of 128 tokens along the token axis,
    and the micro-batches and ranks group other tokens than the one-process batch does)."""
    from safetensors.torch import load_file

    from moe_rl.weights.filesystem import MARKER, read_sharded, version_dir

    steps = len(batches)
    ref_reports, ref_sd = reference_run(ckpt, batches, cfg)
    f32, optim = torch.float32, cfg["trainer"]["optim"]
    k, depth = decoder_chain(tiny_cfg, max(r["chain_tokens"] for r in ref_reports), backward=True)
    beta = (2 * depth + 2) * C_PROB * k**0.5 * eps(f32)  # normwise relative error of a gradient (two paths)
    beta += grad_rel_err
    for step, ref in enumerate(ref_reports):
        got = json.loads((run / "trainer" / f"step_{step}.json").read_text())
        # weights that moved apart in the earlier steps by AdamW's 2 (lr / eps) grad_rel_err ||g|| per tensor
        # change this step's loss (mismatch_kl) by at most sum_t ||d loss / d w_t|| ||dw_t|| (first order)
        dw = {t: 2 * (optim["lr"] / optim["eps"]) * grad_rel_err * sum(r["grad_norms"][t] for r in ref_reports[:step])
              for t in ref["grad_norms"]}
        for key, sens in (("loss", "grad_norms"), ("mismatch_kl", "kl_grad_norms")):
            drift = sum(ref[sens][t] * dw[t] for t in dw)
            assert_within(torch.tensor(got[key]), torch.tensor(ref[key]),
                          ref["bounds"][key] + eps(f32) * abs(ref[key]) + drift, f"step {step} {key}")
        # | ||a|| - ||b|| | <= ||a - b|| <= beta ||g||, plus the rounding of the norm itself
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= (beta + eps(f32)) * ref["grad_norm"], (step, got, ref)
    vdir = version_dir(run / "weights", steps)
    assert (vdir / MARKER).exists()
    published = dict(read_sharded(vdir))
    assert set(published) == set(ref_sd)
    for name, v in ref_sd.items():
        dg = sum(beta * r["grad_norms"].get(name, 0.0) for r in ref_reports)  # buffers: no gradient
        rounding = 2 * steps * eps(f32) * (float(v.double().norm()) + optim["lr"] * v.numel() ** 0.5)
        err = float((published[name].double() - v.double()).norm())
        assert err <= 2 * (optim["lr"] / optim["eps"]) * dg + rounding, (name, err, dg, rounding)
    # the weights moved (a run that published the initial weights would pass the comparison above trivially)
    init = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        init.update(load_file(str(f)))
    moved = max(float((published[k].float() - init[k].float()).abs().max()) for k in init)
    assert moved > 0.5 * optim["lr"]  # AdamW (eps = lr) moves an element with gradient |g| >> lr by ~lr per step


@pytest.mark.multirank  # torchrun inside _run_cluster_trainer (the source scan sees only this function)
def test_cluster_trainer_p2p_publishes_snapshots_without_waiting_for_engines(tmp_path, tiny_checkpoint):
    """``weights.kind = "p2p"`` through the real entry point on 2 ranks: no engine is running and the trainer never
    waits for one; every version is announced as ``p2p`` with a piece index covering both ranks' pieces, the step
    reports record the trainer's blocking seconds (its snapshot), and the final version is also a sharded folder."""
    from moe_rl.weights.announce import read_announcement
    from moe_rl.weights.filesystem import read_sharded, version_dir
    from moe_rl.weights.p2p import group_path, index_path, read_index

    steps = 2
    cfg = cluster_config(tiny_checkpoint, max_steps=steps)
    cfg["weights"]["kind"] = "p2p"
    run, _, _ = _run_cluster_trainer(tmp_path, cfg, steps)
    assert len(json.loads(group_path(run / "weights").read_text())["endpoints"]) == 2
    for step in range(steps):
        got = json.loads((run / "trainer" / f"step_{step}.json").read_text())
        assert got["weight_transport"]["mode"] == "p2p"
        assert got["weight_update"]["bytes"] > 0 and got["weight_update"]["blocking_s"] > 0
        ann = read_announcement(run / "weights", step + 1)
        assert ann["source"] == "p2p" and ann["filesystem_copy"] == (step + 1 == steps)
        idx = read_index(index_path(run / "weights", step + 1), step + 1)
        assert len(idx["ranks"]) == 2 and all(idx["ranks"])
    final = dict(read_sharded(version_dir(run / "weights", steps)))
    names = {k.rsplit("@", 2)[0] for ms in idx["ranks"] for k, *_ in ms}
    assert names == set(final)


@pytest.mark.multirank  # torchrun inside _run_cluster_trainer (the source scan sees only this function)
def test_cluster_trainer_bf16_two_ranks_within_bf16_bound_of_fp32(tmp_path, tiny_checkpoint):
    """``trainer.dtype = "bfloat16"`` (the cluster default) through the real entry point: the step report records
    the start-up facts, and loss / grad_norm stay within the bf16 bound of the fp32 one-process reference:
    ``8 * 2^-8 * sqrt(depth)`` with depth = layers + 2 (3 decoder layers, embedding, head) for the loss and twice
    that for the gradient norm (see tests/trainer/test_mixed_precision.py for the derivation)."""
    import math

    steps = 1
    cfg = cluster_config(tiny_checkpoint, max_steps=steps, dtype="bfloat16")
    run, batches, proc = _run_cluster_trainer(tmp_path, cfg, steps)
    assert "'dtype': 'bfloat16'" in proc.stdout and "'experts_backend': 'grouped_mm'" in proc.stdout
    got = json.loads((run / "trainer" / "step_0.json").read_text())
    assert (got["dtype"], got["experts_backend"]) == ("bfloat16", "grouped_mm")
    frac = got["fp8_param_fraction"]
    assert frac["fp8_params"] == 0 and frac["fraction"] == 0.0 and frac["total_params"] > 0
    ref = reference_run(tiny_checkpoint, batches, {**cfg, "trainer": {**cfg["trainer"], "dtype": "float32"}})[0][0]
    depth = 3 + 2
    assert got["loss"] == pytest.approx(ref["loss"], rel=8 * 2**-8 * math.sqrt(depth))
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=8 * 2**-8 * math.sqrt(2 * depth))


def test_refuses_published_only_architecture_and_fp8_broadcast(tmp_path, tiny_checkpoint):
    from moe_rl.entrypoints.cluster_trainer import main

    cfg = cluster_config(tiny_checkpoint, max_steps=1)
    cfg["weights"].update(kind="broadcast", quantize_fp8=True)
    p = tmp_path / "cluster.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weights.kind='broadcast' with weights.quantize_fp8=true"):
        main(["--config", str(p), "--run-dir", str(tmp_path / "run")])


def test_refuses_a_run_dir_with_trainer_output(tmp_path):
    from moe_rl.entrypoints.cluster_trainer import check_fresh_trainer_dir

    check_fresh_trainer_dir(tmp_path)  # empty: fine
    (tmp_path / "batches").mkdir()
    (tmp_path / "weights" / "step_0").mkdir(parents=True)
    check_fresh_trainer_dir(tmp_path)  # batches (the orchestrator may be first) and version 0 are not output
    (tmp_path / "weights" / "step_3.tmp").mkdir()
    with pytest.raises(ValueError, match=r"already holds trainer output.*step_3.tmp.*fresh run directory"):
        check_fresh_trainer_dir(tmp_path)


def test_checkpoint_path_that_is_not_a_folder_names_the_field(tmp_path):
    from moe_rl.entrypoints.cluster_trainer import checkpoint_dir

    with pytest.raises(ValueError, match=r"model.trainer_checkpoint='/nonexistent/ckpt' is not a folder"):
        checkpoint_dir("/nonexistent/ckpt")
