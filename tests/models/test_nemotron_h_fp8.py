"""Nemotron-H's routed experts in FP8 (``trainer.fp8``): the squared-ReLU (ungated) experts run both projections as
FP8 block-scaled grouped GEMMs (:func:`moe_rl.models.nemotron_h.moe.fp8_relu2_rows_forward`), the model converts
with :func:`moe_rl.moe.convert_model_to_fp8` like the GLM / DeepSeek-V3 families, and the memory planner's FP8 bytes
are what the converted model saves.

Oracle: the float64 high-precision experts (:func:`relu2_experts_forward`, ``backend="loop"``) and the unconverted
model. SQNR floors, derived from E4M3 block scaling (as ``tests/fp8/test_fp8_grouped.py`` derives its floors): one
FP8 GEMM of two quantized Gaussian operands measures ~28-29 dB, so 28 dB is the per-GEMM noise level. The squared
ReLU doubles the relative error of its input (``d(h^2) / h^2 = 2 dh / h``): 4x the noise power, -6 dB, so ~22 dB
after it; the down projection adds its own ~28 dB of independent noise: ``-10 log10(10^-2.2 + 10^-2.8) = 21.0``
dB for the block output, and likewise for the gradients (each chains two FP8 GEMMs around the relu2 derivative
``2 relu(h)``, whose relative error equals ``h``'s). Floor 20 dB (measured 24-26 dB); a wrong scale, a dropped
block or a row sent to another expert gives ~0 dB. The whole-model floor is the GLM conversion test's (20 dB:
chained FP8 GEMMs over several layers).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _tolerance import assert_sqnr_at_least, sqnr_db

from moe_rl.fp8 import Fp8BlockLinear, Fp8Config
from moe_rl.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from moe_rl.models.nemotron_h.ep import LocalReluSquaredExperts, NemotronHExpertParallelMoE
from moe_rl.models.nemotron_h.moe import ReluSquaredExperts, relu2_experts_forward
from moe_rl.moe.experts import sort_by_expert
from moe_rl.moe.fp8_convert import convert_model_to_fp8, fp8_parameter_fraction

BLOCK_FLOOR_DB = 20.0
MODEL_FLOOR_DB = 20.0


def _experts_case(seed=0, T=96, E=8, L=128, Fi=64, K=2):
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(E, Fi, L, generator=g) * L**-0.5
    down = torch.randn(E, L, Fi, generator=g) * Fi**-0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[ids == 3] = 4  # expert 3 receives no tokens (ids may repeat within a token: allowed by the experts)
    return torch.randn(T, L, generator=g), ids, up, down, torch.randn(T, K, L, generator=g)


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_relu2_experts_forward_and_gradients_vs_float64(seed):
    x, ids, up, down, gy = _experts_case(seed)
    leaves64 = [t.double().requires_grad_() for t in (x, up, down)]
    y64 = relu2_experts_forward(leaves64[0], ids, leaves64[1], leaves64[2], backend="loop")
    y64.backward(gy.double())
    leaves = [t.clone().requires_grad_() for t in (x, up, down)]
    y = relu2_experts_forward(leaves[0], ids, leaves[1], leaves[2], backend="loop", fp8_backend="torch")
    y.backward(gy)
    assert y.shape == y64.shape and y.dtype == torch.float32
    assert_sqnr_at_least(y64, y, BLOCK_FLOOR_DB, "y")
    for name, r, o in zip(("dx", "d_up", "d_down"), leaves64, leaves, strict=True):
        assert o.grad.dtype == torch.float32
        assert_sqnr_at_least(r.grad, o.grad, BLOCK_FLOOR_DB, name)
    assert (leaves[1].grad[3] == 0).all() and (leaves[2].grad[3] == 0).all()  # the expert without tokens
    # and it is FP8: the high-precision fp32 path is ~140 dB from float64, this one ~25 dB
    y32 = relu2_experts_forward(x, ids, up, down, backend="loop")
    assert sqnr_db(y64, y) < sqnr_db(y64, y32) - 60


def test_local_fp8_rows_equal_the_full_fp8_experts():
    """The EP path (rows already expert-major, ``local_relu2_experts_forward``) does the full path's arithmetic
    in the same order: bit-equal outputs and gradients."""
    from moe_rl.models.nemotron_h.ep import local_relu2_experts_forward

    x, ids, up, down, gy = _experts_case(2)
    a = [t.clone().requires_grad_() for t in (x, up, down)]
    y_full = relu2_experts_forward(a[0], ids, a[1], a[2], backend="loop", fp8_backend="torch")
    y_full.backward(gy)
    perm_N, token_N, counts_E = sort_by_expert(ids, up.shape[0])
    b = [t.clone().requires_grad_() for t in (x, up, down)]
    y_rows = local_relu2_experts_forward(b[0][token_N], counts_E, b[1], b[2], backend="loop", fp8_backend="torch")
    y_rows.backward(gy.reshape(-1, gy.shape[-1])[perm_N])
    assert torch.equal(y_rows, y_full.reshape(-1, y_full.shape[-1])[perm_N])
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(ValueError, match="counts_E sums to"):
        local_relu2_experts_forward(x, counts_E + 1, up, down, backend="loop", fp8_backend="torch")


def test_enable_fp8_checks_the_backend_and_from_full_keeps_fp8(monkeypatch):
    import torch.distributed as dist

    from moe_rl.models.nemotron_h.moe import NemotronHMoE

    experts = ReluSquaredExperts(4, 16, 8, backend="loop")
    with pytest.raises(ValueError, match=r"backend='fp16' is not an FP8 GEMM backend"):
        experts.enable_fp8("fp16")
    assert experts.fp8_backend is None
    assert experts.enable_fp8("torch") is experts and "fp8_backend='torch'" in repr(experts)
    # expert parallelism slices the local experts out of an FP8 block: they stay FP8 (no process group needed to
    # build one: the rank and the world size are all from_full reads)
    moe = NemotronHMoE(NemotronHConfig.tiny_debug())
    moe.experts.enable_fp8("torch")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    ep = NemotronHExpertParallelMoE.from_full(moe)
    assert isinstance(ep.experts, LocalReluSquaredExperts) and ep.experts.fp8_backend == "torch"
    assert torch.equal(ep.experts.up_proj, moe.experts.up_proj[4:])


def test_convert_nemotron_model_to_fp8_matches_the_reference():
    torch.manual_seed(0)
    cfg = NemotronHConfig.tiny_debug()
    model = NemotronHForCausalLM(cfg)
    ref = NemotronHForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the family's experts are converted, not warned about as foreign
        counts = convert_model_to_fp8(model, Fp8Config(enabled=True, backend="torch"))
    assert list(model.state_dict()) == keys  # same parameters, same names
    n_moe = sum(cfg.layer_kind(i) == "moe" for i in range(cfg.num_hidden_layers))
    assert counts["experts"] == n_moe and counts["linear"] > 0 and counts["skipped_linear"] >= 1
    exps = [m for m in model.modules() if isinstance(m, ReluSquaredExperts)]
    assert len(exps) == n_moe and all(m.fp8_backend == "torch" for m in exps)
    fp8_linear = [n for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)]
    assert not any(n == "lm_head" or ".gate" in n for n in fp8_linear)
    assert any(n.endswith("mixer.in_proj") for n in fp8_linear) and any(n.endswith("q_proj") for n in fp8_linear)
    frac = fp8_parameter_fraction(model)
    expert_params = sum(m.up_proj.numel() + m.down_proj.numel() for m in exps)
    linear_params = sum(model.get_submodule(n).weight.numel() for n in fp8_linear)
    assert frac["fp8_params"] == expert_params + linear_params
    again = convert_model_to_fp8(model, Fp8Config(enabled=True, backend="torch"))  # idempotent: nothing converted
    assert again["experts"] == again["linear"] == 0 and again["skipped_linear"] >= 0

    ids = torch.randint(3, cfg.vocab_size, (2, 24))
    logits, logits_ref = model(ids), ref(ids)
    assert_sqnr_at_least(logits_ref, logits, MODEL_FLOOR_DB, "logits")
    logits.float().logsumexp(-1).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert any(float(m.up_proj.grad.abs().sum()) > 0 for m in exps)


def _saved_fp8_bytes(layer, x) -> float:
    """Bytes of the FP8 weight copies one forward of ``layer`` saves for backward: every saved e4m3 tensor's
    storage plus the fp32 block scales saved right after it (``save_for_backward(x, codes, scales)`` in
    :mod:`moe_rl.fp8.linear` / :mod:`moe_rl.fp8.grouped`)."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    total = 0.0
    for i, t in enumerate(saved):
        if t.dtype == torch.float8_e4m3fn:
            scale = saved[i + 1]
            assert scale.dtype == torch.float32 and scale.dim() == t.dim()
            total += t.untyped_storage().nbytes() + scale.untyped_storage().nbytes()
    return total


