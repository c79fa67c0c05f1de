"""One rank of the memory-planner check (launched by ``tests/distributed/test_memory.py``).

Builds two small glm4_moe models (``SHAPES``), shards it with FSDP2 over the gloo group
(``fully_shard`` per decoder layer and at the root; bf16 = ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), optionally checkpoints every decoder layer, and runs two AdamW steps on random tokens
(loss = mean token log-prob, as the RL trainer computes it) under :class:`LiveBytesMeter`. Writes the peak live
bytes of this rank per scenario to ``<out>/rank<r>.json``.

Usage: ``python _memory_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moe_rl.distributed.meter import LiveBytesMeter
from moe_rl.models.glm4_moe import GlmMoeConfig, GlmMoeForCausalLM

torch.set_num_threads(1)

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES = {
    # (config overrides, seq_len, micro_batch): A = the debug model with a larger vocab; B = other widths, K = 4,
    # 2 shared experts, no attention bias, qk-norm, more rotary dims, shorter sequences in a bigger micro-batch
    "A": (dict(vocab_size=512, num_hidden_layers=3, **IDS), 256, 4),
    "B": (
        dict(vocab_size=1024, num_hidden_layers=4, hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
             head_dim=32, partial_rotary_factor=1.0, intermediate_size=384, n_routed_experts=16,
             num_experts_per_tok=4, moe_intermediate_size=96, n_shared_experts=2, first_k_dense_replace=1,
             attention_bias=False, use_qk_norm=True, **IDS),
        128, 6,
    ),
}


def measure(shape: str, precision: str, ac: str) -> int:
    overrides, seq, micro_batch = SHAPES[shape]
    torch.manual_seed(0)
    cfg = GlmMoeConfig.tiny_debug(**overrides)
    model = GlmMoeForCausalLM(cfg, experts_backend="grouped_mm")
    if ac == "full":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = LiveBytesMeter()
    meter.track(*[p.to_local() for p in model.parameters()])
    torch.manual_seed(1 + dist.get_rank())
    ids = torch.randint(3, cfg.vocab_size, (micro_batch, seq))
    with meter:
        for _ in range(2):
            logits = model(ids)
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
            (-logp.mean()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return meter.peak_bytes


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results: dict[str, object] = {}
    for shape in SHAPES:
        for precision in ("fp32", "bf16"):
            for ac in ("none", "full"):
                key = f"{shape}_{precision}_{ac}"
                try:
                    results[key] = measure(shape, precision, ac)
                except Exception:
                    results[key] = traceback.format_exc()
                (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
