"""GlmMoeDsaForCausalLM (GLM-5) against transformers' GlmMoeDsaForCausalLM, through the on-disk checkpoint format.

The reference is independent: transformers builds its own model from ``cfg.to_hf_config_dict()`` (eager
attention, fp32 softmax), writes it with ``save_pretrained`` (per-expert names), and loads ours with
``from_pretrained``. Sequences are longer than ``index_topk`` so DSA's selection matters.

Tolerance: 1e-5 on O(1) fp32 logits (std ~1). Both sides compute the same math in fp32 with different
association (absorbed MQA-form attention vs HF's expanded per-head keys; einsum vs matmul); the observed gap is
~5e-6 over 3 layers. A single different DSA key in any row moves logits by O(0.1-1), so 1e-5 also checks the
selection. Ties: with 16 indexer heads an indexer score is an exact 0 (every head ReLU'd away) with probability
~2^-16 per pair, so top-k ties, which torch.topk (HF) and our lowest-index rule break differently, do not occur.

The checkpoint tests every family shares (exact conversion, bf16 files, fused in-memory names, config errors) are
in test_checkpoint_families.py.
"""

from __future__ import annotations

import pytest
import torch
from _glm_parity import (
    FAMILIES,
    load_strictly_in_transformers,
    ours_from_reference,
    random_ids,
    randomize_for_parity,
)
from _tolerance import assert_normwise_close, decoder_chain

from moe_rl.distributed.memory import arch_spec
from moe_rl.models.glm_moe_dsa import (
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    from_hf_state_dict,
    hf_key_names,
    save_hf_checkpoint,
    to_hf_state_dict,
)

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

SEQ = 40  # > index_topk = 16: rows t >= 16 attend to 16 of their t + 1 visible keys

FAMILY = FAMILIES["glm_moe_dsa"]  # its parity cases: GLM-5's layout, and a shared indexer with bias, tied, groups
CASES = FAMILY.cases


def _cfg(case: str, **extra) -> GlmMoeDsaConfig:
    return FAMILY.cfg(case, **extra)


def _hf_model(cfg: GlmMoeDsaConfig):
    return FAMILY.hf_reference(cfg)


def _ids(cfg: GlmMoeDsaConfig, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return random_ids(cfg.vocab_size, batch, seq)


def _hf_logits_and_topk(hf, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """HF logits and, per decoder layer, its [B, S, K] selection (own indexer, or the reused one)."""
    sels: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, o: sels.append(o[1])) for layer in hf.model.layers]
    with torch.no_grad():
        logits = hf(ids).logits
    for h in hooks:
        h.remove()
    return logits, sels


