"""Module-scoped Mooncake fixtures for the test modules that share one master (``tests/inference``).

The master starts through the ``start_mooncake_master`` session fixture of ``tests/inference/conftest.py`` (which
skips the test when Mooncake cannot run here, or fails it with ``MOE_RL_REQUIRE_MOONCAKE=1``)::

    from _mooncake import MiB, master_fixture, store_client_fixture

    master = master_fixture(default_kv_lease_ttl_ms=500)
    store = store_client_fixture(local_buffer_bytes=8 * MiB)

Each fixture's name is the module attribute it is assigned to; a client fixture uses the module's ``master``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

MiB = 1 << 20


def master_fixture(**config: Any) -> Callable[..., Any]:
    """A module-scoped fixture: a ``MooncakeMaster`` started with ``MooncakeMasterConfig(**config)``, stopped after
    the module's last test."""

    @pytest.fixture(scope="module")
    def _master(start_mooncake_master: Callable[..., Any]) -> Iterator[Any]:
        m = start_mooncake_master(**config)
        yield m
        m.stop()

    return _master


def store_client_fixture(*, local_buffer_bytes: int, global_segment_bytes: int = 64 * MiB) -> Callable[..., Any]:
    """A module-scoped fixture: a ``StoreClient`` of the module's ``master`` that mounts ``global_segment_bytes``
    (0: it stores nothing itself) and transfers through a ``local_buffer_bytes`` buffer; closed after the module."""

    @pytest.fixture(scope="module")
    def _client(master: Any) -> Iterator[Any]:
        from moe_rl.inference.mooncake import StoreClient

        config = master.client_config(global_segment_bytes=global_segment_bytes, local_buffer_bytes=local_buffer_bytes)
        with StoreClient(config) as client:
            yield client

    return _client
