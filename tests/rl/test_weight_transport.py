"""The Mooncake weight-transport wiring without vLLM or a Mooncake master: announcements, the trainer-side
publisher (store down -> filesystem, counted), and the orchestrator's announcement watcher against a fake
engine whose store "dies" mid-run. Every published version must end up loaded, skipped-because-newer or
failed-then-superseded, and the engine must serve the final version."""

import asyncio
import json
import random

import pytest
import torch
from _fake_engine import (
    FakeEngine,
    FlakyStore,
    StoreEngine,
    final_version_lost_trainer,
    publish_folder_version,
    run_with_trainer,
    store_publisher,
    store_source,
    trainer_report,
)

from moe_rl.envs import AdditionTask, AdditionTaskConfig, CharTokenizer
from moe_rl.rl.batch import batch_path, read_batch
from moe_rl.runtime.orchestrator import Orchestrator, OrchestratorConfig
from moe_rl.runtime.run_dir import RunPaths
from moe_rl.weights.announce import (
    AnnouncementError,
    AnnouncementWatcher,
    announce_path,
    is_announced,
    read_announcement,
    write_announcement,
)
from moe_rl.weights.filesystem import is_published
from moe_rl.weights.mooncake import MooncakeTransportConfig
from moe_rl.weights.publisher import make_weight_publisher


def test_announcement_round_trip_and_validation(tmp_path):
    assert not is_announced(tmp_path, 3) and read_announcement(tmp_path, 3) is None
    p = write_announcement(tmp_path, 3, "mooncake", filesystem_copy=False, shards="0of2,1of2", stats={"a": 1})
    assert p == announce_path(tmp_path, 3) == tmp_path / "announce" / "step_3.json"
    assert read_announcement(tmp_path, 3) == {"version": 3, "source": "mooncake", "filesystem_copy": False,
                                              "path": None, "layout": None, "shards": "0of2,1of2",
                                              "stats": {"a": 1}}
    assert not list((tmp_path / "announce").glob("*.tmp"))  # atomic: the tmp file was renamed
    # a version announced twice is refused (immutable), unless it is the republish-on-request replacement
    with pytest.raises(AnnouncementError, match="version 3 is already announced"):
        write_announcement(tmp_path, 3, "filesystem")
    write_announcement(tmp_path, 3, "filesystem", filesystem_copy=True, replace=True)
    assert read_announcement(tmp_path, 3)["source"] == "filesystem"
    # the watcher jumps to the newest of a run of versions, except for broadcast (every version in order)
    write_announcement(tmp_path, 4, "broadcast")
    assert AnnouncementWatcher(tmp_path).next_version(2) == 4
    assert AnnouncementWatcher(tmp_path, jump=False).next_version(2) == 3
    assert AnnouncementWatcher(tmp_path).next_version(4) is None
    announce_path(tmp_path, 5).write_text("{not json")
    with pytest.raises(AnnouncementError, match="is not JSON"):
        read_announcement(tmp_path, 5)
    with pytest.raises(ValueError, match="source='nfs'"):
        write_announcement(tmp_path, 4, "nfs")
    with pytest.raises(ValueError, match="version=-1"):
        write_announcement(tmp_path, -1, "filesystem")


def test_client_config_needs_the_launchers_ports():
    cfg = MooncakeTransportConfig()
    with pytest.raises(ValueError, match="trainer.mooncake.master.rpc_port=0"):
        cfg.client_config()
    cfg = MooncakeTransportConfig.model_validate({"master": {"rpc_port": 5000, "metadata_port": 5001},
                                                  "local_buffer_bytes": 2 << 20})
    c = cfg.client_config(global_segment_bytes=0)
    assert (c.master_address, c.metadata_url, c.global_segment_bytes, c.local_buffer_bytes) == (
        "127.0.0.1:5000", "http://127.0.0.1:5001/metadata", 0, 2 << 20)


