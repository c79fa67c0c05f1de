"""The checkpoint contract every model family keeps, tested once over the family table (``_glm_parity.FAMILIES``).

Each family package exports ``to_hf_state_dict`` / ``from_hf_state_dict`` (ours <-> Hugging Face names),
``hf_key_names``, ``save_hf_checkpoint`` and ``load_hf_state_dict``. Here: the conversion is exact both ways and
names what transformers writes; a bf16 checkpoint keeps the router correction bias fp32 and reads back as the
cast state dict; transformers' in-memory (fused-expert) names load; conversion errors name the tensor; config
validation errors name the field, value and rule; and, for the families whose forward has no extra output to
compare (GLM-4.5, DeepSeek-V3), the logits equal transformers' through a checkpoint in both directions. What only
one family has (YaRN, the DSA indexer and its selection, MTP layers, Mamba-2, published sizes) stays in that
family's test file.

Parity tolerance: both sides compute the same fp32 math in a different association (e.g. our MLA keys from an
einsum over the latent vs. HF's ``kv_b_proj`` + ``matmul``; our expert combine in one einsum vs. HF's
``index_add_``). Each path is within :func:`_tolerance.assert_normwise_close`'s chain bound of the exact result
(:func:`_tolerance.decoder_chain`: k = the widest reduction, depth = 8 reductions per layer + norm + head), so the
two paths are within twice that bound of each other. The absolute 1e-5 on the O(1) logits (std > 0.3) is checked
as well: a wrong expert, rope pair or scale moves logits by O(0.1-1).
"""

from __future__ import annotations

import json

import pytest
import torch
from _glm_parity import (
    FAMILIES,
    assert_bias_changes_routing,
    both_logits,
    ours_from_reference,
    random_ids,
    randomize_for_parity,
    transformers_from_ours,
)
from _tolerance import assert_normwise_close, decoder_chain
from pydantic import ValidationError

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

ALL_CASES = [pytest.param(f, case, id=f"{f}-{case}") for f, fam in FAMILIES.items() for case in fam.cases]
PARITY_CASES = [pytest.param(f, case, id=f"{f}-{case}") for f in ("glm4_moe", "deepseek_v3")
                for case in FAMILIES[f].cases]


def _assert_logits_match(cfg, got: torch.Tensor, want: torch.Tensor, tokens: int) -> None:
    """Ours vs transformers' fp32 logits: the normwise chain bound of two paths, and 1e-5 (see the module doc)."""
    assert want.std() > 0.3  # O(1) logits, so 1e-5 is meaningful
    k, depth = decoder_chain(cfg, tokens)
    assert_normwise_close(got, want, dtype=torch.float32, k=k, depth=2 * depth, what="logits vs transformers")
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("direction", ["transformers_to_ours", "ours_to_transformers"])
@pytest.mark.parametrize(("family", "case"), PARITY_CASES)
def test_logits_match_transformers_through_a_checkpoint(family, case, direction, tmp_path):
    """transformers' model written with ``save_pretrained`` and read strictly by ours, or ours written with the
    family's ``save_hf_checkpoint`` and read strictly by ``from_pretrained``: the same logits."""
    fam = FAMILIES[family]
    cfg = fam.cfg(case)
    torch.manual_seed(0)
    if direction == "transformers_to_ours":
        hf = fam.hf_reference(cfg)
        ours = ours_from_reference(hf, cfg, tmp_path, fam)
    else:
        ours = fam.model_of(cfg).eval()
        hf = transformers_from_ours(ours, cfg, tmp_path, fam)
    ids = random_ids(cfg.vocab_size, 2, fam.seq)
    assert_bias_changes_routing(ours, ids)
    _assert_logits_match(cfg, *both_logits(ours, hf, ids), ids.numel())


@pytest.mark.parametrize(("family", "case"), ALL_CASES)
def test_state_dict_round_trip_is_exact_and_uses_hf_key_names(family, case, tmp_path):
    fam = FAMILIES[family]
    pkg, cfg = fam.pkg, fam.cfg(case)
    torch.manual_seed(0)
    ours = fam.model_of(cfg)
    randomize_for_parity(ours, seed=4)
    sd = ours.state_dict()
    hf_sd = pkg.to_hf_state_dict(sd, cfg)
    assert set(hf_sd) == set(pkg.hf_key_names(cfg, **fam.key_names))
    assert fam.expert_key in hf_sd and fam.bias_key in hf_sd
    back = pkg.from_hf_state_dict(hf_sd, cfg)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    if fam.key_names:  # the checkpoint holds tensors (MTP layers) transformers' model does not have
        return
    # The key set and shapes equal what transformers itself writes for this config ...
    fam.hf_reference(cfg).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys()}
    assert set(hf_sd) == set(disk)
    assert all(hf_sd[k].shape == disk[k].shape for k in disk)
    # ... and the HF -> ours -> HF direction is exact too. A tied config reads no lm_head.weight of its own: it
    # writes the embedding there (transformers' NemotronH writes an untied, random lm_head even when tied).
    again = pkg.to_hf_state_dict(pkg.from_hf_state_dict(disk, cfg), cfg)
    tied_head = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert all(torch.equal(again[k], disk[k]) for k in set(disk) - tied_head)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_checkpoint_keeps_bias_fp32_and_round_trips(family, tmp_path):
    fam = FAMILIES[family]
    pkg, cfg = fam.pkg, fam.cfg()
    torch.manual_seed(0)
    ours = fam.model_of(cfg)
    randomize_for_parity(ours, seed=3)
    pkg.save_hf_checkpoint(ours, cfg, tmp_path, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice(fam.bias_key).get_dtype() == "F32"
        assert f.get_slice(fam.expert_key).get_dtype() == "BF16"
    loaded = pkg.load_hf_state_dict(tmp_path)
    sd = ours.state_dict()
    assert set(loaded) == set(sd)
    for name, t in sd.items():
        assert torch.equal(loaded[name], t.to(loaded[name].dtype)), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    assert hf.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "glm_moe_dsa"])
