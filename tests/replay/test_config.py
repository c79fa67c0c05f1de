"""``trainer.router_replay`` in the run config: turns recording on in the engine client; rejected for a dense model."""

from __future__ import annotations

import pytest

from moe_rl.models.glm4_moe import GlmMoeConfig
from moe_rl.runtime.config import RLConfig


def test_router_replay_flag_and_dense_model_rejected(tmp_path):
    cfg = RLConfig(output_dir=tmp_path / "run", trainer={"router_replay": True})
    assert cfg.trainer.router_replay is True
    assert RLConfig(output_dir=tmp_path / "run").trainer.router_replay is False
    with pytest.raises(ValueError, match=r"router_replay=true needs an MoE model.*first_k_dense_replace=2"):
        RLConfig(output_dir=tmp_path / "run", trainer={"router_replay": True},
                 model=GlmMoeConfig.tiny_debug(first_k_dense_replace=2))
