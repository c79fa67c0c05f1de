"""Delta encoding through the filesystem transport (moe_rl.weights.delta_sync + filesystem + the engine's load).

The trainer side is ``ShardedFilesystemPublisher(delta=DeltaConfig(enabled=True))``; the engine side is the real
``WeightSyncExtension.load_sharded`` on a stand-in worker whose "model" is a dict (``_apply_weights`` overridden):
everything between the folder and vLLM's ``load_weights`` runs as in the engine. Every comparison is bit-equality on
integer views (the codec copies bit patterns, it does no arithmetic on values).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _weight_versions import changed_version

from moe_rl.weights.delta import DeltaBaseError, DeltaError, bit_view
from moe_rl.weights.delta_sync import (
    DELTA_REQUEST,
    DeltaConfig,
    EngineDeltaState,
    RankDeltaEncoder,
    load_unit,
)
from moe_rl.weights.engine import WeightSyncExtension
from moe_rl.weights.filesystem import ShardedFilesystemPublisher, read_sharded, version_dir
from moe_rl.weights.regions import Piece

NAMES = {  # name -> (shape, dtype): a tiny decoder layer's tensors plus top-level ones
    "model.embed_tokens.weight": ((512, 64), torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": ((64, 64), torch.bfloat16),
    "model.layers.0.self_attn.k_proj.weight": ((32, 64), torch.bfloat16),
    "model.layers.0.mlp.experts.0.gate_proj.weight": ((48, 64), torch.bfloat16),
    "model.layers.0.mlp.experts.1.gate_proj.weight": ((48, 64), torch.bfloat16),
    "model.layers.0.mlp.gate.e_score_correction_bias": ((4,), torch.float32),
    "model.layers.0.input_layernorm.weight": ((64,), torch.float32),
    "model.norm.weight": ((64,), torch.float32),
    "lm_head.weight": ((512, 64), torch.bfloat16),
}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bit_view(a), bit_view(b))


def _initial(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=gen).to(dt) for n, (s, dt) in NAMES.items()}


def _step(sd: dict[str, torch.Tensor], gen: torch.Generator, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """A new version: about ``frac`` of the elements of a random half of the tensors get new bits (special values
    included: NaN, -0.0, inf), the others keep theirs."""

    def new_values(flat: torch.Tensor, k: int) -> torch.Tensor:
        v = torch.randn(k, generator=gen).to(flat.dtype)
        v[0] = [float("nan"), -0.0, float("inf")][int(torch.randint(3, (), generator=gen))]
        return v

    return changed_version(sd, gen, frac=frac, share=0.5, new_values=new_values)


def _pieces(sd: dict[str, torch.Tensor]) -> list[Piece]:
    """Every tensor with dim 0 >= 2 cut in two pieces (as two FSDP shards would be), published by one rank."""
    out = []
    for n, t in sd.items():
        shape = tuple(t.shape)
        half = shape[0] // 2
        out.append(Piece(n, shape, (0,) * t.dim(), t[:half].contiguous()))
        out.append(Piece(n, shape, (half,) + (0,) * (t.dim() - 1), t[half:].contiguous()))
    return out


class DictEngine(WeightSyncExtension):
    """A worker whose model is a dict: ``_apply_weights`` records what vLLM's ``load_weights`` would receive."""

    def __init__(self) -> None:  # no vLLM worker behind it
        self.model: dict[str, torch.Tensor] = {}
        self.loaded: list[set[str]] = []
        self._moe_rl_weight_version = 0

    def weight_version(self) -> int:
        return self._moe_rl_weight_version

    def _apply_weights(self, version, *, weights_path=None, weights_iterator=None):
        if version <= self._moe_rl_weight_version:
            raise ValueError(f"version {version} <= {self._moe_rl_weight_version}")
        got = {n: t.clone() for n, t in weights_iterator}
        self.model.update(got)
        self.loaded.append(set(got))
        self._moe_rl_weight_version = version
        return {"version": version}