def _assert_topk_sets_match(cfg, ids, ours_sel, hf_sel) -> int:
    """Per layer and row, our selection (token-index coordinates, -1 padded) equals HF's visible selection.
    Returns the number of rows where DSA actually dropped keys."""
    batch, seq = ids.shape
    sparse_rows = 0
    for layer, (o, h) in enumerate(zip(ours_sel, hf_sel, strict=True)):
        o = o.view(batch, seq, -1)
        for b in range(batch):
            for t in range(seq):
                got = {int(i) - b * seq for i in o[b, t] if i >= 0}
                want = {
                    int(i) for i in h[b, t] if i <= t
                }  # HF also lists masked (future) keys when t + 1 < K
                assert got == want, (layer, b, t, sorted(got ^ want))
                sparse_rows += int(t + 1 > cfg.index_topk)
    return sparse_rows


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_topk_match_transformers_loaded_from_hf_checkpoint(case, tmp_path):
    cfg = _cfg(case, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    hf = _hf_model(cfg)
    ours = ours_from_reference(hf, cfg, tmp_path, FAMILY)
    ids = _ids(cfg)
    want, hf_sel = _hf_logits_and_topk(hf, ids)
    with torch.no_grad():
        h, ours_sel = ours.hidden_states(ids, return_topk_indices=True)
        got = ours.lm_head(h).float()
    assert want.std() > 0.3
    assert (got - want).abs().max().item() <= 1e-5
    assert _assert_topk_sets_match(cfg, ids, ours_sel, hf_sel) == len(ours_sel) * 2 * (SEQ - cfg.index_topk)
    if cfg.indexer_types is not None:
        assert ours.layers[1].self_attn.indexer is None and torch.equal(ours_sel[1], ours_sel[0])


@pytest.mark.parametrize("case", list(CASES))
def test_our_checkpoint_loads_strictly_in_transformers(case, tmp_path):
    cfg = _cfg(case)  # with one MTP layer
    torch.manual_seed(0)
    ours = GlmMoeDsaForCausalLM(cfg).eval()
    randomize_for_parity(ours, seed=2)
    # transformers has no MTP module (and ignores only "model.layers.78.*"): save the main model
    main_sd = {k: v for k, v in ours.state_dict().items() if not k.startswith("mtp_layers.")}
    save_hf_checkpoint(main_sd, cfg, tmp_path)
    hf = load_strictly_in_transformers(tmp_path, "GlmMoeDsaForCausalLM")
    ids = _ids(cfg)
    want, hf_sel = _hf_logits_and_topk(hf, ids)
    with torch.no_grad():
        h, ours_sel = ours.hidden_states(ids, return_topk_indices=True)
        got = ours.lm_head(h).float()
    assert (got - want).abs().max().item() <= 1e-5
    _assert_topk_sets_match(cfg, ids, ours_sel, hf_sel)


def test_state_dict_round_trip_with_mtp_names(tmp_path):
    cfg = _cfg("shared_indexer_bias_tied_groups")
    torch.manual_seed(0)
    ours = GlmMoeDsaForCausalLM(cfg)
    randomize_for_parity(ours, seed=4)
    sd = ours.state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)  # the key set and the exact round trip: test_checkpoint_families.py
    mtp = {k for k in hf_sd if k.startswith("model.layers.3.")}  # L = 3: the MTP layer, DeepSeek-V3 names
    assert {
        "model.layers.3.enorm.weight",
        "model.layers.3.hnorm.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.norm.weight",
        "model.layers.3.self_attn.indexer.wq_b.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.mlp.experts.7.down_proj.weight",
    } <= mtp
    assert hf_sd["model.layers.3.eh_proj.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert not any(k.startswith("model.layers.1.self_attn.indexer") for k in hf_sd)  # a "shared" layer
    # dropping the MTP layer on request; checkpoint copies of the shared head / embedding are ignored
    no_mtp = from_hf_state_dict(
        {**hf_sd, "model.layers.3.shared_head.head.weight": torch.zeros(1)}, cfg, with_mtp=False
    )
    GlmMoeDsaForCausalLM(cfg, with_mtp=False).load_state_dict(no_mtp, strict=True)
    save_hf_checkpoint(ours, cfg, tmp_path, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.3.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.self_attn.indexer.weights_proj.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.3.eh_proj.weight").get_dtype() == "BF16"


def test_conversion_errors_name_the_keys():
    cfg = _cfg("glm5_layout")
    sd = GlmMoeDsaForCausalLM(cfg).state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
    with pytest.raises(ValueError, match=r"missing 5 key\(s\).*layers\.2\.self_attn\.indexer.*indexer_types"):
        from_hf_state_dict({k: v for k, v in hf_sd.items() if "layers.2.self_attn.indexer" not in k}, cfg)
    with pytest.raises(ValueError, match=r"unexpected Hugging Face key.*model\.layers\.4\.enorm"):
        from_hf_state_dict({**hf_sd, "model.layers.4.enorm.weight": torch.zeros(1)}, cfg)


def test_forward_passes_hidden_states_inputs_and_refuses_the_others():
    """``forward(ids, **inputs)`` is ``lm_head(hidden_states(ids, **inputs))``: the same logits; a keyword
    ``hidden_states`` does not take, or its ``return_topk_indices`` (``forward_full``'s job), raises TypeError."""
    torch.manual_seed(0)
    cfg = _cfg("glm5_layout")
    model = GlmMoeDsaForCausalLM(cfg, with_mtp=False).eval()
    ids = random_ids(cfg.vocab_size, 1, 6)
    with torch.no_grad():
        cu = torch.tensor([0, 2, 6])
        want = model.lm_head(model.hidden_states(ids, cu_seqlens=cu)).float()
        torch.testing.assert_close(model(ids, cu_seqlens=cu), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"return_topk_indices is not an input of forward"):
        model(ids, return_topk_indices=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'cu_seqlen'"):
        model(ids, cu_seqlen=torch.tensor([0, 6]))


def test_glm5_1_builds_on_meta_and_counts_match_arch_spec_and_published_sizes():
    cfg = GlmMoeDsaConfig.glm5_1()
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg)
    assert len(model.layers) == 78 and len(model.mtp_layers) == 1
    assert [layer.is_moe for layer in model.layers].count(False) == 3
    spec = arch_spec(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert total == spec.total_params  # 753,864,119,552 with the MTP layer
    mtp = sum(p.numel() for p in model.mtp_layers.parameters())
    assert abs((total - mtp) / 744e9 - 1) < 0.01  # 743.91e9
    # active: every main-layer parameter except the unselected routed experts (embedding and head excluded)
    active = 0.0
    for layer in model.layers:
        for name, p in layer.named_parameters():
            active += p.numel() * (
                cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in name else 1
            )
    assert active == spec.active_params
    assert abs(active / 40e9 - 1) < 0.01  # 39.88e9
    names = set(to_hf_state_dict(model.state_dict(), cfg))
    assert names == set(hf_key_names(cfg, with_mtp=True))
    assert (
        "model.layers.78.eh_proj.weight" in names
        and "model.layers.77.mlp.experts.255.down_proj.weight" in names
    )


def test_gradients_reach_every_parameter_but_the_frozen_indexer():
    cfg = _cfg("shared_indexer_bias_tied_groups", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg)
    randomize_for_parity(model, seed=5)
    ids = _ids(cfg, batch=2, seq=24)
    out = model.forward_full(ids)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss = loss + torch.nn.functional.cross_entropy(
        out.mtp_logits[0][:, :-1].flatten(0, 1), ids[:, 2:].flatten()
    )
    loss.backward()
    indexer = {id(p) for p in model.indexer_parameters()}
    assert len(indexer) == 5 * 3  # layers 0 and 2 ("full") and the MTP layer; layer 1 is "shared"
    for name, p in model.named_parameters():
        if id(p) in indexer:
            assert p.grad is None, name  # the indexer runs under no_grad (RL: frozen indexer)
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_replay_of_own_routing_and_selection_reproduces_logits():
    cfg = _cfg("shared_indexer_bias_tied_groups")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=6)
    ids = _ids(cfg, batch=2, seq=SEQ)
    routed: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, a, o, i=i: routed.__setitem__(i, o[0]))
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad():
        h, sel = model.hidden_states(ids, return_topk_indices=True)
        base = model.lm_head(h)
    for hk in hooks:
        hk.remove()
    L, K, B, S = cfg.num_hidden_layers, cfg.num_experts_per_tok, *ids.shape
    replay = torch.stack([routed[i].view(B, S, K) for i in range(L)], dim=2).to(torch.uint8)
    with torch.no_grad():  # bit-equal: the own expert ids and key indices in the own order: the same arithmetic
        torch.testing.assert_close(model(ids, replay_ids=replay, topk_indices=sel), base, atol=0, rtol=0)
        torch.testing.assert_close(
            model(ids, topk_indices=torch.stack(sel).to(torch.int32)), base, atol=0, rtol=0
        )
        # other experts in layer 1 change the logits
        other = replay.clone()
        other[:, :, 1] = (other[:, :, 1] + 1) % cfg.n_routed_experts
        assert (model(ids, replay_ids=other) - base).abs().max() > 1e-3
        # layer 0 attending to its K most recent keys instead: rows t >= K change, rows t < K (all keys
        # selected either way) do not; layer 1 ("shared") follows layer 0's replayed selection
        t = torch.arange(B * S)
        recent = t[:, None] - torch.arange(cfg.index_topk)[None, :]
        seq_start = (t // S * S)[:, None]
        recent = torch.where(recent >= seq_start, recent, torch.full_like(recent, -1))
        h2, sel2 = model.hidden_states(ids, topk_indices=[recent, None, None], return_topk_indices=True)
        assert torch.equal(sel2[0], recent) and torch.equal(sel2[1], recent)
        changed = (model.lm_head(h2) - base).abs().amax(-1)  # [B, S]
        assert changed[:, : cfg.index_topk].max() <= 1e-5
        assert changed[:, cfg.index_topk :].min() > 1e-4
    with pytest.raises(ValueError, match=r"replay_ids has shape \(2, 40, 1, 2\).*\(2, 40, 3, 2\)"):
        model(ids, replay_ids=replay[:, :, :1])
    with pytest.raises(ValueError, match=r"topk_indices has shape \(2, 80, 16\).*\(3, 80, 16\)"):
        model(ids, topk_indices=torch.stack(sel[:2]))
    with pytest.raises(
        ValueError, match=r"topk_indices is a list of 2 per-layer tensors but the model has 3"
    ):
        model(ids, topk_indices=sel[:2])


def test_mtp_depth_one_predicts_from_the_next_token_embedding():
    """Row t of MTP depth 1 reads h[t] and embed(ids[t + 1]) and attends causally: changing token j moves
    rows >= j - 1 only."""
    cfg = _cfg("glm5_layout")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=7)
    ids = _ids(cfg, batch=1, seq=24)
    ids2 = ids.clone()
    j = 12
    ids2[0, j] = (ids2[0, j] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model.forward_full(ids).mtp_logits[0], model.forward_full(ids2).mtp_logits[0]
    assert a.shape == (1, 23, cfg.vocab_size)
    diff = (a - b).abs().amax(-1)[0]
    # unaffected rows differ only by rounding (the changed token regroups the loop experts' matmuls)
    assert diff[: j - 1].max() <= 1e-5 and diff[j - 1 :].min() > 1e-3
    with pytest.raises(ValueError, match="no MTP layers"):
        GlmMoeDsaForCausalLM(cfg, with_mtp=False).mtp_logits(ids, torch.zeros(1, 24, cfg.hidden_size))


def test_hf_config_dict_round_trips_through_transformers():
    cfg = _cfg("shared_indexer_bias_tied_groups")
    d = cfg.to_hf_config_dict(torch_dtype=torch.bfloat16)
    assert d["model_type"] == "glm_moe_dsa" and d["architectures"] == ["GlmMoeDsaForCausalLM"]
    hf_cfg = transformers.GlmMoeDsaConfig.from_dict(d)
    assert (
        hf_cfg.indexer_types == ["full", "shared", "full"]
        and hf_cfg.rope_parameters["rope_theta"] == cfg.rope_theta
    )
    assert GlmMoeDsaConfig.from_hf_config_dict(hf_cfg.to_dict()) == cfg
    # transformers' schedule from index_topk_freq / offset (IndexCache) is reproduced
    sched = transformers.GlmMoeDsaConfig(num_hidden_layers=8, index_topk_freq=4, index_skip_topk_offset=2)
    ours = GlmMoeDsaConfig.from_hf_config_dict(
        {"num_hidden_layers": 8, "index_topk_freq": 4, "index_skip_topk_offset": 2}
    )
    assert ours.indexer_types == sched.indexer_types


_PLAN_KERNEL = {"dense": "dense", "torch": "chunked"}  # GlmMoeDsaConfig.attn_backend -> plan_memory attn_kernel


@pytest.mark.parametrize("attn_backend", ["dense", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_block_activation_bytes_match_the_meter_exactly(dtype, attn_backend):
    """The planner's attention-block bytes (``_mla_block`` + ``_dsa_saved`` of the matching kernel, as
    plan_memory adds them) = the bytes autograd keeps, to the byte, for two index_topk values (the per-key terms)."""
    from moe_rl.distributed.memory import _act, _dsa_saved, arch_spec
    from moe_rl.distributed.meter import LiveBytesMeter
    from moe_rl.models.glm_moe_dsa.model import GlmMoeDsaDecoderLayer

    b, T = dtype.itemsize, 96
    for k in (8, 24):
        cfg = GlmMoeDsaConfig.tiny_debug(index_topk=k, num_nextn_predict_layers=0, attn_backend=attn_backend)
        layer = GlmMoeDsaDecoderLayer(cfg, 0, "loop").to(dtype)
        x = torch.randn(T, cfg.hidden_size, dtype=dtype, requires_grad=True)

        def block(layer=layer, x=x):
            attn = layer.self_attn(
                layer.input_layernorm(x), cu_seqlens=torch.tensor([0, T]), token_idx=torch.arange(T)
            )
            return layer.post_attention_layernorm(x + attn.hidden)

        meter = LiveBytesMeter()
        meter.track(*layer.parameters(), x)
        with meter:
            base = meter.current_bytes
            y = block()
            meter.track()  # purge the storages freed since the last op
            saved = meter.current_bytes - base - y.untyped_storage().nbytes()
        arch, d = arch_spec(cfg), cfg.hidden_size
        # the plan also counts the block's input x when autograd saves it (fp32 only: bf16 saves an fp32 copy,
        # measured here) and its output y, both excluded from `saved`
        planned = (_act(arch.attn_act_coeffs, b) + _dsa_saved(arch.dsa, _PLAN_KERNEL[attn_backend], b, T, T)
                   - (4 * d if b == 4 else 0) - b * d)
        assert saved == T * planned, (k, saved / T, planned)


@pytest.mark.parametrize("attn_backend", ["dense", "torch"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_activations_match_the_meter_for_the_whole_model(precision, attn_backend):
    """plan_memory's activations at the head's backward (every layer's saved tensors + the head's) with the
    matching DSA kernel = the bytes alive at the end of the forward, within 1% (measured 0.997 / 1.001 for the
    dense reference in fp32 / bf16, 0.996 / 1.001 for the memory-bounded path)."""
    from moe_rl.distributed.memory import plan_memory
    from moe_rl.distributed.meter import LiveBytesMeter
    from moe_rl.distributed.parallel_dims import ParallelDims

    cfg = GlmMoeDsaConfig.tiny_debug(vocab_size=256, num_nextn_predict_layers=0, attn_backend=attn_backend)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg, experts_backend="grouped_mm")
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    ids = torch.randint(3, 256, (2, 128))
    meter = LiveBytesMeter()
    meter.track(*model.parameters(), *model.buffers())
    with meter:
        base = meter.current_bytes
        logp = torch.log_softmax(model(ids)[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
        meter.track()
        saved = meter.current_bytes - base - logp.untyped_storage().nbytes()
    plan = plan_memory(cfg, ParallelDims(), 128, 2, precision, "none", attn_kernel=_PLAN_KERNEL[attn_backend])
    planned = plan.details["output_head_backward_activation_bytes"]
    assert abs(planned / saved - 1) < 0.01, (planned, saved)


def test_packed_sequences_equal_separate_rows():
    """Two sequences packed in one row with cu_seqlens (attention windows and RoPE positions restart) give the
    logits and the DSA selections of the same sequences as two rows (same token indices b * S + s)."""
    cfg = _cfg("glm5_layout")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    randomize_for_parity(model, seed=8)
    ids = _ids(cfg, batch=2, seq=SEQ)
    with torch.no_grad():
        rows, sel_rows = model.hidden_states(ids, return_topk_indices=True)
        packed, sel_packed = model.hidden_states(
            ids.reshape(1, -1), cu_seqlens=torch.tensor([0, SEQ, 2 * SEQ]), return_topk_indices=True
        )
    # two fp32 paths (packed vs rows: other shapes, other summation order), normwise chain bound
    # (tests/_tolerance.py); a window or RoPE position that fails to restart changes hidden states by O(1)
    k, depth = decoder_chain(cfg, 2 * SEQ)
    assert_normwise_close(packed.view(2, SEQ, -1), rows, dtype=torch.float32, k=k, depth=2 * depth)
    assert all(torch.equal(a, b) for a, b in zip(sel_rows, sel_packed, strict=True))
    with pytest.raises(ValueError, match=r"input_ids must be \[1, T\]"):
        model(ids, cu_seqlens=torch.tensor([0, SEQ, 2 * SEQ]))
