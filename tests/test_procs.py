"""``moe_rl.procs``: a child in a session of its own notices that its parent was killed outright."""

import os
import signal
import subprocess
import sys
import time

from _e2e import run_tag_of

CHILD = """
import os, sys, time
from moe_rl.procs import orphaned
parent = os.getppid()
open(sys.argv[1] + ".started", "w").close()
deadline = time.monotonic() + 60
while not orphaned(parent) and time.monotonic() < deadline:
    time.sleep(0.05)
open(sys.argv[1], "w").write("orphaned" if orphaned(parent) else "timeout")
"""

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(120)
"""


def test_a_child_in_its_own_session_notices_its_parent_was_killed(tmp_path):
    out = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(out)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "child.started").exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child did not start"
            time.sleep(0.05)
        assert not out.exists()  # the parent lives: the child keeps waiting
        time.sleep(0.3)
        assert not out.exists()
        os.kill(parent.pid, signal.SIGKILL)  # no chance to stop its child: only the child itself can notice
        parent.wait()
        deadline = time.monotonic() + 30
        while not out.exists():
            assert time.monotonic() < deadline, "the child did not notice its parent's death"
            time.sleep(0.05)
        time.sleep(0.1)
        assert out.read_text() == "orphaned"
    finally:
        if parent.poll() is None:
            parent.kill()


LAUNCHER = """
import subprocess, sys, time
from moe_rl.procs import OrphanReaper
with OrphanReaper(timeout=float(sys.argv[3])) as reaper:
    # a child in a session of its own that ignores SIGTERM (only SIGKILL ends it), with a grandchild
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    open(sys.argv[2], "w").write(f"{reaper.pid} {child.pid}")
    if sys.argv[4] == "die":
        time.sleep(120)  # killed outright by the test
    else:
        time.sleep(1.0)
        child.kill()
        child.wait()
"""

STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_run(tmp_path, mode: str):
    """Start the stand-in launcher (``mode``: ``die`` waits to be killed, ``exit`` exits normally); wait until its
    child and grandchild carry the run's tag. Returns (launcher, watcher pid, child pid, tag)."""
    from moe_rl.procs import tagged_pids

    pids = tmp_path / "pids"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, STUBBORN, str(pids), "0.5", mode])
    deadline = time.monotonic() + 60
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline and launcher.poll() is None, "the launcher did not start its child"
        time.sleep(0.05)
    reaper_pid, child_pid = map(int, pids.read_text().split())
    # the run's tag, from the child's environment: the child and its grandchild carry it, the watcher does not
    tag = run_tag_of(child_pid)
    while len(tagged_pids(tag)) < 2:  # the grandchild starts after the child
        assert time.monotonic() < deadline, f"tagged: {tagged_pids(tag)}"
        time.sleep(0.05)
    return launcher, reaper_pid, child_pid, tag


def _cleanup(launcher, tag):
    from moe_rl.procs import tagged_pids

    if launcher.poll() is None:
        launcher.kill()
    for pid in tagged_pids(tag):
        os.kill(pid, signal.SIGKILL)


def test_the_reaper_stops_the_tagged_processes_of_a_parent_killed_outright(tmp_path):
    from moe_rl.procs import tagged_pids

    launcher, reaper_pid, child_pid, tag = _start_run(tmp_path, "die")
    try:
        tagged = tagged_pids(tag)
        assert child_pid in tagged and reaper_pid not in tagged and launcher.pid not in tagged
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in tagged) or _alive(reaper_pid):
            assert time.monotonic() < deadline, f"still alive: {[p for p in tagged if _alive(p)]}"
            time.sleep(0.05)
    finally:
        _cleanup(launcher, tag)


def test_a_parent_that_exits_normally_leaves_its_processes_to_itself(tmp_path):
    from moe_rl.procs import tagged_pids

    launcher, reaper_pid, child_pid, tag = _start_run(tmp_path, "exit")
    try:
        grandchild = [p for p in tagged_pids(tag) if p != child_pid]
        assert launcher.wait(timeout=60) == 0
        # the watcher was told "done" and exited without stopping anything: the (re-parented) grandchild lives
        deadline = time.monotonic() + 30
        while _alive(reaper_pid):
            assert time.monotonic() < deadline, "the watcher did not exit"
            time.sleep(0.05)
        time.sleep(1.0)  # longer than the watcher's grace period
        assert grandchild and all(_alive(p) for p in grandchild)
    finally:
        _cleanup(launcher, tag)


def test_reaper_arguments_are_checked():
    import pytest

    from moe_rl.procs import OrphanReaper, stop_tagged, tagged_pids

    for bad in (-1, float("inf"), float("nan"), 10**400):
        with pytest.raises(ValueError, match="timeout"):
            OrphanReaper(timeout=bad)
    for bad in (True, "10", None):
        with pytest.raises(TypeError, match="timeout"):
            OrphanReaper(timeout=bad)
    for bad in ("", "a=b", "a\0b"):
        with pytest.raises(ValueError, match="tag"):
            tagged_pids(bad)
    with pytest.raises(TypeError, match="must be a str"):
        tagged_pids(None)
    with pytest.raises(ValueError, match="timeout"):
        stop_tagged("x", -1)


def test_a_reaper_is_entered_once():
    import pytest

    from moe_rl.procs import RUN_TAG_ENV, OrphanReaper

    before = os.environ.get(RUN_TAG_ENV)
    reaper = OrphanReaper(timeout=0)
    with reaper:
        with pytest.raises(RuntimeError, match="already active"):
            reaper.__enter__()
        assert os.environ[RUN_TAG_ENV] == reaper.tag
    assert os.environ.get(RUN_TAG_ENV) == before
