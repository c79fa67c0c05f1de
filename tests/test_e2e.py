"""End to end: `moe-rl rl` on the debug_cpu recipe with a real vLLM (CPU) server and a 2-rank torchrun
trainer. Slow (one vLLM start each); needs the `cpu` extra."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _e2e import assert_run_processes_tagged, group_alive

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

RECIPE = "recipes/debug_cpu/rl.toml"
REPO = Path(__file__).resolve().parents[1]
# a short warm-up (it still trains, evaluates and caches) and small batches keep the tests fast; the reward need not
# be high here. Batches of 64 = 8 groups of 8 (the recipe's group size), split over the 2 trainer ranks.
FAST_SFT = ["--sft.max-steps", "10", "--sft.eval-every", "10", "--sft.eval-prompts", "10"]
SMALL = ["--orchestrator.batch-size", "64", "--orchestrator.max-inflight", "32"]


def _cli(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "moe_rl.cli", "rl", "@", RECIPE, "--output-dir", str(out), *args]


def test_rl_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run(_cli(out, "--max-steps", "4", *FAST_SFT, *SMALL), cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    required = {"step", "policy_version", "reward_mean", "mismatch_kl", "rollouts_started", "rollouts_trained",
                "rollouts_dropped", "staleness_max", "trainer_idle_frac", "inference_tokens_per_s",
                "trainer_tokens_per_s"}
    for r in records:
        assert required <= set(r)
        # the counters add up at every step
        assert r["rollouts_started"] == r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_inflight"]
        assert 0 <= r["staleness_max"] <= 1  # recipe: max_off_policy_steps = 1
        assert 0.0 <= r["mismatch_kl"] < 0.05
        assert 0.0 <= r["trainer_idle_frac"] <= 1.0
        assert r["inference_tokens_per_s"] > 0 and r["trainer_tokens_per_s"] > 0
        # the weight update of this step (trainer side) and the engine's latest one (moe_rl.weights)
        assert r["weight_transport"] == "filesystem" and r["weight_bytes"] > 0 and r["weight_trainer_blocking_s"] > 0
        if r["weight_engine_version"] > 0:
            assert r["weight_engine_pause_s"] >= r["weight_engine_load_s"] > 0
    batch_size = json.loads((out / "config.json").read_text())["orchestrator"]["batch_size"]
    assert [r["rollouts_trained"] for r in records] == [batch_size * (i + 1) for i in range(4)]
    assert summary["rollouts_started"] == (summary["rollouts_trained"] + summary["rollouts_dropped"]
                                           + summary["rollouts_inflight_at_exit"])
    assert summary["rollouts_trained"] == 4 * batch_size
    assert summary["exit"] == {"status": "finished", "cause": "", "code": 0}
    assert summary["weight_transport"]["versions_loaded"]["count"] >= 1  # compact: count, first, last, gaps
    assert summary["sft"]["steps"] == 10  # the warm-up ran (10 steps: the trigger is out of reach that early)
    # every weight push was served, changed the engine's outputs, and came with a new salt
    events = [json.loads(x) for x in (out / "engine_events.jsonl").read_text().splitlines()]
    versions = [e["version"] for e in events]
    assert versions[0] == 0 and versions == sorted(versions) and versions[-1] >= 3
    for e in events:
        assert e["served_version"] == e["version"]
        assert f"-v{e['version']}-" in e["salt"]
        # vLLM's cached-token count: a new salt misses, the same salt hits every full 32-token block
        assert e["probe_cached_tokens_new_salt"] == 0
        assert e["probe_cached_tokens_same_salt"] == (e["probe_prompt_tokens"] // 32) * 32
    assert len({e["salt"] for e in events}) == len(events)
    assert all(e["probe_logprobs"] != events[0]["probe_logprobs"] for e in events[1:])
    assert (out / "curves.png").stat().st_size > 1000
    # every process the launcher started is gone
    pids = json.loads((out / "pids.json").read_text())
    for name in ("vllm_server", "trainer"):
        assert not group_alive(pids[name]), name


@pytest.mark.parametrize("victim", ["trainer_rank", "vllm_server"])
def test_a_dead_process_stops_the_run(tmp_path, victim):
    out = tmp_path / "run"
    # no engine restart: a dead engine then stops the run (tests/test_e2e_engine_faults.py: one that is restarted)
    proc = subprocess.Popen(_cli(out, "--max-steps", "10000", "--sft.enabled", "false", *SMALL,
                                 "--inference.max-engine-restarts", "0"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "trainer" / "rank_1.pid").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach its first step"
            time.sleep(0.5)
        pids = json.loads((out / "pids.json").read_text())
        rank1 = int((out / "trainer" / "rank_1.pid").read_text())
        # the engine (API server, EngineCore) and torchrun with both ranks carry the run's tag (the watcher's key)
        rank0 = int((out / "trainer" / "rank_0.pid").read_text())
        assert_run_processes_tagged([pids["vllm_server"], pids["trainer"]], [rank0, rank1])
        os.kill(rank1 if victim == "trainer_rank" else pids["vllm_server"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    expected = "trainer (torchrun)" if victim == "trainer_rank" else "vLLM server 0"
    assert "run failed" in err and expected in err, err[-3000:]
    if victim == "vllm_server":
        assert "inference.max_engine_restarts=0" in err, err[-3000:]
    assert "Task exception was never retrieved" not in err, err[-3000:]
    # a failed run still writes its summary (with the cause) and curves
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit"]["status"] == "failed" and summary["exit"]["code"] == 1, summary["exit"]
    assert expected in summary["exit"]["cause"] and summary["steps"] >= 1, summary["exit"]
    assert (out / "curves.png").exists()
    for name in ("vllm_server", "trainer"):
        assert not group_alive(pids[name]), f"{name} process group still alive after the run failed"


def test_invalid_config_fails_before_any_process(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run(_cli(out, "--orchestrator.max-off-policy-steps", "-3"), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert "orchestrator.max_off_policy_steps = -3" in res.stderr and "greater than or equal to 0" in res.stderr
    assert not out.exists()