def _assert_model(engine: DictEngine, ref: dict[str, torch.Tensor]) -> None:
    assert set(engine.model) == set(ref)
    bad = [n for n in ref if not _bits_equal(engine.model[n], ref[n])]
    assert not bad, f"tensors differ from a full send: {bad}"


@pytest.fixture(autouse=True)
def _no_weights_root(monkeypatch):
    monkeypatch.delenv("MOE_RL_WEIGHTS_ROOT", raising=False)


def test_twenty_updates_bit_identical_to_full_sends(tmp_path):
    """20 consecutive updates with random sparse changes: the engine's tensors after each delta load equal, bit for
    bit, the same version sent in full (a plain sharded folder read with read_sharded); deltas move fewer bytes;
    the watcher jumping over versions applies the chain; only the changed load units are handed to the model."""
    gen = torch.Generator().manual_seed(0)
    dpub = ShardedFilesystemPublisher(tmp_path / "delta", {}, delta=DeltaConfig(enabled=True, full_every=6))
    fpub = ShardedFilesystemPublisher(tmp_path / "full", {})
    engine = DictEngine()
    sd = _initial(gen)
    # the watcher jumps over the skipped versions: the next load applies their deltas first
    kinds, skipped, dpub_bytes = [], {5, 6, 13}, {}
    for v in range(1, 21):
        sd = sd if v == 1 else _step(sd, gen)
        st = dpub.publish(_pieces(sd), v)
        fst = fpub.publish(_pieces(sd), v)
        info = st.extra["delta"]
        dpub_bytes[v] = st.bytes - info["header_bytes"]  # the engine counts the buffers it applied
        kinds.append("full" if info["full"] else "delta")
        assert info["raw_bytes"] == fst.bytes
        if not info["full"]:
            # ~1% of the elements changed: sparse buffers (bf16 value + int32 index) plus the JSON header
            assert st.bytes == info["wire_bytes"] < fst.bytes / 4, (v, st.bytes, fst.bytes)
        if v in skipped:
            continue
        before = dict(engine.model)
        rep = engine.load_sharded(str(version_dir(tmp_path / "delta", v)), v)
        full_sent = dict(read_sharded(version_dir(tmp_path / "full", v)))
        _assert_model(engine, full_sent)
        chain = [u for u in range(1, v + 1) if u == v or (u in skipped and all(w in skipped for w in range(u, v)))]
        if "full" in [kinds[u - 1] for u in chain]:
            chain = chain[max(i for i, u in enumerate(chain) if kinds[u - 1] == "full"):]
        assert rep["delta"]["versions"] == chain
        if "full" not in [kinds[u - 1] for u in chain]:
            units = {load_unit(n) for n in NAMES if not _bits_equal(before[n], full_sent[n])}
            assert engine.loaded[-1] == {n for n in NAMES if load_unit(n) in units}
            assert rep["bytes"] == sum(dpub_bytes[u] for u in chain)
        else:
            assert engine.loaded[-1] == set(NAMES)
    # full at 1, then every 6th update after a full one (the skips do not change what the trainer sends)
    assert kinds == ["full"] + ["delta"] * 5 + ["full"] + ["delta"] * 5 + ["full"] + ["delta"] * 5 + ["full", "delta"]
    assert engine.weight_version() == 20


