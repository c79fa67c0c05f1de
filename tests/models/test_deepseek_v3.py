"""DeepseekV3ForCausalLM (DeepSeek-V3 / Kimi-K2): YaRN tables against transformers' rotary embedding, MTP layers
in a checkpoint, R3 replay, packed sequences, published sizes on the meta device, and the Hugging Face config.

The tests every family shares (logits equal transformers' DeepseekV3ForCausalLM through the on-disk checkpoint in
both directions over ``FAMILIES["deepseek_v3"].cases``, exact conversion, bf16 files, fused in-memory names, config
errors) are in test_checkpoint_families.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _glm_parity import (
    FAMILIES,
    random_ids,
    randomize_for_parity,
)
from _tolerance import assert_normwise_close, decoder_chain

from moe_rl.attention.yarn import yarn_inv_freq
from moe_rl.models.deepseek_v3 import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    from_hf_state_dict,
    hf_key_names,
    load_hf_state_dict,
    to_hf_state_dict,
)

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

SEQ = 40  # > original_max_position_embeddings = 16 of the tiny YaRN: positions past the pre-training context

FAMILY = FAMILIES["deepseek_v3"]  # its cases: DeepSeek-V3's layout, a Kimi-K2-like one, plain RoPE


def _cfg(case: str, **extra) -> DeepseekV3Config:
    return FAMILY.cfg(case, **extra)


def _ids(cfg: DeepseekV3Config, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return random_ids(cfg.vocab_size, batch, seq)


def test_yarn_tables_equal_transformers_rotary_embedding():
    """Bit-equal inverse frequencies and attention factor for the published YaRN settings (same fp32 ops)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    for cfg in (DeepseekV3Config.deepseek_v3(), DeepseekV3Config.kimi_k2(), _cfg("dsv3_layout")):
        hf_cfg = transformers.DeepseekV3Config.from_dict(cfg.to_hf_config_dict())
        rot = DeepseekV3RotaryEmbedding(hf_cfg)
        inv, att = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        assert torch.equal(inv, rot.inv_freq) and att == rot.attention_scaling
        hf_attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_cfg, 0)
        assert math.isclose(cfg.softmax_scale, hf_attn.scaling, rel_tol=1e-15)
    # DeepSeek-V3: mscale = mscale_all_dim = 1, so cos/sin are unscaled and the softmax scale grows by
    # (0.1 ln 40 + 1)^2
    dsv3 = DeepseekV3Config.deepseek_v3()
    assert yarn_inv_freq(64, 10000.0, dsv3.rope_scaling)[1] == 1.0
    assert math.isclose(dsv3.softmax_scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_checkpoint_mtp_layers_are_dropped(tmp_path):
    """A checkpoint's MTP layer (model.layers.L.*) is dropped, as transformers drops it; a layer beyond the MTP
    layers is rejected."""
    cfg = _cfg("dsv3_layout")
    ours = DeepseekV3ForCausalLM(cfg)
    mtp_cfg = cfg.model_copy(update={"num_nextn_predict_layers": 1})
    disk = to_hf_state_dict(ours.state_dict(), cfg)
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size),
           "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(cfg.moe_intermediate_size, cfg.hidden_size)}
    save_file({**{k: v.contiguous() for k, v in disk.items()}, **mtp}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(mtp_cfg.to_hf_config_dict()))
    DeepseekV3ForCausalLM(mtp_cfg).load_state_dict(load_hf_state_dict(tmp_path), strict=True)
    with pytest.raises(ValueError, match=r"unexpected Hugging Face key.*model\.layers\.3\.eh_proj"):
        from_hf_state_dict({**disk, **mtp}, cfg)  # num_nextn_predict_layers=0: layer 3 is not an MTP layer


def test_replay_of_own_routing_reproduces_logits_bit_identically():
    cfg = _cfg("dsv3_layout")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=6)
    ids = _ids(cfg)
    routed: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, a, o, i=i: routed.__setitem__(i, o[0]))
        for i, layer in enumerate(model.layers)
        if layer.is_moe
    ]
    with torch.no_grad():
        base = model(ids)
    for hk in hooks:
        hk.remove()
    L, K, (B, S) = cfg.num_hidden_layers, cfg.num_experts_per_tok, ids.shape
    # vLLM routed_experts layout [B, S, L, K]; the dense layer 0's slice is ignored (zeros here)
    replay = torch.stack(
        [routed[i].view(B, S, K) if i in routed else torch.zeros(B, S, K, dtype=torch.int64) for i in range(L)],
        dim=2,
    ).to(torch.uint8)
    with torch.no_grad():  # the own expert ids in the own order: the same arithmetic, so bit-equal
        assert torch.equal(model(ids, replay_ids=replay), base)
        assert torch.equal(model(ids, replay_ids=[None, *[replay[:, :, i] for i in range(1, L)]]), base)
        other = replay.clone()
        other[:, :, 2] = (other[:, :, 2] + 1) % cfg.n_routed_experts
        assert (model(ids, replay_ids=other) - base).abs().max() > 1e-3
        lp = model.token_logprobs(ids, ids.roll(-1, 1), replay_ids=replay, chunk_tokens=7)
        want = torch.log_softmax(base, -1).gather(-1, ids.roll(-1, 1)[..., None])[..., 0]
        torch.testing.assert_close(lp, want)  # chunked head: same logits, fp32 log-softmax rounding
    with pytest.raises(ValueError, match=r"replay_ids has shape \(2, 40, 1, 2\).*\(2, 40, 3, 2\)"):
        model(ids, replay_ids=replay[:, :, :1])


