"""Sample.routed_experts -> TrainingBatch (safetensors) -> trainer replay: every token replays its own row."""

from __future__ import annotations

import numpy as np
import torch
from _tolerance import assert_normwise_close, decoder_chain

from moe_rl.models.glm4_moe import GlmMoeConfig, GlmMoeForCausalLM
from moe_rl.replay import OWN_ROW, RoutedExperts, model_replay_ids
from moe_rl.rl.batch import build_batch, read_batch, write_batch
from moe_rl.rl.buffer import RolloutGroup, Sample


def _record(rng, n_tokens, layers, k, num_experts):
    ids = np.argsort(rng.random((n_tokens, layers, num_experts)), axis=-1)[..., :k]
    ids[-1] = -1  # the last sampled token: placeholder
    return RoutedExperts.from_array(ids, num_experts)


def test_routed_experts_travel_through_the_batch_file_and_replay_per_sample(tmp_path):
    cfg = GlmMoeConfig.tiny_debug()
    torch.manual_seed(0)
    model = GlmMoeForCausalLM(cfg).eval()
    moe_layers = [layer.is_moe for layer in model.layers]
    m, k, e = sum(moe_layers), cfg.num_experts_per_tok, cfg.n_routed_experts
    rng = np.random.default_rng(0)
    shapes = [(5, 3), (7, 2), (4, 4)]  # (prompt, completion) lengths: different, so the batch is padded
    samples = []
    for i, (p, c) in enumerate(shapes):
        prompt = rng.integers(3, cfg.vocab_size, size=p).tolist()
        completion = rng.integers(3, cfg.vocab_size, size=c).tolist()
        rec = None if i == 2 else _record(rng, p + c, m, k, e)
        samples.append(Sample(prompt, completion, [-1.0] * c, reward=float(i), routed_experts=rec))
    batch = build_batch([RolloutGroup(0, 0, "s", samples=samples)], step=0, pad_id=cfg.pad_token_id)
    assert batch.routed_experts.dtype == torch.uint8 and batch.routed_experts.shape == (3, 9, m, k)
    back = read_batch(write_batch(batch, tmp_path))
    assert torch.equal(back.routed_experts, batch.routed_experts)
    assert torch.equal(back.routed_experts_state, batch.routed_experts_state)
    shard = back.shard(2, 3)  # the sample without routing, alone on "rank" 2
    assert (shard.routed_experts_state[0, :8] == OWN_ROW).all() and shard.routed_experts_state[0, 8] == -1
    assert back.routed_experts_state[:2, :7].eq(0).all() and back.routed_experts_state[0, 7:].eq(-1).all()

    replay = model_replay_ids(back.routed_experts, back.routed_experts_state, moe_layers)
    with torch.no_grad():
        batched = model(back.input_ids, replay_ids=replay)
        for i, (s, (p, c)) in enumerate(zip(samples, shapes, strict=True)):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            if s.routed_experts is None:
                alone = model(ids)  # no record: the trainer's own routing
            else:
                rows = s.routed_experts.to_tensor()[None]  # [1, n, M, K], last row -1
                per_layer, j = [], 0
                for is_moe in moe_layers:
                    per_layer.append(rows[:, :, j] if is_moe else None)
                    j += int(is_moe)
                alone = model(ids, replay_ids=per_layer)
            n = p + c
            # Causal model, right padding: the sample's own positions see only its own tokens and rows.
            # two fp32 paths (batch of 3 padded rows vs one row: other GEMM shapes), normwise chain bound
            # (tests/_tolerance.py); replaying another sample's routing changes logits by O(1) relative
            kk, depth = decoder_chain(cfg, back.input_ids.numel())
            assert_normwise_close(batched[i, : n - 1], alone[0, : n - 1], dtype=torch.float32, k=kk,
                                  depth=2 * depth, what=f"sample {i}")
