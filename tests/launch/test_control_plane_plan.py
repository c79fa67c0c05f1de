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
    assert "[guarded: control token on every path but /health]" in section
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