def test_publisher_falls_back_counts_and_announces(tmp_path):
    store, pub = store_publisher(tmp_path, final_version=5)
    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    for v in (1, 2):
        assert pub.publish(sd, v).extra["source"] == "mooncake"
    store.die()
    for v in (3, 4, 5):
        assert pub.publish(sd, v).extra["source"] == "filesystem"
    anns = {v: read_announcement(tmp_path, v) for v in range(1, 6)}
    assert [anns[v]["source"] for v in range(1, 6)] == ["mooncake"] * 2 + ["filesystem"] * 3
    assert [anns[v]["filesystem_copy"] for v in range(1, 6)] == [False, False, True, True, True]
    # store versions have no folder; fallen-back ones have a complete folder (STABLE) before their announcement
    assert [is_published(tmp_path, v) for v in range(1, 6)] == [False, False, True, True, True]
    s = pub.stats()
    assert s["versions_by_source"] == {"mooncake": 2, "filesystem": 3}
    assert s["publish_fallbacks"] == 3
    mc, fs = s["transports"]["mooncake"], s["transports"]["filesystem"]
    # one real failure, then the store is skipped while it cools down (retry_after_s)
    assert (mc["published"], mc["failed"], mc["skipped"]) == (2, 1, 2)
    assert (fs["published"], fs["fallbacks"]) == (3, 3)
    assert "RPC_FAIL" in mc["last_error"]
    assert s["last"]["version"] == 5 and s["last"]["source"] == "filesystem"
    assert s["final_filesystem_copies"] == []  # the final version fell back: it is a folder already


def test_final_version_is_also_written_to_the_folder(tmp_path):
    _, pub = store_publisher(tmp_path, final_version=2)
    sd = {"w": torch.ones(4, dtype=torch.bfloat16)}
    pub.publish(sd, 1)
    pub.publish(sd, 2)
    assert not is_published(tmp_path, 1) and is_published(tmp_path, 2)
    assert read_announcement(tmp_path, 2)["source"] == "mooncake"
    assert read_announcement(tmp_path, 2)["filesystem_copy"] is True
    assert pub.stats()["final_filesystem_copies"] == [2] and pub.stats()["publish_fallbacks"] == 0


async def announcing_trainer(paths, pub, store, max_steps, kill_after, rng):
    """Publishes ``max_steps`` versions through ``pub`` (the real publisher class), killing the store right after
    publishing ``kill_after``: that version is then lost unless the engine loaded it in time."""
    for step in range(max_steps):
        while not batch_path(paths.batches, step).exists():
            pub.serve_requests()  # as rl_trainer does while it waits
            await asyncio.sleep(0.001)
        b = read_batch(batch_path(paths.batches, step))
        await asyncio.sleep(rng.random() * 0.004)
        pub.publish({"w": torch.full((2,), float(step + 1))}, step + 1)
        if step + 1 == kill_after:
            store.die()
        report = trainer_report(step, int(b.input_ids.numel()), weight_transport=pub.stats())
        paths.trainer_step(step).write_text(json.dumps(report))


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_watcher_loads_by_announcement_and_loses_nothing(tmp_path, seed):
    rng = random.Random(seed)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    store, pub = store_publisher(paths.weights, final_version=12)
    engine = StoreEngine(rng, 0.01, store)
    task = AdditionTask(AdditionTaskConfig(), CharTokenizer())
    cfg = OrchestratorConfig(batch_size=8, group_size=2, max_inflight=8, max_off_policy_steps=1, engine_probe=True,
                             keep_weight_versions=1, stall_timeout_s=60)
    src = store_source()
    orch = Orchestrator(cfg, task, engine, paths, max_steps=12, seed=seed, run_id="wt", store=src)

    trainer = announcing_trainer(paths, pub, store, 12, kill_after=5, rng=rng)
    s = run_with_trainer(orch, trainer, timeout_s=120)["weight_transport"]
    assert s["mode"] == "mooncake" and s["versions_published"] == 12
    loaded = {int(v): src for v, src in s["versions_loaded"].items()}
    failed = {int(v) for v in s["versions_failed"]}
    skipped = set(s["versions_skipped_newer"])
    # nothing lost: every version is accounted for exactly once, and the final one is served
    assert sorted([*loaded, *failed, *skipped]) == list(range(1, 13))
    assert s["versions_not_loaded_at_exit"] == []
    assert max(loaded) == 12 and orch.state.engine_version == 12
    # only store versions the engine had not loaded when the store died can be lost (5, or 4 when its load was in
    # flight): superseded (failed), skipped, or - when the trainer waits for a batch that needs it - republished
    # to the folder on the watcher's request and loaded from there
    republished = set(s["versions_republished"])
    assert all(v <= 5 for v in failed | republished) and not failed & republished
    # (the trainer may republish a version that a newer one then supersedes before the engine loads it)
    assert republished <= set(s["trainer_publish"]["republished"])
    # sources follow the announcements: store before the kill, folder after it
    assert all(src == "mooncake" for v, src in loaded.items() if v <= 5 and v not in republished)
    assert all(src == "filesystem" for v, src in loaded.items() if v > 5 or v in republished)
    assert engine.loads == sorted(loaded.items())
    assert s["versions_loaded_by_source"] == {k: list(loaded.values()).count(k) for k in set(loaded.values())}
    assert s["trainer_publish_fallbacks"] == 7 and s["engine_load_fallbacks"] == len(republished)
    assert s["trainer_publish"]["versions_by_source"] == {"mooncake": 5, "filesystem": 7}
    # engine events record the source of every load, the skipped and the failed versions
    events = [json.loads(x) for x in paths.engine_events.read_text().splitlines()][1:]
    assert [(e["version"], e["source"]) for e in events] == sorted(loaded.items())
    assert sorted(v for e in events for v in e["skipped_versions"]) == sorted(skipped)
    assert sorted(v for e in events for v in e["failed_versions"]) == sorted(failed)
    assert {e["version"] for e in events if e["republished"]} == republished
    assert all(e["served_version"] == e["version"] for e in events)
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert records[-1]["weight_publish_fallbacks"] == 7