def test_packed_sequences_equal_separate_rows():
    cfg = _cfg("dsv3_layout")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=7)
    ids = _ids(cfg, batch=2, seq=24)
    with torch.no_grad():
        rows = model(ids)
        packed = model(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 24, 48]))
    k, depth = decoder_chain(cfg, ids.numel())
    assert_normwise_close(packed.view_as(rows), rows, dtype=torch.float32, k=k, depth=2 * depth, what="packed")


def _closed_form_counts(cfg: DeepseekV3Config) -> tuple[int, float]:
    """(total, active) from the architecture's formulas: active = every decoder-layer parameter except the
    unselected routed experts (embedding and head excluded, as the GLM-5 test counts)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    attn = (D * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * cfg.qk_head_dim
            + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
            + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)
    dense = 3 * D * cfg.intermediate_size
    expert = 3 * D * cfg.moe_intermediate_size
    router = cfg.n_routed_experts * D
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    layers = cfg.num_hidden_layers * (attn + 2 * D) + cfg.first_k_dense_replace * dense
    total_moe = n_moe * (router + cfg.n_routed_experts * expert + cfg.n_shared_experts * expert)
    active_moe = n_moe * (router + cfg.num_experts_per_tok * expert + cfg.n_shared_experts * expert)
    head = 2 * cfg.vocab_size * D + D
    return layers + total_moe + head, float(layers + active_moe)


@pytest.mark.parametrize(
    "name, published_total, published_active",
    [("deepseek_v3", 671e9, 37e9), ("kimi_k2", 1.03e12, 32e9)],
)
def test_full_configs_build_on_meta_and_match_published_sizes(name, published_total, published_active):
    """Totals within 1% of the published figures: DeepSeek-V3 671.03B (671B, arXiv 2412.19437, main model without
    MTP); Kimi-K2 1,026.4B (the 1.03T of the model card's checkpoint; the K2 report's rounded "1.04T" is 1.3% above).
    Active = the decoder-layer parameters a token uses plus the LM head (the embedding is a one-row lookup):
    DeepSeek-V3 36.63B, Kimi-K2 31.69B. The published actives are whole billions (37B, 32B), so the check is the
    figure's own rounding interval, +-0.5B (1.35% / 1.56%); the counts are 1.01% / 0.98% from the figures."""
    cfg = getattr(DeepseekV3Config, name)()
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    active = 0.0
    for layer in model.layers:
        for pname, p in layer.named_parameters():
            active += p.numel() * (cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in pname else 1)
    want_total, want_active = _closed_form_counts(cfg)
    assert (total, active) == (want_total, want_active)
    assert buffers == (cfg.num_hidden_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts
    assert abs(total / published_total - 1) < 0.01, total
    with_head = active + cfg.vocab_size * cfg.hidden_size
    assert abs(with_head - published_active) < 0.5e9, with_head
    names = set(to_hf_state_dict(model.state_dict(), cfg))
    assert names == set(hf_key_names(cfg))


def test_hf_config_dict_round_trips_through_transformers_and_published_files():
    for cfg in (DeepseekV3Config.deepseek_v3(), DeepseekV3Config.kimi_k2(), _cfg("plain_rope_unnormalized")):
        hf_cfg = transformers.DeepseekV3Config.from_dict(cfg.to_hf_config_dict())
        assert DeepseekV3Config.from_hf_config_dict(hf_cfg.to_dict()) == cfg
    # the published config.json spelling: rope_scaling with "type", top-level rope_theta, model_type kimi_k2
    kimi = DeepseekV3Config.kimi_k2()
    published = {
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "num_key_value_heads": 64, "rope_theta": 50000.0,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        **{k: v for k, v in kimi.model_dump().items() if k not in ("rope_theta", "rope_scaling")},
    }
    assert DeepseekV3Config.from_hf_config_dict(published) == kimi


@pytest.mark.parametrize(
    "d, pattern",
    [
        ({"model_type": "glm4_moe"}, r"model_type='glm4_moe'.*reads only"),
        ({"q_lora_rank": None}, r"q_lora_rank=None .*not supported"),
        ({"scoring_func": "softmax"}, r"scoring_func='softmax'.*'sigmoid'"),
        ({"num_key_value_heads": 8}, r"num_key_value_heads=8 must equal num_attention_heads=128"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_type='linear' is not supported"),
    ],
)
def test_hf_config_errors_name_the_key(d, pattern):
    with pytest.raises(ValueError, match=pattern):
        DeepseekV3Config.from_hf_config_dict(d)
