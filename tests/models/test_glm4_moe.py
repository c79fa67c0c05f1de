"""GlmMoeForCausalLM (GLM-4.5 family): conversion and config errors, the Hugging Face config read by transformers,
parameter counts, experts backends, padding and R3 replay.

The tests every family shares (logits equal transformers' Glm4MoeForCausalLM through the on-disk checkpoint in both
directions over ``FAMILIES["glm4_moe"].cases``, exact conversion, bf16 files, fused in-memory names, config
validation messages) are in test_checkpoint_families.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _glm_parity import FAMILIES, random_ids, randomize_for_parity
from _tolerance import assert_normwise_close, decoder_chain
from pydantic import ValidationError

from moe_rl.models import GlmMoeConfig, GlmMoeForCausalLM
from moe_rl.models.glm4_moe import from_hf_state_dict, to_hf_state_dict

transformers = pytest.importorskip("transformers")

FAMILY = FAMILIES["glm4_moe"]


def _ids(cfg: GlmMoeConfig, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return random_ids(cfg.vocab_size, batch, seq)


def test_conversion_errors_name_the_keys():
    cfg = GlmMoeConfig.tiny_debug()
    sd = GlmMoeForCausalLM(cfg).state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
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
    assert ours == sum(p.numel() for p in FAMILY.hf_reference(cfg).parameters())


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


def test_config_validates_on_assignment_and_documents_fields():
    cfg = GlmMoeConfig.tiny_debug()
    with pytest.raises(ValidationError, match="num_experts_per_tok=10 must be <= n_routed_experts=8"):
        cfg.num_experts_per_tok = 10
    assert all(f.description for f in GlmMoeConfig.model_fields.values())
    assert GlmMoeConfig.glm45_air().head_dim == 128


def test_importing_models_and_moe_does_not_import_transformers():
    code = "import sys, moe_rl.models, moe_rl.moe; sys.exit(int(any(m in sys.modules for m in ('transformers', 'vllm'))))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
