"""A subprocess sandbox for environment tools: each tool call is a fresh process with CPU-time, wall-time, memory,
file-size and output limits, so a tool that hangs, crashes, allocates without bound, prints megabytes or writes
bytes that are not UTF-8 costs one call (reported in :attr:`ToolResult.status`), never the run.

Per call (:meth:`Sandbox.run`): the process starts in its own session (so the whole process group is killed at the
end, children included) in a fresh empty working directory (removed afterwards) with a minimal environment. A
Python prelude in the child sets the limits before anything else runs (prepended to the code of
:meth:`Sandbox.run_python`; for another program it sets them, then ``exec``s it; no ``preexec_fn``, which is unsafe
in a threaded parent): ``resource.setrlimit`` of ``RLIMIT_CPU`` (CPU seconds; the kernel sends ``SIGXCPU``, then ``SIGKILL`` one second
later), ``RLIMIT_AS`` (address space, bytes: allocations beyond it fail, Python raises ``MemoryError``),
``RLIMIT_FSIZE`` (bytes a process may write to files) and ``RLIMIT_CORE`` = 0. The parent reads at most
``output_bytes`` of stdout (one byte more means ``output_too_large``, and the process is killed) and
``stderr_bytes`` of stderr, and kills the group after ``wall_s`` seconds (``timeout``; a sleep or a blocked read
uses no CPU time, so the CPU limit alone would not end it).

Statuses: ``ok`` (exit 0, UTF-8 stdout within the cap), ``error`` (the tool exited non-zero by itself, e.g. an
uncaught exception: a normal tool answer the environment may show the model), and the faults ``timeout``
(wall or CPU limit), ``memory`` (``MemoryError`` or the memory limit), ``crash`` (killed by another signal),
``output_too_large``, ``invalid_utf8``.

Not a security boundary against a hostile process (no namespaces, seccomp or network isolation): it bounds the
resources of the tool calls a policy writes. POSIX only (``resource``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from moe_rl.procs import RUN_TAG_ENV

__all__ = ["FAULT_STATUSES", "Sandbox", "SandboxLimits", "ToolResult"]

ToolStatus = Literal["ok", "error", "timeout", "memory", "crash", "output_too_large", "invalid_utf8"]
FAULT_STATUSES: tuple[str, ...] = ("timeout", "memory", "crash", "output_too_large", "invalid_utf8")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one tool call.

    Attributes:
        wall_s: wall-clock seconds before the process group is killed (> 0).
        cpu_s: CPU seconds (``RLIMIT_CPU``, whole seconds >= 1).
        memory_bytes: address-space limit (``RLIMIT_AS``, >= 64 MiB: the Python interpreter alone maps ~20 MiB).
        output_bytes: stdout bytes kept (>= 1); more is a fault.
        stderr_bytes: stderr bytes kept (>= 0); more is discarded (not a fault).
        file_bytes: bytes the process may write to files (``RLIMIT_FSIZE``, >= 0).

    Raises:
        ValueError: a limit outside its range.
    """

    wall_s: float = 2.0
    cpu_s: int = 1
    memory_bytes: int = 256 << 20
    output_bytes: int = 4096
    stderr_bytes: int = 4096
    file_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.wall_s > 0:
            raise ValueError(f"SandboxLimits.wall_s={self.wall_s!r} must be > 0 seconds")
        if not isinstance(self.cpu_s, int) or self.cpu_s < 1:
            raise ValueError(f"SandboxLimits.cpu_s={self.cpu_s!r} must be an int >= 1 (RLIMIT_CPU counts whole seconds)")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"SandboxLimits.memory_bytes={self.memory_bytes} must be >= 64 MiB ({64 << 20}); the "
                             "interpreter alone needs ~20 MiB of address space")
        if self.output_bytes < 1 or self.stderr_bytes < 0 or self.file_bytes < 0:
            raise ValueError(f"SandboxLimits: output_bytes={self.output_bytes} must be >= 1, stderr_bytes="
                             f"{self.stderr_bytes} and file_bytes={self.file_bytes} >= 0")


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one sandboxed call.

    Attributes:
        status: ``ok``, ``error`` or a fault (module docstring).
        stdout: the decoded stdout (``""`` for ``output_too_large`` / ``invalid_utf8``).
        stderr: the first ``stderr_bytes`` of stderr, decoded with replacement characters.
        returncode: the exit code (negative: killed by that signal), or None if it never exited by itself.
        wall_s: seconds from start to reaped.
    """

    status: ToolStatus
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float

    @property
    def fault(self) -> bool:
        """True for a fault status (the call failed as a process, not as a computation)."""
        return self.status in FAULT_STATUSES


class Sandbox:
    """Runs tool processes under :class:`SandboxLimits` (module docstring).

    Args:
        limits: the limits of every call.
        max_concurrent: calls running at once (more wait; each is a process).

    Raises:
        ValueError: ``max_concurrent`` < 1.
    """

    def __init__(self, limits: SandboxLimits | None = None, max_concurrent: int = 4) -> None:
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent={max_concurrent!r} must be an int >= 1")
        self.limits = limits or SandboxLimits()
        self.max_concurrent = max_concurrent
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:  # one per event loop (tests run several loops)
            self._sem, self._sem_loop = asyncio.Semaphore(self.max_concurrent), loop
        return self._sem

    async def run_python(self, code: str, stdin: bytes = b"") -> ToolResult:
        """Run ``code`` with this interpreter in isolated mode (``-I -S``: no site-packages, no user paths, no
        ``PYTHON*`` variables), ``stdin`` on its standard input."""
        async with self._semaphore():
            return await self._run([sys.executable, "-I", "-S", "-c", _prelude(self.limits) + "\n" + code],
                                   bytes(stdin))

    async def run(self, argv: list[str], stdin: bytes = b"") -> ToolResult:
        """Run ``argv`` (no shell; the program is looked up on ``PATH=/usr/bin:/bin`` unless it is a path) in the
        sandbox with ``stdin`` on its standard input. A program that cannot be started exits with 127 (status
        ``error``, the reason on stderr).

        Raises:
            ValueError: ``argv`` empty.
        """
        if not argv:
            raise ValueError("argv is empty; pass the program and its arguments")
        launcher = (_prelude(self.limits) + "\nimport os, sys\ntry:\n    os.execvp(sys.argv[1], sys.argv[1:])\n"
                    "except OSError as e:\n    sys.stderr.write(f'cannot run {sys.argv[1]!r}: {e}')\n    sys.exit(127)")
        async with self._semaphore():
            return await self._run([sys.executable, "-I", "-S", "-c", launcher, *argv], bytes(stdin))

    async def _run(self, argv: list[str], stdin: bytes) -> ToolResult:
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix="moe_rl_tool_")
        t0 = time.monotonic()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        if RUN_TAG_ENV in os.environ:  # the run's tag: the launcher's watcher stops it if the launcher is killed
            env[RUN_TAG_ENV] = os.environ[RUN_TAG_ENV]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=workdir, env=env, start_new_session=True)
            status: ToolStatus | None = None
            out = b""
            err = b""
            try:
                async with asyncio.timeout(lim.wall_s):
                    out, err, over = await _communicate(proc, stdin, lim.output_bytes, lim.stderr_bytes)
                    if over:
                        status = "output_too_large"
                    else:
                        await proc.wait()
            except TimeoutError:
                status = "timeout"
            finally:
                _kill_group(proc)
                await _reap(proc)
            rc = proc.returncode
            err_text = err.decode("utf-8", errors="replace")
            if status is None:
                status = _classify(rc, err_text)
            text = ""
            if status in ("ok", "error"):
                try:
                    text = out.decode("utf-8")
                except UnicodeDecodeError:
                    status, text = "invalid_utf8", ""
            return ToolResult(status, text, err_text, rc if status not in ("timeout", "output_too_large") else None,
                              time.monotonic() - t0)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _prelude(lim: SandboxLimits) -> str:
    """Python source that sets the limits in the child process itself (one line, no names left behind)."""
    return (f"import resource as _r; _r.setrlimit(_r.RLIMIT_CPU, ({lim.cpu_s}, {lim.cpu_s + 1})); "
            f"_r.setrlimit(_r.RLIMIT_AS, ({lim.memory_bytes}, {lim.memory_bytes})); "
            f"_r.setrlimit(_r.RLIMIT_FSIZE, ({lim.file_bytes}, {lim.file_bytes})); "
            "_r.setrlimit(_r.RLIMIT_CORE, (0, 0)); del _r")


async def _communicate(proc: asyncio.subprocess.Process, stdin: bytes, out_cap: int,
                       err_cap: int) -> tuple[bytes, bytes, bool]:
    """Feed ``stdin``, read stdout up to ``out_cap`` (+1 byte to detect more) and stderr up to ``err_cap`` (the rest
    is drained and dropped). Returns ``(stdout, stderr, stdout_over_cap)``."""

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):  # the tool exited without reading: not our failure
            pass
        finally:
            proc.stdin.close()

    async def read_err() -> bytes:
        assert proc.stderr is not None
        kept = b""
        while chunk := await proc.stderr.read(65536):
            if len(kept) < err_cap:
                kept += chunk[: err_cap - len(kept)]
        return kept

    async def read_out() -> tuple[bytes, bool]:
        assert proc.stdout is not None
        buf = b""
        while chunk := await proc.stdout.read(65536):
            buf += chunk
            if len(buf) > out_cap:
                return buf[:out_cap], True
        return buf, False

    feeder = asyncio.ensure_future(feed())
    err_task = asyncio.ensure_future(read_err())
    try:
        out, over = await read_out()
        if over:
            return out, b"", True
        err = await err_task
        await feeder
        return out, err, False
    finally:
        for t in (feeder, err_task):
            if not t.done():
                t.cancel()
        await asyncio.gather(feeder, err_task, return_exceptions=True)


async def _reap(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Wait for a killed process and its pipes. asyncio's ``Process.wait()`` returns only once every pipe has closed,
    and a stdout reader left paused on a full buffer (the output cap stopped reading) never sees EOF: drain both
    pipes (discarding) first. A pipe still held open after ``grace_s`` (a grandchild that left the session) is closed
    on our side."""

    async def drain(stream: asyncio.StreamReader | None) -> None:
        if stream is not None:
            while await stream.read(65536):
                pass

    try:
        async with asyncio.timeout(grace_s):
            await asyncio.gather(drain(proc.stdout), drain(proc.stderr))
            await proc.wait()
    except TimeoutError:
        transport = getattr(proc, "_transport", None)  # asyncio exposes no public way to close a child's pipes
        if transport is not None:
            transport.close()
        await proc.wait()


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the tool's session: its children too
    except (ProcessLookupError, PermissionError):
        pass


def _classify(rc: int | None, stderr: str) -> ToolStatus:
    if rc == 0:
        return "ok"
    if rc is not None and rc < 0:
        sig = -rc
        if sig in (signal.SIGXCPU, signal.SIGKILL):  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
            return "timeout"
        return "crash"
    if "MemoryError" in stderr:
        return "memory"
    return "error"