def test_planned_fp8_bytes_equal_what_the_converted_layers_save():
    """``hybrid_arch_spec``'s per-layer FP8 bytes (what ``plan_memory`` adds for ``fp8`` / ``fp8_experts``) equal
    the e4m3 copies and block scales each converted layer saves, for every layer kind; expert widths are multiples
    of 128 (as in the published configs), the dense projections have tail blocks."""
    from moe_rl.distributed.memory import arch_spec
    from moe_rl.models.nemotron_h.model import NemotronHBlock

    cfg = NemotronHConfig.tiny_debug(hidden_size=128, moe_latent_size=128, moe_intermediate_size=128)
    arch = arch_spec(cfg)
    for i in range(cfg.num_hidden_layers):
        torch.manual_seed(i)
        layer = NemotronHBlock(cfg, i, "loop")
        convert_model_to_fp8(layer, Fp8Config(enabled=True, backend="torch"))
        spec = arch.layers[i]
        measured = _saved_fp8_bytes(layer, torch.randn(1, 40, cfg.hidden_size))
        assert measured > 0, spec.kind
        assert spec.fp8_dense_bytes + spec.fp8_expert_bytes == measured, (spec.kind, measured)
        if spec.kind == "moe":
            e, f, w = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_latent_size
            assert spec.fp8_expert_bytes == 2 * e * (f * w + 4)  # one 128 x 128 block per expert matrix
        else:
            assert spec.fp8_expert_bytes == 0


