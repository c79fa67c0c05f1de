"""Child-process helpers shared by the launcher and the vLLM server wrapper (Linux).

Children are started with ``start_new_session=True``, so each one leads a process group holding it and its
own children (vLLM's EngineCore and workers, torchrun's ranks); they are stopped by that group id, never by
name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

__all__ = ["group_members", "orphaned", "stop_group", "tail"]


def group_members(pgid: int) -> list[int]:
    """PIDs (from ``/proc``) whose process group is ``pgid`` and which are not zombies.

    A zombie has already exited; counting it (as ``os.killpg(pgid, 0)`` does) would report a stopped group as
    alive while its reaper (possibly a slow PID 1) has not collected it yet.
    """
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def orphaned(parent_pid: int) -> bool:
    """True once the process that started this one (``parent_pid``, read with ``os.getppid()`` at start-up) has exited:
    this process was then re-parented (to init or a subreaper).

    For children that run in a session of their own, which stopping the parent's process group does not reach
    (torchrun starts each rank so): when the parent is killed outright (SIGKILL), polling this is how they notice.

    Args:
        parent_pid: the parent's pid, as ``os.getppid()`` returned it at start-up.
    """
    return os.getppid() != parent_pid


def stop_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group led by ``proc``, then SIGKILL whatever is left after ``timeout`` s.

    Returns once no live member of the group remains (or 5 s after the SIGKILL). Reaps ``proc`` itself.
    """
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader so it does not linger as a zombie
        if proc.returncode is not None and not group_members(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    end = time.monotonic() + 5
    while group_members(pgid) and time.monotonic() < end:
        time.sleep(0.1)


def tail(path: str | Path, n: int) -> str:
    """The last ``n`` lines of a text file (a note instead if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as exc:
        return f"<could not read {path}: {exc}>"
