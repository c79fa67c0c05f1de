"""One rank of the GLM-5 (``glm_moe_dsa``) memory-planner validation, launched by
``tests/distributed/test_memory.py`` and ``benchmarks/memory_validation.py``.

Each scenario of ``OUT_DIR/scenarios.json`` (``{"name", "cp", "seq_len", "dtype", "ac", "attn_kernel", "loss_chunk_tokens"}``) runs
the cluster trainer's code path at a small scale: a scaled-down GLM-5 (:data:`VALIDATION_CONFIG`, MTP layer built
and not run, as in the trainer) built with ``grouped_mm`` experts, parallelized with
:func:`moe_rl.distributed.parallelize.parallelize_model` on ``ParallelDims(dp_shard=world / cp, cp=cp)``
(``dsa_allgather`` CP attention; FSDP2 ``MixedPrecisionPolicy(bfloat16, float32)`` for ``dtype = "bfloat16"``;
full activation checkpointing for ``ac = "full"``), then two steps of: this rank's CP columns of one random
sequence through ``model.token_logprobs`` (chunked head), the mean log-prob's backward, an AdamW step, under
:class:`moe_rl.distributed.meter.LiveBytesMeter` (parameters tracked first). Writes ``{name: peak bytes |
traceback}`` to ``OUT_DIR/rank<r>.json``.

Usage: ``python _memory_dsa_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

# a scaled-down GLM-5: every block kind (dense + MoE layers, MLA + DSA indexer, shared expert, MTP) at CPU size
VALIDATION_CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
    num_nextn_predict_layers=1, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=32,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


ATTN_BACKEND = {"dense": "dense", "chunked": "torch"}
"""Planner kernel -> ``GlmMoeDsaConfig.attn_backend``."""


def measure(sc: dict, world: int) -> int:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe_rl.distributed.meter import LiveBytesMeter
    from moe_rl.distributed.parallel_dims import ParallelDims
    from moe_rl.distributed.parallelize import parallelize_model, shard_for_context_parallel
    from moe_rl.models.glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cp, seq = int(sc["cp"]), int(sc["seq_len"])
    cfg = GlmMoeDsaConfig.tiny_debug(**VALIDATION_CONFIG, attn_backend=ATTN_BACKEND[sc["attn_kernel"]])
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg, experts_backend="grouped_mm")
    dims = ParallelDims(dp_shard=world // cp, cp=cp)
    mesh = dims.build_mesh("cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if sc["dtype"] == "bfloat16" else None
    parallelize_model(model, dims, mesh, cp_method="dsa_allgather", activation_checkpointing=sc["ac"] == "full",
                      mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rank = dist.get_rank()
    cp_rank = rank % cp if cp > 1 else 0
    data_rank = rank // cp
    g = torch.Generator().manual_seed(1 + data_rank)
    ids = torch.randint(3, cfg.vocab_size, (1, seq), generator=g)
    labels = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
    if cp > 1:
        if mesh["cp"].get_local_rank() != cp_rank:  # the mesh decides which CP column this rank holds
            cp_rank = mesh["cp"].get_local_rank()
        sid = shard_for_context_parallel(ids, cp, cp_rank, pad_value=0)
        slab = shard_for_context_parallel(labels, cp, cp_rank, pad_value=0)
        ids_l, labels_l, positions = sid.local, slab.local, sid.positions
    else:
        ids_l, labels_l, positions = ids, labels, None
    meter = LiveBytesMeter()
    meter.track(*[p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()])
    with meter:
        for _ in range(2):
            lp = model.token_logprobs(ids_l, labels_l, chunk_tokens=sc.get("loss_chunk_tokens"), positions=positions)
            (-lp.mean()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return int(meter.peak_bytes)


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    results: dict[str, object] = {}
    for sc in json.loads((out_dir / "scenarios.json").read_text()):
        try:
            results[sc["name"]] = measure(sc, world)
        except Exception:
            results[sc["name"]] = traceback.format_exc()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
