"""``moe-rl cluster ... --dry-run``: exit codes, the printed memory plan equals ``plan_memory`` called directly, and the
published-only architectures' parameter-state check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_rl import cli
from moe_rl.distributed.memory import GiB, plan_memory
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

REPO = Path(__file__).resolve().parents[2]
GLM = str(REPO / "recipes/glm5_1/rl.toml")
KIMI = str(REPO / "recipes/kimi_k2_7_code/rl.toml")
NEMO = str(REPO / "recipes/nemotron_3_ultra_550b/rl.toml")
H200 = 141e9


def _run(capsys, *args):
    rc = cli.main(["cluster", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _glm_plan(optimizer_offload: bool):
    """The recipe's trainer layout, built by hand: 16 nodes x 8 GPUs, cp 4 -> dp_shard 32, ep 8."""
    plan = plan_memory(GlmMoeDsaConfig.glm5_1(), ParallelDims(dp_shard=32, cp=4, ep=8), 131072, 1, "bf16", "full",
                       optimizer_offload, loss_chunk_tokens=4096)
    return plan


def test_glm5_1_dry_run_prints_the_plan_of_plan_memory(capsys):
    rc, out, err = _run(capsys, "@", GLM, "--dry-run")
    assert rc == 0, err
    assert "nodes: 28 x 8 H200 = trainer 16 + inference 12 (prefill 4x1 + decode 8x1)" in out
    assert "processes: 43 (" in out
    ref = _glm_plan(optimizer_offload=True)
    for name, value in ref.components.items():
        assert f"| {name} | {value / GiB:.2f} |" in out
    assert f"| **peak** | **{ref.peak_bytes / GiB:.2f}** | 100% |" in out
    margin = (H200 - ref.peak_bytes - 3 * GiB) / GiB
    assert margin > 0
    assert f"fits in {H200 / GiB:.1f} GiB with 3.0 GiB reserved: margin {margin:+.2f} GiB" in out
    assert "verdict: OK (0 errors" in out
    # every process's command is printed
    assert out.count("\n  $ ") == 43
    assert "--all2all-backend deepep_low_latency" in out and "--all2all-backend deepep_high_throughput" in out


def test_glm5_1_without_optimizer_offload_fails_with_the_planners_numbers(capsys):
    rc, out, err = _run(capsys, "@", GLM, "--dry-run", "--trainer.optimizer-offload", "false")
    assert rc == 1
    ref = _glm_plan(optimizer_offload=False)
    margin = (H200 - ref.peak_bytes - 3 * GiB) / GiB
    assert margin < 0
    assert f"| **peak** | **{ref.peak_bytes / GiB:.2f}** | 100% |" in out
    assert f"does NOT fit in {H200 / GiB:.1f} GiB with 3.0 GiB reserved: margin {margin:+.2f} GiB" in out
    alt = _glm_plan(optimizer_offload=True)
    assert (f"ERROR: the trainer layout does not fit: peak {ref.peak_bytes / GiB:.2f} GiB" in out
            and f"trainer.optimizer_offload=true: peak {alt.peak_bytes / GiB:.2f} GiB" in out)
    assert "does not fit" in err


def test_invalid_config_exits_2_naming_the_field(capsys):
    rc, out, err = _run(capsys, "@", GLM, "--dry-run", "--cluster.num-nodes", "30")
    assert rc == 2
    assert "cluster.num_nodes=30 but the roles use" in err
    rc, _, err = _run(capsys, "@", GLM)
    assert rc == 2 and "--dry-run, --out DIR, or both" in err


@pytest.mark.parametrize("recipe,params,arch", [(KIMI, 1.04e12, "deepseek_v3"), (NEMO, 5.5e11, "nemotron_h")])
def test_published_only_recipes_check_the_parameter_state(capsys, recipe, params, arch):
    rc, out, err = _run(capsys, "@", recipe, "--dry-run")
    assert rc == 0, err
    assert f"NOT MODELLED: the memory planner has no block model for architecture {arch!r}" in out
    state = 8 * params / 128 / GiB  # fp32 weights + grads, AdamW offloaded, over 16 nodes x 8 GPUs
    assert f"= {state:.2f} GiB per GPU" in out
    assert "WARNING: memory of architecture" in out
    # 60 GB GPUs: even the parameter state does not fit without offload
    rc, out, err = _run(capsys, "@", recipe, "--dry-run", "--cluster.gpu-memory-gb", "60",
                        "--trainer.optimizer-offload", "false")
    assert rc == 1
    assert f"even the parameter state ({16 * params / 128 / GiB:.2f} GiB per GPU)" in out


def test_out_writes_the_sbatch_plan_and_configs(capsys, tmp_path):
    rc, out, err = _run(capsys, "@", GLM, "--out", str(tmp_path))
    assert rc == 0, err
    assert "wrote" in out and "| **peak**" not in out  # without --dry-run only the verdict lines
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan) == 43 and {p["role"] for p in plan} >= {"prefill", "decode", "trainer", "router"}
    cfg = json.loads((tmp_path / "configs/cluster.json").read_text())
    assert cfg["trainer"]["cp"] == 4 and cfg["orchestrator"]["max_off_policy_steps"] == 8
    assert json.loads((tmp_path / "configs/mooncake_store.json").read_text())["mode"] == "standalone-store"
    assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash")


def test_host_memory_of_the_optimizer_offload_is_checked(capsys):
    rc, out, err = _run(capsys, "@", GLM, "--dry-run", "--cluster.host-memory-gb", "300")
    assert rc == 1
    # AdamW moments in fp32 over 32 x 4 GPUs, 8 GPUs per node
    need = 8 * 8 * _glm_plan(True).details["total_params"] / 128 / GiB
    assert f"optimizer offload needs {need:.1f} GiB of host memory per trainer node" in out


@pytest.mark.parametrize("override, msg", [
    (["--orchestrator.off-policy-policy", "mask"], "off_policy_policy='mask' with inference.mode='disaggregated'"),
    (["--trainer.router-replay", "true"], "trainer.router_replay=true with inference.mode='disaggregated'"),
    (["--weights.kind", "nccl"], "weights.kind='nccl' is not wired into the cluster entry points"),
])
def test_dry_run_reports_what_the_entry_points_refuse(capsys, override, msg):
    """A config the orchestrator/trainer would refuse at start-up fails the dry run, before the job is submitted."""
    rc, out, err = _run(capsys, "@", GLM, "--dry-run", *override)
    assert rc == 1
    assert msg in out and "the cluster entry points refuse this config" in err