def test_store_version_falls_back_to_the_folder_copy(tmp_path):
    """An announced store version the store cannot deliver is loaded from its folder copy and counted."""
    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    store, pub = store_publisher(paths.weights, final_version=2)
    engine = StoreEngine(rng, 0.005, store)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=60)
    src = store_source()
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=2,
                        store=src)

    s = run_with_trainer(orch, final_version_lost_trainer(paths, pub, store, orch))["weight_transport"]
    assert s["versions_loaded"] == {"1": "mooncake", "2": "filesystem"}
    assert s["engine_load_fallbacks"] == 1 and s["trainer_publish_fallbacks"] == 0
    last = [json.loads(x) for x in paths.engine_events.read_text().splitlines()][-1]
    assert last["announced_source"] == "mooncake" and last["source"] == "filesystem"
    assert "not in the store" in last["fallback_error"]


@pytest.mark.parametrize("args, pattern", [
    (["--trainer.weight-transport", "nfs"],
     r"trainer\.weight_transport = \"nfs\": Input should be 'filesystem', 'broadcast', 'mooncake' or 'p2p'"),
    (["--trainer.mooncake.keep-versions", "0"], r"trainer\.mooncake\.keep_versions = 0: .*greater than or equal to 1"),
    (["--trainer.mooncake.master.host", "localhost"], r"trainer\.mooncake\.master\.host = \"localhost\": .*IPv4"),
    (["--trainer.weight-transport", "mooncake", "--inference.served-model-name", "my policy"],
     r"inference\.served_model_name='my policy'.* may not contain '\|' or whitespace"),
])
def test_config_errors_name_the_field(tmp_path, args, pattern):
    from moe_rl.config import ConfigError, load_config
    from moe_rl.runtime.config import RLConfig

    with pytest.raises(ConfigError, match=pattern):
        load_config(RLConfig, ["@", "recipes/debug_cpu/rl.toml", "--output-dir", str(tmp_path / "run"), *args])


