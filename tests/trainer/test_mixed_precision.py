"""``trainer.dtype = "bfloat16"``: FSDP2 mixed precision (bf16 compute, fp32 masters / optimizer state / gradient
reduction), grouped-GEMM experts by default, FP8 experts under expert parallelism, the FP8 parameter fraction.

Tier 1 (no process group): config refusals and helpers.

Tier 2 (gloo; ``_mixed_precision_worker.py``, the real trainer step on a tiny GLM-4.5 and a tiny GLM-5): one 1-rank
world runs the single-process scenarios (float64 reference, fp32, bf16 on a 1-rank mesh, FP8), one 2-rank world the
parallel ones (bf16 with EP=2 + activation checkpointing; bf16 with CP=2 on the DSA model; FP8 experts under EP=2).

Error bounds (norm-wise relative error over all gradients, ``||g - g64|| / ||g64||``, against the float64 run):

* bf16: every rounding to bf16 (a parameter cast, a GEMM or elementwise output) has relative error at most
  ``u = 2^-8`` (8 significant bits). Roundings at different layers are independent, so their effect on the output
  grows like a random walk over the depth of the computation: ``err <= c * u * sqrt(depth)`` with ``depth =
  n_layers + 2`` (embedding and head) for the forward loss and twice that for gradients (the backward pass
  traverses the same layers again), and ``c = 8`` covering the few roundings per layer (input, weight, output).
  Tiny GLM-4.5 (2 layers): 8 * 2^-8 * sqrt(8) = 0.088 for gradients; measured 0.013. The run must also differ
  from float64 by more than ``u / 16 = 2^-12`` (a fp32 run is ~4e-7 away), so a silently-fp32 "bf16" run fails.
* fp32: ``8 * 2^-24 * sqrt(depth * K)`` with K = 256 the largest reduction length (summation order only).
* bf16 on 2 ranks vs bf16 on one: both are within the bf16 bound of float64, so within twice that of each other;
  each is also checked against float64 directly.
* FP8 experts under EP vs the single-process FP8 model (both fp32 masters/compute around the FP8 GEMMs): the FP8
  forward and the data-gradient quantize per row (1x128) and the expert weights per expert (128x128), which EP does
  not change, so the loss, the expert weights' gradients and every non-FP8 parameter's gradient agree to fp32
  summation order (``8 * 2^-24 * sqrt(K)``, K = 128 * 48 reduced elements; measured ~5e-8, vs ~0.5 between FP8 and
  fp32 experts). The FP8 linears' weight gradients quantize 128 tokens per scale along the token axis (DeepSeek-V3's
  128x1 Wgrad recipe) over each rank's own tokens, so they legitimately differ by FP8 rounding: bounded by twice
  the e4m3 unit roundoff ``2 * 2^-4`` (measured ~3e-2).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_mixed_precision_worker.py")
U_BF16, U_FP32, U_E4M3 = 2.0**-8, 2.0**-24, 2.0**-4
LAYERS = {"glm4": 2, "dsa": 3}  # GlmMoeConfig.tiny_debug / GlmMoeDsaConfig.tiny_debug num_hidden_layers
K_MAX = 256


def bf16_bound(family: str, backward: bool) -> float:
    depth = (LAYERS[family] + 2) * (2 if backward else 1)
    return 8 * U_BF16 * math.sqrt(depth)


def fp32_bound(family: str) -> float:
    return 8 * U_FP32 * math.sqrt(2 * (LAYERS[family] + 2) * K_MAX)


def rel_err(a: dict, b: dict, keys=None) -> float:
    keys = sorted(b) if keys is None else keys
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in keys)
    den = sum(float((b[k] ** 2).sum()) for k in keys)
    return math.sqrt(num / den)


# ------------------------------------------------------------------------------------------- tier 1: config


def test_unknown_dtype_names_field_value_and_choices(tmp_path):
    from pydantic import ValidationError

    from moe_rl.runtime.config import RLConfig

    with pytest.raises(ValidationError, match=r"trainer\.dtype\n.*'float32' or 'bfloat16'.*input_value='float16'"):
        RLConfig(output_dir=tmp_path, trainer={"dtype": "float16"})
    assert RLConfig(output_dir=tmp_path, trainer={"dtype": "bfloat16"}).trainer.dtype == "bfloat16"


def test_mixed_precision_policy():
    from moe_rl.distributed.parallelize import mixed_precision_policy

    assert mixed_precision_policy("float32") is None
    mp = mixed_precision_policy("bfloat16")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match=r"dtype='float16' is not supported; use 'float32' or 'bfloat16'"):
        mixed_precision_policy("float16")


def test_bf16_on_one_rank_needs_a_process_group():
    import torch.distributed as dist

    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM
    from moe_rl.runtime.trainer.step import apply_trainer_parallelism

    assert not dist.is_initialized()
    model = GlmMoeForCausalLM(GlmMoeConfig.tiny_debug())
    dims = ParallelDims(dp_shard=1)
    assert apply_trainer_parallelism(model, dims, dtype="float32", device_type="cpu", cp_method=None,
                                     activation_checkpointing=False) is None  # plain fp32 model
    with pytest.raises(ValueError, match=r"dtype='bfloat16' on one rank .* torch.distributed.init_process_group"):
        apply_trainer_parallelism(model, dims, dtype="bfloat16", device_type="cpu", cp_method=None,
                                  activation_checkpointing=False)


def test_experts_backend_default_and_refusal():
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.runtime.trainer.config import TrainerConfig
    from moe_rl.runtime.trainer.step import resolve_experts_backend

    assert TrainerConfig().experts_backend == "grouped_mm"
    cfg = GlmMoeConfig.tiny_debug()  # D=128, F=64
    assert resolve_experts_backend("grouped_mm", cfg, "bfloat16", "cpu") == "grouped_mm"
    assert resolve_experts_backend("grouped_mm", cfg, "float32", "cuda") == "loop"  # CUDA grouped_mm is bf16-only
    odd = GlmMoeConfig.tiny_debug(moe_intermediate_size=36)  # multiple of 4 (fp32) but not of 8 (bf16)
    assert resolve_experts_backend("grouped_mm", odd, "float32", "cpu") == "grouped_mm"
    with pytest.raises(ValueError, match=r"trainer.experts_backend='grouped_mm': .*F=36 .*multiples of 8.*'loop'"):
        resolve_experts_backend("grouped_mm", odd, "bfloat16", "cpu", field="trainer.experts_backend")
    with pytest.raises(ValueError, match=r"experts_backend='bmm' is not supported"):
        resolve_experts_backend("bmm", cfg, "float32", "cpu")


def test_fp8_parameter_fraction_counts_converted_weights():
    from moe_rl.fp8 import Fp8BlockLinear, Fp8Config
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM
    from moe_rl.moe.fp8_convert import convert_model_to_fp8, fp8_parameter_fraction
    from moe_rl.moe.fp8_experts import Fp8GroupedExperts

    model = GlmMoeForCausalLM(GlmMoeConfig.tiny_debug())
    total = sum(p.numel() for p in model.parameters())
    assert fp8_parameter_fraction(model) == {"fp8_params": 0, "total_params": total, "fraction": 0.0}
    convert_model_to_fp8(model, Fp8Config(enabled=True, experts=False))
    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8BlockLinear))
    assert lin > 0 and fp8_parameter_fraction(model)["fp8_params"] == lin  # biases are not FP8
    convert_model_to_fp8(model, Fp8Config(enabled=True))
    exp = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in model.modules()
              if isinstance(m, Fp8GroupedExperts))
    frac = fp8_parameter_fraction(model)
    assert exp > 0 and frac["fp8_params"] == lin + exp and frac["fraction"] == (lin + exp) / total


# ------------------------------------------------------------------------------------------- tier 2: gloo


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_ranks, check_scenario):
    out = {}
    for world in (1, 2):
        tmp = tmp_path_factory.mktemp(f"mp{world}")
        res = launch_ranks(WORKER, world, tmp, timeout_s=600)
        for name in (n for n in res[0] if not n.startswith("_")):
            check_scenario(res, name)
            out[name] = torch.load(tmp / f"{name}.pt", weights_only=False)
        out[f"_world{world}"] = res[0]
    return out


@pytest.mark.parametrize("family", ["glm4", "dsa"])
def test_bf16_step_matches_float64_within_bf16_bound(runs, family):
    r64, r32, r16 = (runs[f"{family}_{d}"] for d in ("float64", "float32", "bfloat16"))
    loss64 = r64["report"]["loss"]
    for r, bound in ((r32, fp32_bound(family)), (r16, bf16_bound(family, backward=False))):
        assert abs(r["report"]["loss"] - loss64) <= bound * abs(loss64)
    assert rel_err(r32["grads"], r64["grads"]) <= fp32_bound(family)
    err16 = rel_err(r16["grads"], r64["grads"])
    assert U_BF16 / 16 < err16 <= bf16_bound(family, backward=True), err16  # bf16 really ran, and within bound


@pytest.mark.parametrize("name", ["glm4_bfloat16", "dsa_bfloat16", "glm4_bfloat16_ep2_ac", "dsa_bfloat16_cp2"])
def test_bf16_keeps_fp32_masters_state_reduction_and_router(runs, name):
    c = runs[name]["checks"]
    assert c["param_dtypes"] == ["torch.float32"]  # master weights
    assert c["grad_dtypes"] == ["torch.float32"]
    assert c["opt_state_dtypes"] == ["torch.float32"]  # AdamW moments
    assert c["fsdp_policies"] and all(p == ["torch.bfloat16", "torch.float32"] for p in c["fsdp_policies"])
    assert c["routers"]
    for r in c["routers"]:  # the router sees bf16 activations and weights and returns fp32 scores / gate weights
        assert r == {"input": "torch.bfloat16", "weight": "torch.bfloat16", "topk_weights": "torch.float32",
                     "scores": "torch.float32"}


@pytest.mark.parametrize(("parallel", "single", "family"),
                         [("glm4_bfloat16_ep2_ac", "glm4_bfloat16", "glm4"), ("dsa_bfloat16_cp2", "dsa_bfloat16", "dsa")])
def test_bf16_two_ranks_match_one(runs, parallel, single, family):
    p, s, r64 = runs[parallel], runs[single], runs[f"{family}_float64"]
    bound = bf16_bound(family, backward=True)
    assert rel_err(p["grads"], r64["grads"]) <= bound
    assert rel_err(p["grads"], s["grads"]) <= 2 * bound
    loss_bound = 2 * bf16_bound(family, backward=False)
    assert abs(p["report"]["loss"] - s["report"]["loss"]) <= loss_bound * abs(s["report"]["loss"])


def test_fp8_experts_under_ep_match_single_process(runs):
    ep, single, fp32 = runs["glm4_fp8_float32_ep2"], runs["glm4_fp8_float32"], runs["glm4_float32"]
    assert ep["checks"]["local_expert_fp8"] == ["auto"]  # every LocalExperts runs FP8 (Fp8Config.backend default)
    assert ep["checks"]["fp8_param_fraction"] == single["checks"]["fp8_param_fraction"]
    assert ep["checks"]["fp8_param_fraction"]["fraction"] > 0.9  # tiny vocab: nearly everything is FP8
    fp8_linear = {k for k in single["grads"] if k.endswith(".weight") and k.split(".")[-2].endswith("proj")
                  and ".experts." not in k}
    rest = sorted(set(single["grads"]) - fp8_linear)
    experts = [k for k in rest if ".experts." in k]
    assert experts and fp8_linear
    tol = 8 * U_FP32 * math.sqrt(128 * 48)
    assert abs(ep["report"]["loss"] - single["report"]["loss"]) <= tol * abs(single["report"]["loss"])
    for k in rest:
        assert rel_err(ep["grads"], single["grads"], [k]) <= tol, k
    assert rel_err(ep["grads"], single["grads"], sorted(fp8_linear)) <= 2 * U_E4M3
    # and the experts really are FP8: their gradients differ from the high-precision run's by far more than tol
    assert rel_err(ep["grads"], fp32["grads"], experts) > 100 * tol


def test_gloo_bf16_all_reduce_is_reported(runs):
    # informational: FSDP2 reduces in fp32 (reduce_dtype), so bf16 collectives are never needed for gradients
    assert runs["_world2"]["_gloo_bf16_all_reduce"].startswith(("supported", "unsupported"))
