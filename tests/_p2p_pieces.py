"""Test scaffolding for the ``p2p`` weight transport: a state dict cut as two trainer ranks would own it."""

from __future__ import annotations


def row_half_pieces(sd: dict) -> list[list]:
    """``[rank 0 pieces, rank 1 pieces]``: each tensor of ``sd`` split in two row halves (rank 0 owns the first)."""
    from moe_rl.weights.regions import Piece

    ranks: list = [[], []]
    for name, t in sd.items():
        h = t.shape[0] // 2
        ranks[0].append(Piece(name, tuple(t.shape), (0,) * t.dim(), t[:h]))
        ranks[1].append(Piece(name, tuple(t.shape), (h,) + (0,) * (t.dim() - 1), t[h:]))
    return ranks


def tiny_fsdp_glm():
    """``(cfg, ref_model, model)``: a tiny GLM-4.5 MoE, its unsharded reference and the same weights (seed 11) under
    FSDP2 with ``dp_shard=2`` on this gloo process group (call on both ranks)."""
    import torch

    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.distributed.parallelize import parallelize_model
    from moe_rl.models.glm4_moe.config import GlmMoeConfig
    from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM

    cfg = GlmMoeConfig.tiny_debug(vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  head_dim=8, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
                                  num_experts_per_tok=2)
    torch.manual_seed(11)
    ref_model = GlmMoeForCausalLM(cfg)
    torch.manual_seed(11)
    dims = ParallelDims(dp_shard=2)
    return cfg, ref_model, parallelize_model(GlmMoeForCausalLM(cfg), dims, dims.build_mesh("cpu"))
