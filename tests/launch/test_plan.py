"""Cluster launch plan: node accounting, the exact vLLM flags per role, DP rank coverage, KV connector JSON, Mooncake
commands, validation errors (``moe_rl.launch``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.plan import addr, build_plan

REPO = Path(__file__).resolve().parents[2]
GLM = str(REPO / "recipes/glm5_1/rl.toml")
KIMI = str(REPO / "recipes/kimi_k2_7_code/rl.toml")
NEMO = str(REPO / "recipes/nemotron_3_ultra_550b/rl.toml")


def _load(recipe: str, *overrides: str) -> ClusterConfig:
    return load_config(ClusterConfig, ["@", recipe, *overrides])


def _flag(argv, name):
    """Value after ``name`` in ``argv`` (None if absent)."""
    argv = list(argv)
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture(scope="module")
def glm_plan():
    return build_plan(_load(GLM))


def test_glm5_1_nodes_add_up_to_28_and_each_gpu_node_runs_one_gpu_process(glm_plan):
    cfg = glm_plan.config
    assert cfg.cluster.num_nodes == 28
    assert cfg.trainer.num_nodes == 16
    assert cfg.inference.prefill.nodes + cfg.inference.decode.nodes == 12
    gpu_procs = {}
    for p in glm_plan.processes:
        if p.gpus:
            assert p.node not in gpu_procs, f"node {p.node} has two GPU processes: {gpu_procs[p.node]} and {p.name}"
            gpu_procs[p.node] = p.name
    assert sorted(gpu_procs) == list(range(28))  # every node's GPUs are used, none twice
    assert [p.node for p in glm_plan.by_role("trainer")] == list(range(16))
    assert sorted(p.node for p in glm_plan.by_role("prefill")) == list(range(16, 20))
    assert sorted(p.node for p in glm_plan.by_role("decode")) == list(range(20, 28))
    assert [p.node for p in glm_plan.by_role("mooncake_master")] == [16]
    assert sorted(p.node for p in glm_plan.by_role("mooncake_client")) == list(range(16, 28))
    assert [p.node for p in glm_plan.by_role("router")] == [0]  # beside the orchestrator, on its loopback
    assert [p.node for p in glm_plan.by_role("orchestrator")] == [0]


@pytest.mark.parametrize("role,backend,dp,dbo", [("prefill", "deepep_high_throughput", 32, True),
                                                 ("decode", "deepep_low_latency", 64, False)])
def test_engine_flags_per_role_and_dp_ranks_cover_the_group(glm_plan, role, backend, dp, dbo):
    procs = glm_plan.by_role(role)
    ranks = []
    heads = [p for p in procs if "--headless" not in p.argv]
    assert len(heads) == 1 and _flag(heads[0].argv, "--port") == "8000"
    for p in procs:
        a = p.argv
        assert list(a[:3]) == ["vllm", "serve", "zai-org/GLM-5.1-FP8"]
        assert _flag(a, "--all2all-backend") == backend
        assert ("--enable-dbo" in a) is dbo
        assert "--enable-expert-parallel" in a
        assert int(_flag(a, "--data-parallel-size")) == dp and dp >= 32  # wide EP: EP = DP x TP(1)
        assert _flag(a, "--data-parallel-address") == addr(heads[0].node)  # ZMQ binds it: the numeric address
        assert _flag(a, "--data-parallel-rpc-port") == "13345"
        start = int(_flag(a, "--data-parallel-start-rank") or 0)
        local = int(_flag(a, "--data-parallel-size-local"))
        assert local == 8
        ranks += range(start, start + local)
        assert ("--headless" in a) is (start != 0)
        assert _flag(a, "--max-model-len") == "131072"
        assert _flag(a, "--worker-extension-cls") == "moe_rl.weights.engine.WeightSyncExtension"
    assert sorted(ranks) == list(range(dp))  # distinct, covering 0..DP-1


def test_kv_transfer_config_multiconnector_with_offload(glm_plan):
    envs = []
    for p in glm_plan.by_role("prefill") + glm_plan.by_role("decode"):
        kv = json.loads(_flag(p.argv, "--kv-transfer-config"))
        assert kv["kv_connector"] == "MultiConnector" and kv["kv_role"] == "kv_both"
        assert kv["kv_connector_extra_config"]["connectors"] == [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
        ]
        assert "--enable-prefix-caching" in p.argv
        assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == addr(p.node)  # bound: the node's cluster IPv4
        assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert p.env["VLLM_SERVER_DEV_MODE"] == "1"  # /collective_rpc: weight updates, version probes
        envs.append((p.env["MOONCAKE_CONFIG_PATH"], p.env["PYTHONHASHSEED"]))
    assert set(envs) == {("${RUN_DIR}/configs/mooncake_store.json", "0")}  # one store config, one hash seed
    store = json.loads(glm_plan.files["configs/mooncake_store.json"])
    # keys of vLLM MooncakeStoreConfig.from_file (vllm/distributed/mooncake_store.py)
    assert store == {
        "metadata_server": "http://${HOST_16}:8080/metadata", "master_server_address": "${HOST_16}:50051",
        "protocol": "rdma", "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
        "local_buffer_size": 4 * 1024**3, "enable_offload": False,
    }


def test_kv_transfer_config_other_connectors():
    plan = build_plan(_load(GLM, "--inference.kv-offload", "null"))
    for p in plan.by_role("prefill") + plan.by_role("decode"):
        assert json.loads(_flag(p.argv, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert "MOONCAKE_CONFIG_PATH" not in p.env and "--enable-prefix-caching" not in p.argv
    assert not plan.by_role("mooncake_master") and not plan.by_role("mooncake_client")
    plan = build_plan(_load(GLM, "--inference.kv-offload", "null", "--inference.kv-connector", "MooncakeConnector"))
    roles = {json.loads(_flag(p.argv, "--kv-transfer-config"))["kv_role"] for p in plan.by_role("prefill")}
    assert roles == {"kv_producer"}
    roles = {json.loads(_flag(p.argv, "--kv-transfer-config"))["kv_role"] for p in plan.by_role("decode")}
    assert roles == {"kv_consumer"}


def test_colocated_engine_with_offload_uses_the_store_connector():
    cfg = _load(GLM, "--inference.mode", "colocated", "--inference.prefill", "null", "--inference.decode", "null",
                "--inference.engine.nodes-per-replica", "4", "--inference.engine.replicas", "3")
    plan = build_plan(cfg)
    engines = plan.by_role("engine")
    assert len(engines) == 12
    for p in engines:
        assert json.loads(_flag(p.argv, "--kv-transfer-config")) == {"kv_connector": "MooncakeStoreConnector",
                                                                     "kv_role": "kv_both"}
        assert "--all2all-backend" not in p.argv  # vLLM's default unless the recipe picks one
    router = plan.by_role("router")[0].argv
    assert "--vllm-pd-disaggregation" not in router and "--kv-connector" not in router
    i = router.index("--worker-urls")
    assert router[i + 1:i + 4] == ("http://${HOST_16}:8000", "http://${HOST_20}:8000", "http://${HOST_24}:8000")


def test_router_and_trainer_commands(glm_plan):
    router = glm_plan.by_role("router")[0].argv
    assert "--vllm-pd-disaggregation" in router and _flag(router, "--kv-connector") == "nixl"
    assert _flag(router, "--prefill") == "http://${HOST_16}:8000"
    assert _flag(router, "--decode") == "http://${HOST_20}:8000"
    assert _flag(router, "--prefill-policy") == _flag(router, "--decode-policy") == "consistent_hash"
    for p in glm_plan.by_role("trainer"):
        a = p.argv
        assert a[1:3] == ("-m", "torch.distributed.run")
        assert "--nnodes=16" in a and "--nproc-per-node=8" in a and "--rdzv-backend=c10d" in a
        assert "--rdzv-endpoint=${HOST_0}:29500" in a


def test_mooncake_flags_exist_in_the_installed_binaries(glm_plan):
    exe = shutil.which("mooncake_master") or str(Path(__file__).resolve().parents[2] / ".venv/bin/mooncake_master")
    if not Path(exe).exists():
        pytest.skip("mooncake_master is not installed (the mooncake extra)")
    res = subprocess.run([exe, "--helpfull"], capture_output=True, text=True, timeout=60)
    helptext = res.stdout + res.stderr
    for tok in glm_plan.by_role("mooncake_master")[0].argv[1:]:
        name = tok.lstrip("-").split("=")[0]
        assert f"-{name} (" in helptext, f"mooncake_master has no flag -{name}"
    client = Path(exe).with_name("mooncake_client")
    res = subprocess.run([str(client), "--help"], capture_output=True, text=True, timeout=60)
    helptext = res.stdout + res.stderr
    for tok in glm_plan.by_role("mooncake_client")[0].argv[1:]:
        name = tok.lstrip("-").split("=")[0]
        assert f"-{name} (" in helptext, f"mooncake_client has no flag -{name}"


def _router_help() -> str:
    exe = shutil.which("vllm-router") or str(REPO / ".venv/bin/vllm-router")
    if not Path(exe).exists():
        if os.environ.get("MOE_RL_REQUIRE_ROUTER") == "1":
            pytest.fail("MOE_RL_REQUIRE_ROUTER=1 but vllm-router is not installed (pip install -e '.[router]')")
        pytest.skip("vllm-router is not installed (the router extra)")
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_router_flags_and_policies_exist_in_the_installed_binary(glm_plan):
    import re
    import typing

    from moe_rl.launch.engines import RouterPolicy

    helptext = _router_help()
    # every option the binary accepts, as argparse prints it in its usage and option list
    known = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", helptext))
    colocated = _load(GLM, "--inference.mode", "colocated", "--inference.prefill", "null", "--inference.decode",
                      "null", "--inference.engine.nodes-per-replica", "4", "--inference.engine.replicas", "3")
    plans = {"P/D": glm_plan, "colocated": build_plan(colocated)}
    plans["P/D mooncake"] = build_plan(_load(GLM, "--inference.kv-connector", "MooncakeConnector"))
    for what, plan in plans.items():
        argv = plan.by_role("router")[0].argv
        flags = [t for t in argv[1:] if t.startswith("--")]
        assert flags, what
        missing = [f for f in flags if f not in known]
        assert not missing, f"{what}: vllm-router has no flag {missing}"
    # the --policy choices the binary offers are exactly the config's, for all three policy flags
    for flag in ("--policy", "--prefill-policy", "--decode-policy"):
        m = re.search(re.escape(flag) + r" \{([a-z_,]+)\}", helptext)
        assert m is not None, f"no choices printed for {flag}"
        assert set(m.group(1).split(",")) == set(typing.get_args(RouterPolicy)), flag
    connector = _flag(plans["P/D mooncake"].by_role("router")[0].argv, "--kv-connector")
    m = re.search(r"--kv-connector \{([a-z,]+)\}", helptext)
    assert m is not None and connector == "mooncake" and connector in m.group(1).split(",")


@pytest.mark.parametrize("overrides,pattern", [
    (["--cluster.num-nodes", "27"], r"cluster\.num_nodes=27 but the roles use .* = 28 nodes"),
    (["--trainer.ep", "3"], r"trainer: ep=3 must divide dp_shard\*cp"),
    (["--model.config.n-routed-experts", "100"], r"trainer\.ep=8 must divide the model's 100 routed experts"),
    (["--trainer.seq-len", "131070"], r"trainer\.seq_len=131070 must be divisible by trainer\.cp=8"),
    (["--trainer.cp", "3"], r"not divisible by dp_replicate\*cp = 1\*3; change trainer\.cp"),
    (["--inference.decode.nodes-per-replica", "2", "--inference.decode.replicas", "4"],
     r"inference\.decode\.wide_ep=true needs EP >= 32, but nodes_per_replica=2 x 8 GPUs gives EP=16"),
    (["--inference.max-model-len", "200000"], r"inference\.max_model_len=200000 exceeds trainer\.seq_len=131072"),
    (["--inference.prefill.all2all-backend", "pplx"], r"inference\.prefill\.all2all_backend"),
    (["--name", "glm/try2"], r"name='glm/try2' contains '/', so it cannot make a valid cache_salt"),
    (["--model.config.n-routed-experts", "250", "--model.config.n-group", "1"],
     r"expert-parallel size 32 .* must divide the model's 250 routed experts"),
])
def test_validation_errors_name_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(GLM, *overrides)


def test_modelled_architectures_derive_their_figures():
    with pytest.raises(ConfigError, match=r"remove \['n_routed_experts'\]"):
        _load(NEMO, "--model.n-routed-experts", "512")
    with pytest.raises(ConfigError, match=r"inference\.decode: expert-parallel size 40 .* 384 routed experts"):
        _load(KIMI, "--inference.decode.nodes-per-replica", "5", "--inference.prefill.nodes-per-replica", "7")
    cfg = _load(NEMO)
    assert cfg.model.experts == 512 and cfg.model.modelled
    assert not build_plan(cfg).by_role("mooncake_client")  # offload off for the Mamba hybrid (see the recipe)


def test_ssd_tier_of_the_mooncake_offload():
    plan = build_plan(_load(GLM, "--inference.kv-offload.enable-ssd-offload", "true",
                            "--inference.kv-offload.ssd-path", "/local/mooncake"))
    assert "-enable_offload=true" in plan.by_role("mooncake_master")[0].argv
    for p in plan.by_role("mooncake_client"):
        assert "-enable_offload=true" in p.argv
        assert p.env == {"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/local/mooncake"}
        assert f"-global_segment_size={1024 * 1024**3}" in p.argv
    assert json.loads(plan.files["configs/mooncake_store.json"])["enable_offload"] is True
    with pytest.raises(ConfigError, match=r"enable_ssd_offload=true needs ssd_path"):
        _load(GLM, "--inference.kv-offload.enable-ssd-offload", "true")


def test_model_config_overrides_are_validated_by_the_model_config():
    with pytest.raises(ConfigError, match=r"config: num_experts_per_tok=300 must be <= n_routed_experts=256"):
        _load(GLM, "--model.config.num-experts-per-tok", "300")
    with pytest.raises(ConfigError, match=r"config\.foo = 3: Extra inputs are not permitted"):
        _load(GLM, "--model.config.foo", "3")
    with pytest.raises(ConfigError, match=r"remove \['n_routed_experts'\]"):
        _load(GLM, "--model.n-routed-experts", "256")
