"""``moe-rl cluster ... --dry-run`` of the Nemotron-3-Ultra recipe: the trainer accepts ``nemotron_h``, the printed
trainer plan is ``plan_memory`` of the inputs the trainer runs (``NemotronHConfig.ultra_550b_a55b``: Mamba-2,
GQA and latent-MoE layers), the inference plan counts KV only for the attention layers plus a fixed Mamba-2 state
per sequence, and a layout that does not fit (CP=4: the ring attention's fp32 score blocks) fails naming one that
does."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dry_run import assert_recipe_fits, run_cluster

from moe_rl.config import ConfigError, load_config
from moe_rl.distributed.memory import plan_memory
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.launch.config import ClusterConfig
from moe_rl.models.nemotron_h import NemotronHConfig

REPO = Path(__file__).resolve().parents[2]
NEMO = str(REPO / "recipes/nemotron_3_ultra_550b/rl.toml")


def test_nemotron_dry_run_ok_with_the_plan_of_plan_memory(capsys):
    # the recipe's layout built by hand: 16 nodes x 8 GPUs, cp 32, ep 8, FP8 linears and experts, offload
    ref = plan_memory(NemotronHConfig.ultra_550b_a55b(), ParallelDims(dp_shard=4, cp=32, ep=8), 131072, 1, "bf16",
                      "full", True, loss_chunk_tokens=4096, fp8=True, fp8_experts=True)
    out = assert_recipe_fits(capsys, NEMO, "plan_memory(nemotron_h: 1x4x32 (dp_replicate x dp_shard x cp), ep=8; "
                             "seq 131072 x 1; bfloat16", ref)
    # KV for the 12 attention layers only: K and V of 2 KV heads x 128 in bf16
    assert f"| {2 * 2 * 128 * 2 * 12:,} (12.0 KiB) |" in out
    # 48 Mamba-2 layers: conv state 3 x (16384 + 2 x 8 x 128) in bf16 + SSM state 256 x 64 x 128 in fp32
    state = 48 * (3 * (16384 + 2 * 8 * 128) * 2 + 256 * 64 * 128 * 4)
    assert f"Mamba-2 state per sequence: {state / 2**20:.1f} MiB" in out


def test_cp4_does_not_fit_and_names_the_layout_that_does(capsys):
    rc, out, _ = run_cluster(capsys, "@", NEMO, "--dry-run", "--trainer.cp", "4")
    assert rc == 1
    first = out.splitlines()[0]
    # the ring attention's fp32 [64, 32768, 32768] score blocks per hop: 5 copies + the bool mask in the backward
    assert first.startswith("FAIL: the trainer layout does not fit: peak "), first
    assert "(attention_backward)" in first
    cfg = load_config(ClusterConfig, ["@", NEMO, "--trainer.cp", "4"])
    from moe_rl.launch.dry_run import trainer_memory_plan

    t = 131072 // 4
    assert trainer_memory_plan(cfg).details["attention_backward_transient_bytes"] == (20 * 64 + 1) * t * t
    assert "Layouts that fit (flags to add, cheapest first): --trainer.cp 32: peak " in first
    rc, out, _ = run_cluster(capsys, "@", NEMO, "--dry-run", "--trainer.cp", "4", "--trainer.cp", "32")
    assert rc == 0 and out.startswith("OK (")


def test_too_many_sequences_for_kv_and_mamba_state_fail_naming_the_bound(capsys):
    rc, out, _ = run_cluster(capsys, "@", NEMO, "--dry-run", "--inference.decode.max-num-seqs", "64")
    assert rc == 1
    first = out.splitlines()[0]
    assert "inference.decode.max_num_seqs=64" in first and "MiB Mamba-2 state per sequence" in first
    assert "set max_num_seqs <= 29" in first


def test_preset_picks_the_published_config_and_belongs_to_its_family():
    cfg = load_config(ClusterConfig, ["@", NEMO])
    assert cfg.model.modelled and cfg.model.experts == 512
    assert cfg.model.model_config_obj() == NemotronHConfig.ultra_550b_a55b()
    assert load_config(ClusterConfig, ["@", NEMO, "--model.preset", "nemotron_3_super"]).model.model_config_obj() \
        == NemotronHConfig.super_120b_a12b()
    assert load_config(ClusterConfig, ["@", NEMO, "--model.preset", "null"]).model.model_config_obj() == \
        NemotronHConfig.nano_30b_a3b()
    with pytest.raises(ConfigError, match=r"model.preset='kimi_k2' is read only for architecture='deepseek_v3'"):
        load_config(ClusterConfig, ["@", NEMO, "--model.preset", "kimi_k2"])
    with pytest.raises(ConfigError, match=r"remove \['total_params'\]"):
        load_config(ClusterConfig, ["@", NEMO, "--model.total-params", "5.5e11"])