def test_only_changed_units_are_loaded(tmp_path):
    gen = torch.Generator().manual_seed(1)
    pub = ShardedFilesystemPublisher(tmp_path, {}, delta=DeltaConfig(enabled=True, full_every=100))
    engine = DictEngine()
    sd = _initial(gen)
    pub.publish(_pieces(sd), 1)
    engine.load_sharded(str(version_dir(tmp_path, 1)), 1)
    assert engine.loaded[-1] == set(NAMES)
    sd = dict(sd)
    q = sd["model.layers.0.self_attn.q_proj.weight"].clone()
    q[3, 4] = -q[3, 4] if q[3, 4] != 0 else 1.0
    sd["model.layers.0.self_attn.q_proj.weight"] = q
    st = pub.publish(_pieces(sd), 2)
    assert st.extra["delta"]["changed"] == 1
    rep = engine.load_sharded(str(version_dir(tmp_path, 2)), 2)
    # the whole attention block (vLLM fuses q/k/v into one layer), nothing else
    assert engine.loaded[-1] == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    assert rep["delta"]["changed"] == 1 and rep["tensors"] == 2
    _assert_model(engine, sd)
    # the model was loaded by something else meanwhile: every tensor is handed over, not only the changed units
    engine._moe_rl_weight_version = 7
    sd["lm_head.weight"] = sd["lm_head.weight"] * 2
    pub.publish(_pieces(sd), 8)
    engine.load_sharded(str(version_dir(tmp_path, 8)), 8)
    assert engine.loaded[-1] == set(NAMES)


def _publish_two(tmp_path: Path, gen: torch.Generator) -> tuple[ShardedFilesystemPublisher, DictEngine, dict]:
    pub = ShardedFilesystemPublisher(tmp_path, {}, delta=DeltaConfig(enabled=True, full_every=100))
    engine = DictEngine()
    v1 = _initial(gen)
    pub.publish(_pieces(v1), 1)
    engine.load_sharded(str(version_dir(tmp_path, 1)), 1)
    v2 = _step(v1, gen, frac=0.05)
    pub.publish(_pieces(v2), 2)
    return pub, engine, v1


def _host_bits(engine: DictEngine) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in engine._moe_rl_delta.decoders[0].state.items()}


@pytest.mark.parametrize("where", ["last_byte", "header_json"])
def test_corrupted_delta_file_is_refused_and_nothing_applied(tmp_path, where):
    gen = torch.Generator().manual_seed(2)
    pub, engine, v1 = _publish_two(tmp_path, gen)
    f = version_dir(tmp_path, 2) / "rank_00000.delta.safetensors"
    data = bytearray(f.read_bytes())
    if where == "last_byte":  # a payload bit: caught by a tensor checksum (or an index range check)
        data[-1] ^= 0x10
    else:  # the last tensor's checksum in the delta header (JSON inside the safetensors header), same size
        pat = b'\\"checksum\\":\\"'
        i = data.rindex(pat) + len(pat)
        data[i] = ord("0") if data[i] != ord("0") else ord("1")
    f.write_bytes(bytes(data))
    host = _host_bits(engine)
    with pytest.raises(DeltaError):
        engine.load_sharded(str(version_dir(tmp_path, 2)), 2)
    assert engine.weight_version() == 1 and len(engine.loaded) == 1
    _assert_model(engine, v1)
    state = engine._moe_rl_delta
    assert state.decoders[0].version == 1
    assert all(_bits_equal(state.decoders[0].state[k], t) for k, t in host.items())


@pytest.mark.parametrize("which", ["delta", "full"])
def test_truncated_shard_is_refused(tmp_path, which):
    gen = torch.Generator().manual_seed(3)
    pub, engine, v1 = _publish_two(tmp_path, gen)
    if which == "delta":
        f, v = version_dir(tmp_path, 2) / "rank_00000.delta.safetensors", 2
    else:
        v = 3
        pub.delta.encoder.reset()  # make version 3 full
        pub.publish(_pieces(_step(v1, gen)), v)
        (f,) = sorted(version_dir(tmp_path, v).glob("rank_*-*.safetensors"))
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ValueError, match="truncated"):
        engine.load_sharded(str(version_dir(tmp_path, v)), v)
    assert engine.weight_version() == 1 and len(engine.loaded) == 1 and engine._moe_rl_delta.decoders[0].version == 1
    _assert_model(engine, v1)
    with pytest.raises(ValueError, match="delta-encoded"):  # a delta folder is not a checkpoint on its own
        read_sharded(version_dir(tmp_path, 2))


