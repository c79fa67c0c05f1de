"""The GLM-5.1 memory figures the recipe headers and the launch docs quote are the ones the planner computes now.

The Kimi-K2.7 recipe's header quoted 63 GiB of GLM-5.1 activations at CP=4 (an older planner); the plan says 57.04.
"""

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


def test_kimi_recipe_header_quotes_the_glm_activations(glm_phases):
    text = " ".join(line.lstrip("# ") for line in (REPO / "recipes/kimi_k2_7_code/rl.toml").read_text().splitlines())
    assert f"GLM-5.1 plan at CP=4 already spends {glm_phases[4]['activations'][0]:.2f} GiB per GPU on activations" in text


def test_launch_docs_phase_table_quotes_the_plan(glm_phases):
    text = (REPO / "docs/blocks/launch.md").read_text()
    for name in ("output_head_backward", "layer_backward", "attention_forward", "attention_backward", "optimizer_step"):
        (a, ma), (b, mb) = glm_phases[4][name], glm_phases[8][name]
        assert f"| {name} | {a:.2f} ({ma:+.2f}) | {b:.2f} ({mb:+.2f}) |" in text, name
