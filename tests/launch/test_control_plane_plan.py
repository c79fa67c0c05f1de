"""The cluster plan's control plane: every engine API server binds its node's cluster address and loads the token
middleware, nothing binds 0.0.0.0, and the dry run lists every listening address with its guard and finds no unguarded
control endpoint (``moe_rl.launch.plan.listeners``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.dry_run import dry_run
from moe_rl.launch.plan import CONTROL_MIDDLEWARE, addr, build_plan, listeners
from moe_rl.launch.slurm import render_sbatch

REPO = Path(__file__).resolve().parents[2]
RECIPES = [str(REPO / f"recipes/{r}/rl.toml") for r in ("glm5_1", "kimi_k2_7_code", "nemotron_3_ultra_550b")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_engines_bind_the_cluster_address_with_the_middleware(recipe):
    plan = build_plan(load_config(ClusterConfig, ["@", recipe]))
    for p in plan.processes:
        assert "0.0.0.0" not in " ".join(p.argv), p.name
        if p.role in ("engine", "prefill", "decode") and "--headless" not in p.argv:
            argv = list(p.argv)
            assert argv[argv.index("--host") + 1] == addr(p.node)
            assert argv[argv.index("--middleware") + 1] == CONTROL_MIDDLEWARE
            assert p.env["MOE_RL_WEIGHTS_ROOT"] == "${RUN_DIR}/weights"
            assert "--api-key" not in argv  # the token travels in the environment (VLLM_API_KEY), never in argv
    text = render_sbatch(plan)
    assert "export MOE_RL_CONTROL_TOKEN VLLM_API_KEY" in text and "chmod 600" in text
    assert 'echo "$MOE_RL_CONTROL_TOKEN' not in text


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_lists_listeners_and_none_is_unguarded(recipe):
    res = dry_run(load_config(ClusterConfig, ["@", recipe]), suggest=False)
    assert "## listening" in res.text
    section = res.text.split("## listening", 1)[1].split("\n\n", 1)[0]
    assert "[guarded: control token on every path but /health; /collective_rpc: moe_rl's worker methods only]" in section
    assert "UNGUARDED]" not in section.replace("UNGUARDED (documented exception)", "")
    assert not [e for e in res.errors if "without a guard" in e]
    plan = res.plan
    api = [x for x in listeners(plan) if x.what.startswith("vLLM API server")]
    assert api and all(x.guarded for x in api)
    assert all(x.guarded or x.exception for x in listeners(plan))


def test_dry_run_fails_on_an_unguarded_api_server(monkeypatch):
    """A plan whose engine lacks the middleware is refused (what the dry-run check exists for)."""
    import moe_rl.launch.dry_run as dr

    real = dr.listeners

    def without_guard(plan):
        return [dataclasses.replace(x, guarded=False, guard="none") if x.what.startswith("vLLM API") else x
                for x in real(plan)]

    monkeypatch.setattr(dr, "listeners", without_guard)
    res = dr.dry_run(load_config(ClusterConfig, ["@", RECIPES[0]]), suggest=False)
    assert not res.ok and any("without a guard" in e for e in res.errors)


def _glm(*overrides: str):
    return build_plan(load_config(ClusterConfig, ["@", RECIPES[0], *overrides]))


def test_listeners_include_what_vllm_and_torch_open_besides_the_http_port():
    """Besides each API server: the DP handshake and ZMQ sockets on the replica head's cluster address, the NIXL side
    channel of every engine process (port 5600 + its DP ranks, on its node's address), the stores torch binds on every
    interface (vLLM's process groups, the trainer's c10d rendezvous and torchrun's shared store)."""
    plan = _glm()
    got = listeners(plan)
    by = {(x.process, x.what.split(" (")[0]): x for x in got}
    assert by[("prefill.r0.n0", "vLLM data-parallel handshake")].address == "${ADDR_16}:13345"
    assert by[("decode.r0.n0", "vLLM engine input/output + DP coordinator")].address == "${ADDR_20}:<ephemeral>"
    assert by[("decode.r0.n0", "vLLM DP process group store")].address == "*:<ephemeral>"
    side = [x for x in got if x.what.startswith("vLLM NIXL side channel")]
    engines = plan.by_role("prefill") + plan.by_role("decode")
    assert len(side) == len(engines) == 12
    for p in engines:
        x = next(s for s in side if s.process == p.name)
        assert x.address == f"${{ADDR_{p.node}}}:{5600 + p.dp_start_rank}-{5600 + p.dp_start_rank + p.dp_local - 1}"
        assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == f"${{ADDR_{p.node}}}"
    rdzv = by[("trainer.n0", "torch c10d rendezvous store")]
    assert rdzv.address == "*:29500" and rdzv.wildcard and not rdzv.guarded
    assert ("trainer.n1", "torch c10d rendezvous store") not in by
    # every unguarded listener is on loopback, on a cluster address (an accepted exception) or marked as every interface
    for x in got:
        assert x.guarded or x.loopback or x.wildcard or x.address.startswith(("${ADDR_", "${HOST_")), x
    router = by[("router", "vllm-router")]  # its own routes have no authentication: only on trainer node 0's loopback
    assert router.address == "127.0.0.1:30000" and router.loopback and not router.guarded
    assert not [x for x in got if "store, one per trainer rank" in x.what]  # filesystem transport: no stores


def test_broadcast_and_p2p_transports_list_one_store_per_trainer_node():
    for kind in ("broadcast", "p2p"):
        got = [x for x in listeners(_glm("--weights.kind", kind)) if "store, one per trainer rank" in x.what]
        assert len(got) == 16 and all(x.wildcard for x in got)


def test_the_dry_run_accepts_exceptions_only_on_the_cluster_interface(monkeypatch):
    """An unguarded documented exception on the node's address is accepted silently; the same on every interface is
    a warning naming it (the firewall is then the guard); an unguarded listener that is no exception fails."""
    import moe_rl.launch.dry_run as dr
    from moe_rl.launch.plan import Listener

    def only(extra):
        monkeypatch.setattr(dr, "listeners", lambda plan: [extra])
        return dr.dry_run(load_config(ClusterConfig, ["@", RECIPES[0]]), suggest=False)

    res = only(Listener("x", "${ADDR_3}:9", "thing", "none", False, True))
    assert res.ok and not [w for w in res.warnings if "every interface" in w]
    res = only(Listener("x", "0.0.0.0:9", "thing", "none", False, True))
    assert res.ok and any("every interface" in w and "thing (x)" in w for w in res.warnings)
    res = only(Listener("x", "${ADDR_3}:9", "thing", "none", False, False))
    assert not res.ok and any("without a guard" in e for e in res.errors)
    res = only(Listener("x", "127.0.0.1:9", "thing", "none", False, False))
    assert res.ok