def test_plan_memory_adds_the_exact_fp8_bytes():
    from moe_rl.distributed.memory import arch_spec, plan_memory
    from moe_rl.distributed.parallel_dims import ParallelDims

    cfg = NemotronHConfig.ultra_550b_a55b()

    def gather(fp8: bool, fp8_experts: bool) -> float:
        p = plan_memory(cfg, ParallelDims(dp_shard=32, cp=4, ep=8), 131072, 1, "bf16", "full", True,
                        loss_chunk_tokens=4096, fp8=fp8, fp8_experts=fp8_experts)
        return p.components["fsdp_allgather"]

    arch = arch_spec(cfg)
    biggest = max(arch.layers, key=lambda lyr: lyr.dense_params + lyr.expert_params / 8)
    assert biggest.kind == "moe"
    assert gather(True, False) - gather(False, False) == pytest.approx(biggest.fp8_dense_bytes, rel=1e-12)
    assert gather(True, True) - gather(True, False) == pytest.approx(biggest.fp8_expert_bytes / 8, rel=1e-12)
    # Ultra's widths are multiples of 128: exactly 1 + 4 / 128^2 bytes per FP8 weight, ~1.3 GB of expert copies
    e, f, lw = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_latent_size
    assert biggest.fp8_expert_bytes / 8 == 2 * e * f * lw / 8 * (1 + 4 / 128**2)
    assert round(biggest.fp8_expert_bytes / 8 / 1e9, 2) == 1.34
