"""The memory planner's view of Nemotron-H / Nemotron-3 (``NemotronHConfig.arch_spec``: Mamba-2, GQA attention,
squared-ReLU MLP and latent-MoE layers, :func:`moe_rl.distributed.memory.hybrid_arch_spec`).

- parameters: ``arch_spec`` counts exactly the built model's parameters (the tiny model, a variant with biases, no
  latent and tied embeddings, and a 6-layer model of Ultra's widths on the meta device), its active count is
  ``parameter_counts``' minus the head and the final norm, and the presets give the published sizes;
- activations, per layer kind: what autograd keeps (``LiveBytesMeter``) is the planned bytes per token times the
  tokens plus a per-call constant (the same at 64 and 512 tokens, so the per-token coefficients are exact), and that
  constant is at most one fp32 copy of the layer's parameters (the casts of weights made per call: the router's
  fp32 weight, ``-exp(A_log)``, the conv weight), nonnegative;
- phases: without CP the attention layers run SDPA (no O(T^2) term), under CP the ring attention's fp32 score blocks
  are the transients, and the Mamba-2 layers add their chunk-level and CP state-correction terms.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM, parameter_counts

VARIANT = dict(moe_latent_size=None, mlp_bias=True, use_bias=True, tie_word_embeddings=True, mamba_num_heads=8,
               ssm_state_size=16, n_groups=4, chunk_size=8, num_experts_per_tok=4, topk_group=2, n_routed_experts=16,
               hidden_size=96)


@pytest.mark.parametrize("overrides", [{}, VARIANT], ids=["tiny", "variant"])
def test_arch_spec_counts_the_built_model(overrides):
    from moe_rl.distributed.memory import arch_spec

    cfg = NemotronHConfig.tiny_debug(**overrides)
    model = NemotronHForCausalLM(cfg)
    arch = arch_spec(cfg)
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    # parameter_counts' active count keeps the head (the embedding too when tied: the same matrix) and the final
    # norm, which the planner counts with the embedding
    head = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    assert arch.active_params + head == parameter_counts(model)["active"]
    assert [layer.kind for layer in arch.layers] == [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    assert sum(layer.expert_params for layer in arch.layers) == sum(
        p.numel() for layer in model.layers if layer.is_moe for p in layer.mixer.experts.parameters())


def test_arch_spec_of_ultra_widths_on_meta_and_the_published_sizes():
    from moe_rl.distributed.memory import arch_spec

    small = NemotronHConfig.ultra_550b_a55b(hybrid_override_pattern="ME*EM-")
    with torch.device("meta"):
        model = NemotronHForCausalLM(small)
    assert arch_spec(small).total_params == sum(p.numel() for p in model.parameters())
    assert arch_spec(small).active_params + (small.vocab_size + 1) * small.hidden_size == \
        parameter_counts(model)["active"]
    ultra, nano = arch_spec(NemotronHConfig.ultra_550b_a55b()), arch_spec(NemotronHConfig.nano_30b_a3b())
    assert round(ultra.total_params / 1e9) == 549  # model card: 550B total
    assert round((ultra.active_params + 131072 * 8192) / 1e9) == 55  # 55B active (head included, embedding not)
    assert round(nano.total_params / 1e9, 1) == 31.6  # Nano-30B-A3B: 31.6B total
    assert round((nano.active_params + 131072 * 2688) / 1e9, 1) == 3.2  # 3.2B active without the embedding
    assert ultra.name == "nemotron_h" and ultra.dsa is None and ultra.dense_attn.sdpa_without_cp
    kinds = [layer.kind for layer in ultra.layers]
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (48, 48, 12)


def _saved_bytes(layer, x):
    from moe_rl.distributed.meter import LiveBytesMeter

    meter = LiveBytesMeter()
    meter.track(*layer.parameters(), *layer.buffers(), x)
    with meter:
        base = meter.current_bytes
        y = layer(x)
        meter.track()
        return meter.current_bytes - base - y.untyped_storage().nbytes()


@pytest.mark.parametrize("overrides", [{}, VARIANT], ids=["tiny", "variant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_layer_kind_keeps_the_planned_bytes_per_token(overrides, dtype):
    from moe_rl.distributed.memory import _ssm_seq_bytes, arch_spec
    from moe_rl.models.nemotron_h.model import NemotronHBlock

    cfg = NemotronHConfig.tiny_debug(**overrides)
    arch, b, d = arch_spec(cfg), dtype.itemsize, cfg.hidden_size
    for kind in ("mamba", "attention", "mlp", "moe"):
        i = next(j for j in range(cfg.num_hidden_layers) if cfg.layer_kind(j) == kind)
        spec = arch.layers[i]
        consts = []
        for tokens in (64, 512):
            torch.manual_seed(0)
            layer = NemotronHBlock(cfg, i, "grouped_mm").to(dtype)
            x = torch.randn(1, tokens, d, dtype=dtype, requires_grad=True)
            saved = _saved_bytes(layer, x)
            # a chain counts each layer's own output and not its input: in fp32 the next layer's norm keeps this
            # layer's output (4 D per token, planned here, outside `saved`)
            per_token = spec.act_bytes_per_token(b) + _ssm_seq_bytes(spec, tokens, 1) - (4 * d if b == 4 else 0)
            consts.append(saved - per_token * tokens)
        assert abs(consts[0] - consts[1]) <= 1e-9 * abs(saved), (kind, consts)
        assert 0 <= consts[0] <= 4 * spec.params, (kind, consts[0], spec.params)


def test_phases_sdpa_without_cp_ring_blocks_and_mamba_terms_under_cp():
    from moe_rl.distributed.memory import _ssd_chunk_bytes, arch_spec, plan_memory
    from moe_rl.distributed.parallel_dims import ParallelDims

    cfg = NemotronHConfig.ultra_550b_a55b()
    seq = 131072

    def plan(cp: int):
        return plan_memory(cfg, ParallelDims(dp_shard=128 // cp, cp=cp, ep=8), seq, 1, "bf16", "full", True,
                           loss_chunk_tokens=4096, fp8=True, fp8_experts=True)

    p1, p32 = plan(1), plan(32)
    assert p1.details["attention_backward_transient_bytes"] == 0.0  # fused SDPA: no [H, T, T] scores
    assert p1.details["attention_saved_bytes_per_token"] == 0.0
    t = seq // 32
    assert p32.details["attention_backward_transient_bytes"] == (20 * 64 + 1) * t * t
    mamba = next(layer for layer in arch_spec(cfg).layers if layer.kind == "mamba")
    # the largest layer's activations at CP=32: a Mamba-2 layer's coefficients + its chunk term + the CP correction
    chunk = _ssd_chunk_bytes(256, 128, t)
    assert chunk == (4 * 256 + 2) * (t // 128 + 1) ** 2 / t
    assert p32.details["act_bytes_per_token_per_layer_max"] == pytest.approx(
        mamba.act_bytes_per_token(2) + chunk + 4 * 256 * 64 + 8 * 256, rel=1e-12)


@pytest.mark.parametrize("cp", ["32", "4"])
def test_docs_memory_page_quotes_the_nemotron_plan(capsys, cp):
    """docs/memory.md embeds ``python -m moe_rl.launch.memory --model nemotron_3_ultra ...``; regenerate the section
    when the planner changes."""
    from pathlib import Path

    from moe_rl.launch.memory import main

    main(["--model", "nemotron_3_ultra", "--nodes", "16", "--cp", cp, "--ep", "8", "--optimizer-offload", "--fp8",
          "--loss-chunk-tokens", "4096", "--gpu-gb", "141"])
    page = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    blocks = capsys.readouterr().out.split("## ")[1:]
    assert blocks
    for block in blocks:
        assert block.strip() in page, f"docs/memory.md is stale; regenerate it. Missing:\n{block}"
