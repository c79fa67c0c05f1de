"""Pieces shared by every model family: :mod:`moe_rl.models.common.head` (chunked LM head and token log-probs)."""
