"""Mooncake Store: key scheme, master lifecycle, checked client, routed-experts payloads (real master).

The tests that need a master skip when Mooncake cannot run here (no package / no libibverbs), naming the
fix; with ``MOE_RL_REQUIRE_MOONCAKE=1`` (CI) they fail instead.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

import numpy as np
import pytest
import torch
from _mooncake import MiB, master_fixture, store_client_fixture

from moe_rl.inference.mooncake import (
    MissingKeyError,
    MooncakeMaster,
    MooncakeMasterConfig,
    StoreError,
    StoreKey,
    parse_shard,
    require_mooncake,
    shard_id,
)
from moe_rl.inference.mooncake.routed_experts import RoutedExpertsStore
from moe_rl.replay.indices import RoutedExperts

master = master_fixture(default_kv_lease_ttl_ms=500)
store = store_client_fixture(local_buffer_bytes=8 * MiB)


# ---------------------------------------------------------------------- keys (no master)
def test_key_round_trip_and_layout():
    k = StoreKey(kind="weights", model="zai-org/GLM-4.5-Air", dtype="bfloat16",
                 name="model.layers.3.mlp.experts.7.down_proj.weight", version=12, shard=shard_id(3, 8), part=2)
    text = k.to_str()
    assert text == ("moe_rl|k1|weights|zai-org/GLM-4.5-Air|v12|bfloat16|3of8|"
                    "model.layers.3.mlp.experts.7.down_proj.weight|p2")
    assert StoreKey.parse(text) == k
    kv = StoreKey(kind="kv", model="m", dtype="fp8_e4m3", name="blockhash0f", salt="run7-v3")
    assert StoreKey.parse(str(kv)) == kv and str(kv).split("|")[4] == "srun7-v3"
    assert parse_shard("3of8") == (3, 8) and k.with_part(0).part == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "a|b"}, r"model='a\|b' contains '\|'"),
        ({"name": "x y"}, r"name='x y' contains ' '"),
        ({"dtype": ""}, "dtype is empty"),
        ({"kind": "blob"}, "kind='blob' is not one of"),
        ({"salt": "s"}, "exactly one of version"),
        ({"version": -1}, r"version=-1 must be an int >= 0"),
        ({"shard": "8of8"}, r"shard='8of8'"),
        ({"shard": "0/1"}, "is not '<rank>of<world>'"),
        ({"part": -1}, "part=-1"),
    ],
)
def test_key_validation_names_the_component(kwargs, match):
    base = {"kind": "weights", "model": "m", "dtype": "float32", "name": "w", "version": 1}
    with pytest.raises(ValueError, match=match):
        StoreKey(**{**base, **kwargs})


def test_key_parse_rejects_foreign_strings():
    with pytest.raises(ValueError, match="expected 9"):
        StoreKey.parse("moe_rl|k1|weights")
    with pytest.raises(ValueError, match="expected moe_rl|k1"):
        StoreKey.parse("other|k1|weights|m|v1|f|0of1|w|p0")
    with pytest.raises(ValueError, match="generation 'vx'"):
        StoreKey.parse("moe_rl|k1|weights|m|vx|f|0of1|w|p0")
    with pytest.raises(ValueError, match="rank=2, world=2"):
        shard_id(2, 2)


# ---------------------------------------------------------------------- install errors (no master)
def test_missing_libibverbs_says_how_to_install(monkeypatch):
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake not installed")

    def no_lib(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    with pytest.raises(ImportError, match=r"pip install 'moe_rl\[mooncake\]'.*apt-get install libibverbs1"):
        require_mooncake()
    with pytest.raises(ImportError, match="libibverbs.so.1"):
        MooncakeMaster().start()


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"pip install 'moe_rl\[mooncake\]'"):
        require_mooncake()


def test_master_config_rejects_bad_values():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="must be an IPv4 address"):
        MooncakeMasterConfig(host="localhost")
    with pytest.raises(ValidationError, match="default_kv_lease_ttl_ms"):
        MooncakeMasterConfig(default_kv_lease_ttl_ms=0)  # a zero lease makes every get fail (LEASE_EXPIRED)


def test_master_start_failure_quotes_log(start_mooncake_master):
    with pytest.raises(RuntimeError, match=r"master exited with code .*master.log"):
        start_mooncake_master(extra_args=["--no_such_flag_for_moe_rl=1"], startup_timeout_s=20)


# ---------------------------------------------------------------------- master
def _listen_addrs(port: int) -> set[str]:
    """Local IPv4 addresses (hex, /proc/net/tcp order) in LISTEN state on ``port``."""
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


def test_master_binds_loopback_only(master):
    assert master.rpc_address == f"127.0.0.1:{master.rpc_port}"
    assert master.metadata_url == f"http://127.0.0.1:{master.metadata_port}/metadata"
    for port in (master.rpc_port, master.metadata_port, master.metrics_port):
        assert _listen_addrs(port) == {"0100007F"}, port  # 127.0.0.1, not 0.0.0.0


# ---------------------------------------------------------------------- bytes and tensors
def test_put_get_bytes_and_missing(store):
    payload = os.urandom(3 * MiB + 17)
    assert store.put("b:one", payload).written == 1
    assert store.get("b:one") == payload
    assert store.exists("b:one") and not store.exists("b:none")
    with pytest.raises(MissingKeyError, match="'b:none'"):
        store.get("b:none")
    with pytest.raises(MissingKeyError) as info:
        store.get_batch(["b:one", "b:none", "b:none2"])
    assert info.value.keys == ["b:none", "b:none2"]
    with pytest.raises(ValueError, match="'b:empty' is empty"):
        store.put("b:empty", b"")
    with pytest.raises(ValueError, match=r"max_object_bytes=4194304"):
        store.put("b:big", bytes(4 * MiB + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.int64])
def test_tensor_round_trip_is_bit_exact(store, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        x = (torch.randn(33, 17, generator=g) * 100).to(dtype)
    else:
        x = torch.randint(-(2**30), 2**30, (33, 17), generator=g).to(dtype)
    x = x.t()  # non-contiguous input
    key = StoreKey(kind="weights", model="m", dtype=str(dtype).removeprefix("torch."), name="t", version=0)
    store.put_tensor(key, x)
    y = store.get_tensor(key)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.contiguous().view(torch.uint8), x.contiguous().view(torch.uint8))
    assert store.put_tensor(key, x.clone()).already_present == 1  # idempotent
    with pytest.raises(ValueError, match="already holds a different tensor"):
        store.put_tensor(key, x.float() + 1 if dtype.is_floating_point else x + 1)


def test_put_batch_is_idempotent_for_duplicates(store):
    a, b = os.urandom(1000), os.urandom(2000)
    r = store.put_batch([("d:a", a), ("d:b", b), ("d:a", bytearray(a))])
    assert (r.written, r.duplicates_in_batch, r.already_present, r.bytes_written) == (2, 1, 0, 3000)
    c = os.urandom(10)
    r = store.put_batch([("d:a", a), ("d:c", c)])
    assert (r.written, r.already_present, r.bytes_written) == (1, 1, 10)
    assert store.get_batch(["d:a", "d:b", "d:c"]) == [a, b, c]
    with pytest.raises(ValueError, match=r"key 'd:b' already holds a different payload"):
        store.put_batch([("d:new", b"x"), ("d:b", b + b"!")])
    assert not store.exists("d:new")  # the conflict is found before anything is written
    with pytest.raises(ValueError, match="key 'd:z' appears twice in the batch with different payloads"):
        store.put_batch([("d:z", b"1"), ("d:z", b"2")])


def test_put_batch_splits_to_fit_the_transfer_buffer(store):
    blobs = [(f"s:{i}", os.urandom(3 * MiB)) for i in range(4)]  # 12 MiB through an 8 MiB buffer
    assert store.put_batch(blobs).written == 4
    assert store.get_batch([k for k, _ in blobs]) == [v for _, v in blobs]


def test_remove_respects_leases(store):
    store.put("r:x", b"123")
    assert store.get("r:x") == b"123"  # the get leases the object for default_kv_lease_ttl (500 ms)
    with pytest.raises(StoreError, match=r"remove\('r:x'\) failed with code -706 OBJECT_HAS_LEASE"):
        store.remove("r:x")
    assert store.remove("r:x", force=True) is True
    assert store.remove("r:x") is False and not store.exists("r:x")


# ---------------------------------------------------------------------- routed experts
def _record(seed: int, tokens: int = 40, layers: int = 4, k: int = 8, experts: int = 256) -> RoutedExperts:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(tokens)])
    ids[-1] = -1  # last sampled token: placeholder row
    return RoutedExperts.from_array(ids, experts)


def test_routed_experts_round_trip_by_rollout(store):
    rex = RoutedExpertsStore(store, "glm-test")
    records = {f"rollout-{i}": _record(i) for i in range(3)}
    assert rex.put_step(records, version=5).written == 3
    assert rex.put_step(records, version=5).already_present == 3  # re-sent step: no-op
    got = rex.get_step(list(records), version=5)
    assert got == records and got["rollout-1"].num_placeholder_rows == 1
    assert rex.get("rollout-2", version=5).to_numpy().tolist() == records["rollout-2"].to_numpy().tolist()
    with pytest.raises(MissingKeyError):
        rex.get("rollout-0", version=6)  # the version is part of the key
    with pytest.raises(ValueError, match="rollout-0.*already holds a different payload"):
        rex.put("rollout-0", _record(99), version=5)
    with pytest.raises(ValueError, match="contains ' '"):
        rex.key("bad id", 5)
    assert rex.remove(list(records), version=5) == 3
    with pytest.raises(MissingKeyError):
        rex.get_step(list(records), version=5)