def test_default_is_the_filesystem_transport(tmp_path):
    from moe_rl.config import load_config
    from moe_rl.runtime.config import RLConfig

    cfg = load_config(RLConfig, ["@", "recipes/debug_cpu/rl.toml", "--output-dir", str(tmp_path / "run")])
    assert cfg.trainer.weight_transport == "filesystem"
    pub = make_weight_publisher(cfg, tmp_path / "w", {"model_type": "toy"})
    st = pub.publish({"w": torch.ones(2)}, 1)
    assert is_published(tmp_path / "w", 1) and st.transport == "filesystem" and st.bytes == 8
    ann = read_announcement(tmp_path / "w", 1)
    assert (ann["source"], ann["layout"], ann["stats"]["bytes"]) == ("filesystem", "sharded", 8)
    assert pub.serve_requests() is None
    assert pub.stats() == {"mode": "filesystem", "versions_by_source": {"filesystem": 1}, "publish_fallbacks": 0,
                           "final_filesystem_copies": [], "last": pub.stats()["last"]}


def test_a_failed_folder_load_is_retried_and_not_counted_as_a_fallback(tmp_path):
    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    store, pub = store_publisher(paths.weights, final_version=2)
    store.die()  # every version goes to the folder

    class OnceBroken(StoreEngine):
        failures = 0

        async def update_weights(self, path, version):
            if self.failures == 0:
                self.failures += 1
                raise RuntimeError("engine busy")
            return await super().update_weights(path, version)

    engine = OnceBroken(rng, 0.005, store)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=60)
    src = store_source()
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=2,
                        store=src)

    s = run_with_trainer(orch, announcing_trainer(paths, pub, store, 2, kill_after=-1, rng=rng))["weight_transport"]
    assert engine.failures == 1
    assert s["versions_not_loaded_at_exit"] == [] and s["versions_republished"] == []
    assert s["engine_load_fallbacks"] == 0 and s["trainer_publish_fallbacks"] == 2
    assert set(s["versions_loaded"].values()) == {"filesystem"}
    # the first attempt's version was either retried and loaded, or superseded by version 2 (then failed)
    assert sorted([*map(int, s["versions_loaded"]), *map(int, s["versions_failed"]),
                   *s["versions_skipped_newer"]]) == [1, 2]


class ShardedEngine(FakeEngine):
    """``FakeEngine`` plus ``load_sharded`` that really reads the folder (``read_sharded``: sizes, CRC-32s,
    assembly); its first load dies mid-read (an engine that died while loading) and the next ones go through."""

    def __init__(self, rng):
        super().__init__(rng, 0.002)
        self.attempts = 0
        self.loaded: dict = {}

    async def load_sharded(self, path, version):
        from moe_rl.weights.filesystem import read_sharded

        self.attempts += 1
        if self.attempts == 1:
            raise ConnectionError("engine process died while loading (connection reset)")
        self.loaded = dict(read_sharded(path))
        self.version = version
        return {"version": version, "read_s": 0.001, "reload_s": 0.002, "bytes": 8}


def test_sharded_folder_fault_is_a_counted_retry_and_metrics_have_the_update(tmp_path):
    """A sharded version whose first load fails (the engine died mid-load) is loaded on a counted retry; a truncated
    shard of a later version is refused (never loaded) until a newer version supersedes it; metrics.jsonl records
    the trainer's blocking seconds and bytes and the engine's pause and load seconds."""
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, version_dir

    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    engine = ShardedEngine(rng)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=60)
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=3)
    pub = ShardedFilesystemPublisher(paths.weights, {"model_type": "toy"})

    async def trainer():
        for step in range(3):
            while not batch_path(paths.batches, step).exists():
                await asyncio.sleep(0.001)
            st = pub.publish({"w": torch.full((2,), float(step + 1))}, step + 1)
            if step == 1:  # truncate version 2's shard before the engine reads it
                f = next(version_dir(paths.weights, 2).glob("rank_*.safetensors"))
                f.write_bytes(f.read_bytes()[:-4])
            write_announcement(paths.weights, step + 1, "filesystem", filesystem_copy=True,
                               path=st.extra["path"], layout="sharded", stats=st.as_dict())
            if step != 1:
                while orch.state.engine_version < step + 1:  # wait for the engine, so every case is exercised
                    await asyncio.sleep(0.001)
            upd = {"version": step + 1, "transport": "filesystem", "blocking_s": st.blocking_s, "bytes": st.bytes}
            paths.trainer_step(step).write_text(json.dumps(trainer_report(step, 1, weight_update=upd)))

    s = run_with_trainer(orch, trainer(), timeout_s=60)["weight_transport"]
    assert engine.attempts >= 3 and s["engine_load_retries"] >= 1
    assert s["versions_loaded"]["1"] == "filesystem" and s["versions_loaded"]["3"] == "filesystem"
    assert "2" not in s["versions_loaded"] and "truncated" in s["versions_failed"]["2"]
    assert torch.equal(engine.loaded["w"], torch.full((2,), 3.0))  # the newest version, whole
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    for r in records:
        assert r["weight_transport"] == "filesystem" and r["weight_bytes"] == 8
        assert r["weight_trainer_blocking_s"] > 0
    assert records[0]["weight_engine_version"] == 1 and records[0]["weight_load_retries"] == 1
    assert records[-1]["weight_engine_pause_s"] > 0 and records[-1]["weight_engine_load_s"] == pytest.approx(0.003)


