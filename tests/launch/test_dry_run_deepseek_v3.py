"""``moe-rl cluster ... --dry-run`` of a DeepSeek-V3 / Kimi-K2 recipe: the trainer accepts ``deepseek_v3``, the
printed trainer plan is ``plan_memory`` of the inputs the trainer runs (``DeepseekV3Config.kimi_k2``: plain MLA in
its dense form), the inference KV plan counts one MLA latent + rope key per token and layer, a layout that does not
fit fails naming the one that does, and an INT4 engine checkpoint is refused (the trainer cannot publish INT4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _dry_run import assert_recipe_fits, run_cluster

from moe_rl.config import ConfigError, load_config
from moe_rl.distributed.memory import plan_memory
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.launch.config import ClusterConfig
from moe_rl.models.deepseek_v3.config import DeepseekV3Config

REPO = Path(__file__).resolve().parents[2]
KIMI = str(REPO / "recipes/kimi_k2_7_code/rl.toml")


def test_kimi_dry_run_ok_with_the_plan_of_plan_memory(capsys):
    # the recipe's layout built by hand: 20 nodes x 8 GPUs, cp 32, ep 8, FP8 linears and experts, offload
    ref = plan_memory(DeepseekV3Config.kimi_k2(), ParallelDims(dp_shard=5, cp=32, ep=8), 131072, 1, "bf16", "full",
                      True, loss_chunk_tokens=4096, fp8=True, fp8_experts=True)
    out = assert_recipe_fits(capsys, KIMI, "plan_memory(deepseek_v3: 1x5x32 (dp_replicate x dp_shard x cp), ep=8; "
                             "seq 131072 x 1; bfloat16", ref)
    # MLA KV cache: (kv_lora_rank 512 + rope 64) x 2 B (bf16) x 61 layers, no DSA indexer key
    assert f"| {(512 + 64) * 2 * 61:,} (68.6 KiB) |" in out


def test_kimi_layout_that_does_not_fit_names_the_one_that_does(capsys):
    rc, out, err = run_cluster(capsys, "@", KIMI, "--dry-run", "--cluster.num-nodes", "28",
                               "--trainer.num-nodes", "16", "--trainer.cp", "8")
    assert rc == 1
    first = out.splitlines()[0]
    # the dense attention's fp32 [64, 16384, 16384] score blocks per ring hop
    assert first.startswith("FAIL: the trainer layout does not fit: peak "), first
    assert "(attention_backward)" in first
    assert "--cluster.num-nodes 32 --trainer.num-nodes 20 --trainer.cp 32: peak 119.49 GiB" in first
    # applying the suggestion gives the recipe's layout, which fits
    rc, out, _ = run_cluster(capsys, "@", KIMI, "--dry-run", "--cluster.num-nodes", "32",
                             "--trainer.num-nodes", "20", "--trainer.cp", "32")
    assert rc == 0 and out.startswith("OK (")


def test_int4_engine_checkpoint_is_refused_naming_what_to_set(capsys):
    rc, out, err = run_cluster(capsys, "@", KIMI, "--dry-run", "--model.inference-quantization", "int4")
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith("FAIL: the cluster entry points refuse this config: the engines serve an INT4 "
                            "checkpoint"), first
    assert "no INT4 publisher" in first and "model.inference_quantization='fp8' with weights.quantize_fp8=true" in first


def _ckpt(tmp_path: Path, quantization: dict | None) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = {"model_type": "kimi_k2"} | ({"quantization_config": quantization} if quantization else {})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                         "group_size": 32, "symmetric": True}}}}


@pytest.mark.parametrize("quant,expected", [(INT4, "int4"), ({"quant_method": "fp8", "weight_block_size": [128, 128]},
                                                              "fp8"), (None, "none")])
def test_checkpoint_quantization_reads_a_local_config(tmp_path, quant, expected):
    from moe_rl.runtime.checks import checkpoint_quantization

    assert checkpoint_quantization(str(_ckpt(tmp_path, quant))) == expected
    assert checkpoint_quantization("moonshotai/Kimi-K2-Instruct") is None  # a hub id: nothing downloaded


def test_a_local_int4_checkpoint_is_refused_without_a_declaration(capsys, tmp_path):
    ckpt = str(_ckpt(tmp_path, INT4))
    rc, out, _ = run_cluster(capsys, "@", KIMI, "--dry-run", "--model.inference-checkpoint", ckpt,
                             "--model.inference-quantization", "null")
    assert rc == 1 and "the engines serve an INT4 checkpoint" in out.splitlines()[0]
    # a declaration that contradicts the checkpoint's config.json is refused too
    rc, out, _ = run_cluster(capsys, "@", KIMI, "--dry-run", "--model.inference-checkpoint", ckpt)
    assert rc == 1 and "model.inference_quantization='fp8' but the config.json" in out.splitlines()[0]


def test_preset_is_deepseek_v3_only_and_picks_the_published_config():
    cfg = load_config(ClusterConfig, ["@", KIMI])
    assert cfg.model.model_config_obj() == DeepseekV3Config.kimi_k2() and cfg.model.experts == 384
    assert load_config(ClusterConfig, ["@", KIMI, "--model.preset", "null"]).model.model_config_obj() == \
        DeepseekV3Config.deepseek_v3()
    with pytest.raises(ConfigError, match=r"model.preset='kimi_k2' is read only for architecture='deepseek_v3'"):
        load_config(ClusterConfig, ["@", str(REPO / "recipes/glm5_1/rl.toml"), "--model.preset", "kimi_k2"])
