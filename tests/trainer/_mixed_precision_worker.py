"""One rank of the mixed-precision trainer tests (``tests/trainer/test_mixed_precision.py``).

Every scenario runs the real trainer step (:func:`moe_rl.runtime.trainer.step.apply_trainer_parallelism`,
:func:`~moe_rl.runtime.trainer.step.make_optimizer`, :func:`~moe_rl.runtime.trainer.step.train_step`) on a tiny GLM-4.5
(``glm4``) or GLM-5 (``dsa``, no MTP) model built from seed 0, on one fixed batch, and rank 0 saves
``OUT_DIR/<scenario>.pt`` = ``{"report", "grads", "params", "checks"}``: the step report, every gradient right before
AdamW (full tensors, float64), the parameters after the step, and dtype facts (parameter / gradient / optimizer-state
dtypes, the FSDP groups' mixed-precision policies, what the routers saw and returned).

``WORLD == 1``: the single-process scenarios (float64 reference, fp32, bf16 on a 1-rank mesh, FP8 experts in fp32
and in bf16). ``WORLD == 2``: the parallel scenarios (bf16 under ``parallelize_model`` with EP + activation
checkpointing for glm4, context parallelism for dsa; FP8 experts under EP).

Usage: ``python _mixed_precision_worker.py RANK WORLD INIT_FILE OUT_DIR``; writes ``OUT_DIR/rank<r>.json``
``{scenario: "ok" | traceback}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))

B, L = 4, 12
PROMPTS, LENGTHS = (3, 4, 2, 5), (12, 10, 9, 12)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def make_model(family: str, backend: str):
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM
    from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig
    from moe_rl.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    if family == "glm4":
        return GlmMoeForCausalLM(GlmMoeConfig.tiny_debug(), experts_backend=backend)
    return GlmMoeDsaForCausalLM(GlmMoeDsaConfig.tiny_debug(), experts_backend=backend, with_mtp=False)


def make_batch(vocab: int):
    """4 rows of 12 tokens (right-padded with 0), completions after the prompt, positive advantages (the loss is
    ~ -mean ratio, far from 0, so its relative error is meaningful)."""
    from moe_rl.rl.batch import TrainingBatch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (B, L), generator=g)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        ids[i, n:] = 0
        mask[i, p - 1 : n - 1] = True
    inf_lp = -(torch.rand(B, L - 1, generator=g) + 3.0) * mask  # ~ -log(V)
    return TrainingBatch(input_ids=ids, loss_mask=mask, inference_logprobs=inf_lp,
                         advantages=torch.rand(B, generator=g) + 0.5, version_start=torch.zeros(B, dtype=torch.int64),
                         rewards=torch.zeros(B), step=0)


def run(name: str, spec: dict, rank: int, out_dir: Path) -> None:
    from torch.distributed.fsdp import FSDPModule

    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.moe.ep import LocalExperts
    from moe_rl.moe.fp8_convert import convert_model_to_fp8, fp8_parameter_fraction
    from moe_rl.moe.router import TopKRouter
    from moe_rl.rl.loss import LossConfig
    from moe_rl.runtime.trainer.config import OptimizerConfig
    from moe_rl.runtime.trainer.step import (
        StepSettings,
        TrainerState,
        apply_trainer_parallelism,
        make_optimizer,
        train_step,
    )

    family, dtype = spec["family"], spec["dtype"]
    model = make_model(family, "loop" if dtype == "float64" else "grouped_mm")
    if dtype == "float64":
        model.double()
    if spec.get("fp8"):
        convert_model_to_fp8(model)
    dims = ParallelDims(**spec.get("dims", {"dp_shard": 1}))
    mesh = None
    if dtype != "float64":
        mesh = apply_trainer_parallelism(model, dims, dtype=dtype, device_type="cpu", cp_method=None,
                                         activation_checkpointing=spec.get("ac", False))
    routers: list[dict] = []

    def router_hook(mod, args, out):
        routers.append({"input": str(args[0].dtype), "weight": str(mod.weight.dtype),
                        "topk_weights": str(out[1].dtype), "scores": str(out[2].dtype)})

    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(router_hook)
    opt, sched = make_optimizer(model, OptimizerConfig(lr=1e-3, eps=1e-3, warmup_steps=0, max_grad_norm=1e9))
    settings = StepSettings(loss=LossConfig(), max_grad_norm=1e9, temperature=1.0, pad_id=0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    st = TrainerState(settings, model, opt, sched, dims, mesh, rank, world)
    grads: dict[str, torch.Tensor] = {}
    grad_dtypes: set[str] = set()

    def capture(o, args, kwargs):  # a collective under FSDP (full_tensor): every rank runs it
        for n, p in model.named_parameters():
            if p.grad is None:  # e.g. the DSA indexer: trained by its own loss only, not by this step's loss
                continue
            grads[n.replace("_checkpoint_wrapped_module.", "")] = _full(p.grad).double().clone()
            grad_dtypes.add(str(p.grad.dtype))

    opt.register_step_pre_hook(capture)
    report = train_step(st, make_batch(model.config.vocab_size), 0)
    policies = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is not None:
                policies.append([str(pg.mp_policy.param_dtype), str(pg.mp_policy.reduce_dtype)])
    opt_state = sorted({str(_full(v).dtype) for s in opt.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0})
    checks = {
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted(grad_dtypes),
        "opt_state_dtypes": opt_state,
        "fsdp_policies": policies,
        "routers": routers,
        "fp8_param_fraction": fp8_parameter_fraction(model),
        "local_expert_fp8": sorted({str(m.fp8_backend) for m in model.modules() if isinstance(m, LocalExperts)}),
    }
    params = {n.replace("_checkpoint_wrapped_module.", ""): _full(p.detach()).double().clone()
              for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"report": report, "grads": grads, "params": params, "checks": checks}, out_dir / f"{name}.pt")


SINGLE = {
    f"{fam}_{dt}": {"family": fam, "dtype": dt} for fam in ("glm4", "dsa") for dt in ("float64", "float32", "bfloat16")
}
SINGLE.update({
    "glm4_fp8_float32": {"family": "glm4", "dtype": "float32", "fp8": True},
})
PARALLEL = {
    "glm4_bfloat16_ep2_ac": {"family": "glm4", "dtype": "bfloat16", "dims": {"dp_shard": 2, "ep": 2}, "ac": True},
    "dsa_bfloat16_cp2": {"family": "dsa", "dtype": "bfloat16", "dims": {"dp_shard": 1, "cp": 2}},
    "glm4_fp8_float32_ep2": {"family": "glm4", "dtype": "float32", "fp8": True, "dims": {"dp_shard": 2, "ep": 2}},
}


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results: dict[str, str] = {}
    if world == 2:  # does gloo reduce bf16? (informational: the fp32 reduce_dtype never needs it)
        try:
            t = torch.ones(4, dtype=torch.bfloat16)
            dist.all_reduce(t)
            results["_gloo_bf16_all_reduce"] = "supported" if bool((t == 2).all()) else "wrong result"
        except Exception as exc:  # noqa: BLE001
            results["_gloo_bf16_all_reduce"] = f"unsupported: {type(exc).__name__}: {str(exc)[:200]}"
    for name, spec in (SINGLE if world == 1 else PARALLEL).items():
        try:
            run(name, spec, rank, out_dir)
            results[name] = "ok"
        except Exception:  # noqa: BLE001
            results[name] = traceback.format_exc()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
