"""The analytical EP vs FSDP traffic model (``moe_rl.moe.ep.traffic``) on small hand-computed cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moe_rl.moe.ep.traffic import (
    MODELS,
    MoELayerShape,
    crossover_tokens,
    ep_rows_per_token,
    ep_token_bytes,
    fsdp_expert_bytes,
    markdown_report,
    row_bytes,
    traffic_table,
)

# E=4, D=256, F=128, K=2 on ep=2: 2 experts per rank, half the slots leave the GPU.
SMALL = MoELayerShape(name="small", num_experts=4, hidden=256, moe_ffn=128, top_k=2)


def test_row_bytes():
    assert row_bytes(256, "bf16") == 512
    assert row_bytes(256, "fp32") == 1024
    assert row_bytes(256, "fp8") == 256 + 2 * 4  # two 1x128 blocks, one fp32 scale each
    assert row_bytes(7168, "fp8") == 7168 + 56 * 4
    assert row_bytes(200, "fp8") == 200 + 2 * 4  # a partial block still carries a scale
    with pytest.raises(ValueError, match=r"dtype='int4' is not supported"):
        row_bytes(8, "int4")  # type: ignore[arg-type]


def test_ep_rows_per_token_per_slot_and_dedup():
    assert ep_rows_per_token(SMALL, 2) == 1.0  # K * (ep-1)/ep = 2 * 1/2
    assert ep_rows_per_token(SMALL, 1) == 0.0
    assert ep_rows_per_token(SMALL, 4) == 1.5
    # dedup: the remote rank holds 2 of 4 experts; it is missed only if both picks are local: C(2,2)/C(4,2) = 1/6
    assert ep_rows_per_token(SMALL, 2, dedup=True) == pytest.approx(5 / 6)
    # ep = E: one expert per rank, distinct experts = distinct ranks, so dedup changes nothing
    assert ep_rows_per_token(SMALL, 4, dedup=True) == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"ep=3 must be >= 1 and divide num_experts=4"):
        ep_rows_per_token(SMALL, 3)


def test_ep_token_bytes_hand_computed():
    bf16 = ep_token_bytes(SMALL, 10, 2)  # 10 tokens * 1 row * 512 B per exchange
    assert (bf16.dispatch_fwd, bf16.combine_fwd, bf16.combine_bwd, bf16.dispatch_bwd) == (
        5120,
        5120,
        5120,
        5120,
    )
    assert bf16.total == 20480
    fp8 = ep_token_bytes(SMALL, 10, 2, dispatch_dtype="fp8", combine_dtype="bf16")
    assert (fp8.dispatch_fwd, fp8.combine_fwd, fp8.combine_bwd, fp8.dispatch_bwd) == (2640, 5120, 2640, 5120)
    assert fp8.total == 15520
    assert ep_token_bytes(SMALL, 10, 2, backward=False).total == 10240
    assert ep_token_bytes(SMALL, 0, 2).total == 0


def test_fsdp_expert_bytes_hand_computed():
    assert SMALL.expert_params == 3 * 4 * 256 * 128 == 393216
    f = fsdp_expert_bytes(SMALL, 2)  # (N-1)/N = 1/2; 2 bf16 gathers + 1 fp32 reduce-scatter
    assert f.all_gather == 2 * 393216 * 2 * 0.5 == 786432
    assert f.reduce_scatter == 393216 * 4 * 0.5 == 786432
    assert f.total == 1572864
    assert fsdp_expert_bytes(SMALL, 2, gathers=1, backward=False).total == 393216
    assert fsdp_expert_bytes(SMALL, 1).total == 0  # nothing to gather from yourself
    assert (
        fsdp_expert_bytes(SMALL, 4, weight_dtype="fp32", grad_dtype="bf16").total
        == 393216 * (2 * 4 + 2) * 0.75
    )


def test_crossover_is_where_the_bytes_meet():
    per_token = ep_token_bytes(SMALL, 1, 2).total  # 2048
    fsdp = fsdp_expert_bytes(SMALL, 2).total
    t_star = crossover_tokens(per_token, fsdp)
    assert t_star == 768
    assert ep_token_bytes(SMALL, 768, 2).total == fsdp
    assert crossover_tokens(0.0, fsdp) == math.inf


def test_table_covers_models_and_tokens_and_ep_wins_at_training_sizes():
    rows = traffic_table()
    assert {r.model for r in rows} == set(MODELS) and len(rows) == 3 * len(MODELS)
    for r in rows:
        assert r.ep_fp8 < r.ep_bf16 < r.fsdp, r
        assert r.crossover_fp8 > r.tokens_per_gpu
    dsv3 = [r for r in rows if r.model == "DeepSeek-V3 671B" and r.tokens_per_gpu == 4096][0]
    # 4096 tokens * 8 * 7/8 rows * (2 * 7392 fp8 + 2 * 14336 bf16 bytes)
    assert dsv3.ep_fp8 == 4096 * 7 * (2 * 7392 + 2 * 14336)


def test_glm45_air_matches_the_model_config():
    from moe_rl.models.glm4_moe.config import GlmMoeConfig

    cfg = GlmMoeConfig()
    air = MODELS["GLM-4.5-Air 106B"]
    assert (air.num_experts, air.hidden, air.moe_ffn, air.top_k) == (
        cfg.n_routed_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
    )


def test_committed_doc_is_current():
    doc = Path(__file__).resolve().parents[2] / "docs" / "ep_traffic.md"
    assert doc.read_text() == markdown_report(), (
        "regenerate: python -m moe_rl.moe.ep.traffic --out docs/ep_traffic.md"
    )
