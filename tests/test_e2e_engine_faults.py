"""End to end: `moe-rl rl` with two vLLM (CPU) engines survives the death of one (SIGKILL mid-run): its in-flight
rollouts are dropped and re-queued, it is restarted and rejoins at the current weight version before it gets
requests again, and the run finishes with exact accounting. Slow (three vLLM starts); needs the `cpu` extra."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _e2e import group_alive

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm")

RECIPE = "recipes/debug_cpu/rl.toml"
REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 8
# batches of 64 = 8 groups of 8, split over the 2 trainer ranks; no SFT warm-up (the reward does not matter here):
# the untrained policy rarely samples <eos>, so completions run to max_new_tokens = 32 and the engines, not the
# trainer, are the bottleneck: rollouts are in flight on both engines at any time, also when one is killed
ARGS = ["--max-steps", str(MAX_STEPS), "--sft.enabled", "false", "--task.max-new-tokens", "32",
        "--orchestrator.batch-size", "64",
        "--orchestrator.max-inflight", "32", "--inference.num-engines", "2", "--inference.max-engine-restarts", "2",
        "--inference.engine-restart-backoff-s", "0.5"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _requests_on(log: Path, token: str) -> float:
    """Requests running or waiting on the engine whose log is ``log`` (its Prometheus ``/metrics``)."""
    import httpx

    port = re.search(r"--port (\d+)", log.read_text().splitlines()[0]).group(1)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"},
                     timeout=10, trust_env=False).text
    return sum(float(m.group(1)) for m in re.finditer(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE))


def _token_versions(out: Path) -> list[tuple[int, int, list[int]]]:
    """Per trained sample: (consuming step, version_start, versions of its sampled tokens in order)."""
    from safetensors.torch import load_file

    rows = []
    for f in sorted((out / "batches").glob("step_*.safetensors")):
        t = load_file(str(f))
        step = int(f.stem.split("_")[1])
        for start, tv in zip(t["version_start"].tolist(), t["token_versions"].tolist(), strict=True):
            rows.append((step, start, [v for v in tv if v >= 0]))
    return rows


def test_an_engine_killed_mid_run_is_restarted_and_rejoins_at_the_current_version(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "rl", "@", RECIPE, "--output-dir", str(out), *ARGS]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while len(_lines(out / "metrics.jsonl")) < 1:  # mid-run: after the first trainer step
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach its first step"
            time.sleep(0.2)
        pids = json.loads((out / "pids.json").read_text())
        assert len(pids["vllm_servers"]) == 2, pids
        victim = pids["vllm_servers"][1]
        token = (out / "control_token").read_text().strip()
        while _requests_on(out / "logs" / "vllm_1.log", token) == 0:  # kill it with rollouts in flight
            assert time.monotonic() < deadline, "engine 1 never had a request in flight"
            time.sleep(0.05)
        # pause the trainer ranks (each in its own session, torchrun's elastic agent starts them so) until the
        # engine has rejoined, so that the run cannot end before the restarted engine gets requests again (a vLLM
        # start takes 20-50 s, the remaining steps a few seconds)
        ranks = [int((out / "trainer" / f"rank_{r}.pid").read_text()) for r in (0, 1)]
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        steps_at_kill = len(_lines(out / "metrics.jsonl"))
        version_at_kill = _lines(out / "engine_events.jsonl")[-1]["version"]
        assert steps_at_kill <= MAX_STEPS - 2, f"the run was at step {steps_at_kill} of {MAX_STEPS} when paused"
        try:
            faults = out / "logs" / "engine_faults.jsonl"
            while not any(e["event"] == "rejoined" for e in _lines(faults)):
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline + 300, f"engine 1 did not rejoin: {_lines(faults)}"
                time.sleep(0.2)
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    records = _lines(out / "metrics.jsonl")
    batch_size = 64
    assert summary["exit"] == {"status": "finished", "cause": "", "code": 0}

    # the death and the restart are counted, per step and in the summary
    eng = summary["engines"]
    assert eng["num_engines"] == 2 and eng["engine_deaths"] == 1 and eng["engine_restarts"] == 1, eng
    assert _lines(out / "logs" / "engine_faults.jsonl") == eng["events"]
    assert eng["engine_restart_failures"] == 0 and eng["requests_refused_not_live"] == 0, eng
    died = [e for e in eng["events"] if e["event"] == "died"]
    assert [(e["engine"], e["pid"], e["exit_code"]) for e in died] == [(1, victim, -signal.SIGKILL)], died
    assert [r["engine_deaths"] for r in records] == sorted(r["engine_deaths"] for r in records)
    assert records[-1]["engine_deaths"] == 1 and records[-1]["engine_restarts"] == 1, records[-1]

    # it rejoined at the current version, verified by its version probe, before it got requests again
    (rejoin,) = [e for e in eng["events"] if e["event"] == "rejoined"]
    assert rejoin["engine"] == 1 and rejoin["served_version"] == rejoin["version"] == rejoin["current_version"]
    assert rejoin["version"] >= version_at_kill, (rejoin, version_at_kill)
    assert rejoin["t"] > died[0]["t"]
    loaded = [e["version"] for e in _lines(out / "engine_events.jsonl")]
    assert rejoin["version"] in loaded  # a version the run's weight watcher loaded (0 = the start weights)
    restarted = eng["engines"][1]
    assert restarted["restarts"] == 1 and restarted["state"] == "live" and restarted["pid"] != victim
    assert restarted["requests_since_live"] > 0, restarted  # it served the run again ...
    assert restarted["first_request_t"] >= restarted["t_live"] == rejoin["t_live"]  # ... only once it was live
    assert (out / "logs" / "vllm_1.restart1.log").exists()

    # its in-flight rollouts were dropped and re-queued; the accounting is exact at every step and at the end
    dropped = summary["rollouts_dropped_by_reason"]
    assert dropped.get("engine_died", 0) > 0 and dropped["engine_died"] % 8 == 0, dropped  # whole groups of 8
    assert summary["groups_retried"] >= dropped["engine_died"] // 8
    for r in records:
        assert r["rollouts_started"] == (r["rollouts_trained"] + r["rollouts_dropped"] + r["rollouts_withheld"]
                                         + r["rollouts_inflight"]), r
    assert summary["rollouts_started"] == (summary["rollouts_trained"] + summary["rollouts_dropped"]
                                           + summary["rollouts_withheld"] + summary["rollouts_inflight_at_exit"])
    assert summary["rollouts_dropped"] == sum(dropped.values())
    assert [r["rollouts_trained"] for r in records] == [batch_size * (i + 1) for i in range(MAX_STEPS)]
    assert summary["engine_errors"] == 0, summary["engine_error_messages"]

    # policy versions never go backwards within a sample, and stay within the staleness bound
    rows = _token_versions(out)
    assert len(rows) == MAX_STEPS * batch_size
    for step, start, versions in rows:
        assert versions, (step, start)
        assert versions == sorted(versions) and start <= versions[0] and versions[-1] <= step, (step, start, versions)
        assert step - start <= 1  # recipe: max_off_policy_steps = 1

    # every process the launcher started, the killed engine's group included, is gone
    pids = json.loads((out / "pids.json").read_text())
    assert pids["vllm_servers"][1] == restarted["pid"]
    for pgid in (victim, *pids["vllm_servers"], pids["trainer"]):
        assert not group_alive(pgid), pgid
