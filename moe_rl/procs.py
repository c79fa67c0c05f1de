"""Child-process helpers shared by the launcher and the vLLM server wrapper (Linux).

Children are started with ``start_new_session=True``, so each one leads a process group holding it and its
own children (vLLM's EngineCore and workers, torchrun's ranks); they are stopped by that group id, never by
name.

A parent killed outright (SIGKILL, the OOM killer) cannot stop them, and children in sessions of their own
outlive it. :class:`OrphanReaper` covers that case: the parent tags every process it starts through their
environment (``MOE_RL_RUN_TAG``, inherited by grandchildren) and runs a small watcher process, in a session of
its own, that holds the read end of a pipe from the parent. The pipe reaches end-of-file when the parent exits,
however it exits; unless the parent said ``done`` first, the watcher stops every process carrying the tag
(SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from pathlib import Path

__all__ = ["RUN_TAG_ENV", "OrphanReaper", "group_members", "orphaned", "stop_group", "stop_tagged", "tagged_pids", "tail"]

RUN_TAG_ENV = "MOE_RL_RUN_TAG"
"""Environment variable that marks the processes of one run (set by :class:`OrphanReaper`; inherited by every
process started from it)."""

_DONE = b"done\n"


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


def tagged_pids(tag: str) -> list[int]:
    """PIDs (from ``/proc``) of the live processes whose environment holds ``MOE_RL_RUN_TAG=<tag>``.

    A process's ``/proc/<pid>/environ`` is the environment it was started with (later ``os.environ`` changes do not
    show), and only processes of this user can be read; zombies (empty environ) and this process are left out.

    Args:
        tag: the run's tag (non-empty, no ``=`` or NUL).

    Raises:
        TypeError: ``tag`` is not a str.
        ValueError: ``tag`` is empty or holds ``=`` or NUL.
    """
    if not isinstance(tag, str):
        raise TypeError(f"tagged_pids: tag = {tag!r} must be a str (the run's tag), not {type(tag).__name__}")
    if not tag or "=" in tag or "\0" in tag:
        raise ValueError(f"tagged_pids: tag = {tag!r} must be a non-empty str without '=' or NUL")
    needle = f"{RUN_TAG_ENV}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry))
    return pids


def stop_tagged(tag: str, timeout: float = 10.0) -> list[int]:
    """SIGTERM every process tagged ``tag`` (:func:`tagged_pids`), then SIGKILL those still alive after
    ``timeout`` s (and any tagged process that appeared meanwhile).

    Args:
        tag: the run's tag.
        timeout: grace period after SIGTERM (s, >= 0).

    Returns:
        The PIDs found (and signalled) on the first scan.

    Raises:
        TypeError: ``timeout`` not a number; ``tag`` as :func:`tagged_pids`.
        ValueError: ``timeout`` negative, not finite or >= 1e9; ``tag`` as :func:`tagged_pids`.
    """
    _check_timeout("stop_tagged", timeout)
    first = tagged_pids(tag)
    for pid in first:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(50):  # SIGKILL until none is left (a tagged process may have started another meanwhile)
        left = tagged_pids(tag)
        if not left:
            break
        for pid in left:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.1)
    return first


def _check_timeout(owner: str, timeout: object) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{owner}: timeout = {timeout!r} must be a number of seconds, not {type(timeout).__name__}")
    if not 0 <= timeout < 1e9:  # also refuses nan, inf and ints too large for a float
        raise ValueError(f"{owner}: timeout = {timeout!r} must be a finite number of seconds in [0, 1e9)")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class OrphanReaper:
    """Stops a run's processes when the process that started them dies without stopping them itself.

    Use as a context manager around the part of a program that starts children: on entry it sets
    ``os.environ[MOE_RL_RUN_TAG]`` to a fresh tag (so every child started after it, and their children, carry it)
    and starts the watcher (``python -m moe_rl.procs --reap <tag>``, in a session of its own, untagged); on exit
    it tells the watcher ``done`` and restores ``os.environ``. If this process dies before the exit (SIGKILL, OOM
    killer, a crash of the interpreter), the watcher reads end-of-file without ``done`` and stops every tagged
    process (:func:`stop_tagged`). The normal exit path must still stop its own children: the watcher only
    covers a parent that could not.

    Only processes started with ``exec`` (``subprocess``, ``asyncio`` subprocesses) carry the tag: a bare
    ``os.fork`` child keeps the environment its parent was started with. One reaper per process, entered once, and
    not from several threads at a time (``os.environ`` is process-wide); a forked child leaving the block does not
    tell the watcher ``done`` (only the process that entered it does).

    Args:
        timeout: the watcher's grace period between SIGTERM and SIGKILL (s, finite, >= 0).

    Raises:
        TypeError: ``timeout`` not a number.
        ValueError: ``timeout`` negative, not finite or >= 1e9.
        RuntimeError: (on entry) this reaper is already active.
    """

    def __init__(self, timeout: float = 10.0):
        _check_timeout("OrphanReaper", timeout)
        self.timeout = float(timeout)
        self.tag = uuid.uuid4().hex
        self._proc: subprocess.Popen | None = None
        self._previous: str | None = None
        self._owner: int | None = None

    @property
    def pid(self) -> int | None:
        """The watcher's PID (None outside the ``with`` block)."""
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> OrphanReaper:
        if self._proc is not None:
            raise RuntimeError(f"OrphanReaper: already active (watcher pid {self._proc.pid}); use a new OrphanReaper")
        env = {k: v for k, v in os.environ.items() if k != RUN_TAG_ENV}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moe_rl.procs", "--reap", self.tag, "--timeout", repr(self.timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )
        self._previous = os.environ.get(RUN_TAG_ENV)
        self._owner = os.getpid()
        os.environ[RUN_TAG_ENV] = self.tag
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owner != os.getpid():  # a forked child leaving the block: the parent still runs, say nothing
            return
        if self._previous is None:
            os.environ.pop(RUN_TAG_ENV, None)
        else:
            os.environ[RUN_TAG_ENV] = self._previous
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.write(_DONE)
            proc.stdin.close()
        except (BrokenPipeError, OSError):  # the watcher is gone: nothing to tell
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _reap_main(argv: list[str]) -> int:
    """The watcher of :class:`OrphanReaper`: block until stdin closes; stop the tagged processes unless the last
    thing read was ``done``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m moe_rl.procs")
    parser.add_argument("--reap", required=True, metavar="TAG")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe decides
    data = sys.stdin.buffer.read()
    if data.endswith(_DONE):
        return 0
    stop_tagged(args.reap, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(_reap_main(sys.argv[1:]))
