"""The tool sandbox: every fault a tool can cause (hang, CPU spin, crash, megabytes of output, invalid UTF-8, a
memory bomb, a child process left behind) ends that call within its limits and is reported by status; ordinary
answers and ordinary errors are not faults. Each case is bounded in time (the limits are small)."""

import asyncio
import os
import time

import pytest

from moe_rl.envs.sandbox import FAULT_STATUSES, Sandbox, SandboxLimits

LIMITS = SandboxLimits(wall_s=1.0, cpu_s=1, memory_bytes=128 << 20, output_bytes=1000, stderr_bytes=200)
# cases that must not end by the wall clock get a roomy one (a loaded machine may take a second to start a process)
ROOMY = SandboxLimits(wall_s=20.0, cpu_s=1, memory_bytes=128 << 20, output_bytes=1000, stderr_bytes=200)

CASES = {
    # name: (code, expected status)
    "ok": ("import sys; print(sys.stdin.read()[::-1])", "ok"),
    "error": ("1/0", "error"),
    "hang": ("import time; time.sleep(60)", "timeout"),
    "spin": ("while True: pass", "timeout"),
    "crash": ("import os; os.abort()", "crash"),
    "megabytes": ("import sys; sys.stdout.write('x' * 5_000_000)", "output_too_large"),
    "invalid_utf8": ("import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe')", "invalid_utf8"),
    "memory_bomb": ("x = bytearray(1 << 30)", "memory"),
}


def test_each_fault_ends_its_call_within_the_limits_and_is_reported():
    fast, roomy = Sandbox(LIMITS, max_concurrent=len(CASES)), Sandbox(ROOMY, max_concurrent=len(CASES))

    async def go():
        async def one(name, code):
            sb = fast if name in ("hang", "spin") else roomy
            t = time.monotonic()
            r = await sb.run_python(code, b"abc")
            return r, time.monotonic() - t

        return await asyncio.gather(*(one(name, code) for name, (code, _) in CASES.items()))

    results = asyncio.run(go())
    for (name, (_, want)), (r, dt) in zip(CASES.items(), results, strict=True):
        assert r.status == want, (name, r)
        assert r.fault == (want in FAULT_STATUSES), name
        if name in ("hang", "spin"):  # the 1 s wall limit, then kill + reap (a loaded machine stretches the reap)
            assert dt < LIMITS.wall_s + 10, (name, dt)
    by = dict(zip(CASES, (r for r, _ in results), strict=True))
    assert by["ok"].stdout == "cba\n" and by["ok"].returncode == 0
    assert "ZeroDivisionError" in by["error"].stderr and by["error"].returncode == 1
    assert by["megabytes"].stdout == "" and by["megabytes"].returncode is None
    assert by["hang"].returncode is None and by["crash"].returncode < 0


def test_the_whole_process_group_is_killed(tmp_path):
    marker = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    sb = Sandbox(SandboxLimits(wall_s=1.0, file_bytes=1 << 10))
    r = asyncio.run(sb.run_python(code))
    assert r.status == "timeout"
    pid = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:  # a killed, not yet reaped child is a zombie: gone for our purpose
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail(f"the tool's child {pid} survived the sandbox")


def test_limits_validation():
    with pytest.raises(ValueError, match="wall_s=0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="cpu_s=0"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="64 MiB"):
        SandboxLimits(memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="max_concurrent=0"):
        Sandbox(max_concurrent=0)
    with pytest.raises(ValueError, match="argv is empty"):
        asyncio.run(Sandbox().run([]))


def test_other_programs_run_under_the_same_limits():
    sb = Sandbox(SandboxLimits(wall_s=20.0, cpu_s=1, memory_bytes=128 << 20, output_bytes=100))
    short = Sandbox(SandboxLimits(wall_s=1.0))

    async def go():
        return await asyncio.gather(sb.run(["cat"], b"hello"), sb.run(["sh", "-c", "ulimit -v; ulimit -t"]),
                                    short.run(["sleep", "30"]), sb.run(["no-such-program-xyz"]),
                                    sb.run(["sh", "-c", "yes | head -c 100000"]))

    cat, ulimits, sleep, missing, yes = asyncio.run(go())
    assert (cat.status, cat.stdout) == ("ok", "hello")
    assert ulimits.stdout.split() == [str(128 << 10), "1"]  # KiB of address space, CPU seconds
    assert sleep.status == "timeout" and yes.status == "output_too_large"
    assert missing.status == "error" and missing.returncode == 127 and "no-such-program-xyz" in missing.stderr


def test_output_over_the_cap_never_leaves_the_call_waiting_on_its_pipes():
    """The cap stops reading stdout with megabytes still in the pipe (the reader pauses on its full buffer); the call
    must drain and end anyway, every time (a race: before the fix about one call in ten never returned)."""
    sb = Sandbox(ROOMY, max_concurrent=4)

    async def go():
        return await asyncio.gather(*(sb.run_python("import sys; sys.stdout.write('x' * 20_000_000)")
                                      for _ in range(12)))

    for r in asyncio.run(asyncio.wait_for(go(), 120)):
        assert r.status == "output_too_large" and r.stdout == "", r


def test_a_grandchild_that_leaves_the_session_holding_stdout_cannot_hold_the_call():
    """A tool that starts a process in a new session (outside the killed group) with our stdout: the call ends after
    its wall limit plus the pipe grace, our ends of the pipes are closed."""
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True); "
            "time.sleep(60)")
    sb = Sandbox(SandboxLimits(wall_s=1.0))
    t = time.monotonic()
    r = asyncio.run(asyncio.wait_for(sb.run_python(code), 60))
    assert r.status == "timeout", r
    assert time.monotonic() - t < 1.0 + 5.0 + 10.0  # wall + pipe grace + a loaded machine's slack


def test_a_tool_process_carries_the_run_tag_and_nothing_else_of_the_environment(monkeypatch):
    """The launcher's watcher (moe_rl.procs.OrphanReaper) finds tool processes by the run tag; no other variable of
    the launcher's environment reaches them."""
    from moe_rl.procs import RUN_TAG_ENV

    code = "import os, json; print(json.dumps(sorted(os.environ)), os.environ.get('MOE_RL_RUN_TAG'))"
    monkeypatch.setenv(RUN_TAG_ENV, "t123")
    monkeypatch.setenv("MOE_RL_SECRET_FOR_TEST", "x")
    r = asyncio.run(Sandbox(SandboxLimits(wall_s=30.0)).run_python(code))
    assert r.status == "ok", r
    names, tag = r.stdout.rsplit(" ", 1)
    assert tag.strip() == "t123" and RUN_TAG_ENV in names and "MOE_RL_SECRET_FOR_TEST" not in names
    monkeypatch.delenv(RUN_TAG_ENV)
    r = asyncio.run(Sandbox(SandboxLimits(wall_s=30.0)).run_python(code))
    assert r.status == "ok" and r.stdout.rsplit(" ", 1)[1].strip() == "None", r
