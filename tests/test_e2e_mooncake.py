"""End to end: `moe-rl rl --trainer.weight-transport mooncake` on the debug_cpu recipe (real vLLM CPU server, 2-rank
torchrun trainer, loopback Mooncake master), with the Mooncake master SIGKILLed mid-run. The run must finish,
train every step, load the versions before the kill from the store and the later ones from the filesystem
fallback, count the fallbacks on both sides, and lose no version. Slow (one vLLM start); needs the `cpu` and
`mooncake` extras (skips naming the missing piece otherwise)."""

import json
import os
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
STEPS = 6
# no SFT warm-up and small batches: the test is about weight transport, not reward
SHORT = ["--sft.enabled", "false", "--orchestrator.batch-size", "32", "--orchestrator.max-inflight", "8"]


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_rl_run_mooncake_master_killed_mid_run(tmp_path):
    from moe_rl.inference.mooncake import require_mooncake

    try:
        require_mooncake()
    except ImportError as exc:
        pytest.skip(f"Mooncake cannot run here: {exc}")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "rl", "@", RECIPE, "--output-dir", str(out), "--max-steps", str(STEPS),
           "--trainer.weight-transport", "mooncake", *SHORT]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_at = None
    try:
        deadline = time.monotonic() + 600
        # kill the master once the engine has loaded version 2 from the store
        while killed_at is None:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the run did not load version 2 from the store"
            loaded = [e for e in _events(out / "engine_events.jsonl") if e.get("source") == "mooncake"]
            if any(e["version"] >= 2 for e in loaded):
                pids = json.loads((out / "pids.json").read_text())
                os.kill(pids["mooncake_master"], signal.SIGKILL)
                killed_at = max(e["version"] for e in loaded)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert killed_at < STEPS, "the master was killed after the last version: nothing to fall back"

    # every step trained
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    batch = json.loads((out / "config.json").read_text())["orchestrator"]["batch_size"]
    assert records[-1]["rollouts_trained"] == STEPS * batch

    # trainer side: the store until the kill, then the filesystem, each fallback counted
    last = json.loads((out / "trainer" / f"step_{STEPS - 1}.json").read_text())["weight_transport"]
    k = last["versions_by_source"]["mooncake"]
    assert killed_at <= k < STEPS
    assert last["versions_by_source"].get("filesystem", 0) == STEPS - k == last["publish_fallbacks"]
    mc = last["transports"]["mooncake"]
    assert mc["published"] == k and mc["failed"] >= 1 and "-900" in mc["last_error"]
    assert mc["failed"] + mc["skipped"] == STEPS - k
    assert last["transports"]["filesystem"]["fallbacks"] == STEPS - k

    # engine side: store versions from the store, later ones from the folder, nothing lost, final version served
    s = json.loads((out / "summary.json").read_text())["weight_transport"]
    assert s["mode"] == "mooncake" and s["versions_published"] == STEPS
    # compact in summary.json: [from, to] runs of loaded versions per source
    loaded = {v: src for src, runs in s["versions_loaded"]["ranges_by_source"].items()
              for a, b in runs for v in range(a, b + 1)}
    assert len(loaded) == s["versions_loaded"]["count"]
    failed = {int(v) for v in s["versions_failed"]}
    skipped = set(s["versions_skipped_newer"])
    republished = set(s["versions_republished"])
    assert sorted([*loaded, *failed, *skipped]) == list(range(1, STEPS + 1))
    assert s["versions_not_loaded_at_exit"] == []
    assert all(src == "mooncake" for v, src in loaded.items() if v <= killed_at)
    assert all(src == "filesystem" for v, src in loaded.items() if v > k or v in republished)
    assert all(killed_at < v <= k for v in failed | republished)  # only store versions not yet loaded are lost
    assert s["trainer_publish_fallbacks"] == STEPS - k
    # store-announced versions loaded from a folder: the republished ones (the final version fell back to the folder)
    assert s["engine_load_fallbacks"] == len(republished)
    events = _events(out / "engine_events.jsonl")
    assert events[-1]["version"] == events[-1]["served_version"] == STEPS
    assert [e["version"] for e in events[1:]] == sorted(loaded)
    assert all(e["served_version"] == e["version"] for e in events)
    # every process is gone
    pids = json.loads((out / "pids.json").read_text())
    for name in ("vllm_server", "trainer", "mooncake_master"):
        assert not group_alive(pids[name]), name