def test_sharded_store_mode_falls_back_to_the_sharded_folder_and_counts(tmp_path):
    """The per-rank store path (``shard="<rank>of<world>"``, what every trainer rank runs with a model): pieces go
    to the store, a dead store sends the version to the sharded folder (counted like the single-rank chain), the
    final version also gets a folder copy, and the announcements name the shards or the folder."""
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, is_sharded, read_sharded, version_dir
    from moe_rl.weights.publisher import RunWeightPublisher

    class Store(FlakyStore):
        removed: list = []

        def _remove_unfinished(self, version):
            self.removed.append(version)

    store = Store()
    sharded = ShardedFilesystemPublisher(tmp_path, {"model_type": "toy"})
    pub = RunWeightPublisher("mooncake", tmp_path, sharded=sharded, store=store, final_version=3, retry_after_s=0.0)
    sd = {"w": torch.arange(4.0)}
    assert pub.publish(sd, 1).extra["source"] == "mooncake"
    assert set(store.data[1]) == {"w@0@4"}  # a piece key: the engine assembles the shards
    ann = read_announcement(tmp_path, 1)
    assert (ann["source"], ann["shards"], ann["filesystem_copy"]) == ("mooncake", "0of1", False)
    store.die()
    st = pub.publish(sd, 2)
    assert st.extra["source"] == "filesystem" and "RPC_FAIL" in st.extra["attempts"][0]["error"]
    assert store.removed == [2] and is_sharded(version_dir(tmp_path, 2))
    assert read_announcement(tmp_path, 2)["layout"] == "sharded"
    assert torch.equal(dict(read_sharded(version_dir(tmp_path, 2)))["w"], sd["w"])
    store.alive = True
    assert pub.publish(sd, 3).extra["source"] == "mooncake"  # retry_after_s=0: the store is tried again
    assert read_announcement(tmp_path, 3)["filesystem_copy"] and is_sharded(version_dir(tmp_path, 3))
    s = pub.stats()
    assert s["versions_by_source"] == {"mooncake": 2, "filesystem": 1} and s["publish_fallbacks"] == 1
    mc, fs = s["transports"]["mooncake"], s["transports"]["filesystem"]
    assert (mc["published"], mc["failed"], mc["skipped"], fs["published"], fs["fallbacks"]) == (2, 1, 0, 1, 1)
    assert s["final_filesystem_copies"] == [3]


class BroadcastEngine(FakeEngine):
    """``FakeEngine`` whose weight RPCs are real receivers: ``init_sharded_broadcast`` joins the trainer's groups
    (``BroadcastReceiver``), ``update_weights_from_broadcast`` receives every group's update and assembles it."""

    def __init__(self, rng):
        super().__init__(rng, 0.002)
        self.rxs: list = []
        self.loaded: dict = {}
        self.received: list[int] = []

    async def init_sharded_broadcast(self, endpoints, rank_offset, world_size, backend, timeout_s):
        from moe_rl.weights.broadcast import BroadcastReceiver

        def join():
            return [BroadcastReceiver(h, p, rank_offset, world_size, backend=backend, timeout_s=timeout_s)
                    for h, p in endpoints]

        self.rxs = await asyncio.to_thread(join)
        return [{"groups": len(self.rxs)}]

    async def update_weights_from_broadcast(self, version):
        from moe_rl.weights.regions import assemble

        def receive():
            items = []
            for rx in self.rxs:
                v, d = rx.receive_all()
                assert v == version
                items += list(d.items())
            return dict(assemble(items))

        self.loaded = await asyncio.to_thread(receive)
        self.version = version
        self.received.append(version)
        return {"version": version, "recv_s": 0.001, "reload_s": 0.001, "bytes": 8}


