"""The test-module side of ``tests/conftest.py``'s ``launch_ranks``: one module-scoped fixture per world size.

A multi-rank test module launches its worker once per world size and checks each scenario in its own test::

    from _ranks import ranks_fixture

    ep2 = ranks_fixture(WORKER, 2, TIMEOUT_S)

    def test_ep2(ep2, check_scenario, scenario):
        check_scenario(ep2, scenario)

(``check_scenario`` is also a session fixture of ``tests/conftest.py``, for modules that do not import this one.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def ranks_fixture(worker: Path, world: int | tuple[int, ...], timeout_s: float) -> Callable[..., dict[int, dict]]:
    """A module-scoped fixture that runs ``worker`` on ``world`` gloo ranks (``launch_ranks``) and returns
    ``{rank: report}``; each run gets its own temporary folder named after the worker and the world size.

    ``world`` may be a tuple of world sizes: the fixture is then parametrized over them (ids ``world2``, ...), so
    one test runs every scenario at each size and each size is launched once per module.

    The fixture's name is the module attribute it is assigned to.
    """
    worlds = world if isinstance(world, tuple) else None

    @pytest.fixture(scope="module", params=worlds, ids=None if worlds is None else [f"world{w}" for w in worlds])
    def _ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               launch_ranks: Callable[..., dict[int, dict]]) -> dict[int, dict]:
        size = request.param if worlds is not None else world
        return launch_ranks(worker, size, tmp_path_factory.mktemp(f"{worker.stem.lstrip('_')}{size}"), timeout_s)

    return _ranks


def scenario_result(world: tuple[Path, dict, dict[int, dict]], scenario: str) -> tuple[Any, dict]:
    """For a module fixture that returns ``(root, prepared, results)``, whose worker saved each scenario's output to
    ``root/<scenario>/result.pt``: assert that ``scenario`` passed on every rank (:func:`check_scenario`), then return
    ``(prepared[scenario], the loaded result.pt)``."""
    import torch

    root, prepared, results = world
    check_scenario(results, scenario)
    return prepared[scenario], torch.load(root / scenario / "result.pt", weights_only=True)


def check_scenario(results: dict[int, dict], scenario: str) -> None:
    """Assert that ``scenario`` reported ``"ok"`` on every rank of ``results`` (``{rank: report}``); the failure
    message shows each failing rank's traceback (or ``"scenario did not run"``)."""
    failures = {r: res.get(scenario, "scenario did not run") for r, res in results.items()}
    failures = {r: msg for r, msg in failures.items() if msg != "ok"}
    assert not failures, "\n".join(f"--- rank {r}:\n{msg}" for r, msg in failures.items())