def test_wrong_base_is_refused_and_a_full_version_requested(tmp_path):
    """A fresh engine meets a delta whose base folder is gone: refused by name, a full version requested, which
    every trainer rank honours once on its next publication; a base that is another publication's version 1
    (same version, other bits) is refused too."""
    gen = torch.Generator().manual_seed(4)
    pub, _, v1 = _publish_two(tmp_path, gen)
    fresh = DictEngine()
    shutil.rmtree(version_dir(tmp_path, 1))
    with pytest.raises(DeltaBaseError, match="full version was requested"):
        fresh.load_sharded(str(version_dir(tmp_path, 2)), 2)
    assert fresh.weight_version() == 0 and not fresh.loaded and (tmp_path / DELTA_REQUEST).exists()
    v3 = _step(v1, gen)
    st = pub.publish(_pieces(v3), 3)
    assert st.extra["delta"]["full"] and st.extra["delta"]["full_requests"] == 1
    fresh.load_sharded(str(version_dir(tmp_path, 3)), 3)
    _assert_model(fresh, v3)
    st = pub.publish(_pieces(_step(v3, gen)), 4)
    assert not st.extra["delta"]["full"], "a request is honoured once"

    # another publication's version 1 (other bits): same base version, other checksum
    other = tmp_path / "other"
    opub = ShardedFilesystemPublisher(other, {}, delta=DeltaConfig(enabled=True, full_every=100))
    engine = DictEngine()
    engine.load_sharded(str(version_dir(tmp_path, 3)), 3)
    opub.publish(_pieces(_initial(torch.Generator().manual_seed(9))), 3)
    opub.publish(_pieces(_step(v3, gen)), 4)
    with pytest.raises(DeltaBaseError, match="checksum"):
        engine.load_sharded(str(version_dir(other, 4)), 4)
    _assert_model(engine, v3)


def test_two_ranks_roll_back_together():
    """Two trainer ranks' encoders, one engine state: rank 1's corrupt delta rolls rank 0's applied delta back."""
    from moe_rl.weights.delta import DeltaChecksumError, DeltaUpdate

    gen = torch.Generator().manual_seed(5)
    encs = [RankDeltaEncoder(None, DeltaConfig(enabled=True, full_every=50)) for _ in range(2)]
    sd = _initial(gen)

    def split(sd):  # rank 0 the first halves, rank 1 the second halves
        ps = _pieces(sd)
        return [ps[0::2], ps[1::2]]

    state = EngineDeltaState()
    ups = {1: {r: e.encode(p, 1) for r, (e, p) in enumerate(zip(encs, split(sd), strict=True))}}
    state.advance(1, ups.__getitem__)
    before = {r: {k: t.clone() for k, t in d.state.items()} for r, d in state.decoders.items()}
    sd2 = _step(sd, gen, frac=0.1)
    good = {r: e.encode(p, 2) for r, (e, p) in enumerate(zip(encs, split(sd2), strict=True))}
    header, tensors = good[1].to_tensors()
    key = next(k for k in tensors if k.endswith("/values"))
    tensors = dict(tensors)
    tensors[key] = tensors[key].clone()
    tensors[key][0] ^= 1
    ups[2] = {0: good[0], 1: DeltaUpdate.from_tensors(header, tensors)}
    with pytest.raises(DeltaChecksumError):
        state.advance(2, ups.__getitem__)
    assert {r: d.version for r, d in state.decoders.items()} == {0: 1, 1: 1}
    for r, d in state.decoders.items():
        assert all(_bits_equal(d.state[k], t) for k, t in before[r].items())
    ups[2] = good
    state.advance(2, ups.__getitem__)
    got = dict(state.weights())
    assert all(_bits_equal(got[n], sd2[n]) for n in NAMES)


def test_config_refusals():
    with pytest.raises(ValueError, match="full_every"):
        DeltaConfig(enabled=True, full_every=0)
    with pytest.raises(ValueError, match="enabled"):
        RankDeltaEncoder(None, DeltaConfig(enabled=False))


