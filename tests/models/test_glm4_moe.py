"""GlmMoeForCausalLM against transformers' Glm4MoeForCausalLM, through the real on-disk checkpoint format.

The references are independent: transformers builds its own model from ``cfg.to_hf_config_dict()``, writes
it with ``save_pretrained`` (per-expert names on disk), and loads ours with ``from_pretrained``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _glm_parity import (
    assert_bias_changes_routing,
    both_logits,
    hf_causal_lm,
    ours_from_reference,
    random_ids,
    randomize_for_parity,
    transformers_from_ours,
)
from _tolerance import assert_normwise_close, decoder_chain
from pydantic import ValidationError

from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM
from moe_rl.models.glm4_moe import (
    from_hf_state_dict,
    hf_key_names,
    load_hf_state_dict,
    save_hf_checkpoint,
    to_hf_state_dict,
)

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

torch.set_num_threads(1)

# Parity cases. All randomize the noaux_tc bias so that it changes which experts are picked.
CASES = {
    "tiny_debug": {},
    "groups_scale_qknorm": dict(
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        n_shared_experts=2,
        num_hidden_layers=3,
    ),
    "tied_unnormalized_nobias": dict(
        tie_word_embeddings=True, norm_topk_prob=False, attention_bias=False, first_k_dense_replace=0
    ),
}


def _cfg(case: str) -> GlmMoeConfig:
    return GlmMoeConfig.tiny_debug(**CASES[case])


def _hf_model(cfg: GlmMoeConfig):
    return hf_causal_lm(transformers.Glm4MoeConfig, cfg, attn_implementation="sdpa")


def _ids(cfg: GlmMoeConfig, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return random_ids(cfg.vocab_size, batch, seq)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_loaded_from_hf_checkpoint(case, tmp_path):
    cfg = _cfg(case)
    torch.manual_seed(0)
    hf = _hf_model(cfg)
    ours = ours_from_reference(hf, cfg, tmp_path, GlmMoeForCausalLM(cfg), hf_key_names, load_hf_state_dict)
    ids = _ids(cfg)
    assert_bias_changes_routing(ours, ids)
    got, want = both_logits(ours, hf, ids)
    assert want.std() > 0.3  # O(1) logits, so 1e-5 is a meaningful tolerance
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_our_checkpoint_loads_in_transformers_from_pretrained(case, tmp_path):
    cfg = _cfg(case)
    torch.manual_seed(0)
    ours = GlmMoeForCausalLM(cfg).eval()
    hf = transformers_from_ours(ours, cfg, tmp_path, save_hf_checkpoint, "Glm4MoeForCausalLM", "sdpa")
    ids = _ids(cfg)
    assert_bias_changes_routing(ours, ids)
    got, want = both_logits(ours, hf, ids)
    assert (got - want).abs().max().item() <= 1e-5


def test_bf16_checkpoint_keeps_bias_fp32(tmp_path):
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(0)
    ours = GlmMoeForCausalLM(cfg)
    randomize_for_parity(ours, seed=3)
    save_hf_checkpoint(ours.state_dict(), cfg, tmp_path, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.experts.3.up_proj.weight").get_dtype() == "BF16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    assert hf.dtype == torch.bfloat16
    loaded = load_hf_state_dict(tmp_path)
    for name, t in ours.state_dict().items():
        torch.testing.assert_close(loaded[name].float(), t.to(loaded[name].dtype).float(), msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip_is_exact_and_uses_hf_disk_names(case, tmp_path):
    cfg = _cfg(case)
    torch.manual_seed(0)
    ours = GlmMoeForCausalLM(cfg)
    randomize_for_parity(ours, seed=4)
    sd = ours.state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
    back = from_hf_state_dict(hf_sd, cfg)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)

    # The key set equals what transformers itself writes for this config.
    _hf_model(cfg).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys()}
    assert set(hf_sd) == set(disk)
    assert all(hf_sd[k].shape == disk[k].shape for k in disk)
    # ... and the HF -> ours -> HF direction is exact too.
    again = to_hf_state_dict(from_hf_state_dict(disk, cfg), cfg)
    assert all(torch.equal(again[k], disk[k]) for k in disk)


def test_hf_in_memory_fused_names_are_accepted():
    cfg = GlmMoeConfig.tiny_debug()
    hf = _hf_model(cfg)
    randomize_for_parity(hf, seed=5)
    in_memory = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in in_memory  # transformers 5 fuses experts in memory
    ours = GlmMoeForCausalLM(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(in_memory, cfg), strict=True)
    ids = _ids(cfg)
    with torch.no_grad():
        assert (ours(ids) - hf.eval()(ids).logits).abs().max().item() <= 1e-5


def test_conversion_errors_name_the_keys():
    cfg = GlmMoeConfig.tiny_debug()
    sd = GlmMoeForCausalLM(cfg).state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
    broken = dict(hf_sd)
    del broken["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 expert tensor.*experts\.5\.up_proj"):
        from_hf_state_dict(broken, cfg)
    with pytest.raises(ValueError, match=r"unexpected Hugging Face key.*'vision.proj'"):
        from_hf_state_dict({**hf_sd, "vision.proj": torch.zeros(1)}, cfg)
    bad = dict(hf_sd)
    bad["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 128)
    with pytest.raises(
        ValueError, match=r"experts\.0\.down_proj\.weight has shape \(64, 128\), expected \(128, 64\)"
    ):
        from_hf_state_dict(bad, cfg)
    with pytest.raises(
        ValueError, match=r"state_dict does not match the config: missing 1 key\(s\) \['norm.weight'\]"
    ):
        to_hf_state_dict({k: v for k, v in sd.items() if k != "norm.weight"}, cfg)
    # MTP layers of real checkpoints (layer index >= num_hidden_layers) are ignored.
    mtp = {**hf_sd, "model.layers.2.eh_proj.weight": torch.zeros(1)}
    assert set(from_hf_state_dict(mtp, cfg)) == set(sd)


def test_hf_config_dict_is_read_by_transformers():
    cfg = GlmMoeConfig.tiny_debug(n_group=2, routed_scaling_factor=2.5, use_qk_norm=True)
    d = cfg.to_hf_config_dict(torch_dtype=torch.bfloat16)
    assert d["model_type"] == "glm4_moe" and d["architectures"] == ["Glm4MoeForCausalLM"]
    assert d["dtype"] == "bfloat16" and d["num_nextn_predict_layers"] == 0
    hf_cfg = transformers.AutoConfig.for_model(
        **{k: v for k, v in d.items() if k != "model_type"}, model_type="glm4_moe"
    )
    for field in GlmMoeConfig.model_fields:
        if field not in ("rope_theta", "partial_rotary_factor"):
            assert getattr(hf_cfg, field) == getattr(cfg, field), field
    assert hf_cfg.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf_cfg.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor
    assert hf_cfg.dtype == torch.bfloat16
    assert GlmMoeConfig.from_hf_config_dict(hf_cfg.to_dict()) == cfg


def test_tiny_debug_matches_task_spike_parameter_count():
    # shared/notes/task-spike.md: the HF model of this config without q/k/v biases has 427,648 parameters.
    model = GlmMoeForCausalLM(GlmMoeConfig.tiny_debug(attention_bias=False))
    assert sum(p.numel() for p in model.parameters()) == 427_648
    cfg = GlmMoeConfig.tiny_debug()
    ours = sum(p.numel() for p in GlmMoeForCausalLM(cfg).parameters())
    assert ours == sum(p.numel() for p in _hf_model(cfg).parameters())


def test_init_is_deterministic_and_backends_agree():
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(123)
    a = GlmMoeForCausalLM(cfg)
    torch.manual_seed(123)
    b = GlmMoeForCausalLM(cfg, experts_backend="grouped_mm")
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert a.embed_tokens.weight[cfg.pad_token_id].abs().max() == 0
    randomize_for_parity(a, seed=6)
    b.load_state_dict(a.state_dict())
    ids = _ids(cfg)
    la, lb = a(ids), b(ids)
    # two fp32 paths (loop vs grouped_mm experts: other GEMM shapes, other summation order), normwise bound of
    # the whole chain (tests/_tolerance.py); a wrong expert or weight mapping is off by O(1) relative
    k, depth = decoder_chain(cfg, ids.numel())
    assert_normwise_close(lb, la, dtype=torch.float32, k=k, depth=2 * depth, what="logits")
    (la.square().mean()).backward()
    (lb.square().mean()).backward()
    k, depth = decoder_chain(cfg, ids.numel(), backward=True)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_normwise_close(pb.grad, pa.grad, dtype=torch.float32, k=k, depth=2 * depth + 1, what=name)


def test_right_padding_does_not_change_earlier_logits():
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=7)
    ids = _ids(cfg, batch=2, seq=10)
    padded = torch.cat([ids, torch.full((2, 6), cfg.pad_token_id)], dim=1)
    with torch.no_grad():
        # matmul blocking only (other sequence length, other GEMM shapes): two fp32 paths, normwise chain bound;
        # a pad token leaking into earlier positions changes their logits by O(1) relative
        k, depth = decoder_chain(cfg, padded.numel())
        assert_normwise_close(model(padded)[:, :10], model(ids), dtype=torch.float32, k=k, depth=2 * depth)


def test_replay_of_own_routing_reproduces_logits_and_checks_shape():
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=8)
    ids = _ids(cfg)
    own = {}
    moe = model.layers[1].mlp
    hook = moe.router.register_forward_hook(lambda m, args, out: own.__setitem__("ids", out[0]))
    with torch.no_grad():
        base = model(ids)
    hook.remove()
    replay = torch.zeros(*ids.shape, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.uint8)
    replay[:, :, 1] = own["ids"].view(*ids.shape, -1).to(torch.uint8)  # layer 0 is dense: ignored
    with torch.no_grad():  # bit-equal: the own ids in the own order, so the same gathers, GEMMs and sums
        torch.testing.assert_close(model(ids, replay_ids=replay), base, atol=0, rtol=0)
        other = replay.clone()
        other[:, :, 1] = (other[:, :, 1] + 1) % cfg.n_routed_experts
        assert (model(ids, replay_ids=other) - base).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"replay_ids has shape \(2, 16, 1, 2\).*\(2, 16, 2, 2\)"):
        model(ids, replay_ids=replay[:, :, :1])
    with pytest.raises(TypeError, match=r"replay_ids must be a tensor or a list of per-layer tensors, got dict"):
        model(ids, replay_ids={})


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (dict(num_key_value_heads=3), r"num_attention_heads=4 must be divisible by num_key_value_heads=3"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be <= n_routed_experts=8"),
        (dict(n_group=3), r"n_routed_experts=8 must be divisible by n_group=3"),
        (dict(n_group=8), r"n_group=8 leaves 1 expert per group"),
        (dict(n_group=2, topk_group=3), r"topk_group=3 must be <= n_group=2"),
        (
            dict(n_group=4, topk_group=1, num_experts_per_tok=3),
            r"num_experts_per_tok=3 must be <= topk_group",
        ),
        (
            dict(partial_rotary_factor=0.3),
            r"head_dim \* partial_rotary_factor = 32 \* 0.3 = 9.6 must be an even",
        ),
        (dict(first_k_dense_replace=3), r"first_k_dense_replace=3 must be <= num_hidden_layers=2"),
        (dict(eos_token_id=[2, 40]), r"eos_token_id=40 must be in \[0, vocab_size=32\)"),
        (dict(hidden_size=0), r"hidden_size\n.*greater than or equal to 1"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor\n.*greater than 0"),
        (dict(num_mtp_layers=1), r"num_mtp_layers\n.*Extra inputs are not permitted"),
    ],
)
def test_config_validation_messages(overrides, pattern):
    with pytest.raises(ValidationError, match=pattern):
        GlmMoeConfig.tiny_debug(**overrides)


def test_config_validates_on_assignment_and_documents_fields():
    cfg = GlmMoeConfig.tiny_debug()
    with pytest.raises(ValidationError, match="num_experts_per_tok=10 must be <= n_routed_experts=8"):
        cfg.num_experts_per_tok = 10
    assert all(f.description for f in GlmMoeConfig.model_fields.values())
    assert GlmMoeConfig.glm45_air().head_dim == 128


def test_importing_models_and_moe_does_not_import_transformers():
    code = "import sys, moe_rl.models, moe_rl.moe; sys.exit(int(any(m in sys.modules for m in ('transformers', 'vllm'))))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