def test_hf_in_memory_fused_expert_names_load(family):
    """transformers 5 fuses the experts in memory (``experts.gate_up_proj``); that state dict loads strictly and
    gives transformers' logits."""
    fam = FAMILIES[family]
    cfg = fam.cfg(**({"num_nextn_predict_layers": 0} if fam.key_names else {}))
    hf = fam.hf_reference(cfg)
    randomize_for_parity(hf, seed=5)
    in_memory = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in in_memory
    ours = fam.model_of(cfg).eval()
    ours.load_state_dict(fam.pkg.from_hf_state_dict(in_memory, cfg), strict=True)
    ids = random_ids(cfg.vocab_size, 2, fam.seq)
    _assert_logits_match(cfg, *both_logits(ours, hf, ids), ids.numel())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_missing_expert_tensor_is_named(family):
    fam = FAMILIES[family]
    cfg = fam.cfg()
    hf_sd = fam.pkg.to_hf_state_dict(fam.model_of(cfg).state_dict(), cfg)
    del hf_sd[fam.expert_key]
    with pytest.raises(ValueError, match=fam.missing_expert):
        fam.pkg.from_hf_state_dict(hf_sd, cfg)


CONFIG_ERRORS = {
    "glm4_moe": [
        (dict(num_key_value_heads=3), r"num_attention_heads=4 must be divisible by num_key_value_heads=3"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be <= n_routed_experts=8"),
        (dict(n_group=3), r"n_routed_experts=8 must be divisible by n_group=3"),
        (dict(n_group=8), r"n_group=8 leaves 1 expert per group"),
        (dict(n_group=2, topk_group=3), r"topk_group=3 must be <= n_group=2"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=3), r"num_experts_per_tok=3 must be <= topk_group"),
        (dict(partial_rotary_factor=0.3), r"head_dim \* partial_rotary_factor = 32 \* 0.3 = 9.6 must be an even"),
        (dict(first_k_dense_replace=3), r"first_k_dense_replace=3 must be <= num_hidden_layers=2"),
        (dict(eos_token_id=[2, 40]), r"eos_token_id=40 must be in \[0, vocab_size=32\)"),
        (dict(hidden_size=0), r"hidden_size\n.*greater than or equal to 1"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor\n.*greater than 0"),
        (dict(num_mtp_layers=1), r"num_mtp_layers\n.*Extra inputs are not permitted"),
    ],
    "deepseek_v3": [
        (dict(n_group=3), r"n_routed_experts=8 must be divisible by n_group=3"),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be <= topk_group \* n_routed_experts"),
        (dict(pad_token_id=64), r"pad_token_id=64 must be in \[0, vocab_size=64\)"),
        (dict(bos_token_id=64), r"bos_token_id=64 must be in \[0, vocab_size=64\)"),
        (dict(eos_token_id=[1, 70]), r"eos_token_id=70 must be in \[0, vocab_size=64\)"),
        (dict(qk_rope_head_dim=7), r"qk_rope_head_dim=7 must be even"),
    ],
    "glm_moe_dsa": [
        (dict(indexer_types=["full", "shared"]), r"indexer_types has 2 entries but num_hidden_layers=3"),
        (dict(indexer_types=["shared", "full", "full"]), r"indexer_types\[0\] must be 'full'"),
        (dict(index_head_dim=4), r"index_head_dim=4 must be >= qk_rope_head_dim=8"),
        (dict(bos_token_id=999), r"bos_token_id=999 must be in \[0, vocab_size=\d+\)"),
        # the MoE routing rules shared with GlmMoeConfig (moe_rl.models.common.config)
        (dict(n_group=8), r"n_group=8 leaves 1 expert per group"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=3), r"num_experts_per_tok=3 must be <= topk_group"),
        (dict(first_k_dense_replace=4), r"first_k_dense_replace=4 must be <= num_hidden_layers=3"),
    ],
    "nemotron_h": [
        (dict(hybrid_override_pattern="MEX"), r"hybrid_override_pattern"),
        (dict(num_experts_per_tok=6), r"num_experts_per_tok"),  # 2 groups of 4, 1 kept: at most 4
    ],
}


@pytest.mark.parametrize(
    ("family", "overrides", "pattern"),
    [pytest.param(f, o, p, id=f"{f}-{i}") for f, rows in CONFIG_ERRORS.items() for i, (o, p) in enumerate(rows)],
)
def test_config_validation_messages(family, overrides, pattern):
    fam = FAMILIES[family]
    with pytest.raises(ValidationError, match=pattern):
        getattr(fam.pkg, fam.config).tiny_debug(**overrides)
