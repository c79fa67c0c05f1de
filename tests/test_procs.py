"""``moe_rl.procs``: a child in a session of its own notices that its parent was killed outright."""

import os
import signal
import subprocess
import sys
import time

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
