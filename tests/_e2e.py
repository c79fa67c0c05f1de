"""Helpers of the end-to-end tests (``tests/test_e2e*.py``); imported as ``from _e2e import ...`` (``tests/`` is on
``sys.path``, see ``tests/conftest.py``)."""

from __future__ import annotations

import time

from moe_rl.procs import group_members


def group_alive(pgid: int, wait_s: float = 20.0) -> bool:
    """True if the process group ``pgid`` still has a live member after waiting up to ``wait_s`` seconds for it to
    exit."""
    deadline = time.monotonic() + wait_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)
    return False
