"""``task.factory`` targets for the cluster orchestrator tests (imported by name: ``_factory_tasks:<callable>``)."""

from __future__ import annotations

from moe_rl.envs import AdditionTask, AdditionTaskConfig

CALLS: list[object] = []
"""The tokenizers ``addition_task`` was called with."""


def addition_task(tok):
    """A user task: 1-digit addition over ``tok``."""
    CALLS.append(tok)
    return AdditionTask(AdditionTaskConfig(num_digits=1, max_new_tokens=3), tok)


def not_a_task(tok):
    """Returns an object without the task interface."""
    return object()


NOT_CALLABLE = 3
