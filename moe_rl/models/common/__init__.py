"""Pieces shared by every model family: :mod:`moe_rl.models.common.head` (chunked LM head and token log-probs),
:mod:`moe_rl.models.common.decoder` (RMSNorm, the GLM MLP, weight init, ``forward`` / ``token_logprobs``, experts
backend, replay inputs), :mod:`moe_rl.models.common.state_dict` (Hugging Face checkpoint names of everything but the
attention), :mod:`moe_rl.models.common.config` (MoE routing field checks, the ``config.json`` round trip and
:class:`~moe_rl.models.common.config.MlaMoeConfig`, the MLA families' config base) and
:mod:`moe_rl.models.common.parallelize` (EP, CP, activation checkpointing and FSDP2 composed for a family)."""