# ---------------------------------------------------------------------------------------------------- broadcast
@pytest.mark.filterwarnings("ignore:.*TCPStore.*")
def test_broadcast_delta_updates_bit_identical(tmp_path):
    """The broadcast transport with delta encoding (one gloo group: this "trainer rank" + the stand-in worker): the
    buckets carry each DeltaUpdate's buffers, the plan its header. 8 updates, every one bit-identical to the version
    sent; deltas move fewer bytes than the full versions; a worker without the base refuses a delta (nothing
    loaded) and recovers with the next full version."""
    import json
    import threading

    from moe_rl.weights.broadcast import (
        BroadcastReceiver,
        BroadcastTransportConfig,
        ShardedBroadcastPublisher,
        group_file,
    )

    cfg = BroadcastTransportConfig(host="127.0.0.1", engine_workers=1, timeout_s=60.0, bucket_bytes=16 << 10)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "pub", ShardedBroadcastPublisher(tmp_path, cfg, delta=DeltaConfig(enabled=True, full_every=4))))
    t.start()
    gf = group_file(tmp_path)
    for _ in range(600):
        if gf.exists():
            break
        threading.Event().wait(0.05)
    (host, port), = json.loads(gf.read_text())["endpoints"]
    engine = DictEngine()
    engine._moe_rl_broadcast = [BroadcastReceiver(host, port, 1, 2, timeout_s=60.0)]
    t.join(60)
    pub = box["pub"]
    gen = torch.Generator().manual_seed(6)
    sd = _initial(gen)

    def send(v: int) -> None:
        box[v] = pub.publish(_pieces(sd), v)

    try:
        for v in range(1, 9):
            sd = sd if v == 1 else _step(sd, gen)
            th = threading.Thread(target=send, args=(v,))
            th.start()
            if v == 6:  # this worker lost its host copy: the delta is received, refused, nothing loaded
                engine._moe_rl_delta.invalidate()
                with pytest.raises(DeltaBaseError):
                    engine.update_weights_from_broadcast(v)
                th.join(60)
                assert engine.weight_version() == 5
                pub.delta.failed()  # what the trainer does on a reported failure: the next version is full
                continue
            rep = engine.update_weights_from_broadcast(v)
            th.join(60)
            assert rep["version"] == v and rep["bytes"] == box[v].bytes
            _assert_model(engine, sd)
        infos = [box[v].extra["delta"] for v in range(1, 9)]
        assert [i["full"] for i in infos] == [True, False, False, False, True, False, True, False]
        full_bytes = box[1].bytes
        assert all(box[v].bytes < full_bytes / 4 for v in range(1, 9) if not infos[v - 1]["full"])
    finally:
        pub.close()


# ---------------------------------------------------------------------------------------------------- config
def test_cpu_job_config_selects_delta_and_refuses_other_transports(tmp_path):
    from moe_rl.config import ConfigError, load_config
    from moe_rl.runtime.config import RLConfig
    from moe_rl.weights.publisher import make_weight_publisher

    base = ["@", "recipes/debug_cpu/rl.toml", "--output-dir", str(tmp_path / "run")]
    cfg = load_config(RLConfig, [*base, "--trainer.weight-delta.enabled", "true", "--trainer.weight-delta.full-every",
                                 "3"])
    assert cfg.trainer.weight_delta == DeltaConfig(enabled=True, full_every=3)
    pub = make_weight_publisher(cfg, tmp_path / "w", {"model_type": "toy"})
    w = torch.arange(4096, dtype=torch.float32)
    assert pub.publish({"w": w}, 1).extra["delta"]["full"]
    w = w.clone()
    w[7] = -1.0
    st = pub.publish({"w": w}, 2)
    assert not st.extra["delta"]["full"] and st.extra["delta"]["changed"] == 1 and st.bytes < 4096 * 4 / 4
    engine = DictEngine()
    engine.load_sharded(str(version_dir(tmp_path / "w", 1)), 1)
    engine.load_sharded(str(version_dir(tmp_path / "w", 2)), 2)
    assert _bits_equal(engine.model["w"], w)
    with pytest.raises(ConfigError, match="delta encoding is implemented for the filesystem, broadcast and p2p"):
        load_config(RLConfig, [*base, "--trainer.weight-transport", "mooncake", "--trainer.weight-delta.enabled",
                               "true"])
    for transport in ("broadcast", "p2p"):
        got = load_config(RLConfig, [*base, "--trainer.weight-transport", transport,
                                     "--trainer.weight-delta.enabled", "true"])
        assert got.trainer.weight_delta.enabled


