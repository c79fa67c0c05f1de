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
    with pytest.raises(TypeError, match="GlmMoeConfig or GlmMoeDsaConfig"):
        plan_memory(object(), ParallelDims(), 16)


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


def test_docs_memory_page_is_what_the_command_prints(capsys):
    """docs/memory.md embeds the CLI's output; regenerate the page when the planner changes."""
    from moe_rl.distributed.memory import _main

    _main(["--model", "glm5_1", "--nodes", "16", "20", "28", "--cp", "4", "--ep", "8", "--loss-chunk-tokens", "4096"])
    printed = capsys.readouterr().out
    page = (HERE.parents[1] / "docs" / "memory.md").read_text()
    tables = [block for block in printed.split("## ")[1:]]
    assert tables
    for block in tables:
        assert block.strip() in page, f"docs/memory.md is stale; regenerate it. Missing:\n{block}"
