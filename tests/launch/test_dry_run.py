"""``moe-rl cluster ... --dry-run``: the verdict is the first line, exit codes, the printed memory plan equals
``plan_memory`` of the inputs the trainer runs (bf16, memory-bounded DSA, FP8, CP), the inference KV plan, and the
refusals the entry points would raise (a model the trainer cannot build, a layout that does not fit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _dry_run import assert_plan_printed, run_cluster

from moe_rl.distributed.memory import GiB, plan_memory
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig

REPO = Path(__file__).resolve().parents[2]
GLM = str(REPO / "recipes/glm5_1/rl.toml")
KIMI = str(REPO / "recipes/kimi_k2_7_code/rl.toml")
H200 = 140.4 * GiB  # the recipe's cluster.gpu_memory_gib


def _glm_plan(cp: int = 8, optimizer_offload: bool = True, precision: str = "bf16", kernel: str = "chunked"):
    """The recipe's trainer layout, built by hand: 16 nodes x 8 GPUs, dp_shard 128 / cp, ep 8, FP8 linears and
    experts, the memory-bounded DSA kernel."""
    return plan_memory(GlmMoeDsaConfig.glm5_1(), ParallelDims(dp_shard=128 // cp, cp=cp, ep=8), 131072, 1, precision,
                       "full", optimizer_offload, loss_chunk_tokens=4096, attn_kernel=kernel, fp8=True,
                       fp8_experts=True)


def test_glm5_1_dry_run_verdict_first_and_the_plan_of_plan_memory(capsys):
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run")
    assert rc == 0, err
    assert out.splitlines()[0] == "OK (0 errors, 1 warnings)"  # the listeners on every interface (torch, Mooncake)
    assert "kinds of listener bind every interface" in out + err
    assert "trains on: built-in task AdditionTaskConfig (max_new_tokens 4)" in out
    assert "nodes: 28 x 8 H200 = trainer 16 + inference 12 (prefill 4x1 + decode 8x1)" in out
    assert "processes: 43 (" in out
    assert "bfloat16, DSA chunked; AC full; optimizer_offload=true; loss chunk 4096, fp8 linears + experts" in out
    ref = _glm_plan()
    assert_plan_printed(out, ref)
    margin = (H200 - ref.peak_bytes - 3 * GiB) / GiB
    assert margin > 0
    assert f"fits in {H200 / GiB:.1f} GiB with 3.0 GiB reserved: margin {margin:+.2f} GiB" in out
    assert out.rstrip().endswith("verdict: OK (0 errors, 1 warnings)")
    # repeated processes are condensed: one line per kind, the varying numbers as {first..last}
    assert "[stage 1] 12 x mooncake_client  node {16..27}  gpus 0" in out
    assert "[stage 2] 7 x decode  node {21..27}  gpus 8" in out and "[stage 4] 16 x trainer  node {0..15}" in out
    assert "--data-parallel-start-rank '{8..56 step 8}'" in out
    assert out.count("\n  $ ") == 9  # master, clients, prefill head + rest, decode head + rest, router, trainers, orchestrator
    assert "--all2all-backend deepep_low_latency" in out and "--all2all-backend deepep_high_throughput" in out


def test_glm5_1_inference_plan_kv_per_token_and_contexts(capsys):
    """MLA + DSA KV per token from the config: (512 + 64) x 2 B + the indexer key (128 + 4 B) per layer, x 78."""
    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--inference.decode.kv-cache-dtype", "auto",
                             "--inference.prefill.kv-cache-dtype", "auto")
    per_token = ((512 + 64) * 2 + 128 + 4) * 78
    assert per_token == 100_152 and f"{per_token:,} (97.8 KiB)" in out
    # decode: 0.75 x 140.4 GiB - 32.39 GiB FP8 weights - 8 GiB reserve = 64.91 GiB of KV = 5.31 contexts of 131,072
    assert rc == 1  # 8 sequences per decode GPU do not fit in bf16 KV
    first = out.splitlines()[0]
    assert first.startswith("FAIL: inference.decode.max_num_seqs=8 but one DP rank's KV budget"), first
    assert "holds 5.31 full contexts of max_model_len=131072; set max_num_seqs <= 5" in first
    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run")
    assert rc == 0 and f"{(656 + 132) * 78:,} (60.0 KiB)" in out
    assert "| decode | 64 | 1 | 32.39 |" in out and "| prefill | 32 | 1 | 42.94 |" in out


def test_recipe_concurrency_that_the_kv_plan_cannot_hold_fails(capsys):
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run", "--inference.decode.max-num-seqs", "96")
    assert rc == 1
    assert out.splitlines()[0].startswith("FAIL: inference.decode.max_num_seqs=96 but one DP rank's KV budget")
    assert "set max_num_seqs <= 8" in err


def test_admitting_more_rollouts_than_the_engines_run_is_warned(capsys):
    """max_inflight counts groups: 2048 x 16 rollouts against 64 decode ranks x 8 sequences queue in the engines."""
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run", "--orchestrator.max-inflight", "2048")
    assert rc == 0
    assert out.splitlines()[0] == "OK (0 errors, 2 warnings)"  # + the listeners on every interface
    assert ("orchestrator.max_inflight=2048 groups x group_size=16 = 32768 rollouts admitted, but the engines run 512 "
            "sequences at once") in out + err
    assert "lower max_inflight to about 32" in out + err
    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run")
    assert rc == 0 and "max_inflight" not in out.split("## resolved config")[0]


def test_a_layout_that_does_not_fit_fails_with_the_reason_first(capsys):
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run", "--trainer.cp", "4",
                               "--trainer.optimizer-offload", "false")
    assert rc == 1
    ref = _glm_plan(cp=4, optimizer_offload=False)
    margin = (H200 - ref.peak_bytes - 3 * GiB) / GiB
    assert margin < 0
    assert out.splitlines()[0].startswith(f"FAIL: the trainer layout does not fit: peak {ref.peak_bytes / GiB:.2f} GiB")
    assert f"| **peak** | **{ref.peak_bytes / GiB:.2f}** | 100% |" in out
    assert f"does NOT fit in {H200 / GiB:.1f} GiB with 3.0 GiB reserved: margin {margin:+.2f} GiB" in out
    alt = _glm_plan(cp=8, optimizer_offload=False)  # one changed setting, no offload: the cheapest that fits
    assert f"cheapest first): --trainer.cp 8: peak {alt.peak_bytes / GiB:.2f} GiB" in out
    assert "does not fit" in err


def test_the_plan_follows_trainer_dtype(capsys):
    """The fp32 trainer (what the CPU recipe runs) is planned as fp32: CP=4 does not fit an H200."""
    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--trainer.dtype", "float32", "--trainer.cp", "4")
    ref = _glm_plan(cp=4, precision="fp32")
    assert rc == 1 and "float32, DSA chunked" in out
    assert f"| **peak** | **{ref.peak_bytes / GiB:.2f}** | 100% |" in out
    assert ref.peak_bytes > _glm_plan(cp=4).peak_bytes * 1.3


def test_invalid_config_exits_2_naming_the_field(capsys):
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run", "--cluster.num-nodes", "30")
    assert rc == 2
    assert "cluster.num_nodes=30 but the roles use" in err
    rc, _, err = run_cluster(capsys, "@", GLM)
    assert rc == 2 and "--dry-run, --out DIR, or both" in err
    rc, _, err = run_cluster(capsys, "@", GLM, "--dry-run", "--trainer.dtype", "float16")
    assert rc == 2 and "trainer.dtype" in err


def test_out_writes_the_sbatch_plan_and_configs(capsys, tmp_path):
    rc, out, err = run_cluster(capsys, "@", GLM, "--out", str(tmp_path))
    assert rc == 0, err
    assert "wrote" in out and "| **peak**" not in out  # without --dry-run only the verdict lines
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan) == 43 and {p["role"] for p in plan} >= {"prefill", "decode", "trainer", "router"}
    cfg = json.loads((tmp_path / "configs/cluster.json").read_text())
    assert cfg["trainer"]["cp"] == 8 and cfg["orchestrator"]["max_off_policy_steps"] == 8
    assert json.loads((tmp_path / "configs/mooncake_store.json").read_text())["mode"] == "standalone-store"
    assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert (tmp_path / "dry_run.txt").read_text().startswith("OK (")


def test_host_memory_of_the_optimizer_offload_is_checked(capsys):
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run", "--cluster.host-memory-gb", "300")
    assert rc == 1
    # AdamW moments in fp32 of the trained parameters (the MTP layer gets no gradient) over 16 x 8 GPUs, 8 per node
    need = 8 * 8 * _glm_plan().details["trained_params"] / 128 / GiB
    assert f"optimizer offload needs {need:.1f} GiB of host memory per trainer node" in out


@pytest.mark.parametrize("override, msg", [
    (["--orchestrator.off-policy-policy", "mask"], "off_policy_policy='mask' with inference.mode='disaggregated'"),
    (["--trainer.router-replay", "true"], "trainer.router_replay=true with inference.mode='disaggregated'"),
    (["--weights.kind", "broadcast", "--weights.quantize-fp8", "true"],
     "weights.kind='broadcast' with weights.quantize_fp8=true"),
])
def test_dry_run_reports_what_the_entry_points_refuse(capsys, override, msg):
    """A config the orchestrator/trainer would refuse at start-up fails the dry run, before the job is submitted."""
    rc, out, err = run_cluster(capsys, "@", GLM, "--dry-run", *override)
    assert rc == 1
    assert msg in out.splitlines()[0] and "refuse this config" in err


def test_condense_processes_merges_only_number_differences():
    from moe_rl.launch.dry_run import condense_processes
    from moe_rl.launch.plan import Process

    procs = [Process(f"w.n{i}", "decode", 20 + i, ("serve", f"--rank={8 * i}", "--host", f"${{HOST_{20 + i}}}"))
             for i in range(1, 4)]
    procs.append(Process("other", "decode", 30, ("serve", "--flag")))
    lines = condense_processes(procs)
    assert lines[0] == "[stage 0] 3 x decode  node {21..23}  gpus 0"
    assert lines[1] == "  $ serve '--rank={8..24 step 8}' --host '${HOST_{21..23}}'"
    assert lines[2] == "[stage 0] other  node 30  gpus 0" and lines[3] == "  $ serve --flag"


def test_the_plan_follows_the_models_dsa_kernel(capsys):
    """``model.config.attn_backend = "dense"`` (the [T, T] reference) is planned as such and does not fit."""
    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--model.config.attn-backend", "dense")
    ref = _glm_plan(kernel="dense")
    assert rc == 1 and "bfloat16, DSA dense" in out
    assert out.splitlines()[0].startswith(f"FAIL: the trainer layout does not fit: peak {ref.peak_bytes / GiB:.2f} GiB")
    assert ref.peak_bytes > 2.5 * _glm_plan().peak_bytes


def _suggested_flags(first_line: str) -> list[list[str]]:
    """The flag sets of the ``Layouts that fit (...): --a.b v --c.d w: peak ...; ...`` part of a FAIL line."""
    assert "Layouts that fit (flags to add, cheapest first): " in first_line, first_line
    tail = first_line.split("Layouts that fit (flags to add, cheapest first): ", 1)[1]
    return [part.split(": peak ")[0].split() for part in tail.split("; ")]


@pytest.mark.parametrize("flags", [
    ["--trainer.cp", "1"],
    ["--model.config.attn-backend", "dense"],
    ["--trainer.cp", "4", "--trainer.optimizer-offload", "false"],
    ["--trainer.dtype", "float32", "--trainer.cp", "4"],
    ["--trainer.num-nodes", "2", "--cluster.num-nodes", "14"],  # no layout on 2 nodes: nodes added to both counts
])
def test_every_suggested_layout_applied_gives_ok(capsys, flags):
    """Every printed suggestion is a complete set of flags: appended to the failing command it gives OK (a
    suggestion such as ``trainer.num_nodes=23`` alone, which breaks the node sum, is never printed)."""
    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", *flags)
    assert rc == 1
    suggestions = _suggested_flags(out.splitlines()[0])
    assert suggestions
    for extra in suggestions:
        rc2, out2, err2 = run_cluster(capsys, "@", GLM, "--dry-run", *flags, *extra)
        assert rc2 == 0, (extra, err2)
        assert out2.splitlines()[0].startswith("OK ("), extra


def test_suggestions_search_every_layout_on_the_same_nodes(capsys):
    """CP=1 fails, but CP=4 and CP=8 fit on the same 16 nodes: they are listed (cheapest, i.e. smallest CP, first);
    the dense DSA reference gets the memory-bounded kernel as its one-flag fix."""
    _, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--trainer.cp", "1")
    first = out.splitlines()[0]
    sugg = _suggested_flags(first)
    assert sugg[0] == ["--trainer.cp", "4"] and ["--trainer.cp", "8"] in sugg
    assert "No layout" not in first and "num_nodes" not in first
    _, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--model.config.attn-backend", "dense")
    assert _suggested_flags(out.splitlines()[0])[0] == ["--model.config.attn-backend", "torch"]
    # nothing fits on 2 trainer nodes: the suggestion adds the same nodes to both counts, so they still add up
    _, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--trainer.num-nodes", "2", "--cluster.num-nodes", "14")
    (only,) = _suggested_flags(out.splitlines()[0])
    assert only[0] == "--cluster.num-nodes" and only[2] == "--trainer.num-nodes"
    assert int(only[1]) - 14 == int(only[3]) - 2 > 0


def test_without_dry_run_the_verdict_is_first_and_fail_writes_nothing(capsys, tmp_path):
    rc, out, err = run_cluster(capsys, "@", GLM, "--trainer.cp", "1", "--out", str(tmp_path / "bad"))
    assert rc == 1
    assert out.splitlines()[0].startswith("FAIL: the trainer layout does not fit")
    assert not (tmp_path / "bad").exists()
    assert "nothing written" in err
    rc, out, err = run_cluster(capsys, "@", GLM, "--out", str(tmp_path / "good"))
    assert rc == 0, err
    assert out.splitlines()[0] == "OK (0 errors, 1 warnings)"  # the listeners on every interface
    assert (tmp_path / "good/job.sbatch").exists()
    before = (tmp_path / "good/job.sbatch").read_text()
    rc, _, err = run_cluster(capsys, "@", GLM, "--trainer.cp", "1", "--out", str(tmp_path / "good"))
    assert rc == 1 and "is from an earlier run, not this config: do not submit it" in err
    assert (tmp_path / "good/job.sbatch").read_text() == before  # untouched, not rewritten for the failing config


def test_the_dry_run_prints_each_phase_and_the_config_once(capsys):
    """A row per planner phase with its GiB and margin; at CP=4 the layer backward (with its FSDP all-gather buffers)
    is plan_memory's peak and leaves the smallest margin, above the optimizer step; the config is printed once."""
    from moe_rl.config import load_config
    from moe_rl.launch.config import ClusterConfig
    from moe_rl.launch.dry_run import phase_peaks, trainer_plan_inputs_of

    rc, out, _ = run_cluster(capsys, "@", GLM, "--dry-run", "--trainer.cp", "4")
    assert rc == 0
    ref = _glm_plan(cp=4)
    assert ref.peak_phase == "layer_backward"
    comp = ref.components
    layer = (comp["parameters"] + comp["gradients"] + comp["optimizer"] + ref.details["layer_backward_bytes"]
             + ref.details["fsdp_allgather_bytes"])
    assert layer == pytest.approx(ref.peak_bytes, rel=1e-12)
    assert f"| layer_backward (plan_memory's peak) | {layer / GiB:.2f} | {(H200 - layer - 3 * GiB) / GiB:+.2f} |" \
        in out
    cfg = load_config(ClusterConfig, ["@", GLM, "--trainer.cp", "4"])
    phases = phase_peaks(trainer_plan_inputs_of(cfg), ref)
    assert phases["layer_backward"] == pytest.approx(layer, rel=1e-12)
    assert phases["optimizer_step"] < phases["layer_backward"]
    opt = phases["optimizer_step"]
    assert f"| optimizer_step | {opt / GiB:.2f} | {(H200 - opt - 3 * GiB) / GiB:+.2f} |" in out
    assert out.count('"max_off_policy_steps"') == 1
    assert "## file ${RUN_DIR}/configs/cluster.json" not in out and "## resolved config" in out


def test_a_bad_attn_backend_names_the_rule(capsys):
    rc, _, err = run_cluster(capsys, "@", GLM, "--dry-run", "--model.config.attn-backend", "flash")
    assert rc == 2
    assert "config.attn_backend = 'flash'" in err and "(rule: expected='dense' or 'torch')" in err
