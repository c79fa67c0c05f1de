"""End to end: `moe-rl rl --resume` on the debug_cpu recipe (real vLLM CPU server, 2-rank torchrun/gloo FSDP2 trainer).

Segment 1 runs 4 steps with a checkpoint every 2 steps (checkpoints 2 and 4). The COMPLETE marker of checkpoint 4
is then removed, as if the run had been stopped while completing it, so the resume must ignore it and continue from
checkpoint 2: the work of steps 2-3 is set aside and trained again. Segment 2 resumes to 5 steps. Checked: refusals
(config that differs in the model, --resume with --overwrite), steps and versions continue (the engine serves
version 2 before anything else, every later version is above it), the accounting is continuous, the trainer's
state after loading equals the saved one bit for bit (digests of every rank's shards), the engines' weights of
version 2 equal those segment 1 published, and training proceeds. Slow (two vLLM starts)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

RECIPE = "recipes/debug_cpu/rl.toml"
REPO = Path(__file__).resolve().parents[1]
FAST_SFT = ["--sft.max-steps", "10", "--sft.eval-every", "10", "--sft.eval-prompts", "10"]
SMALL = ["--orchestrator.batch-size", "64", "--orchestrator.max-inflight", "32", "--trainer.checkpoint-every", "2"]


def _cli(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "moe_rl.cli", "rl", "@", RECIPE, "--output-dir", str(out), *FAST_SFT, *SMALL, *args]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_resume_continues_steps_versions_accounting_and_weights(tmp_path):
    from moe_rl.weights.filesystem import read_sharded

    out = tmp_path / "run"
    res = subprocess.run(_cli(out, "--max-steps", "4"), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4"]
    (ckpts / "step_4" / "COMPLETE").unlink()  # stopped while completing checkpoint 4: it must be ignored
    seg1_events = _lines(out / "engine_events.jsonl")
    seg1_summary = json.loads((out / "summary.json").read_text())
    saved_digests = json.loads((ckpts / "step_2" / "trainer" / "trainer.json").read_text())["digests"]
    engine_saved = read_sharded(ckpts / "step_2" / "engine" / "step_2")
    orch_saved = json.loads((ckpts / "step_2" / "orchestrator.json").read_text())["counters"]
    # the checkpoint's engine weights are version 2 as segment 1 published it (and the resumed engine loads it)
    published = read_sharded(out / "weights" / "step_2")
    assert [n for n, _ in published] == [n for n, _ in engine_saved]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(published, engine_saved, strict=True))
    batch_size = 64

    # refusals: fields that must match, --resume with --overwrite; nothing is changed
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    bad = subprocess.run(_cli(out, "--max-steps", "5", "--model.num-hidden-layers", "3", "--resume"), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "model.num_hidden_layers: 2 (checkpoint) != 3 (now)" in bad.stderr, bad.stderr
    both = subprocess.run(_cli(out, "--max-steps", "5", "--resume", "--overwrite"), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert both.returncode == 2 and "exclude each other" in both.stderr, both.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before

    res = subprocess.run(_cli(out, "--max-steps", "5", "--resume"), cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit"]["status"] == "finished" and summary["steps"] == 5
    r = summary["resume"]
    assert r["from_step"] == 2 and r["discarded_steps"] == [2, 3]
    assert r["earlier_segments"] == [{"exit": seg1_summary["exit"], "steps": 4}]
    assert r["discarded_rollouts_started"] == seg1_summary["rollouts_started"] - orch_saved["started"]
    assert r["dropped_at_resume"] == orch_saved["inflight"] + orch_saved["queued"] + orch_saved["in_batch"]

    # steps continue: 0-1 from segment 1, 2-4 trained again after the resume; the set-aside lines are kept apart
    records = _lines(out / "metrics.jsonl")
    assert [x["step"] for x in records] == [0, 1, 2, 3, 4]
    assert [x["policy_version"] for x in records] == [1, 2, 3, 4, 5]
    assert [x["step"] for x in _lines(out / "resume_discarded.jsonl")] == [2, 3]
    # accounting: continuous counters, the invariant at every step, the earlier segment in the totals
    assert [x["rollouts_trained"] for x in records] == [batch_size * (i + 1) for i in range(5)]
    for x in records:
        assert x["rollouts_started"] == x["rollouts_trained"] + x["rollouts_dropped"] + x["rollouts_withheld"] + \
            x["rollouts_inflight"]
    assert records[2]["rollouts_started"] >= orch_saved["started"]
    assert summary["rollouts_started"] == (summary["rollouts_trained"] + summary["rollouts_dropped"]
                                           + summary["rollouts_withheld"] + summary["rollouts_inflight_at_exit"])
    assert summary["rollouts_trained"] == 5 * batch_size
    assert summary["rollouts_dropped_by_reason"].get("resume", 0) == r["dropped_at_resume"]

    # versions: the fresh engine serves version 2 before anything else, then strictly increasing above it
    seg2 = _lines(out / "engine_events.jsonl")[len(seg1_events):]
    assert seg2[0]["version"] == seg2[0]["served_version"] == 2
    versions = [e["version"] for e in seg2]
    assert versions == sorted(set(versions)) and all(e["served_version"] == e["version"] for e in seg2)
    assert versions[-1] >= 4
    # versions 3.. are published again with other weights: the resumed segment's salts share nothing with the first
    # segment's, so no prefix cache can hand it KV computed under the discarded versions
    assert {e["salt"] for e in seg2}.isdisjoint(e["salt"] for e in seg1_events)
    seg1_v2 = [e for e in seg1_events if e["version"] == 2]
    if seg1_v2:  # the same weights, the same greedy probe, bit for bit
        assert seg2[0]["probe_logprobs"] == seg1_v2[0]["probe_logprobs"]

    # the trainer's state after loading equals the saved one bit for bit on every rank
    resumed = json.loads((out / "trainer" / "step_2.json").read_text())["resumed_from"]
    assert resumed["step"] == 2 and resumed["digests_loaded"] == resumed["digests_saved"] == saved_digests
    # training proceeds: the final version differs from the resumed one; new checkpoints 4 and 5 (keep 2)
    final = dict(read_sharded(out / "weights" / "step_5"))
    assert any(not torch.equal(final[n], t) for n, t in engine_saved)
    assert all(x["grad_norm"] > 0 for x in records[2:])
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_5"]
    shutil.rmtree(out, ignore_errors=True)
