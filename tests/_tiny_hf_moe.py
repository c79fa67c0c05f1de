"""Tiny ``transformers`` MoE models built from local configs (no hub, no downloads) for replay and FP8 tests.

Each builder seeds torch, builds the model in fp32 eval mode and, for the sigmoid-routed families, gives the
router's ``e_score_correction_bias`` random values so that the selection bias is exercised.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "qwen3_moe_nonorm", "mixtral", "deepseek_v3", "glm4_moe")
VOCAB = 64


def build(family: str, *, seed: int = 0, hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 2):
    """fp32 eval model of ``family`` (one of :data:`FAMILIES`) with 2 MoE layers."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=top_k)
    if family.startswith("qwen3_moe"):
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                                num_hidden_layers=2, head_dim=hidden // 4, num_experts=experts,
                                norm_topk_prob=family == "qwen3_moe")
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=inter, num_hidden_layers=2, head_dim=hidden // 4,
                               num_local_experts=experts)
        model = tf.MixtralForCausalLM(cfg)
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=2 * inter,
                                  moe_intermediate_size=inter, num_hidden_layers=3, first_k_dense_replace=1,
                                  n_routed_experts=experts, n_group=4, topk_group=2, n_shared_experts=1,
                                  routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif family == "glm4_moe":
        cfg = tf.Glm4MoeConfig(**common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                               num_hidden_layers=3, first_k_dense_replace=1, head_dim=hidden // 4,
                               n_routed_experts=experts, n_group=2, topk_group=1, n_shared_experts=1,
                               routed_scaling_factor=1.5)
        model = tf.Glm4MoeForCausalLM(cfg)
    else:
        raise ValueError(f"family={family!r}; expected one of {FAMILIES}")
    model = model.float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    # Router rows of std 0.02 over D=32 give near-uniform softmaxes; a larger gate spreads the scores so that
    # top-k margins sit far above fp32 rounding (the selection reference below compares in float64).
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            with torch.no_grad():
                p.normal_(0.0, 0.5, generator=g)
    return model
