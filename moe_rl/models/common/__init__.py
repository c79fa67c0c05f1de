"""Pieces shared by every model family: :mod:`moe_rl.models.common.head` (chunked LM head and token log-probs),
:mod:`moe_rl.models.common.decoder` (RMSNorm, the GLM MLP, weight init, experts backend, replay inputs),
:mod:`moe_rl.models.common.state_dict` (Hugging Face checkpoint names of everything but the attention) and
:mod:`moe_rl.models.common.config` (MoE routing field checks)."""