def test_broadcast_mode_connects_then_receives_every_version_in_order(tmp_path):
    """``weight_transport="broadcast"``: the watcher waits for the trainer's group file, makes the engine join, then
    takes every announced version in order (no jumping: each is sent once); the final version also lands in the
    folder."""
    from moe_rl.weights.broadcast import BroadcastTransportConfig, ShardedBroadcastPublisher
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, is_sharded, version_dir
    from moe_rl.weights.publisher import RunWeightPublisher

    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    engine = BroadcastEngine(rng)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=60)
    steps = 4
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=steps,
                        weight_transport="broadcast")

    async def trainer():
        bc = await asyncio.to_thread(ShardedBroadcastPublisher, paths.weights,
                                     BroadcastTransportConfig(timeout_s=30, bucket_bytes=8))
        pub = RunWeightPublisher("broadcast", paths.weights, broadcast=bc, final_version=steps,
                                 sharded=ShardedFilesystemPublisher(paths.weights, {"model_type": "toy"}))
        for step in range(steps):
            while not batch_path(paths.batches, step).exists():
                await asyncio.sleep(0.001)
            st = await asyncio.to_thread(pub.publish, {"w": torch.full((2,), float(step + 1))}, step + 1)
            upd = {"version": step + 1, "transport": "broadcast", "blocking_s": st.blocking_s, "bytes": st.bytes}
            paths.trainer_step(step).write_text(json.dumps(trainer_report(step, 1, weight_update=upd)))
        pub.close()

    s = run_with_trainer(orch, trainer(), timeout_s=60)["weight_transport"]
    assert engine.received == [1, 2, 3, 4] and s["mode"] == "broadcast"
    assert set(s["versions_loaded"].values()) == {"broadcast"} and s["versions_skipped_newer"] == []
    assert torch.equal(engine.loaded["w"], torch.full((2,), 4.0))
    assert is_sharded(version_dir(paths.weights, steps)) and not version_dir(paths.weights, 1).exists()
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert all(r["weight_transport"] == "broadcast" and r["weight_bytes"] == 8 for r in records)


class P2PEngine(FakeEngine):
    """``FakeEngine`` whose weight RPCs are a real puller: ``init_p2p`` joins the trainer ranks' groups
    (``PiecePuller``), ``update_weights_from_p2p`` pulls, checks and assembles the version; the first pull of version
    2 meets a CRC-32 mismatch on the wire (the server's ``corrupt_once`` hook), re-pulled and counted."""

    def __init__(self, rng, server_of):
        super().__init__(rng, 0.002)
        self.puller = None
        self.loaded: dict = {}
        self.pulled: list[int] = []
        self.retries = 0
        self.server_of = server_of

    async def init_p2p(self, endpoints, rank_offset, world_size, timeout_s):
        from moe_rl.weights.p2p import PiecePuller

        self.puller = await asyncio.to_thread(PiecePuller, endpoints, rank_offset, world_size, timeout_s=timeout_s)
        return [{"groups": len(self.puller.groups)}]

    async def update_weights_from_p2p(self, index, version):
        if version == 2:
            self.server_of().fault = "corrupt_once"
        weights, rep = await asyncio.to_thread(self.puller.pull, index, version)
        self.loaded = dict(weights)
        self.version = version
        self.pulled.append(version)
        self.retries += rep["retries"]
        return {"version": version, "pull_s": rep["pull_s"], "reload_s": 0.001, "bytes": rep["bytes"]}


