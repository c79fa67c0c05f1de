"""One rank of ``tests/models/test_deepseek_v3_parallel.py``: DeepseekV3ForCausalLM under
:func:`moe_rl.distributed.parallelize.parallelize_model` on 2 gloo ranks against the single-process model.

Each scenario builds the tiny model (same seed on every rank), parallelizes it for one layout, runs forward and
backward on this rank's part of the batch and compares the global loss and every gathered gradient with the full
model on the full batch (:func:`_tolerance.assert_normwise_close` with the decoder chain of forward + backward,
twice: each path is within the bound of the exact result).

Usage: ``python _deepseek_v3_parallel_worker.py RANK WORLD INIT_FILE OUT_DIR``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from _glm_parity import random_ids, randomize_for_parity  # noqa: E402
from _rank_worker import run_rank_worker  # noqa: E402
from _tolerance import assert_normwise_close, decoder_chain  # noqa: E402

from moe_rl.distributed.parallel_dims import ParallelDims  # noqa: E402
from moe_rl.distributed.parallelize import parallelize_model, shard_for_context_parallel  # noqa: E402
from moe_rl.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

torch.set_num_threads(1)
B, S = 2, 16  # S a multiple of 2 * cp = 4: zigzag CP shards need no padding
CFG = DeepseekV3Config.tiny_debug(n_routed_experts=4, n_group=2, topk_group=1)


def build() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(CFG)
    randomize_for_parity(model, seed=11)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(CFG.vocab_size, B, S + 1)
    return ids[:, :-1], ids[:, 1:]


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


_REF: dict[str, object] = {}


def reference() -> dict:
    if not _REF:
        model = build()
        ids, labels = batch()
        loss = loss_sum(model(ids), labels) / ids.numel()
        loss.backward()
        _REF.update(loss=loss.detach(), grads={n: p.grad.clone() for n, p in model.named_parameters()})
    return _REF


def check(dims: ParallelDims, **kw) -> None:
    ref = reference()
    mesh = dims.build_mesh("cpu")
    model = parallelize_model(build(), dims, mesh, **kw)
    assert (model.cp_group is not None) == (dims.cp > 1)
    ids, labels = batch()
    data_rank, data_ranks = mesh.data_rank, dims.dp_replicate * dims.dp_shard
    rows = slice(data_rank * B // data_ranks, (data_rank + 1) * B // data_ranks)
    ids, labels = ids[rows], labels[rows]
    positions = None
    if dims.cp > 1:
        r = mesh.coordinate("cp")
        sid = shard_for_context_parallel(ids, dims.cp, r)
        ids, labels, positions = sid.local, shard_for_context_parallel(labels, dims.cp, r).local, sid.positions
    local = loss_sum(model(ids, positions=positions), labels)
    (local * dims.dp_size / (B * S)).backward()
    total = local.detach().clone()
    dist.all_reduce(total)
    k, depth = decoder_chain(CFG, B * S, backward=True)
    assert_normwise_close(total / (B * S), ref["loss"], dtype=torch.float32, k=k, depth=2 * depth, what="loss")
    names = set()
    for n, p in model.named_parameters():
        n = n.replace("_checkpoint_wrapped_module.", "")
        names.add(n)
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert_normwise_close(g, ref["grads"][n], dtype=torch.float32, k=k, depth=2 * depth, what=f"grad {n}")
    assert names == set(ref["grads"]), sorted(names ^ set(ref["grads"]))


def dp2_ep2():
    check(ParallelDims(dp_shard=2, ep=2))


def cp2_ep2_ring_ac():
    check(ParallelDims(cp=2, ep=2), cp_method="ring", activation_checkpointing=True)


def cp2_ulysses():
    check(ParallelDims(cp=2), cp_method="ulysses")


def validation_errors():
    import pytest

    dims = ParallelDims(cp=2)
    mesh = dims.build_mesh("cpu")
    with pytest.raises(ValueError, match=r"cp_method='dsa_allgather'.*'ring' or 'ulysses'"):
        parallelize_model(build(), dims, mesh, cp_method="dsa_allgather")
    model = parallelize_model(build(), dims, mesh)
    with pytest.raises(ValueError, match=r"context-parallel forward needs positions"):
        model(batch()[0][:, :8])


if __name__ == "__main__":
    run_rank_worker([dp2_ep2, cp2_ep2_ring_ac, cp2_ulysses, validation_errors], started=_T0)
