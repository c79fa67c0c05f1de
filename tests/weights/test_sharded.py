"""Sharded publication with no gather: every trainer rank ships only its own pieces (4 gloo ranks, FSDP2 and
HSDP x EP with tied embeddings), through the filesystem transport (a folder, read back with ``read_sharded``) and the
broadcast transport (one group per trainer rank, received concurrently and assembled). The result equals the
unsharded model's checkpoint tensors bit for bit (same values, same casts). Worker: ``_sharded_worker.py``."""

from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_sharded_worker.py")


@pytest.fixture(scope="module")
def results(launch_ranks, tmp_path_factory):
    return launch_ranks(WORKER, 4, tmp_path_factory.mktemp("sharded"), timeout_s=600)


@pytest.mark.parametrize("scenario", ["fs_fsdp4", "fs_hsdp_ep_tied", "broadcast_fsdp4"])
def test_sharded_publish(results, check_scenario, scenario):
    check_scenario(results, scenario)
