"""``VllmServerConfig.kv_transfer_config``: rendered as ``--kv-transfer-config`` JSON, bad values refused (no vLLM)."""

from __future__ import annotations

import json

import pytest

from moe_rl.inference import VllmServer, VllmServerConfig

STORE = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
         "kv_connector_extra_config": {"shared_storage_path": "/abs/kv"}}


def test_rendered_once_as_compact_json(tmp_path):
    argv = VllmServer(VllmServerConfig(kv_transfer_config=STORE), tmp_path, tmp_path / "log").command(8000)
    assert argv.count("--kv-transfer-config") == 1
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == STORE
    assert "--kv-transfer-config" not in VllmServer(VllmServerConfig(), tmp_path, tmp_path / "log").command(8000)


@pytest.mark.parametrize(("value", "needle"), [
    ({"kv_role": "kv_both"}, "no 'kv_connector' name"),
    ({"kv_connector": "NixlConnector", "kv_role": "prefill"}, "must be one of"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": [1]}, "must be a dict"),
    ({"kv_connector": "ExampleConnector", "kv_role": "kv_both"}, "absolute directory"),
    ({**STORE, "kv_connector_extra_config": {"shared_storage_path": "rel/kv"}}, "absolute directory"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": {1, 2}}},
     "not JSON-serialisable"),
])
def test_bad_values_refused(value, needle):
    with pytest.raises(ValueError, match="kv_transfer_config") as err:
        VllmServerConfig(kv_transfer_config=value)
    assert needle in str(err.value)


def test_flag_in_extra_args_refused():
    with pytest.raises(ValueError, match="kv_transfer_config field"):
        VllmServerConfig(extra_args=["--kv-transfer-config", json.dumps(STORE)])
