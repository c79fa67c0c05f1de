"""FP8-vs-BF16 training validation on the debug model (the DeepSeek-V3 bar: relative loss error < 0.25%).

DeepSeek-V3 (arXiv 2412.19437, §3.3 and Appendix B.1) validated its FP8 recipe by training the same model on
the same data in BF16 and in FP8 and comparing the loss curves: the relative error stayed below 0.25%. This
module does the same at toy scale: the tiny GLM-MoE debug model (``GlmMoeConfig.tiny_debug()``: hidden 128,
intermediate 256, experts of width 64, so every FP8 GEMM has partial 128-blocks) trained with teacher forcing
on 2-digit addition (``moe_rl.runtime.trainer.sft``'s batches, AdamW, warm-up, clip 1.0), three times from the same
initial weights on the same batches:

* ``fp32``: everything fp32 (context: how far BF16 itself is from full precision);
* ``bf16``: fp32 master weights, forward/backward under ``torch.autocast(bfloat16)`` (the BF16 baseline);
* ``fp8``: the ``bf16`` run with every linear except router/lm_head and the routed experts converted by
  :func:`moe_rl.moe.convert_model_to_fp8` (GEMMs in FP8 block scaling, fp32 accumulation, torch backend).

Metrics (:func:`_pair_stats`, each pair "A vs B" relative to B, signed so that positive means A has the higher
loss): ``window_signed`` = ``(mean(L_A) - mean(L_B)) / mean(L_B)`` over the last ``window`` steps (the loss
level), ``curve_signed`` = the mean over all steps of the paired per-step ``(L_A,t - L_B,t) / L_B,t`` (the whole
curve; same batches at every step), plus magnitudes and per-step median/max. The pair ``fp8_vs_bf16`` is the
measurement; ``bf16_vs_fp32`` is its noise floor: BF16 is known to be fine, so whatever BF16-vs-FP32 shows is
what rounding differences alone do to this comparison, and an FP8 figure below it says nothing about FP8.

Regimes (``REGIMES``, ``--regime``):

* ``high-lr`` (the first measurement; SFT recipe: lr 1e-3, batch 64, warm-up 50, 200 steps, window 50):
  the run crosses a sharp drop of the loss (around loss ~1.7, where the model learns the structure of the
  task) and then trains on a noisy plateau; the step at which a run crosses it moves by a few steps with any
  rounding change (the top-k routing is discrete, so a tiny change flips expert choices and the runs
  separate). From there the curves of any two precisions differ by trajectory noise of 0.2-2%, of either
  sign: BF16 vs FP32 differs as much as FP8 vs BF16 (4 seeds, 2026-11-29 files
  ``fp8_vs_bf16_training_seed{0,1,2,3}_*.json``). The 0.25% bar cannot be judged there at this scale.
  Lowering the lr to 3e-4 at batch 128 does not change this: over 200 steps (file
  ``fp8_vs_bf16_training_lr3e-4-200steps_seeds0-1-2-3_*.json``) BF16 vs FP32 differs by -0.57 / -1.43 /
  +0.47 / +0.32% (last-50-step window, seeds 0-3), and around the drop FP8 vs BF16 is +1.7% in seed 0 but
  -1.8% in seed 1 (10-step means).
* ``controlled`` (default: lr 3e-4, batch 128, warm-up 20, 40 steps, window 10): the descent before that
  drop (loss 3.45 -> ~1.9), where the trajectories stay together: the noise floor BF16 vs FP32 is a few
  hundredths of a percent, an order of magnitude below the bar, so the FP8 figure measures FP8's effect on
  the loss curve and not chaos. This is what the DeepSeek-V3 bar means (FP8 does not move the loss curve of
  the same run by more than 0.25%); it is judged per seed (every seed's window and curve within the bar) and
  on the seed-averaged window (``summarize_seeds``).

Results (2026-11-29, CPU, 1 thread): ``controlled``, seeds 0-3: FP8 vs BF16 window +0.157 / +0.079 / +0.058 /
+0.029% (mean +0.081%), curve +0.060 / +0.090 / +0.075 / +0.008% (mean +0.058%); noise floor BF16 vs FP32
window max 0.014%, curve max 0.005%: the bar holds in every seed, with a small FP8 offset of consistent sign
(FP8 loss slightly higher). The same lr over 200 steps: FP8 vs BF16 window +0.50 / +0.12 / +0.40 / +0.33%
(mean +0.34%, every seed positive) against a noise floor of 0.32-1.43% (either sign): above the bar, but
inside the noise, so a plateau offset of this size can be neither confirmed nor excluded at this scale.

Run: ``python -m moe_rl.runtime.fp8_validate --seeds 0 1 2 3 --out benchmarks/results`` (the ``controlled`` regime)
writes ``fp8_vs_bf16_training_controlled_seeds0-1-2-3_<date>.json`` (summary, per-seed losses, provenance).
``--regime high-lr --seed S`` reproduces the first measurement's single-seed file
``fp8_vs_bf16_training_seed<S>_<date>.json``; other flags override single hyper-parameters of the preset
(file tag ``<regime>-custom`` unless ``--tag`` names it). ``--rl-runs BASE_DIR FP8_DIR`` instead summarises
the mismatch_kl of two finished ``moe-rl rl`` runs into ``fp8_rl_mismatch_kl_<date>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["REGIMES", "compare_rl_runs", "compare_training", "summarize_seeds", "train_losses"]

MODES = ("fp32", "bf16", "fp8")

#: Hyper-parameter presets (module docstring, "Regimes").
REGIMES: dict[str, dict[str, Any]] = {
    "high-lr": {"steps": 200, "window": 50, "batch_size": 64, "lr": 1e-3, "warmup_steps": 50},
    "controlled": {"steps": 40, "window": 10, "batch_size": 128, "lr": 3e-4, "warmup_steps": 20},
}


def train_losses(mode: str, *, steps: int, seed: int = 0, batch_size: int = 64, lr: float = 1e-3,
                 warmup_steps: int = 50, init_state: dict | None = None) -> list[float]:
    """Train the debug model for ``steps`` steps in ``mode`` and return the per-step training loss.

    Args:
        mode: ``"fp32"`` | ``"bf16"`` | ``"fp8"`` (module docstring).
        steps: optimizer steps.
        seed: seeds the initial weights (unless ``init_state``) and the batch sampler.
        batch_size, lr, warmup_steps: SFT hyper-parameters (``moe_rl.runtime.trainer.config.SftConfig`` defaults).
        init_state: state dict to start from (so all modes share one initialisation).

    Returns:
        ``steps`` float losses (token-mean cross entropy on the answer tokens, nats).

    Raises:
        ValueError: unknown ``mode``.
    """
    from moe_rl.envs.addition import AdditionTask, AdditionTaskConfig
    from moe_rl.envs.tokenizer import CharTokenizer
    from moe_rl.fp8 import Fp8Config
    from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM
    from moe_rl.moe.fp8_convert import convert_model_to_fp8
    from moe_rl.runtime.trainer.sft import _sft_batch, sft_optimizer, sft_step

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {MODES}")
    from moe_rl.runtime.config import RLConfig

    alphabet = RLConfig.model_fields["alphabet"].default
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer(alphabet))
    torch.manual_seed(seed)
    model = GlmMoeForCausalLM(GlmMoeConfig.tiny_debug())
    if init_state is not None:
        model.load_state_dict(init_state)
    if mode == "fp8":
        convert_model_to_fp8(model, Fp8Config(enabled=True, backend="torch"))
    rng = random.Random(seed)
    opt, sched = sft_optimizer(model, lr, warmup_steps)
    losses = []
    model.train()
    for _ in range(steps):
        ids, mask = _sft_batch(task, rng, batch_size)
        losses.append(sft_step(model, opt, sched, ids, mask, bf16_autocast=mode != "fp32").item())
    return losses


def _window_rel(a: list[float], b: list[float], window: int) -> float:
    """Signed ``(mean(a[-window:]) - mean(b[-window:])) / mean(b[-window:])`` (positive: ``a`` has the higher loss)."""
    ma, mb = statistics.fmean(a[-window:]), statistics.fmean(b[-window:])
    return (ma - mb) / mb


def _pair_stats(a: list[float], b: list[float], window: int) -> dict[str, float]:
    """Relative differences of loss curve ``a`` against reference curve ``b`` (same steps, same batches).

    Returns:
        ``window_signed``: :func:`_window_rel` over the last ``window`` steps; ``window_abs``: its magnitude;
        ``curve_signed``: mean over all steps of ``(a_t - b_t) / b_t`` (the whole curve's relative offset,
        positive: ``a`` learns slower / ends higher); ``curve_abs``: mean of ``|a_t - b_t| / b_t``;
        ``per_step_median`` / ``per_step_max``: of ``|a_t - b_t| / b_t``.
    """
    rel = [(x - y) / y for x, y in zip(a, b, strict=True)]
    absrel = [abs(r) for r in rel]
    w = _window_rel(a, b, window)
    return {"window_signed": w, "window_abs": abs(w), "curve_signed": statistics.fmean(rel),
            "curve_abs": statistics.fmean(absrel), "per_step_median": statistics.median(absrel),
            "per_step_max": max(absrel)}


def compare_training(steps: int = 200, seed: int = 0, window: int = 50,
                     modes: tuple[str, ...] = MODES, batch_size: int = 64, lr: float = 1e-3,
                     warmup_steps: int = 50) -> dict[str, Any]:
    """Run ``modes`` from one initialisation on the same batches; return losses and relative differences.

    Args:
        steps, seed, batch_size, lr, warmup_steps: as in :func:`train_losses` (the defaults are the SFT
            recipe's, i.e. the "high-lr" regime of the module docstring).
        window: trailing steps averaged for the loss level (clipped to ``steps``).
        modes: subset of :data:`MODES` to run.

    Returns:
        ``{"losses": {mode: [...]}, "seconds": {mode: s}, "fp8_vs_bf16": {...}, "bf16_vs_fp32": {...},
        "rel_loss_diff_fp8_vs_bf16": float, "rel_loss_diff_bf16_vs_fp32": float,
        "per_step_rel_diff_fp8_vs_bf16": {"median", "max"}, ...}``; the pair dicts are :func:`_pair_stats`
        (first mode against the second), present when both modes ran; ``rel_loss_diff_*`` is the pair's
        ``window_abs`` (kept for the earlier result files).

    Raises:
        ValueError: ``steps`` or ``window`` < 1, or an unknown mode.
    """
    from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM

    if steps < 1 or window < 1:
        raise ValueError(f"steps={steps}, window={window}: both must be >= 1")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes={modes!r}: {bad} not in {MODES}")
    torch.manual_seed(seed)
    init = copy.deepcopy(GlmMoeForCausalLM(GlmMoeConfig.tiny_debug()).state_dict())
    losses, seconds = {}, {}
    for m in modes:
        t0 = time.perf_counter()
        losses[m] = train_losses(m, steps=steps, seed=seed, batch_size=batch_size, lr=lr,
                                 warmup_steps=warmup_steps, init_state=init)
        seconds[m] = time.perf_counter() - t0
    window = min(window, steps)
    out: dict[str, Any] = {"steps": steps, "seed": seed, "window": window, "batch_size": batch_size, "lr": lr,
                           "warmup_steps": warmup_steps, "losses": losses, "seconds": seconds}
    if "fp8" in losses and "bf16" in losses:
        st = _pair_stats(losses["fp8"], losses["bf16"], window)
        out["fp8_vs_bf16"] = st
        out["rel_loss_diff_fp8_vs_bf16"] = st["window_abs"]
        out["per_step_rel_diff_fp8_vs_bf16"] = {"median": st["per_step_median"], "max": st["per_step_max"]}
    if "bf16" in losses and "fp32" in losses:
        st = _pair_stats(losses["bf16"], losses["fp32"], window)
        out["bf16_vs_fp32"] = st
        out["rel_loss_diff_bf16_vs_fp32"] = st["window_abs"]
    return out


def summarize_seeds(runs: list[dict[str, Any]], bar: float = 0.0025) -> dict[str, Any]:
    """Aggregate :func:`compare_training` results of several seeds (one regime).

    For each pair (``fp8_vs_bf16``, and the noise floor ``bf16_vs_fp32``) and each metric of
    :func:`_pair_stats`: the per-seed values, their mean, and the max of the magnitudes. ``pooled_window_signed``
    is the relative difference of the seed-averaged window losses (trajectory noise averages out over seeds,
    a systematic FP8 offset does not).

    Returns:
        ``{"seeds", "bar", "fp8_vs_bf16": {metric: {"per_seed", "mean", "max_abs"}, "pooled_window_signed"},
        "bf16_vs_fp32": {...}, "passed": {...}}``; ``passed`` applies ``bar`` to the FP8 pair's
        ``max_abs`` of ``window_signed`` and ``curve_signed`` (every seed within the bar) and to the pooled figure.
    """
    out: dict[str, Any] = {"seeds": [r["seed"] for r in runs], "bar": bar}
    for pair, (a, b) in (("fp8_vs_bf16", ("fp8", "bf16")), ("bf16_vs_fp32", ("bf16", "fp32"))):
        if not all(pair in r for r in runs):
            continue
        agg: dict[str, Any] = {}
        for k in runs[0][pair]:
            vals = [r[pair][k] for r in runs]
            agg[k] = {"per_seed": vals, "mean": statistics.fmean(vals), "max_abs": max(abs(v) for v in vals)}
        w = runs[0]["window"]
        agg["pooled_window_signed"] = _window_rel(
            [statistics.fmean(r["losses"][a][i] for r in runs) for i in range(runs[0]["steps"])],
            [statistics.fmean(r["losses"][b][i] for r in runs) for i in range(runs[0]["steps"])], w)
        out[pair] = agg
    if "fp8_vs_bf16" in out:
        f = out["fp8_vs_bf16"]
        out["passed"] = {"every_seed_window": f["window_signed"]["max_abs"] < bar,
                         "every_seed_curve": f["curve_signed"]["max_abs"] < bar,
                         "pooled_window": abs(f["pooled_window_signed"]) < bar}
    return out


def compare_rl_runs(base_dir: Path, fp8_dir: Path) -> dict[str, Any]:
    """mismatch_kl of two ``moe-rl rl`` runs (``<dir>/metrics.jsonl``), e.g. the debug recipe with and without
    ``--trainer.fp8 true``. Step 0 trains on rollouts of the initial weights (engine and trainer hold the same
    policy), so its mismatch_kl is pure trainer-vs-engine numerics; later steps add one step of policy lag.

    Returns:
        ``{"base": {...}, "fp8": {...}}`` with per-step ``mismatch_kl``, its mean / max and step-0 value, and
        ``reward_mean`` first-5 / last-5 means.
    """
    out: dict[str, Any] = {}
    for name, d in (("base", base_dir), ("fp8", fp8_dir)):
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        kl = [float(r["mismatch_kl"]) for r in rows]
        rew = [float(r["reward_mean"]) for r in rows]
        cfg = json.loads((Path(d) / "config.json").read_text())
        out[name] = {
            "run_dir": str(d), "steps": len(rows), "fp8": cfg["trainer"].get("fp8"),
            "inference_dtype": cfg["inference"]["dtype"], "mismatch_kl": kl,
            "mismatch_kl_step0": kl[0] if kl else None, "mismatch_kl_mean": statistics.fmean(kl) if kl else None,
            "mismatch_kl_max": max(kl) if kl else None,
            "reward_first5": statistics.fmean(rew[:5]) if rew else None,
            "reward_last5": statistics.fmean(rew[-5:]) if rew else None,
        }
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _dirty() -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "moe_rl"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.stdout.strip())


def _provenance(argv: list[str] | None) -> dict[str, Any]:
    return {
        "commit": _commit(), "moe_rl_uncommitted_changes": _dirty(),
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "processor": platform.processor(), "python": sys.version.split()[0],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "command": "python -m moe_rl.runtime.fp8_validate " + " ".join(argv if argv is not None else sys.argv[1:]),
    }


def _save_result(res: dict[str, Any], path: Path, argv: list[str] | None) -> Path:
    """Stamp ``res`` with :func:`_provenance` (key ``"provenance"``, last), write it to ``path`` as JSON (indent 1),
    creating the folder, and return ``path``."""
    res["provenance"] = _provenance(argv)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return path


def _run_training(args: argparse.Namespace, argv: list[str] | None) -> int:
    torch.set_num_threads(args.threads)
    regime = dict(REGIMES[args.regime])
    keys = ("steps", "window", "batch_size", "lr", "warmup_steps")
    overridden = [k for k in keys if getattr(args, k) is not None]
    for k in overridden:
        regime[k] = getattr(args, k)
    seeds = args.seeds if args.seeds is not None else [args.seed]
    today = _dt.date.today().isoformat()
    if len(seeds) == 1 and args.regime == "high-lr" and not overridden:  # first measurement's single-seed file
        res = compare_training(seed=seeds[0], **regime)
        res["bar"] = 0.0025
        res["passed"] = res["rel_loss_diff_fp8_vs_bf16"] < res["bar"]
        res["within_bf16_vs_fp32_noise"] = res["rel_loss_diff_fp8_vs_bf16"] <= res["rel_loss_diff_bf16_vs_fp32"]
        path = _save_result(res, args.out / f"fp8_vs_bf16_training_seed{seeds[0]}_{today}.json", argv)
        print(f"rel loss diff fp8 vs bf16 (last {res['window']} steps): {res['rel_loss_diff_fp8_vs_bf16']:.4%} "
              f"(bar 0.25%: {'pass' if res['passed'] else 'FAIL'}); bf16 vs fp32: "
              f"{res['rel_loss_diff_bf16_vs_fp32']:.4%}; seconds {res['seconds']}; -> {path}")
        return 0
    runs = []
    for sd in seeds:
        r = compare_training(seed=sd, **regime)
        runs.append(r)
        f, n = r["fp8_vs_bf16"], r["bf16_vs_fp32"]
        print(f"seed {sd}: fp8 vs bf16 window {f['window_signed']:+.3%} curve {f['curve_signed']:+.3%} | noise floor "
              f"bf16 vs fp32 window {n['window_signed']:+.3%} curve {n['curve_signed']:+.3%} | s {r['seconds']}",
              flush=True)
    res = {"regime": args.regime, "params": regime, "summary": summarize_seeds(runs), "runs": runs}
    tag = args.tag or (args.regime if not overridden else f"{args.regime}-custom")
    path = _save_result(res, args.out / f"fp8_vs_bf16_training_{tag}_seeds{'-'.join(map(str, seeds))}_{today}.json",
                        argv)
    sm = res["summary"]
    for pair in ("fp8_vs_bf16", "bf16_vs_fp32"):
        x = sm[pair]
        print(f"{pair}: window mean {x['window_signed']['mean']:+.3%} max|.| {x['window_signed']['max_abs']:.3%}; "
              f"curve mean {x['curve_signed']['mean']:+.3%} max|.| {x['curve_signed']['max_abs']:.3%}; "
              f"pooled window {x['pooled_window_signed']:+.3%}")
    print(f"passed (bar 0.25%): {sm['passed']} -> {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="FP8 vs BF16 training of the debug model (DeepSeek-V3 0.25% bar)")
    p.add_argument("--regime", choices=sorted(REGIMES), default="controlled",
                   help="hyper-parameter preset (module docstring); the flags below override single values")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--window", type=int, default=None, help="trailing steps averaged for the loss level")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds -> one summary file")
    p.add_argument("--tag", default=None, help="file-name tag of the multi-seed result (default: the regime)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--rl-runs", type=Path, nargs=2, metavar=("BASE_DIR", "FP8_DIR"), default=None,
                   help="instead of training: summarise mismatch_kl of two finished `moe-rl rl` runs")
    args = p.parse_args(argv)
    if args.rl_runs is None:
        return _run_training(args, argv)
    res = compare_rl_runs(*args.rl_runs)
    path = _save_result(res, args.out / f"fp8_rl_mismatch_kl_{_dt.date.today().isoformat()}.json", argv)
    for k in ("base", "fp8"):
        r = res[k]
        print(f"{k}: steps {r['steps']} mismatch_kl step0 {r['mismatch_kl_step0']:.3e} mean "
              f"{r['mismatch_kl_mean']:.3e} max {r['mismatch_kl_max']:.3e}; reward {r['reward_first5']:.3f} -> "
              f"{r['reward_last5']:.3f}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
