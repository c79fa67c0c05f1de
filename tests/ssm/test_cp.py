"""Context parallelism for the Mamba-2 layer (:func:`moe_rl.ssm.ssd_scan_cp`, :class:`moe_rl.ssm.Mamba2Mixer` with
a group) against one process, forward and backward, on real gloo groups of 2 and 4 ranks (one process per rank:
``tests/ssm/_cp_worker.py``; each world size launched once per module, every scenario checked in its own test).

Scenarios: the scan with the state passed between ranks (slices of unequal length, chunks shorter and longer than
a slice, an initial state on rank 0); the whole mixer (conv halo from the previous rank + state passing), every
parameter gradient summed over ranks; sizes that differ across ranks raise the same ValueError everywhere.
Tolerances: fp32 atol 1e-5 per element and the normwise chain bound (the worker's module docstring).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import check_scenario, ranks_fixture

WORKER = Path(__file__).with_name("_cp_worker.py")
TIMEOUT_S = 300

cp = ranks_fixture(WORKER, (2, 4), TIMEOUT_S)  # each world size launched once, every scenario at each

SCENARIOS = ["scan_cp", "mixer_cp", "validation_errors"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cp(cp, scenario):
    check_scenario(cp, scenario)