def test_p2p_mode_joins_then_pulls_announced_versions(tmp_path):
    """``weight_transport="p2p"``: the watcher waits for the trainer's p2p group file, makes the engine join (the
    trainer never waits for it), then pulls announced versions (``source: "p2p"``, the piece index beside the
    announcement); a CRC-32 mismatch on the wire is re-pulled and counted; the trainer's blocking time is its
    snapshot; the final version also lands in the folder."""
    from moe_rl.weights.filesystem import ShardedFilesystemPublisher, is_sharded, version_dir
    from moe_rl.weights.p2p import P2PPublisher, P2PTransportConfig, index_path
    from moe_rl.weights.publisher import RunWeightPublisher

    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    box: dict = {}
    engine = P2PEngine(rng, lambda: box["p2p"].server)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=60)
    steps = 4
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=steps,
                        weight_transport="p2p")

    async def trainer():
        pp = box["p2p"] = P2PPublisher(paths.weights, P2PTransportConfig(timeout_s=30, bucket_bytes=8))
        pub = RunWeightPublisher("p2p", paths.weights, p2p=pp, final_version=steps,
                                 sharded=ShardedFilesystemPublisher(paths.weights, {"model_type": "toy"}))
        for step in range(steps):
            while not batch_path(paths.batches, step).exists():
                await asyncio.sleep(0.001)
            st = pub.publish({"w": torch.full((2,), float(step + 1))}, step + 1)
            assert st.extra["source"] == "p2p" and index_path(paths.weights, step + 1).exists()
            ann = read_announcement(paths.weights, step + 1)
            assert ann["source"] == "p2p" and ann["stats"]["bytes"] == 8
            upd = {"version": step + 1, "transport": "p2p", "blocking_s": st.blocking_s, "bytes": st.bytes}
            paths.trainer_step(step).write_text(json.dumps(trainer_report(step, 1, weight_update=upd)))
            if step < steps - 1:
                while orch.state.engine_version < step + 1:  # the engine pulls while the "trainer" waits for data
                    await asyncio.sleep(0.001)
        while orch.state.engine_version < steps:  # the trainer rank serves until the engine pulled the last one
            await asyncio.sleep(0.001)
        pub.close()

    s = run_with_trainer(orch, trainer(), timeout_s=60)["weight_transport"]
    assert engine.pulled == [1, 2, 3, 4] and engine.retries == 1
    assert set(s["versions_loaded"].values()) == {"p2p"}
    assert torch.equal(engine.loaded["w"], torch.full((2,), 4.0))
    assert is_sharded(version_dir(paths.weights, steps))
    records = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert all(r["weight_transport"] == "p2p" and r["weight_bytes"] == 8 for r in records)
    assert all(r["weight_trainer_blocking_s"] > 0 for r in records)


def test_final_store_version_with_folder_copy_is_retried_after_a_failed_load(tmp_path):
    """The final version is announced as a store version with a folder copy (``filesystem_copy``). If the store
    lost it and the engine's first folder load failed transiently, the watcher must retry the folder copy (as it
    retries a failed ``filesystem`` version), not wait for a ``filesystem`` re-announcement that never comes (the
    trainer holds no copy to republish and has usually exited): the run would end in the stall timeout."""
    rng = random.Random(0)
    paths = RunPaths(tmp_path)
    publish_folder_version(paths, 0)
    store, pub = store_publisher(paths.weights, final_version=2)

    class FolderOnceBroken(StoreEngine):
        folder_failures = 0

        async def update_weights(self, path, version):
            if version == 2 and self.folder_failures == 0:
                self.folder_failures += 1
                raise RuntimeError("engine busy (folder reload timed out)")
            return await super().update_weights(path, version)

    engine = FolderOnceBroken(rng, 0.002, store)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_inflight=4, engine_probe=False, stall_timeout_s=8)
    orch = Orchestrator(cfg, AdditionTask(AdditionTaskConfig(), CharTokenizer()), engine, paths, max_steps=2,
                        store=store_source())

    s = run_with_trainer(orch, final_version_lost_trainer(paths, pub, store, orch))["weight_transport"]
    assert engine.folder_failures == 1
    assert s["versions_loaded"] == {"1": "mooncake", "2": "filesystem"}
    assert s["versions_failed"] == {} and s["versions_not_loaded_at_exit"] == []
    # one load fell back from the store to the folder (the successful retry); not a trainer republish
    assert s["engine_load_fallbacks"] == 1 and s["versions_republished"] == []
    assert engine.loads[-1] == (2, "filesystem")
