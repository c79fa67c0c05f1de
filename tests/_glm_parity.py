"""Scaffolding shared by the GLM and DeepSeek-V3 family parity tests (ours against transformers through a
checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


@torch.no_grad()
def randomize_for_parity(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: norms 1 + 0.1 N, biases 0.1 N, matrices N / sqrt(fan_in), selection bias 0.3 N.

    The noaux_tc correction bias (a buffer) is randomized too, so that it changes which experts are picked.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def random_ids(vocab_size: int, batch: int, seq: int) -> torch.Tensor:
    """``[batch, seq]`` int64 token ids, uniform over the vocabulary, from a fixed seed (7)."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7))


def hf_causal_lm(config_cls, cfg, attn_implementation: str = "eager") -> torch.nn.Module:
    """transformers' own causal LM of ``cfg`` (built from ``cfg.to_hf_config_dict()`` read by ``config_cls``, e.g.
    ``transformers.DeepseekV3Config``), fp32, eager experts, in eval mode: the independent reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_config(
        config_cls.from_dict(cfg.to_hf_config_dict()), attn_implementation=attn_implementation,
        experts_implementation="eager", dtype=torch.float32,
    ).eval()


def assert_bias_changes_routing(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """The randomized correction bias must alter at least one token's expert set in some MoE layer of ``model``
    (a model of ours: ``layers[i].is_moe``, ``layers[i].mlp.router``), or a parity test would not exercise it."""
    captured = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, args, kw: captured.append((m, args[0])), with_kwargs=True)
        for layer in model.layers
        if layer.is_moe
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    changed = 0
    for moe, x in captured:
        x_TD = x.reshape(-1, x.shape[-1])  # [B, S, D] (glm4_moe) or [T, D] (the MLA families)
        with_bias, _, _ = moe.router(x_TD)
        saved = moe.router.e_score_correction_bias.clone()
        moe.router.e_score_correction_bias.zero_()
        without, _, _ = moe.router(x_TD)
        moe.router.e_score_correction_bias.copy_(saved)
        changed += int((with_bias.sort(-1).values != without.sort(-1).values).any(-1).sum())
    assert changed > 0, "the correction bias never changed selection: the test would not exercise it"


def save_reference_checkpoint(hf: torch.nn.Module, cfg, path: Path, key_names: list[str]) -> None:
    """Randomize transformers' model ``hf`` for parity (seed 1), write it with ``save_pretrained`` to ``path`` and
    check the checkpoint: its tensor names are ``key_names`` (the family's ``hf_key_names(cfg)``) and its
    ``config.json`` reads back as ``cfg`` (``type(cfg).from_hf_config_dict``)."""
    from safetensors import safe_open

    randomize_for_parity(hf, seed=1)
    hf.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(key_names)
    assert type(cfg).from_hf_config_dict(json.loads((path / "config.json").read_text())) == cfg


def load_strictly_in_transformers(path: Path, architecture: str, attn_implementation: str = "eager"):
    """transformers' ``AutoModelForCausalLM.from_pretrained(path)`` (eager experts), in eval mode, after checking
    that no key was missing, unexpected or mismatched, that the class is ``architecture`` and the dtype fp32."""
    import transformers

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, experts_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(hf).__name__ == architecture and hf.dtype == torch.float32
    return hf.eval()


def load_ours_strictly(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``model`` (one of ours) in eval mode with ``state_dict`` loaded strictly; a tied ``lm_head`` must still be
    the embedding's matrix afterwards."""
    model.eval().load_state_dict(state_dict, strict=True)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    return model


def ours_from_reference(hf: torch.nn.Module, cfg, path: Path, model: torch.nn.Module, hf_key_names,
                        load_hf_state_dict) -> torch.nn.Module:
    """transformers' model ``hf`` written by :func:`save_reference_checkpoint` (the family's ``hf_key_names(cfg)``)
    and read back strictly into ``model`` (one of ours, built from ``cfg``) with the family's
    ``load_hf_state_dict``."""
    save_reference_checkpoint(hf, cfg, path, hf_key_names(cfg))
    return load_ours_strictly(model, load_hf_state_dict(path))


def transformers_from_ours(ours: torch.nn.Module, cfg, path: Path, save_hf_checkpoint, architecture: str,
                           attn_implementation: str = "eager") -> torch.nn.Module:
    """``ours`` randomized for parity (seed 2), written with the family's ``save_hf_checkpoint`` (exactly
    ``config.json``, ``generation_config.json`` and ``model.safetensors``) and loaded strictly by transformers
    (:func:`load_strictly_in_transformers`)."""
    randomize_for_parity(ours, seed=2)
    save_hf_checkpoint(ours, cfg, path)
    assert {p.name for p in path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    return load_strictly_in_transformers(path, architecture, attn_implementation)


@torch.no_grad()
def both_logits(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ours, transformers')`` logits of ``ids [B, S]``; ours must be fp32 ``[B, S, V]``."""
    want = hf(ids).logits
    got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == (*ids.shape, ours.config.vocab_size)
    return got, want