def test_cluster_config_refuses_delta_with_fp8():
    from types import SimpleNamespace

    from moe_rl.launch.config import WeightTransportConfig
    from moe_rl.runtime.checks import unsupported_weights_kind

    def problem(**kw):
        return unsupported_weights_kind(SimpleNamespace(weights=WeightTransportConfig(**kw)))

    on = {"enabled": True, "full_every": 5}
    assert WeightTransportConfig().delta == DeltaConfig()
    assert problem(kind="filesystem", quantize_fp8=False, delta=on) is None
    assert problem(kind="broadcast", quantize_fp8=False, delta=on) is None
    assert problem(kind="p2p", quantize_fp8=False, delta=on) is None
    assert "weights.delta.enabled=true" in problem(kind="filesystem", quantize_fp8=True, delta=on)
    assert problem(kind="filesystem", quantize_fp8=True) is None


# ---------------------------------------------------------------------------------------------------- p2p
def test_p2p_delta_updates_bit_identical_chains_and_refusals(tmp_path):
    """The p2p transport with delta encoding: each trainer rank holds its updates' buffers, the index carries the
    headers; the worker pulls them, follows a chain over a skipped version still held, and a version no longer held
    as a base is refused (nothing loaded, a full version requested and honoured)."""
    from moe_rl.weights.p2p import P2PPublisher, P2PTransportConfig, PiecePuller, index_path

    pub = P2PPublisher(tmp_path, P2PTransportConfig(timeout_s=30, keep_versions=2),
                       delta=DeltaConfig(enabled=True, full_every=100))
    engine = DictEngine()
    engine._moe_rl_p2p = PiecePuller(pub.endpoints, 1, 2, timeout_s=30)
    gen = torch.Generator().manual_seed(7)
    sd = _initial(gen)
    stats = {}
    try:
        for v in range(1, 9):
            sd = sd if v == 1 else _step(sd, gen)
            stats[v] = pub.publish(_pieces(sd), v)
            if v in (3, 6):
                continue  # skipped by the watcher: 4 chains over 3 (still held); 7 needs 6 (held) too
            rep = engine.update_weights_from_p2p(str(index_path(tmp_path, v)), v)
            expect = [v - 1, v] if v - 1 in (3, 6) else [v]
            assert rep["delta"]["versions"] == expect
            _assert_model(engine, sd)
        full = stats[1].bytes
        assert stats[1].extra["delta"]["full"] and all(
            not stats[v].extra["delta"]["full"] and stats[v].bytes < full / 4 for v in range(2, 9))
        # a fresh worker needs a full version: delta 8's base (7) has no host copy, and 6 is no longer held
        fresh = DictEngine()
        fresh._moe_rl_p2p = engine._moe_rl_p2p
        with pytest.raises(DeltaBaseError, match="full version was requested"):
            fresh.update_weights_from_p2p(str(index_path(tmp_path, 8)), 8)
        assert fresh.weight_version() == 0 and not fresh.loaded
        sd = _step(sd, gen)
        st = pub.publish(_pieces(sd), 9)
        assert st.extra["delta"]["full"] and st.extra["delta"]["full_requests"] == 1
        fresh.update_weights_from_p2p(str(index_path(tmp_path, 9)), 9)
        _assert_model(fresh, sd)
        engine.update_weights_from_p2p(str(index_path(tmp_path, 9)), 9)  # the full version serves everyone
        _assert_model(engine, sd)
    finally:
        pub.close()
