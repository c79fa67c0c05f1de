"""``plan_memory`` and ``python -m moe_rl.launch.memory`` refuse input that used to give a silent, wrong plan.

Before: ``optimizer_states=-1`` gave a smaller (negative-term) plan, ``optimizer_offload="no"`` counted as offload
on (a truthy string), float sizes planned fractional sequences, a tuple for ``parallel_dims`` failed with an
AttributeError, ``--ep 7`` with 256 routed experts planned a layout the trainer refuses, and the CLI planned the
dense DSA reference by default for GLM-5.1, whose config runs the memory-bounded kernel.
"""

from __future__ import annotations

import pytest

from moe_rl.distributed.memory import plan_memory
from moe_rl.distributed.parallel_dims import ParallelDims
from moe_rl.models.glm_moe_dsa.config import GlmMoeDsaConfig


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"seq_len": 16.0}, TypeError, r"seq_len=16.0 must be an int"),
    ({"seq_len": True}, TypeError, r"seq_len=True must be an int"),
    ({"micro_batch": 1.5}, TypeError, r"micro_batch=1.5 must be an int"),
    ({"loss_chunk_tokens": 1.5}, TypeError, r"loss_chunk_tokens=1.5 must be an int"),
    ({"optimizer_states": -1}, ValueError, r"optimizer_states=-1 must be >= 0"),
    ({"optimizer_offload": "no"}, TypeError, r"optimizer_offload='no' must be a bool"),
    ({"fp8": 1}, TypeError, r"fp8=1 must be a bool"),
    ({"parallel_dims": (1, 1, 1, 1)}, TypeError, r"parallel_dims must be a ParallelDims, got tuple"),
    ({"parallel_dims": ParallelDims(dp_shard=3, ep=3)}, ValueError,
     r"ep=3 must divide the model's n_routed_experts=8"),
])
def test_plan_memory_refuses_bad_input(kwargs, exc, match):
    args = {"model_config": GlmMoeDsaConfig.tiny_debug(), "parallel_dims": ParallelDims(), "seq_len": 16}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        plan_memory(**args)


def test_plan_memory_valid_input_still_plans():
    plan = plan_memory(GlmMoeDsaConfig.tiny_debug(), ParallelDims(dp_shard=2, ep=2), 16, optimizer_states=0,
                       optimizer_offload=False, loss_chunk_tokens=None)
    assert plan.components["optimizer"] == 0.0 and plan.peak_bytes > 0


def test_memory_cli_refuses_ep_not_dividing_the_experts(capsys):
    from moe_rl.launch.memory import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "glm5_1", "--nodes", "28", "--cp", "4", "--ep", "7"])
    assert exc.value.code == 2
    assert "ep=7 must divide the model's n_routed_experts=256" in capsys.readouterr().err


def test_memory_cli_default_kernel_is_the_models(capsys):
    """Without ``--attn-kernel`` the CLI plans the DSA kernel the model config runs (GLM-5.1: ``attn_backend =
    "torch"``, the memory-bounded path); it used to plan the dense ``[T, T]`` reference (586 GiB on 28 nodes)."""
    from moe_rl.launch.memory import main

    assert main(["--model", "glm5_1", "--nodes", "16", "--cp", "8"]) == 0
    heading = [line for line in capsys.readouterr().out.splitlines() if line.startswith("## ")]
    assert len(heading) == 1 and "DSA chunked" in heading[0], heading
