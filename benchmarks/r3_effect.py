"""Measure router replay (R3): engine-vs-trainer routing agreement and mismatch_kl with and without replay.

Setup (the debug_cpu main job's numerics): the vLLM CPU engine serves the policy in **bf16** (weights and
activations) with the routing capture hook on; the trainer (``moe_rl`` ``GlmMoeForCausalLM``) recomputes the
sampled tokens' log-probs in **fp32** from the fp32 checkpoint, once with its own routing (replay off) and
once replaying the engine's recorded routing (replay on). Same samples, same seeds, so the two numbers
differ only by the routing the trainer uses.

Per sampled token (the k3 estimator ``r - log r - 1``, ``log r = logp_trainer - logp_engine``; prime-rl's
``mismatch_kl``):

- ``agreement``: fraction of (token, MoE layer) pairs whose engine top-k set equals the trainer's own;
  100% with replay by construction (checked).
- ``mismatch_kl_off`` / ``mismatch_kl_on``: mean k3 over all completion tokens.
- Isolating the routing-caused part. Tokens are split by ``D``: some position the prediction depends on
  (<= the predicting position, any MoE layer) was routed differently by the engine and by the trainer's
  own router. Routing can only matter for ``D`` tokens; for the others, replay changes nothing (their
  routing is identical either way, so their k3 is identical too -- checked). The routing-caused part of a
  run's mismatch is ``frac_D * (KL[D] - KL[not D])`` (excess of the affected tokens over the unaffected
  ones, on the same token sets in both runs); with replay it should vanish up to the difficulty difference
  of the two token sets, which ``KL_on[D] - KL_on[not D]`` measures. We also report the plain difference
  ``KL_off - KL_on``.

Usage::

    .venv/bin/python benchmarks/r3_effect.py --out /tmp/r3_offline.json [--model-dir DIR]

``benchmarks/results/r3_effect.json`` holds these runs (random 3-MoE-layer model; the debug_cpu recipe model
after SFT via ``--model-dir``) next to the main job's per-step ``mismatch_kl`` with replay off and on.

Without ``--model-dir`` the script builds the debug_cpu recipe's model shape (with 4 layers so 3 are MoE)
from a fixed seed. Several seeds/checkpoints can be given; each is one entry of the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _bench_common import commit


def _build_model(out: Path, seed: int, layers: int) -> Path:
    import torch

    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe import GlmMoeConfig, save_hf_checkpoint

    cfg = GlmMoeConfig.tiny_debug(num_hidden_layers=layers)
    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                p.normal_(0.0, 0.3)  # peaked next-token distributions, like a trained policy
            elif "experts" in name or "router" in name:
                p.normal_(0.0, 0.1)
    save_hf_checkpoint(model, cfg, out)
    return out


def _sample(model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int, seed: int, dtype: str):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import base64

    from vllm import LLM, SamplingParams

    from moe_rl.replay import TokenIndices

    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=256, enforce_eager=True, seed=seed,
              enable_prefix_caching=True, block_size=32, kv_cache_memory_bytes=64 * 2**20,
              distributed_executor_backend="uni", skip_tokenizer_init=True,
              worker_extension_cls="moe_rl.weights.engine.WeightSyncExtension")
    (info,) = llm.collective_rpc("enable_routed_experts_capture")
    sp = SamplingParams(temperature=1.0, n=n, max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    (popped,) = llm.collective_rpc("pop_routed_experts", args=([o.request_id for o in outs],))
    samples = []
    for o in outs:
        for c in o.outputs:
            entry = popped["records"][o.request_id][str(c.index)]
            rec = TokenIndices.from_bytes(base64.b64decode(entry["data"]))
            lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)]
            samples.append((list(o.prompt_token_ids), list(c.token_ids), lps, rec))
    llm.llm_engine.engine_core.shutdown()
    return samples, info


def _trainer_pass(model, moe_layers, seq, replay_rows):
    """fp32 logprobs of seq[1:] and the trainer's own top-k sets per MoE layer ([S, M, K], sorted)."""
    import torch

    own = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if layer.is_moe:
            hooks.append(layer.mlp.router.register_forward_hook(
                lambda m, a, o, i=i: own.__setitem__(i, o[0].detach())))
    replay = None
    if replay_rows is not None:
        rows = torch.from_numpy(replay_rows).long()[None]  # [1, S, M, K]
        replay, j = [], 0
        for is_moe in moe_layers:
            replay.append(rows[:, :, j] if is_moe else None)
            j += int(is_moe)
    with torch.no_grad():
        logits = model(torch.tensor([seq]), replay_ids=replay)
    for h in hooks:
        h.remove()
    lp = logits.float().log_softmax(-1)[0, :-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    own_ids = np.stack([own[i].numpy() for i in sorted(own)], axis=1)
    return lp.numpy().astype(np.float64), np.sort(own_ids, axis=-1)


def measure(model_dir: Path, seed: int, num_prompts: int, n: int, max_tokens: int, engine_dtype: str) -> dict:
    import torch

    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe import GlmMoeConfig, load_hf_state_dict

    cfg = GlmMoeConfig.from_hf_config_dict(json.loads((model_dir / "config.json").read_text()))
    rng = np.random.default_rng(seed)
    prompts = [[cfg.bos_token_id] + rng.integers(3, cfg.vocab_size, size=int(rng.integers(12, 40))).tolist()
               for _ in range(num_prompts)]
    t0 = time.perf_counter()
    samples, info = _sample(model_dir, prompts, n, max_tokens, seed, engine_dtype)
    sample_s = time.perf_counter() - t0

    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg)
    model.load_state_dict({k: v.float() for k, v in load_hf_state_dict(model_dir).items()}, strict=True)
    model.eval()
    moe_layers = [layer.is_moe for layer in model.layers]
    assert info["layer_ids"] == [i for i, m in enumerate(moe_layers) if m], info

    k3_off, k3_on, dmask, seq_index, pair_agree, pair_total, on_agree = [], [], [], [], 0, 0, True
    for prompt, completion, eng_lp, rec in samples:
        seq = prompt + completion
        rows = rec.to_numpy(np.int64)  # [S-1, M, K]
        assert rows.shape[0] == len(seq) - 1 and rec.num_placeholder_rows == 0
        full = np.concatenate([rows, np.full((1, *rows.shape[1:]), -1)], axis=0)  # last token: placeholder
        lp_off, own = _trainer_pass(model, moe_layers, seq, None)
        lp_on, own_on = _trainer_pass(model, moe_layers, seq, full)
        eng_sets = np.sort(rows, axis=-1)
        agree_tok = (eng_sets == own[:-1]).all(axis=-1)  # [S-1, M]
        pair_agree += int(agree_tok.sum())
        pair_total += int(agree_tok.size)
        # The token at position p+1 is predicted from positions 0..p: affected if any of them disagreed.
        bad_pos = ~agree_tok.all(axis=1)
        affected = np.cumsum(bad_pos) > 0  # index p: some position <= p disagreed
        p0 = len(prompt) - 1  # predicting positions of the completion tokens: p0 .. p0 + c - 1
        c = len(completion)
        eng = np.asarray(eng_lp, dtype=np.float64)
        for lp, out in ((lp_off, k3_off), (lp_on, k3_on)):
            log_r = lp[p0 : p0 + c] - eng
            out.append(np.exp(log_r) - log_r - 1)
        dmask.append(affected[p0 : p0 + c])
        seq_index.append(np.full(c, len(seq_index)))
        on_agree &= bool(np.array_equal(np.sort(full[:-1], -1), own_on[:-1]))  # replay: 100% by construction
    k_off, k_on, d = np.concatenate(k3_off), np.concatenate(k3_on), np.concatenate(dmask)
    frac_d = float(d.mean())

    def part(k):
        if d.all() or not d.any():
            return None
        return frac_d * float(k[d].mean() - k[~d].mean())

    routing_off, routing_on = part(k_off), part(k_on)
    # 95% bootstrap interval of the replay-on routing part, resampling whole sequences.
    seq_of = np.concatenate(seq_index)
    groups = [np.flatnonzero(seq_of == i) for i in range(len(samples))]
    boot_rng = np.random.default_rng(1234)
    boot = []
    for _ in range(400):
        idx = np.concatenate([groups[i] for i in boot_rng.integers(0, len(groups), size=len(groups))])
        kb, db = k_on[idx], d[idx]
        if db.any() and not db.all():
            boot.append(float(db.mean() * (kb[db].mean() - kb[~db].mean())))
    lo, hi = (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))) if boot else (None, None)
    bound = max(abs(lo), abs(hi)) if boot else None
    return {
        "model_dir": str(model_dir),
        "seed": seed,
        "engine_dtype": engine_dtype,
        "trainer_dtype": "float32",
        "moe_layers": int(sum(moe_layers)),
        "num_experts": cfg.n_routed_experts,
        "top_k": cfg.num_experts_per_tok,
        "sequences": len(samples),
        "completion_tokens": int(k_off.size),
        "routing_agreement_off": pair_agree / max(1, pair_total),
        "routing_agreement_on": 1.0 if on_agree else None,
        "tokens_affected_frac": frac_d,
        "mismatch_kl_off": float(k_off.mean()),
        "mismatch_kl_on": float(k_on.mean()),
        "mismatch_kl_ratio_off_over_on": float(k_off.mean() / max(k_on.mean(), 1e-30)),
        "mismatch_kl_off_affected": float(k_off[d].mean()) if d.any() else None,
        "mismatch_kl_off_unaffected": float(k_off[~d].mean()) if (~d).any() else None,
        "mismatch_kl_on_affected": float(k_on[d].mean()) if d.any() else None,
        "mismatch_kl_on_unaffected": float(k_on[~d].mean()) if (~d).any() else None,
        "unaffected_tokens_max_abs_k3_diff": float(np.abs(k_off[~d] - k_on[~d]).max()) if (~d).any() else None,
        "routing_part_off": routing_off,
        "routing_part_on": routing_on,
        "routing_part_on_ci95": [lo, hi],
        "routing_part_cut_lower_bound": (routing_off / bound) if routing_off and bound else None,
        "kl_reduction_off_minus_on": float(k_off.mean() - k_on.mean()),
        "sample_s": sample_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, action="append", default=[])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--engine-dtype", default="bfloat16")
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [(d, 0) for d in args.model_dir] or [
            (_build_model(Path(tmp) / f"seed{s}", s, args.layers), s) for s in args.seeds
        ]
        for d, s in dirs:
            for seed in ([s] if not args.model_dir else args.seeds):
                r = measure(d, seed, args.prompts, args.n, args.max_tokens, args.engine_dtype)
                print(json.dumps(r), flush=True)
                runs.append(r)
    import torch
    import vllm

    out = {
        "what": "router replay (R3): engine (vLLM CPU, bf16) vs trainer (fp32) routing agreement and mismatch_kl",
        "provenance": {"commit": commit(), "machine": platform.platform(), "python": sys.version.split()[0],
                       "torch": torch.__version__, "vllm": vllm.__version__,
                       "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])])},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
