"""Pieces shared by every model family: :mod:`moe_rl.models.common.head` (chunked LM head and token log-probs),
:mod:`moe_rl.models.common.decoder` (RMSNorm, the GLM MLP, weight init, ``forward`` / ``token_logprobs``, experts
backend, replay inputs), :mod:`moe_rl.models.common.state_dict` (Hugging Face checkpoint names of everything but the
attention), :mod:`moe_rl.models.common.config` (MoE routing field checks, the ``config.json`` round trip and
:class:`~moe_rl.models.common.config.MlaMoeConfig`, the MLA families' config base) and
:mod:`moe_rl.models.common.parallelize` (EP, CP, activation checkpointing and FSDP2 composed for a family)."""

CHECKPOINT_FUNCTIONS = ("from_hf_state_dict", "hf_key_names", "load_hf_state_dict", "save_hf_checkpoint", "to_hf_state_dict")
"""The Hugging Face checkpoint functions every family's ``state_dict`` module defines and its package exports
(``moe_rl.models.<family>.load_hf_state_dict``, ...)."""


def family_exports(**by_submodule: tuple[str, ...]) -> dict[str, str]:
    """A family package's lazy exports (``{name: submodule}`` for :func:`moe_rl._lazy.lazy_getattr`): the names
    given per submodule (``model=("GlmMoeForCausalLM", ...)``) plus :data:`CHECKPOINT_FUNCTIONS` from
    ``state_dict``.

    Raises:
        ValueError: a name given twice.
    """
    exports = dict.fromkeys(CHECKPOINT_FUNCTIONS, "state_dict")
    for submodule, names in by_submodule.items():
        for name in names:
            if name in exports:
                raise ValueError(f"family_exports: {name!r} is listed under {exports[name]!r} and {submodule!r}; "
                                 "name each export once")
            exports[name] = submodule
    return exports
