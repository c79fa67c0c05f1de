"""The memory figures the recipe headers and the launch docs quote are the ones the planner computes now (GLM-5.1,
Kimi-K2.7 and Nemotron-3-Ultra: each recipe's own plan)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.dry_run import GiB, phase_peaks, trainer_memory_plan, trainer_plan_inputs_of

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def glm_phases():
    cfg = load_config(ClusterConfig, ["@", str(REPO / "recipes/glm5_1/rl.toml")])
    gpu = cfg.cluster.gpu_bytes
    out = {}
    for cp in (4, 8):
        plan = trainer_memory_plan(cfg, cp=cp)
        phases = phase_peaks(trainer_plan_inputs_of(cfg, cp=cp), plan)
        out[cp] = {name: (v / GiB, (gpu - v - plan.reserve_bytes) / GiB) for name, v in phases.items()}
        out[cp]["activations"] = (plan.components["activations"] / GiB, None)
    return out


def test_glm5_1_recipe_header_quotes_the_plan(glm_phases):
    text = (REPO / "recipes/glm5_1/rl.toml").read_text()
    lb4, lb8, opt = glm_phases[4]["layer_backward"], glm_phases[8]["layer_backward"], glm_phases[8]["optimizer_step"]
    assert f"layer backward {lb4[0]:.2f} ({lb4[1]:+.2f}) at CP=4, {lb8[0]:.2f} ({lb8[1]:+.2f}) at CP=8" in text
    assert f"{opt[0]:.2f} ({opt[1]:+.2f}) at both" in text


def test_kimi_recipe_header_quotes_its_plan():
    text = " ".join(line.lstrip("# ") for line in (REPO / "recipes/kimi_k2_7_code/rl.toml").read_text().splitlines())
    cfg = load_config(ClusterConfig, ["@", str(REPO / "recipes/kimi_k2_7_code/rl.toml")])

    def phases(**changes):
        return {k: v / GiB for k, v in phase_peaks(trainer_plan_inputs_of(cfg, **changes),
                                                   trainer_memory_plan(cfg, **changes)).items()}

    cp8, cp32, n16 = phases(cp=8), phases(), phases(num_nodes=16)
    assert (f"the attention_backward phase plans {cp8['attention_backward']:.2f} GiB per GPU at CP=8 and "
            f"{cp32['attention_backward']:.2f} GiB at CP=32") in text
    plan = trainer_memory_plan(cfg)
    margin = (cfg.cluster.gpu_bytes - plan.peak_bytes - plan.reserve_bytes) / GiB
    assert plan.peak_phase == "optimizer_step"
    assert (f"{n16['optimizer_step']:.2f} GiB per GPU on 16 nodes, {cp32['optimizer_step']:.2f} GiB on 20 (the "
            f"plan's peak; margin {margin:+.2f} GiB") in text


def test_nemotron_recipe_header_quotes_its_plan():
    from moe_rl.distributed.memory import arch_spec
    from moe_rl.launch.dry_run import inference_memory_plan

    recipe = REPO / "recipes/nemotron_3_ultra_550b/rl.toml"
    text = " ".join(line.lstrip("# ") for line in recipe.read_text().splitlines())
    cfg = load_config(ClusterConfig, ["@", str(recipe)])
    gpu = cfg.cluster.gpu_bytes

    def phases(**changes):
        return {k: v / GiB for k, v in phase_peaks(trainer_plan_inputs_of(cfg, **changes),
                                                   trainer_memory_plan(cfg, **changes)).items()}

    plan = trainer_memory_plan(cfg)
    cp32, cp4 = phases(), phases(cp=4)
    margin = (gpu - plan.peak_bytes - plan.reserve_bytes) / GiB
    assert plan.peak_phase == "optimizer_step" and max(cp32, key=cp32.get) == "optimizer_step"
    assert (f"at CP=32 (4096 tokens per GPU) the peak is the optimizer step, {cp32['optimizer_step']:.2f} GiB per "
            f"H200 ({margin:+.2f} GiB margin); the ring attention's backward is {cp32['attention_backward']:.2f} GiB"
            ) in text
    score_blocks = trainer_memory_plan(cfg, cp=4).details["attention_backward_transient_bytes"] / GiB
    assert (f"score blocks alone take {score_blocks:.0f} GiB (attention backward {cp4['attention_backward']:.2f} GiB)"
            ) in text
    arch = arch_spec(cfg.model.model_config_obj())
    assert f"{arch.total_params / 1e9:.1f}B parameters, {arch.active_params / 1e9:.1f}B active" in text
    decode = next(r for r in inference_memory_plan(cfg) if r.role == "decode")
    assert (f"12 KiB per token in bf16) plus a fixed Mamba-2 state of {decode.state_bytes_per_seq / 2**20:.1f} MiB "
            f"per sequence") in text and decode.kv_bytes_per_token == 12 * 1024
    assert f"{decode.contexts_per_gpu:.2f} full 131072-token contexts per decode GPU" in text
    assert decode.max_num_seqs <= int(decode.contexts_per_gpu)


def test_launch_docs_phase_table_quotes_the_plan(glm_phases):
    text = (REPO / "docs/blocks/launch.md").read_text()
    for name in ("output_head_backward", "layer_backward", "attention_forward", "attention_backward", "optimizer_step"):
        (a, ma), (b, mb) = glm_phases[4][name], glm_phases[8][name]
        assert f"| {name} | {a:.2f} ({ma:+.2f}) | {b:.2f} ({mb:+.2f}) |" in text, name
