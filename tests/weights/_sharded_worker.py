"""4-rank worker for ``test_sharded.py``: sharded publish (filesystem folder, broadcast groups) from a parallelized
model, no gather, checked against the unsharded model's checkpoint tensors.

Scenarios (the default group is the 4 trainer ranks):

- ``fs_fsdp4``: ``ParallelDims(dp_shard=4)``; every rank writes only its pieces, rank 0 reads the folder back with
  ``read_sharded`` and compares every tensor, bit for bit, with ``to_hf_state_dict`` of the unsharded model cast
  like the publisher (the same values, the same casts: bit-equality is the right bar).
- ``fs_hsdp_ep_tied``: ``ParallelDims(dp_replicate=2, dp_shard=2, ep=2)``, tied embeddings: replicas publish once.
- ``broadcast_fsdp4``: ``ShardedBroadcastPublisher`` on every rank; rank 0 also runs the "engine" in threads (one
  ``BroadcastReceiver`` per trainer rank's group, endpoints from the group file), which receives and assembles.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _rank_worker import RankArgs, run_rank_worker  # noqa: E402

from moe_rl.distributed.parallel_dims import ParallelDims  # noqa: E402
from moe_rl.distributed.parallelize import parallelize_model  # noqa: E402
from moe_rl.models.glm4_moe import to_hf_state_dict  # noqa: E402
from moe_rl.models.glm4_moe.config import GlmMoeConfig  # noqa: E402
from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM  # noqa: E402
from moe_rl.models.hf_io import keeps_fp32  # noqa: E402

ARGS = RankArgs.parse(sys.argv)
OUT: dict = {}


def config(tied: bool) -> GlmMoeConfig:
    return GlmMoeConfig.tiny_debug(vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                   head_dim=8, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
                                   num_experts_per_tok=2, tie_word_embeddings=tied)


def build(dims: ParallelDims, tied: bool, seed: int):
    cfg = config(tied)
    torch.manual_seed(seed)
    ref_model = GlmMoeForCausalLM(cfg)
    ref = {k: v.detach().to(torch.float32 if keeps_fp32(k) else torch.bfloat16)
           for k, v in to_hf_state_dict(ref_model.state_dict(), cfg).items()}
    torch.manual_seed(seed)
    model = parallelize_model(GlmMoeForCausalLM(cfg), dims, dims.build_mesh("cpu"))
    return cfg, model, ref


def same(got: list[tuple[str, torch.Tensor]], ref: dict[str, torch.Tensor]) -> None:
    got = dict(got)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))[:5]
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def _fs(dims: ParallelDims, tied: bool, version: int) -> None:
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, read_sharded, version_dir

    cfg, model, ref = build(dims, tied, seed=version)
    root = ARGS.out_dir / "weights"
    pub = ShardedFilesystemPublisher(root, {"model_type": "toy"}, mcfg=cfg, dtype=torch.bfloat16)
    st = pub.publish(model, version)
    nbytes = [None] * ARGS.world
    dist.all_gather_object(nbytes, st.bytes)
    total = sum(v.numel() * v.element_size() for v in ref.values())
    assert sum(nbytes) == total, (nbytes, total)  # each element written exactly once, by one rank
    assert max(nbytes) < total, nbytes  # nobody wrote the whole model
    dist.barrier()
    if ARGS.rank == 0:
        assert st.bytes_total > total  # safetensors headers on top of the raw bytes
        same(read_sharded(version_dir(root, version)), ref)
        # an engine reads only what it serves
        one = sorted(ref)[:3]
        same(read_sharded(version_dir(root, version), set(one)), {k: ref[k] for k in one})
    OUT.setdefault("bytes_per_rank", {})[f"v{version}"] = nbytes


def fs_fsdp4() -> None:
    _fs(ParallelDims(dp_shard=4), tied=False, version=1)


def fs_hsdp_ep_tied() -> None:
    _fs(ParallelDims(dp_replicate=2, dp_shard=2, ep=2), tied=True, version=2)


def broadcast_fsdp4() -> None:
    from moe_rl.weights.broadcast import (
        BroadcastReceiver,
        BroadcastTransportConfig,
        ShardedBroadcastPublisher,
        read_group_file,
    )
    from moe_rl.weights.regions import assemble

    cfg, model, ref = build(ParallelDims(dp_shard=4), tied=False, seed=3)
    root = ARGS.out_dir / "bcast"
    got: dict = {}

    def engine() -> None:  # what WeightSyncExtension.init_sharded_broadcast + update_weights_from_broadcast do
        try:
            while (g := read_group_file(root)) is None:
                time.sleep(0.01)
            rxs = [BroadcastReceiver(h, p, 1, g["world_size"], timeout_s=60) for h, p in g["endpoints"]]
            items: list = []
            lock = threading.Lock()

            def one(rx):
                version, d = rx.receive_all()
                with lock:
                    items.extend(d.items())
                    got.setdefault("versions", []).append(version)

            ts = [threading.Thread(target=one, args=(rx,)) for rx in rxs]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            got["weights"] = assemble(items)
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario
            got["error"] = exc

    th = None
    if ARGS.rank == 0:
        th = threading.Thread(target=engine)
        th.start()
    pub = ShardedBroadcastPublisher(root, BroadcastTransportConfig(timeout_s=60, bucket_bytes=4096), mcfg=cfg,
                                    dtype=torch.bfloat16)
    st = pub.publish(model, 7)
    assert st.bytes > 0 and st.extra["buckets"] >= 1
    pub.close()
    if th is not None:
        th.join(60)
        assert "error" not in got, got.get("error")
        assert got["versions"] == [7] * ARGS.world
        same(got["weights"], ref)


run_rank_worker([fs_fsdp4, fs_hsdp_ep_tied, broadcast_fsdp4], started=STARTED, extras=OUT, barrier_after_each=True)
