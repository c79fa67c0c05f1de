"""The memory planner against measured peaks, exact parameter counts and the seed's arithmetic.

Measured peaks: ``_memory_worker.py`` runs two small glm4_moe shapes with FSDP2 over 2 real gloo ranks (fp32 and
bf16 mixed precision, with and without per-layer activation checkpointing), two AdamW steps each, under
:class:`moe_rl.distributed.meter.LiveBytesMeter`; :func:`plan_memory` must be within 15% of every rank's peak
(the issue's bar). The planner is an upper-bound model (it adds everything alive at its peak phase), so it is
allowed to be up to 15% above and up to 15% below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_rl.distributed.memory import GiB, arch_spec, layer_allgather_bytes, plan_memory
from moe_rl.distributed.meter import LiveBytesMeter
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.models.glm4_moe import GlmMoeConfig, GlmMoeForCausalLM
from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _memory_worker import SHAPES  # noqa: E402


@pytest.fixture(scope="module")
def measured(tmp_path_factory, launch_ranks):
    return launch_ranks(HERE / "_memory_worker.py", 2, tmp_path_factory.mktemp("mem"), 600)


# scaled-down GLM-5 through parallelize_model on 2 gloo ranks (the benchmark runs the full grid on 4 ranks: cp 1/2/4
# x 4 sequence lengths, docs/memory.md): the dense DSA reference in fp32 at cp 1 (its [T, T] indexer transient is
# the peak), the memory-bounded path in bf16 at cp 2 (all-gathered keys, FSDP2 mixed precision)
DSA_POINTS = [
    dict(cp=1, seq_len=512, dtype="float32", ac="full", attn_kernel="dense"),
    dict(cp=2, seq_len=512, dtype="bfloat16", ac="full", attn_kernel="chunked"),
]


@pytest.fixture(scope="module")
def measured_dsa(tmp_path_factory):
    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    from memory_validation import run_ranks

    return run_ranks(DSA_POINTS, 2, tmp_path_factory.mktemp("mem_dsa"), 900)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("point", range(len(DSA_POINTS)))
def test_glm5_plan_within_10_percent_of_measured_peak(measured_dsa, point):
    """The planner's formula (PlanInputs of the worker's exact config and layout) against the per-rank peak the
    live-bytes meter measures during real forward + backward + AdamW steps through parallelize_model."""
    from memory_validation import planned, scenario_name

    sc = DSA_POINTS[point]
    plan = planned(sc, world=2)
    for rank, res in measured_dsa.items():
        got = res.get(scenario_name(sc), res)
        assert isinstance(got, int), f"rank {rank} failed:\n{got}"
        ratio = plan.peak_bytes / got
        assert 0.9 <= ratio <= 1.1, (f"{sc} rank {rank}: planned {plan.peak_bytes:.0f} B vs measured {got} B "
                                     f"(ratio {ratio:.3f}); {plan.components} at {plan.peak_phase}")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_plan_within_15_percent_of_measured_fsdp2_peak(measured, shape, precision, ac):
    overrides, seq, micro_batch = SHAPES[shape]
    plan = plan_memory(
        GlmMoeConfig.tiny_debug(**overrides), ParallelDims(dp_shard=2), seq, micro_batch, precision, ac
    )
    for rank, res in measured.items():
        got = res[f"{shape}_{precision}_{ac}"]
        assert isinstance(got, int), f"rank {rank} failed:\n{got}"
        ratio = plan.peak_bytes / got
        assert 0.85 <= ratio <= 1.15, (
            f"{shape} {precision} AC={ac} rank {rank}: planned {plan.peak_bytes:.0f} B vs measured {got} B "
            f"(ratio {ratio:.3f}); plan {plan.components} at {plan.peak_phase}"
        )


def test_activations_without_checkpointing_match_the_meter_in_one_process():
    """The per-token formulas reproduce the measured end-of-forward bytes of the fp32 model (within 3%)."""
    cfg = GlmMoeConfig.tiny_debug(vocab_size=256, num_hidden_layers=3)
    model = GlmMoeForCausalLM(cfg, experts_backend="grouped_mm")
    ids = torch.randint(3, 256, (2, 128))
    meter = LiveBytesMeter()
    meter.track(*model.parameters())
    with meter:
        base = meter.current_bytes
        logp = torch.log_softmax(model(ids)[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
        saved = meter.current_bytes - base - logp.untyped_storage().nbytes()
    plan = plan_memory(cfg, ParallelDims(), 128, 2, "fp32", "none")
    assert plan.peak_phase == "output_head_backward"
    assert abs(plan.components["activations"] / saved - 1) < 0.03, (plan.components["activations"], saved)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"use_qk_norm": True, "attention_bias": False},
     {"num_hidden_layers": 4, "first_k_dense_replace": 2, "n_shared_experts": 0}],
)
def test_glm4_parameter_count_is_exact(overrides):
    cfg = GlmMoeConfig.tiny_debug(**overrides)
    with torch.device("meta"):
        model = GlmMoeForCausalLM(cfg)
    assert arch_spec(cfg).total_params == sum(p.numel() for p in model.parameters())


def test_glm5_1_counts_match_the_published_744b_total_and_40b_active():
    spec = arch_spec(GlmMoeDsaConfig.glm5_1())
    mtp = spec.layers[-1].params  # the one MTP layer (published totals count the 78 decoder layers)
    main = spec.total_params - mtp
    assert abs(main / 744e9 - 1) < 0.01, main
    assert abs(spec.active_params / 40e9 - 1) < 0.01, spec.active_params
    assert 0.96 < spec.expert_params / spec.total_params < 0.99


def test_seed_arithmetic_one_fp32_layer_allgather_and_ep8():
    assert abs(layer_allgather_bytes(800e9, 78) / 41.03e9 - 1) < 1e-3  # "about 40 GB"
    cfg = GlmMoeDsaConfig.glm5_1()
    no_ep = plan_memory(cfg, ParallelDims(dp_shard=64), 4096, 1, "fp32", "full")
    ep8 = plan_memory(cfg, ParallelDims(dp_shard=64, ep=8), 4096, 1, "fp32", "full")
    one = no_ep.details["layer_allgather_bytes"]
    assert 38e9 < one < 41e9, one  # one fp32 all-gather of a GLM-5.1 MoE layer ~ 39.5 GB
    assert one / ep8.details["layer_allgather_bytes"] > 6.5  # experts (~98% of the layer) split 8 ways
    # sharded state is unchanged by EP (same fraction of every parameter per GPU)
    assert no_ep.components["parameters"] == ep8.components["parameters"]


def test_sharding_divides_parameters_gradients_and_optimizer_state():
    cfg = GlmMoeDsaConfig.glm5_1()
    a = plan_memory(cfg, ParallelDims(dp_shard=16, cp=4, ep=8), 131072, 1)
    b = plan_memory(cfg, ParallelDims(dp_shard=32, cp=4, ep=8), 131072, 1)
    for name in ("parameters", "gradients", "optimizer"):
        assert a.components[name] == pytest.approx(2 * b.components[name])
    assert a.components["activations"] == b.components["activations"]
    off = plan_memory(cfg, ParallelDims(dp_shard=32, cp=4, ep=8), 131072, 1, optimizer_offload=True)
    assert off.components["optimizer"] == 0


def test_report_says_whether_the_glm5_1_layout_fits():
    plan = plan_memory(GlmMoeDsaConfig.glm5_1(), ParallelDims(dp_shard=56, cp=4, ep=8), 131072, 1,
                       loss_chunk_tokens=4096)
    text = plan.report(141e9)
    verdict = "fits in" if plan.fits(141e9) else "does NOT fit in"
    assert "| **peak** |" in text and verdict in text, text
    assert plan.fits(plan.peak_bytes + plan.reserve_bytes) and not plan.fits(plan.peak_bytes)
    assert plan.peak_bytes / GiB > 50


def test_bad_arguments_raise_with_the_rule():
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard\*cp = 2\*2 = 4"):
        ParallelDims(dp_shard=2, cp=2, ep=3)
    with pytest.raises(ValueError, match=r"seq_len=10 must be divisible by cp=4"):
        plan_memory(GlmMoeConfig.tiny_debug(), ParallelDims(dp_shard=1, cp=4), 10)
    with pytest.raises(ValueError, match=r"precision='fp8'"):
        plan_memory(GlmMoeConfig.tiny_debug(), ParallelDims(), 16, precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ArchSpec or a model config with an arch_spec\(\) method"):
        plan_memory(object(), ParallelDims(), 16)


def test_planner_reads_shapes_not_families():
    """The planner imports no model family: a config describes itself through ``arch_spec()``, and the shape
    builders name the protocol fields a config lacks."""
    from moe_rl.distributed.memory import GqaShape, MlaDsaShape, gqa_arch_spec, mla_dsa_arch_spec

    gqa, mla = GlmMoeConfig.tiny_debug(), GlmMoeDsaConfig.tiny_debug()
    assert isinstance(gqa, GqaShape) and not isinstance(gqa, MlaDsaShape)
    assert isinstance(mla, MlaDsaShape) and not isinstance(mla, GqaShape)
    assert arch_spec(gqa) == gqa_arch_spec(gqa) and arch_spec(gqa).name == "glm4_moe"
    assert arch_spec(mla) == mla_dsa_arch_spec(mla) and arch_spec(mla).name == "glm_moe_dsa"
    spec = arch_spec(mla)
    assert arch_spec(spec) is spec  # an ArchSpec passes through
    with pytest.raises(TypeError, match=r"gqa_arch_spec needs a GqaShape.*lacks \[.*'head_dim'"):
        gqa_arch_spec(mla)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mla_dsa_arch_spec needs a MlaDsaShape.*lacks \[.*'kv_lora_rank'"):
        mla_dsa_arch_spec(gqa)  # type: ignore[arg-type]


def test_meter_counts_resize_and_frees():
    meter = LiveBytesMeter()
    with meter:
        x = torch.empty(1000, dtype=torch.float32)
        assert meter.current_bytes == 4000
        x.untyped_storage().resize_(0)
        assert meter.current_bytes == 0
        x.untyped_storage().resize_(8000)
        assert meter.current_bytes == 8000
        del x
        y = torch.zeros(10)
        assert meter.current_bytes == 40
    assert meter.peak_bytes == 8000
    del y


DOC_COMMANDS = [
    # the GLM-5.1 recipe's trainer (16 nodes, bf16, memory-bounded DSA, FP8, AdamW offload) at CP 4 and 8, and what
    # the fp32 trainer and the dense DSA reference would need
    ["--precision", "bf16", "--attn-kernel", "chunked", "--cp", "4", "--nodes", "16"],
    ["--precision", "bf16", "--attn-kernel", "chunked", "--cp", "8", "--nodes", "16"],
    ["--precision", "fp32", "--attn-kernel", "chunked", "--cp", "4", "--nodes", "16"],
    ["--precision", "bf16", "--attn-kernel", "dense", "--cp", "8", "--nodes", "16"],
]
DOC_COMMON = ["--model", "glm5_1", "--ep", "8", "--loss-chunk-tokens", "4096", "--optimizer-offload", "--fp8",
              "--gpu-gib", "140.4"]


@pytest.mark.parametrize("args", DOC_COMMANDS, ids=lambda a: "_".join(a[1::2]))
def test_docs_memory_page_is_what_the_command_prints(capsys, args):
    """docs/memory.md embeds the output of ``python -m moe_rl.launch.memory``; regenerate the page when the planner
    changes."""
    from moe_rl.launch.memory import main

    main(DOC_COMMON + args)
    printed = capsys.readouterr().out
    page = (HERE.parents[1] / "docs" / "memory.md").read_text()
    tables = [block for block in printed.split("## ")[1:]]
    assert tables
    for block in tables:
        assert block.strip() in page, f"docs/memory.md is stale; regenerate it. Missing:\n{block}"


def test_trainer_plan_inputs_read_what_the_trainer_runs():
    """One mapping from both trainer configs to the planner: dtype, DSA kernel, checkpointing, offload, FP8, CP."""
    from moe_rl.distributed.memory import trainer_plan_inputs
    from moe_rl.launch.config import TrainerLayout
    from moe_rl.runtime.trainer.config import TrainerConfig

    layout = TrainerLayout(num_nodes=16, cp=8, ep=8, seq_len=131072, fp8=True, optimizer_offload=True)
    inp = trainer_plan_inputs(GlmMoeDsaConfig.glm5_1(attn_backend="torch"), layout, gpus_per_node=8)
    assert (inp.dtype, inp.attn_kernel, inp.activation_checkpointing, inp.optimizer_offload, inp.fp8) == (
        "bfloat16", "chunked", "full", True, True)
    assert inp.parallel_dims == ParallelDims(dp_shard=16, cp=8, ep=8) and inp.loss_chunk_tokens == 4096
    dense = trainer_plan_inputs(GlmMoeDsaConfig.glm5_1(attn_backend="dense"), layout.model_copy(update={
        "dtype": "float32"}), gpus_per_node=8)
    assert (dense.dtype, dense.attn_kernel, dense.precision) == ("float32", "dense", "fp32")
    assert dense.plan().peak_bytes > 2 * inp.plan().peak_bytes
    cpu = TrainerConfig.model_validate({"nproc_per_node": 2, "parallel": {"cp": 2, "activation_checkpointing": True}})
    ci = trainer_plan_inputs(GlmMoeConfig.tiny_debug(), cpu, seq_len=64)
    assert (ci.dtype, ci.activation_checkpointing, ci.parallel_dims.cp, ci.attn_kernel) == ("float32", "full", 2, "dense")
    with pytest.raises(ValueError, match="seq_len is required"):
        trainer_plan_inputs(GlmMoeConfig.tiny_debug(), cpu)
    with pytest.raises(ValueError, match="gpus_per_node is required"):
        trainer_plan_inputs(GlmMoeDsaConfig.glm5_1(), layout)
    with pytest.raises(TypeError, match="TrainerLayout or a TrainerConfig"):
        trainer_plan_inputs(GlmMoeDsaConfig.glm5_1(), object())


def test_memory_bounded_dsa_grows_linearly_and_the_dense_reference_quadratically():
    cfg = GlmMoeDsaConfig.glm5_1()
    dims = ParallelDims(dp_shard=32, cp=4, ep=8)

    def act(kernel, seq):
        p = plan_memory(cfg, dims, seq, 1, "bf16", "full", True, loss_chunk_tokens=4096, attn_kernel=kernel)
        # activations + transients of the forward/backward phases (the optimizer step does not depend on seq)
        return max(p.details[f"{k}_bytes"] for k in ("output_head_backward", "layer_backward", "attention_forward",
                                                      "attention_backward"))

    assert 1.8 < act("chunked", 131072) / act("chunked", 65536) < 2.2
    # the dense reference's [Tq, Tk] indexer transient quadruples when the sequence doubles
    dense = [plan_memory(cfg, dims, seq, 1, "bf16", "full", True, attn_kernel="dense").details[
        "dsa_forward_transient_bytes"] for seq in (65536, 131072)]
    assert 3.9 < dense[1] / dense[0] <= 4.0
    assert act("dense", 131072) > 2 * act("chunked", 131072)


def test_bad_planner_inputs_raise_naming_the_field():
    from moe_rl.distributed.memory import PlanInputs

    with pytest.raises(ValueError, match=r"attn_kernel='flash' must be 'dense'"):
        plan_memory(GlmMoeDsaConfig.tiny_debug(), ParallelDims(), 16, attn_kernel="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=0 must be >= 1"):
        plan_memory(GlmMoeDsaConfig.tiny_debug(), ParallelDims(), 16, loss_chunk_tokens=0)
    with pytest.raises(ValueError, match=r"trainer.dtype='float16' must be 'float32' or 'bfloat16'"):
        PlanInputs(GlmMoeDsaConfig.tiny_debug(), ParallelDims(), 16, dtype="float16")  # type: ignore[arg-type]
