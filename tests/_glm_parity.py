"""Scaffolding shared by the model family tests (ours against transformers through a checkpoint), and the table of
the families (:data:`FAMILIES`) that the family files and the cross-family checkpoint tests build their configs
from."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_rl.attention.yarn import YarnRope


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


def ours_from_reference(hf: torch.nn.Module, cfg, path: Path, family: Family) -> torch.nn.Module:
    """transformers' model ``hf`` written by :func:`save_reference_checkpoint` (the family's ``hf_key_names(cfg)``)
    and read back strictly into the family's model of ``cfg`` with the family's ``load_hf_state_dict``."""
    save_reference_checkpoint(hf, cfg, path, family.pkg.hf_key_names(cfg))
    return load_ours_strictly(family.model_of(cfg), family.pkg.load_hf_state_dict(path))


def transformers_from_ours(ours: torch.nn.Module, cfg, path: Path, family: Family) -> torch.nn.Module:
    """``ours`` randomized for parity (seed 2), written with the family's ``save_hf_checkpoint`` (exactly
    ``config.json``, ``generation_config.json`` and ``model.safetensors``) and loaded strictly by transformers
    as the family's architecture (:func:`load_strictly_in_transformers`)."""
    randomize_for_parity(ours, seed=2)
    family.pkg.save_hf_checkpoint(ours, cfg, path)
    assert {p.name for p in path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    return load_strictly_in_transformers(path, family.hf_model, family.attn_implementation)


@torch.no_grad()
def both_logits(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ours, transformers')`` logits of ``ids [B, S]``; ours must be fp32 ``[B, S, V]``."""
    want = hf(ids).logits
    got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == (*ids.shape, ours.config.vocab_size)
    return got, want


@dataclass(frozen=True)
class Family:
    """One model family of ``moe_rl.models`` as the cross-family checkpoint tests see it.

    ``model`` / ``hf_model`` are our causal LM class and transformers' (its ``architectures`` entry); ``hf_config``
    is transformers' config class. ``cases`` are named ``tiny_debug`` overrides (the first is the family's default
    layout); ``expert_key`` and ``bias_key`` are Hugging Face tensor names of a routed expert and of a router's
    correction bias in every case (checkpoints keep the bias fp32); ``missing_expert`` is the error
    ``from_hf_state_dict`` raises without ``expert_key``; ``key_names`` are the keyword arguments of
    ``hf_key_names`` that name every tensor ``to_hf_state_dict`` writes. The parity tests run transformers with
    ``attn_implementation`` on ``seq`` tokens per row.
    """

    package: str
    config: str
    model: str
    hf_config: str
    hf_model: str
    cases: dict[str, dict] = field(default_factory=lambda: {"tiny_debug": {}})
    expert_key: str = "model.layers.1.mlp.experts.5.up_proj.weight"
    bias_key: str = "model.layers.1.mlp.gate.e_score_correction_bias"
    missing_expert: str = r"missing 1 expert tensor.*layers\.1\.mlp\.experts\.5\.up_proj"
    key_names: dict = field(default_factory=dict)
    attn_implementation: str = "eager"
    seq: int = 40

    @property
    def pkg(self):
        """The family's package (its config, model and checkpoint functions)."""
        return importlib.import_module(f"moe_rl.models.{self.package}")

    def cfg(self, case: str | None = None, **extra):
        """The family's ``tiny_debug`` config of ``case`` (default: the first), with ``extra`` overrides."""
        overrides = self.cases[case if case is not None else next(iter(self.cases))]
        return getattr(self.pkg, self.config).tiny_debug(**{**overrides, **extra})

    def model_of(self, cfg, **kwargs) -> torch.nn.Module:
        """The family's causal LM of ``cfg``."""
        return getattr(self.pkg, self.model)(cfg, **kwargs)

    def hf_reference(self, cfg) -> torch.nn.Module:
        """transformers' own causal LM of ``cfg`` (:func:`hf_causal_lm` with the family's config class and
        attention implementation)."""
        import transformers

        return hf_causal_lm(getattr(transformers, self.hf_config), cfg, self.attn_implementation)


FAMILIES = {
    f.package: f
    for f in (
        Family(
            "glm4_moe", "GlmMoeConfig", "GlmMoeForCausalLM", "Glm4MoeConfig", "Glm4MoeForCausalLM",
            cases={
                "tiny_debug": {},
                "groups_scale_qknorm": dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True,
                                            n_shared_experts=2, num_hidden_layers=3),
                "tied_unnormalized_nobias": dict(tie_word_embeddings=True, norm_topk_prob=False,
                                                 attention_bias=False, first_k_dense_replace=0),
            },
            missing_expert=r"missing 1 expert tensor.*experts\.5\.up_proj",
            attn_implementation="sdpa",
            seq=16,
        ),
        Family(
            "deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3Config", "DeepseekV3ForCausalLM",
            cases={
                # 2 groups of 4 experts, 1 kept; YaRN with cos/sin factor != 1 and softmax mscale
                "dsv3_layout": {},
                "kimi_like_bias_tied_half_rope": dict(
                    n_group=1, topk_group=1, routed_scaling_factor=2.827, attention_bias=True,
                    tie_word_embeddings=True, first_k_dense_replace=0, rope_interleave=False, n_shared_experts=2,
                    rope_theta=50000.0,
                    rope_scaling=YarnRope(factor=32.0, original_max_position_embeddings=16,
                                         beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                ),
                "plain_rope_unnormalized": dict(rope_scaling=None, norm_topk_prob=False, rms_norm_eps=1e-5),
            },
            seq=40,  # > original_max_position_embeddings = 16 of the tiny YaRN: positions past that context
        ),
        Family(
            "glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
            cases={
                "glm5_layout": dict(index_n_heads=16),
                "shared_indexer_bias_tied_groups": dict(
                    index_n_heads=16, indexer_types=["full", "shared", "full"], attention_bias=True,
                    tie_word_embeddings=True, n_group=2, topk_group=1, first_k_dense_replace=0,
                    routed_scaling_factor=1.5,
                ),
            },
            key_names={"with_mtp": True},
            seq=40,  # > index_topk = 16: rows t >= 16 attend to 16 of their t + 1 visible keys
        ),
        Family(
            "nemotron_h", "NemotronHConfig", "NemotronHForCausalLM", "NemotronHConfig", "NemotronHForCausalLM",
            cases={
                "tiny_latent_groups": dict(initializer_range=0.125),
                "no_latent_tied_unnormalized": dict(
                    initializer_range=0.125, moe_latent_size=None, tie_word_embeddings=True, norm_topk_prob=False,
                    n_group=1, hybrid_override_pattern="*EMM-E", mlp_bias=True,
                ),
            },
            expert_key="backbone.layers.1.mixer.experts.3.down_proj.weight",
            bias_key="backbone.layers.1.mixer.gate.e_score_correction_bias",
            missing_expert=r"experts \[3\] are missing",
        ),
    )
}
