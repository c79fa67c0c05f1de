"""End to end: `moe-rl rl` with multi-turn rollouts (chained addition, 2 turns) and router replay, on a real vLLM
(CPU) server and the 2-rank trainer. Slow (one vLLM start); needs the `cpu` extra."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[1]
# no SFT warm-up and small batches keep the run short; the reward need not be high here
FAST = ["--sft.enabled", "false", "--orchestrator.batch-size", "32", "--orchestrator.max-inflight", "8"]
STEPS = 2  # the second step runs after a weight push: stitching and replay are checked across an update


def test_multiturn_rl_run_with_router_replay(tmp_path):
    from moe_rl.rl.batch import read_batch

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "rl", "@", "recipes/debug_cpu/rl.toml", "@",
           "recipes/debug_cpu/rl_multiturn.toml", "--output-dir", str(out), "--max-steps", str(STEPS),
           "--trainer.router-replay", "true", *FAST]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert 0.0 <= r["mismatch_kl"] < 0.05
        assert r["rollouts_started"] == r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_inflight"]
        # every finished sample ran both turns and got one complete stitched routing record
        assert r["multiturn_turns"] == 2 * r["multiturn_samples"] > 0
        assert r["multiturn_routed_experts_stitched"] == r["multiturn_samples"]
        assert r["multiturn_routed_experts_missing_turn"] == r["multiturn_routed_experts_incomplete"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollouts_trained"] == STEPS * 32 and summary["engine_errors"] == 0
    plus = 13  # '+': the first character of every env segment "+c="
    for step in range(STEPS):
        b = read_batch(out / "batches" / f"step_{step}.safetensors")
        for i in range(b.num_samples):
            ids = b.input_ids[i].tolist()
            model = (b.token_versions[i] >= 0).tolist()  # predicted positions of model tokens
            n = max(j for j, m in enumerate(model) if m) + 2  # the sample ends with a model token (turn 2)
            lm = b.loss_mask[i, : n - 1].tolist()
            assert lm == model[: n - 1]  # "drop" policy: every model token is trained, nothing else
            # [prompt: False] [turn 1: True] [env "+c=": False] [turn 2: True]
            runs = [lm[0]] + [lm[j] for j in range(1, n - 1) if lm[j] != lm[j - 1]]
            assert runs == [False, True, False, True], runs
            env_start = lm.index(False, lm.index(True))
            assert ids[env_start + 1] == plus
            assert b.routed_experts_state[i, : n - 1].eq(0).all()  # complete routing on every forwarded token
            assert b.routed_experts_state[i, n - 1:].eq(-1).all()
