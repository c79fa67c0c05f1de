"""Every weight transport of ``moe_rl.weights`` against one real vLLM CPU engine (in-process, the tiny MoE).

For each transport (sharded folder, sharded broadcast over two gloo groups, Mooncake Store with one shard per
"trainer rank", p2p pulls from two "trainer ranks" over gloo point-to-point), the version is cut into the pieces two trainer ranks would own (each tensor split along dim 0) and
published that way; after the update the engine's greedy tokens and log-probs must be bit-identical to a path
reload of the same checkpoint (``reload_and_repack``, which ``test_vllm_reload.py`` shows equals a fresh load):
both paths hand vLLM's loader the same tensors, so the same arithmetic runs in the same order. Each update also
changes the outputs (the comparison would be vacuous otherwise).

Faults, each with the engine left on its previous version, whole (assemble, then swap): a truncated shard, a shard
whose bytes changed (CRC-32), a broadcast whose sender stops after the first bucket (timeout), a piece missing from
a store shard set, a p2p piece whose held copy is corrupt (CRC-32 after the re-pulls). One engine serves every test of the module (in file order).
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 4, 5, 13, 6, 15], [1] + list(range(3, 16)) * 3]
MAX_TOKENS = 10
MiB = 1 << 20
_STATE: dict = {"version": 0}


@pytest.fixture(scope="module")
def llm(tiny_moe_dirs, vllm_engine):
    with vllm_engine(tiny_moe_dirs["v1"]) as engine:
        yield engine


@pytest.fixture(scope="module")
def weights(tiny_moe_dirs):
    from safetensors.torch import load_file

    return {name: load_file(str(tiny_moe_dirs[name] / "model.safetensors")) for name in ("v2", "v3")}


def two_rank_pieces(sd: dict[str, torch.Tensor]):
    """The pieces two FSDP ranks would publish: every tensor split in two along dim 0 (0-d tensors: rank 0)."""
    from moe_rl.weights.regions import Piece

    ranks: list[list] = [[], []]
    for name, t in sd.items():
        shape = tuple(t.shape)
        if t.dim() == 0 or shape[0] < 2:
            ranks[0].append(Piece(name, shape, (0,) * t.dim(), t.contiguous()))
            continue
        half = shape[0] // 2
        ranks[0].append(Piece(name, shape, (0,) * t.dim(), t[:half].contiguous()))
        ranks[1].append(Piece(name, shape, (half,) + (0,) * (t.dim() - 1), t[half:].contiguous()))
    return ranks


def next_version() -> int:
    _STATE["version"] += 1
    return _STATE["version"]


def check_matches_path_reload(llm, greedy, path, got, before) -> None:
    v = next_version()
    llm.collective_rpc("reload_and_repack", args=(str(path), v))
    ref = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"path-{v}")
    assert got != before, "the update did not change the outputs: the comparison would mean nothing"
    assert got == ref, "tokens or log-probs differ from a path reload of the same checkpoint"


def test_filesystem_sharded(llm, greedy, weights, tiny_moe_dirs, tmp_path_factory):
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, version_dir

    root = tmp_path_factory.mktemp("fs")
    before = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt="base")
    v = next_version()
    pub = ShardedFilesystemPublisher(root, {"model_type": "glm4_moe"}, config=None)
    pieces = [p for rank in two_rank_pieces(weights["v2"]) for p in rank]
    st = pub.publish(pieces, v)
    (res,) = llm.collective_rpc("load_sharded", args=(str(version_dir(root, v)), v))
    assert res["source"] == "filesystem" and res["version"] == v and res["tensors"] == len(weights["v2"])
    assert res["bytes"] == st.bytes == sum(t.numel() * t.element_size() for t in weights["v2"].values())
    assert res["moe_layers_repacked"] == res["moe_layers_total"] == 1
    got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"fs-{v}")
    check_matches_path_reload(llm, greedy, tiny_moe_dirs["v2"], got, before)
    _STATE["v2_out"] = got
    _STATE["fs_root"] = root


def test_broadcast_two_sender_groups(llm, greedy, weights, tiny_moe_dirs):
    from moe_rl.weights.broadcast import WeightBroadcaster

    senders = [WeightBroadcaster("127.0.0.1", 0, world_size=2, timeout_s=30, bucket_bytes=64 * 1024) for _ in range(2)]
    endpoints = [["127.0.0.1", s.port] for s in senders]
    joined = [threading.Thread(target=s.connect) for s in senders]
    for t in joined:
        t.start()
    (info,) = llm.collective_rpc("init_sharded_broadcast", args=(endpoints, 1, 2, "gloo", 30.0))
    for t in joined:
        t.join()
    assert info["groups"] == 2 and info["rank"] == 1
    v = next_version()
    ranks = two_rank_pieces(weights["v3"])
    sends = [threading.Thread(target=s.send, args=({p.key: p.tensor for p in pieces}, v))
             for s, pieces in zip(senders, ranks, strict=True)]
    for t in sends:
        t.start()
    (res,) = llm.collective_rpc("update_weights_from_broadcast", args=(v,))
    for t in sends:
        t.join()
    assert res["source"] == "broadcast" and res["groups"] == 2 and res["tensors"] == len(weights["v3"])
    assert res["bytes"] == sum(s.stats["bytes"] for s in senders) and res["buckets"] > 2
    got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"bc-{v}")
    check_matches_path_reload(llm, greedy, tiny_moe_dirs["v3"], got, _STATE["v2_out"])
    _STATE["v3_out"] = got
    _STATE["senders"] = senders


def test_mooncake_sharded_puts(llm, greedy, weights, tiny_moe_dirs, start_mooncake_master):
    from moe_rl.inference.mooncake import StoreClient
    from moe_rl.weights.mooncake import MooncakeWeightTransport

    master = start_mooncake_master()
    try:
        owner = StoreClient(master.client_config(global_segment_bytes=64 * MiB, local_buffer_bytes=16 * MiB))
        v = next_version()
        for r, pieces in enumerate(two_rank_pieces(weights["v2"])):
            MooncakeWeightTransport(owner, "tiny-glm", shard=f"{r}of2").publish({p.key: p.tensor for p in pieces}, v)
        store_cfg = master.client_config(local_buffer_bytes=16 * MiB).model_dump()
        (res,) = llm.collective_rpc("update_weights_from_mooncake", args=(store_cfg, "tiny-glm", v, "0of2,1of2"))
        assert res["source"] == "mooncake" and res["version"] == v
        got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"mc-{v}")
        check_matches_path_reload(llm, greedy, tiny_moe_dirs["v2"], got, _STATE["v3_out"])
        # a shard set with a missing shard: the store has 0of2 and 1of2 but not 2of3 -> nothing applied
        held = llm.collective_rpc("weight_version")[0]
        with pytest.raises(Exception, match="not in the Mooncake store"):
            llm.collective_rpc("update_weights_from_mooncake", args=(store_cfg, "tiny-glm", v, "0of2,1of2,2of3"))
        assert llm.collective_rpc("weight_version") == [held]
        owner.close()
    finally:
        master.stop()


def test_faults_leave_the_previous_version_whole(llm, greedy, weights, tiny_moe_dirs):
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, version_dir

    held = llm.collective_rpc("weight_version")[0]
    before = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"held-{held}")
    root = _STATE["fs_root"]
    pub = ShardedFilesystemPublisher(root, {"model_type": "glm4_moe"})
    pieces = [p for rank in two_rank_pieces(weights["v3"]) for p in rank]

    # 1. a truncated shard
    v = held + 1
    pub.publish(pieces, v)
    shard = sorted(version_dir(root, v).glob("rank_*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(Exception, match="truncated or was rewritten"):
        llm.collective_rpc("load_sharded", args=(str(version_dir(root, v)), v))
    # 2. the same size, other bytes: the CRC-32 of a piece differs
    bad = bytearray(data)
    bad[-8:] = bytes(8) if data[-8:] != bytes(8) else b"\xff" * 8
    shard.write_bytes(bytes(bad))
    with pytest.raises(Exception, match="CRC-32"):
        llm.collective_rpc("load_sharded", args=(str(version_dir(root, v)), v))
    assert llm.collective_rpc("weight_version") == [held]
    assert greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"held-{held}-b") == before

    # 3. a broadcast whose sender stops after the first bucket: the worker times out, nothing was applied
    from moe_rl.weights.broadcast import WeightBroadcaster, plan_buckets

    senders = _STATE["senders"]
    items = {p.key: p.tensor for p in pieces}

    def partial_send(s: WeightBroadcaster) -> None:
        plan = plan_buckets(list(items.items()), v, s.bucket_bytes)
        g = s._group
        raw = plan.to_bytes()
        g.broadcast(torch.tensor([len(raw)], dtype=torch.int64), "header length")
        g.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), "header")
        buf = torch.zeros(plan.bucket_nbytes[0], dtype=torch.uint8)
        g.broadcast(buf, "bucket 1")  # then silence: the trainer "died"

    ts = [threading.Thread(target=partial_send, args=(s,)) for s in senders]
    for t in ts:
        t.start()
    with pytest.raises(Exception, match="weights unchanged"):
        llm.collective_rpc("update_weights_from_broadcast", args=(v,))
    for t in ts:
        t.join(60)
    assert llm.collective_rpc("weight_version") == [held]
    assert greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"held-{held}-c") == before

    # a good version after the faults loads (the version counter goes on)
    v2 = v + 1
    pub.publish(pieces, v2)
    (res,) = llm.collective_rpc("load_sharded", args=(str(version_dir(root, v2)), v2))
    assert res["version"] == v2 and llm.collective_rpc("weight_version") == [v2]


@pytest.mark.parametrize("backend", ["gloo", "nixl"])
def test_p2p_pull_from_two_trainer_ranks(llm, greedy, weights, tiny_moe_dirs, tmp_path_factory, backend):
    """``p2p``: two "trainer ranks" (``PieceServer`` threads here; gloo point-to-point, or NIXL READs of their
    registered slots) hold their pieces; the worker connects to both (``init_p2p``, which picks the trainer's backend),
    pulls what it needs, checks the CRC-32s, assembles, then swaps. A corrupt held piece is refused after the
    re-pulls and the engine keeps serving its version, whole."""
    from moe_rl.weights.p2p import PieceServer, write_index

    if backend == "nixl":
        import importlib.util
        import os

        if importlib.util.find_spec("nixl") is None:
            if os.environ.get("MOE_RL_REQUIRE_NIXL") == "1":
                pytest.fail("MOE_RL_REQUIRE_NIXL=1 but nixl is not importable (pip install 'moe_rl[nixl]')")
            pytest.skip("nixl is not importable (pip install 'moe_rl[nixl]')")
        from moe_rl.weights.p2p_nixl import NixlPieceServer as PieceServer  # noqa: F811

    root = tmp_path_factory.mktemp(f"p2p_{backend}")
    # the gloo case leaves v2 served: the NIXL case loads v3 (the update must change the outputs), then tries v2
    new, other = ("v2", "v3") if backend == "gloo" else ("v3", "v2")
    held = llm.collective_rpc("weight_version")[0]
    before = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"p2p-held-{held}")
    servers = [PieceServer("127.0.0.1", 2, timeout_s=60, bucket_bytes=64 * 1024, rank=r) for r in range(2)]
    (info,) = llm.collective_rpc("init_p2p", args=([["127.0.0.1", s.port] for s in servers], 1, 2, 60.0))
    assert info["groups"] == 2 and info["rank"] == 1
    _STATE["version"] = max(_STATE["version"], held)  # the faults test loaded versions past the counter
    v = next_version()
    metas = [s.hold(v, pieces) for s, pieces in zip(servers, two_rank_pieces(weights[new]), strict=True)]
    index = write_index(root, v, metas)
    (res,) = llm.collective_rpc("update_weights_from_p2p", args=(str(index), v))
    assert res["source"] == "p2p" and res["version"] == v and res["tensors"] == len(weights[new])
    assert res["bytes"] == sum(t.numel() * t.element_size() for t in weights[new].values()) and res["retries"] == 0
    assert res["moe_layers_repacked"] == res["moe_layers_total"] == 1
    got = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"p2p-{v}")
    check_matches_path_reload(llm, greedy, tiny_moe_dirs[new], got, before)

    # a corrupt held piece on trainer rank 1: CRC-32 mismatch on every re-pull, nothing loaded
    served = llm.collective_rpc("weight_version")[0]
    ref = greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"p2p-served-{served}")
    v2 = next_version()
    metas = [s.hold(v2, pieces) for s, pieces in zip(servers, two_rank_pieces(weights[other]), strict=True)]
    index = write_index(root, v2, metas)
    t = next(iter(servers[1]._held[v2].values()))
    t.reshape(-1).view(torch.uint8)[0] ^= 0xFF
    with pytest.raises(Exception, match="CRC-32"):
        llm.collective_rpc("update_weights_from_p2p", args=(str(index), v2))
    assert llm.collective_rpc("weight_version") == [served]
    assert greedy(llm, PROMPTS, MAX_TOKENS, cache_salt=f"p2p-served-{served}-b") == ref
    for s in servers:
        s.close()
