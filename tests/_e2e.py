"""Helpers of the end-to-end tests (``tests/test_e2e*.py``); imported as ``from _e2e import ...`` (``tests/`` is on
``sys.path``, see ``tests/conftest.py``)."""

from __future__ import annotations

import time

from moe_rl.procs import RUN_TAG_ENV, group_members, tagged_pids


def group_alive(pgid: int, wait_s: float = 20.0) -> bool:
    """True if the process group ``pgid`` still has a live member after waiting up to ``wait_s`` seconds for it to
    exit."""
    deadline = time.monotonic() + wait_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)
    return False


def run_tag_of(pid: int) -> str | None:
    """The ``MOE_RL_RUN_TAG`` a process was started with (None when it has none)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(RUN_TAG_ENV.encode() + b"="):
                return item.split(b"=", 1)[1].decode()
    return None


def assert_run_processes_tagged(pgids: list[int], pids: list[int] = ()) -> None:
    """Every live member of the process groups ``pgids``, and every process of ``pids`` (e.g. trainer ranks, which
    torchrun starts in sessions of their own), carries one and the same run tag, so the launcher's watcher
    (``moe_rl.procs.OrphanReaper``) would find them all were the launcher killed outright."""
    members = [pid for pgid in pgids for pid in group_members(pgid)] + list(pids)
    assert members, f"no live member in the process groups {pgids}"
    tags = {pid: run_tag_of(pid) for pid in members}
    assert len(set(tags.values())) == 1 and None not in tags.values(), tags
    assert set(members) <= set(tagged_pids(next(iter(tags.values())))), tags
