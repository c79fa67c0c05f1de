"""The dry run refuses what the cluster trainer refuses at start-up: expert sizes its grouped experts cannot run.

The cluster trainer builds its routed experts with ``torch._grouped_mm`` (``resolve_experts_backend("grouped_mm",
...)``, no config switch), which needs 16-byte rows; before this check the dry run printed ``OK`` for e.g.
``--model.config.moe-intermediate-size 2052`` in bf16 and the job would have stopped at trainer start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl import cli
from moe_rl.models.glm4_moe.config import GlmMoeConfig
from moe_rl.runtime.checks import grouped_experts_problem
from moe_rl.runtime.trainer.step import resolve_experts_backend

GLM = str(Path(__file__).resolve().parents[2] / "recipes/glm5_1/rl.toml")


def test_dry_run_fails_for_expert_sizes_the_trainer_refuses(capsys):
    rc = cli.main(["cluster", "@", GLM, "--dry-run", "--model.config.moe-intermediate-size", "2052"])
    out = capsys.readouterr().out
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith("FAIL: the cluster trainer refuses this config: its routed experts run torch._grouped_mm")
    assert "F=2052 to be multiples of 8 in torch.bfloat16" in first and "model.config.moe_intermediate_size" in first


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (130, 64), (128, 66), (132, 68), (136, 72)])
def test_the_check_agrees_with_the_trainer(device_type, dtype, hidden, inter):
    """``check_trainer_supported``'s expert rule and the trainer's ``resolve_experts_backend`` refuse the same
    (size, dtype, device) combinations."""
    cfg = GlmMoeConfig.tiny_debug().model_copy(update={"hidden_size": hidden, "moe_intermediate_size": inter})
    problem = grouped_experts_problem(cfg, dtype, device_type)
    try:
        resolve_experts_backend("grouped_mm", cfg, dtype, device_type)
        refused = False
    except ValueError:
        refused = True
    assert refused == (problem is not None), (problem, refused)


@pytest.mark.parametrize("dtype, device_type, match", [
    ("float16", "cpu", r"dtype='float16' is not a trainer dtype; use 'float32' or 'bfloat16'"),
    ("foo", "cpu", r"dtype='foo' is not a trainer dtype"),  # was AttributeError from getattr(torch, "foo")
    (None, "cpu", r"dtype=None is not a trainer dtype"),
    ("float32", "tpu", r"device_type='tpu' is not supported; use 'cpu' or 'cuda'"),
])
def test_resolve_experts_backend_refuses_bad_dtype_and_device(dtype, device_type, match):
    with pytest.raises(ValueError, match=match):
        resolve_experts_backend("grouped_mm", GlmMoeConfig.tiny_debug(), dtype, device_type)
