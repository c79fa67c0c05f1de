"""NemotronHForCausalLM (Nemotron-H / Nemotron-3 hybrid) against transformers' NemotronHForCausalLM, through the real
on-disk checkpoint format; R3 replay; state-dict round trips; meta-device parameter counts of the public models.

The logits reference is independent: transformers builds its own model from ``cfg.to_hf_config_dict()`` and loads
our ``save_hf_checkpoint`` output with ``from_pretrained`` (per-expert ``backbone.`` names on disk, its own
conversion to stacked experts), running its PyTorch Mamba-2 path (no ``mamba_ssm`` kernels here) and eager
attention. The checkpoint tests every family shares (exact conversion, bf16 files, config errors) are in
test_checkpoint_families.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from _glm_parity import FAMILIES
from _tolerance import C_PROB, assert_normwise_close, decoder_chain, eps

from moe_rl.models.nemotron_h import (
    NemotronHConfig,
    NemotronHForCausalLM,
    from_hf_state_dict,
    load_hf_state_dict,
    parameter_counts,
    save_hf_checkpoint,
    to_hf_state_dict,
)

transformers = pytest.importorskip("transformers")

FAMILY = FAMILIES["nemotron_h"]  # its cases: latent MoE with routing groups; no latent, tied, unnormalized
CASES = FAMILY.cases


def _model(case: str, seed: int = 0) -> NemotronHForCausalLM:
    """Ours, with every parameter of order one after its layer (weights ~ N(0, 1/fan_in)), random norms, SSM
    parameters and a correction bias large enough to change which experts win (so routing is exercised)."""
    cfg = FAMILY.cfg(case)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "D", "dt_bias")) or name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
        for layer in model.layers:
            if layer.is_moe:
                layer.mixer.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
    return model.eval()


def _ids(cfg: NemotronHConfig, batch: int = 2, seq: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    model = _model(case)
    cfg = model.config
    save_hf_checkpoint(model, cfg, tmp_path)
    ref = transformers.NemotronHForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert ref.config.layers_block_type == [
        {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[c] for c in cfg.hybrid_override_pattern]
    ids = _ids(cfg)
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits.float()
    # Two fp32 paths of the same chain, each within the normwise bound of the exact result (tests/_tolerance.py):
    # k = the longest reduction, depth = 8 reductions per layer + norm + head (a Mamba-2 layer: in_proj, conv,
    # the scan's intra-chunk, state and inter-chunk sums, the gated norm, out_proj), doubled for the two paths.
    k, depth = decoder_chain(cfg, ids.numel())
    assert_normwise_close(ours, theirs, dtype=torch.float32, k=k, depth=2 * depth, what=case)
    # (The acceptance figure, max |diff| <= 1e-5 at fp32, is a measurement, not this test's tolerance:
    # 2.3e-6 and 5.8e-6 on these two cases with |logits| up to 4.2; see docs/blocks/models.md.)
    bound = 2 * depth * C_PROB * math.sqrt(k) * eps(torch.float32) * float(theirs.double().norm())
    # The comparison can fail: the logits are not flat, and changing one expert's weight moves them far beyond it.
    assert float(theirs.std()) > 0.1
    with torch.no_grad():
        moe = next(layer for layer in model.layers if layer.is_moe).mixer
        moe.experts.down_proj.mul_(1.5)
        assert float((model(ids) - theirs).norm()) > 100 * bound


def _own_routing(model: NemotronHForCausalLM, ids: torch.Tensor) -> list[torch.Tensor | None]:
    """The expert ids every MoE layer picks on ``ids`` (``[B, S, K]``; None for the other layers)."""
    got: dict[int, torch.Tensor] = {}
    hooks = [layer.mixer.gate.register_forward_hook(
        lambda mod, args, out, i=i: got.__setitem__(i, out[0])) for i, layer in enumerate(model.layers) if layer.is_moe]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return [got[i].view(*ids.shape, -1) if i in got else None for i in range(len(model.layers))]


def test_r3_replay_of_own_routing_is_exact():
    model = _model("tiny_latent_groups")
    cfg, ids = model.config, _ids(model.config)
    with torch.no_grad():
        base = model(ids)
    routing = _own_routing(model, ids)
    stacked = torch.stack([r if r is not None else torch.zeros_like(routing[1]) for r in routing], dim=2)
    with torch.no_grad():
        # same scores gathered at the same ids in the same order: bit-identical
        assert torch.equal(model(ids, replay_ids=routing), base)
        assert torch.equal(model(ids, replay_ids=stacked.to(torch.int16)), base)
        # another routing changes the output (the replay is used)
        other = [None if r is None else (r + 1) % cfg.n_routed_experts for r in routing]
        assert not torch.allclose(model(ids, replay_ids=other), base)
    with pytest.raises(ValueError, match=r"\[B, S, L, K\]"):
        model(ids, replay_ids=stacked[:, :, :-1])


def test_r3_replay_gradient_reaches_replayed_router_rows():
    model = _model("tiny_latent_groups").train()
    ids = _ids(model.config)
    routing = _own_routing(model, ids)
    model.zero_grad()
    model.token_logprobs(ids, torch.roll(ids, -1, 1), replay_ids=routing).sum().backward()
    layer = next(i for i, r in enumerate(routing) if r is not None)
    used = torch.unique(routing[layer])
    grad = model.layers[layer].mixer.gate.weight.grad
    assert bool((grad[used].abs().sum(-1) > 0).all())


def test_packed_sequences_equal_separate_rows():
    model = _model("tiny_latent_groups")
    cfg = model.config
    a, b = _ids(cfg, 1, 7, seed=3), _ids(cfg, 1, 5, seed=4)
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), cu_seqlens=[0, 7, 12])
        alone = torch.cat([model(a), model(b)], dim=1)
    k, depth = decoder_chain(cfg, 12)
    assert_normwise_close(packed, alone, dtype=torch.float32, k=k, depth=2 * depth, what="packed")
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.cat([a, b], dim=1), cu_seqlens=[0, 7, 11])


def test_chunked_token_logprobs_match_full():
    model = _model("tiny_latent_groups")
    cfg, ids = model.config, _ids(model.config)
    labels = torch.roll(ids, -1, 1)
    with torch.no_grad():
        full = torch.log_softmax(model(ids), -1).gather(-1, labels[..., None])[..., 0]
        chunked = model.token_logprobs(ids, labels, chunk_tokens=5)
    k, depth = decoder_chain(cfg, ids.numel())
    assert_normwise_close(chunked, full, dtype=torch.float32, k=k, depth=4, what="chunked head")


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trips(case, tmp_path):
    """The head, MTP tensors, an fp32 checkpoint and transformers' in-memory names (the key set and the exact
    round trip: test_checkpoint_families.py)."""
    model = _model(case)
    cfg, sd = model.config, model.state_dict()
    hf = to_hf_state_dict(sd, cfg)
    assert torch.equal(hf["lm_head.weight"], sd["lm_head.weight"])
    mtp = {**hf, "mtp.layers.0.mixer.q_proj.weight": torch.zeros(1)}  # MTP tensors are dropped, as transformers does
    assert sorted(from_hf_state_dict(mtp, cfg)) == sorted(sd)
    save_hf_checkpoint(model, cfg, tmp_path)
    loaded = load_hf_state_dict(tmp_path)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    # transformers 5's in-memory names (model., stacked experts) load too
    ref = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg.to_hf_config_dict()))
    ref.load_state_dict({("" if k == "lm_head.weight" else "model.") + k: v for k, v in sd.items()
                         if not (cfg.tie_word_embeddings and k == "lm_head.weight")}, strict=False)
    mem = from_hf_state_dict(ref.state_dict(), cfg)
    assert all(torch.equal(mem[k], sd[k]) for k in sd)


# The published Nemotron-3-Nano-30B-A3B-BF16 config.json (its architecture keys; the rest are generation/runtime
# settings): the default preset reads back from it.
NANO_CONFIG_JSON = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "attention_bias": False, "chunk_size": 128,
    "conv_kernel": 4, "expand": 2, "head_dim": 128, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "intermediate_size": 1856,
    "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "mamba_num_heads": 64,
    "mamba_proj_bias": False, "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2",
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "partial_rotary_factor": 1.0, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001,
    "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": 1, "use_bias": False, "use_conv_bias": True,
    "vocab_size": 131072, "residual_in_fp32": False, "rescale_prenorm_residual": True,
}


def test_published_nano_config_reads_as_the_preset():
    assert NemotronHConfig.from_hf_config_dict(NANO_CONFIG_JSON) == NemotronHConfig.nano_30b_a3b()


def test_config_round_trip_and_errors():
    cfg = NemotronHConfig.super_120b_a12b()
    d = cfg.to_hf_config_dict("bfloat16")
    assert NemotronHConfig.from_hf_config_dict(d) == cfg
    hf = transformers.NemotronHConfig(**d)
    assert hf.hybrid_override_pattern == cfg.hybrid_override_pattern and hf.moe_latent_size == 1024
    # a released config.json spells the layer list with mamba/attention and the norm eps as norm_eps
    released = {k: v for k, v in d.items() if k not in ("hybrid_override_pattern", "layer_norm_epsilon")}
    released["layers_block_type"] = [{"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}[c]
                                     for c in cfg.hybrid_override_pattern]
    released["norm_eps"] = 1e-5
    assert NemotronHConfig.from_hf_config_dict(released) == cfg
    with pytest.raises(ValueError, match="mlp_hidden_act"):
        NemotronHConfig.from_hf_config_dict({**d, "mlp_hidden_act": "silu"})


# Public figures. Nano: NVIDIA's Nemotron 3 Nano release ("3.2B active (3.6B with embeddings), 31.6B total").
# Super: the BF16 checkpoint's safetensors headers (123,611,012,096 weights, of which 2,942,324,736 MTP; 12,770,216,960
# used per token with the embedding), as quoted by a public parameter-count test; the name says 120B / A12B.
# Ultra: NVIDIA's release (550B total, 55B active).
PUBLIC = {
    "nano_30b_a3b": {"total": 31.6e9, "active": 3.2e9, "active_with_embeddings": 3.6e9},
    "super_120b_a12b": {"total": 123_611_012_096 - 2_942_324_736, "active_with_embeddings": 12_770_216_960},
    "ultra_550b_a55b": {"total": 550e9, "active": 55e9},
}


@pytest.mark.parametrize("preset", sorted(PUBLIC))
def test_meta_parameter_counts_match_public_totals(preset):
    cfg = getattr(NemotronHConfig, preset)()
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    counts = parameter_counts(model)
    for key, public in PUBLIC[preset].items():
        assert abs(counts[key] - public) <= 0.01 * public, f"{preset} {key}: {counts[key]:,} vs public {public:,.0f}"


def test_gradients_match_transformers(tmp_path):
    model = _model("tiny_latent_groups").train()
    cfg = model.config
    save_hf_checkpoint(model, cfg, tmp_path)
    ref = transformers.NemotronHForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="eager").train()
    ids = _ids(cfg)
    labels = torch.roll(ids, -1, 1)
    torch.log_softmax(model(ids), -1).gather(-1, labels[..., None]).sum().backward()
    torch.log_softmax(ref(ids).logits.float(), -1).gather(-1, labels[..., None]).sum().backward()
    theirs = {k.removeprefix("model."): p.grad for k, p in ref.named_parameters()}
    k, depth = decoder_chain(cfg, ids.numel(), backward=True)
    for name, p in model.named_parameters():
        # the same bound as the logits, for the forward and backward chain of both paths
        assert_normwise_close(p.grad, theirs[name], dtype=torch.float32, k=k, depth=2 * depth, what=name)


def test_grouped_mm_backend_equals_loop():
    model = _model("tiny_latent_groups")
    cfg, ids = model.config, _ids(model.config)
    with torch.no_grad():
        loop = model(ids)
        model.set_experts_backend("grouped_mm")
        grouped = model(ids)
    k, depth = decoder_chain(cfg, ids.numel())
    assert_normwise_close(grouped, loop, dtype=torch.float32, k=k, depth=2 * depth, what="grouped_mm vs loop")
    with pytest.raises(ValueError, match="backend"):
        model.set_experts_backend("triton")
