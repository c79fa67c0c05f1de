"""The ``p2p`` transport's NIXL backend (``moe_rl.weights.p2p_nixl``, ``trainer.p2p.backend = "nixl"``).

- 2 trainer ranks (FSDP2) x 2 puller processes (``_p2p_nixl_worker.py``): every piece pulled over NIXL is
  bit-identical to the same piece pulled over gloo, and the assembled tensors equal the unsharded model's.
- The version guarantee: a slot rewritten while (or after) an engine read it is refused by the version tag, with the
  CRC-32s off (the tag alone must catch it); a racing publisher never lets a mixed version through.
- A missing ``nixl`` package: ImportError naming ``pip install 'moe_rl[nixl]'``, only when the backend is selected.

Everything but the ImportError test is skipped when ``nixl`` is not importable; ``MOE_RL_REQUIRE_NIXL=1`` makes that
a failure. (The CUDA wheels ``nixl`` + ``nixl-cu12`` run without a GPU: UCX over shared memory / TCP.)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _p2p_pieces import row_half_pieces

WORKER = Path(__file__).with_name("_p2p_nixl_worker.py")


def _have_nixl() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def nixl() -> None:
    if not _have_nixl():
        if os.environ.get("MOE_RL_REQUIRE_NIXL") == "1":
            pytest.fail("MOE_RL_REQUIRE_NIXL=1 but nixl is not importable (pip install 'moe_rl[nixl]')")
        pytest.skip("nixl is not importable (pip install 'moe_rl[nixl]')")



def test_missing_nixl_is_an_import_error_naming_the_extra(tmp_path, monkeypatch):
    from moe_rl.weights.p2p import P2PPublisher, P2PTransportConfig
    from moe_rl.weights.p2p_nixl import p2p_publisher

    monkeypatch.setitem(sys.modules, "nixl", None)  # `import nixl...` now raises ImportError
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(ImportError, match=r"backend='nixl' needs the NIXL.*pip install 'moe_rl\[nixl\]'"):
        p2p_publisher(tmp_path, P2PTransportConfig(timeout_s=5, backend="nixl"))
    with pytest.raises(ValueError, match="backend='nixl' with server PieceServer.*p2p_publisher"):
        P2PPublisher(tmp_path, P2PTransportConfig(timeout_s=5, backend="nixl"))  # never silently gloo
    pub = p2p_publisher(tmp_path / "g", P2PTransportConfig(timeout_s=5))  # gloo (the default) never imports it
    assert type(pub) is P2PPublisher
    assert json.loads((tmp_path / "g" / "announce" / "p2p_group.json").read_text())["backend"] == "gloo"
    pub.close()
    with pytest.raises(ValueError, match="backend"):
        P2PTransportConfig(backend="rdma")


def test_pieces_equal_the_gloo_path_in_one_process(tmp_path, nixl):
    from moe_rl.weights.p2p import PiecePuller, PieceServer, write_index
    from moe_rl.weights.p2p_nixl import NixlPiecePuller, NixlPieceServer, open_puller

    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(64, 8, generator=g).to(torch.bfloat16), "b": torch.randn(33, generator=g),
          "c": torch.randint(-9, 9, (6, 5, 4), generator=g, dtype=torch.int32)}
    out = {}
    for name, srv_cls in (("gloo", PieceServer), ("nixl", NixlPieceServer)):
        servers = [srv_cls("127.0.0.1", 2, timeout_s=30, bucket_bytes=256, rank=r) for r in range(2)]
        puller = open_puller([["127.0.0.1", s.port] for s in servers], 1, 2, timeout_s=30)
        assert type(puller) is (NixlPiecePuller if name == "nixl" else PiecePuller)
        idx = write_index(tmp_path / name, 1, [s.hold(1, ps) for s, ps in zip(servers, row_half_pieces(sd), strict=True)])
        got, rep = puller.pull(idx, 1)
        out[name] = dict(got)
        assert rep["retries"] == 0 and rep["bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
        for s in servers:
            s.close()
    for k, t in sd.items():
        assert torch.equal(out["gloo"][k], t) and torch.equal(out["nixl"][k], t)
        assert out["nixl"][k].dtype == t.dtype


def test_two_trainer_ranks_two_pullers_bit_identical_to_gloo(tmp_path, nixl, launch_ranks, check_scenario):
    rep = launch_ranks(WORKER, 2, tmp_path, 600)
    check_scenario(rep, "nixl_vs_gloo_fsdp2_two_pullers")
    for w in (1, 2):
        ans = rep[0][f"puller{w}"]
        assert ans["ok"] and ans["nixl_v2"]["bytes"] == ans["gloo_v2"]["bytes"] > 0
        assert ans["nixl_subset_bytes"] == ans["gloo_subset_bytes"] < ans["nixl_v2"]["bytes"]
        assert ans["nixl_stats"]["registrations"] == 2  # one receive buffer per trainer rank, registered once
    for r in range(2):  # one slot per held version (keep_versions=2), registered once each
        assert rep[r][f"nixl_server_rank{r}"]["registrations"] == 2


def _server_and_puller(keep: int):
    from moe_rl.weights.p2p_nixl import NixlPiecePuller, NixlPieceServer

    srv = NixlPieceServer("127.0.0.1", 2, timeout_s=30, keep_versions=keep)
    return srv, NixlPiecePuller([["127.0.0.1", srv.port]], 1, 2, timeout_s=30)


def _fill(v: int) -> list:
    from moe_rl.weights.regions import Piece

    return [Piece("w", (256, 64), (0, 0), torch.full((256, 64), float(v))),
            Piece("b", (1000,), (0,), torch.full((1000,), float(v), dtype=torch.bfloat16))]


def test_a_slot_rewritten_during_the_read_is_refused(tmp_path, nixl):
    """The trainer reuses the slot of version 1 (keep_versions=1) while the engine reads it: with the CRC-32s off,
    the version tag alone refuses the torn data; an evicted version is refused by name; the next pull works."""
    from moe_rl.weights.p2p import P2PError, write_index

    srv, puller = _server_and_puller(keep=1)
    idx1 = write_index(tmp_path, 1, [srv.snapshot(1, _fill(1))[0]])  # crc32 = -1: unchecked
    real = puller._read
    calls = []

    def racing_read(name, local, remote, what):  # the data READ, then the trainer publishes version 2 over it
        real(name, local, remote, what)
        if not calls:
            calls.append(what)
            srv.snapshot(2, _fill(2))

    puller._read = racing_read
    with pytest.raises(P2PError, match="does not hold version 1 any more: its slot was rewritten.*tag now 2"):
        puller.pull(idx1, 1)

    # a writer caught half-way (tag -1, half the bytes new) while the engine reads: refused, not returned
    idx2 = write_index(tmp_path, 2, [[["w@0_0@256_64", "float32", [256, 64], 256 * 64 * 4, -1],
                                      ["b@0@1000", "bfloat16", [1000], 2000, -1]]])
    calls.clear()

    def torn_read(name, local, remote, what):
        if not calls:
            calls.append(what)
            buf = srv._slots[srv._slot_of[2]]["buf"]
            buf[:8].view(torch.int64)[0] = -1
            buf[64:64 + 4096].fill_(7)
        real(name, local, remote, what)

    puller._read = torn_read
    with pytest.raises(P2PError, match="does not hold version 2 any more.*tag now -1"):
        puller.pull(idx2, 2)
    puller._read = real
    with pytest.raises(P2PError, match="does not hold version 1 \\(it holds \\[2\\]"):
        puller.pull(idx1, 1)  # evicted: its descriptors are gone
    idx3 = write_index(tmp_path, 3, [srv.snapshot(3, _fill(3))[0]])
    got, _ = puller.pull(idx3, 3)
    assert torch.equal(dict(got)["w"], torch.full((256, 64), 3.0)) and srv.stats_nixl["registrations"] == 1
    srv.close()


def test_racing_publisher_never_yields_a_mixed_version(tmp_path, nixl):
    """A thread publishes versions as fast as it can (keep_versions=1: every version overwrites the only slot)
    while the engine pulls the latest one over and over, CRC-32s off: every pull either returns exactly one
    version's bytes (all elements equal to that version) or raises P2PError; never a mix."""
    from moe_rl.weights.p2p import P2PError, write_index

    srv, puller = _server_and_puller(keep=1)
    metas = srv.snapshot(1, _fill(1))[0]
    for v in range(1, 200):
        write_index(tmp_path, v, [metas])
    latest = [1]
    stop = threading.Event()

    def publish() -> None:
        v = 1
        while not stop.is_set() and v < 199:
            v += 1
            srv.snapshot(v, _fill(v))
            latest[0] = v
            time.sleep(0.004 * (v % 3))  # sometimes a pull fits between two versions, sometimes it races one

    t = threading.Thread(target=publish)
    t.start()
    ok = refused = 0
    try:
        while t.is_alive():
            v = latest[0]
            try:
                got, _ = puller.pull(tmp_path / "announce" / f"p2p_{v}.json", v)
            except P2PError as exc:
                assert "does not hold version" in str(exc), exc
                refused += 1
                continue
            for _, tensor in got:
                assert bool((tensor.float() == float(v)).all()), f"version {v} pulled with other versions' bytes"
            ok += 1
    finally:
        stop.set()
        t.join()
        srv.close()
    assert ok > 0, (ok, refused)


def test_nixl_backend_only_with_the_p2p_transport(monkeypatch):
    """The backend is refused with another transport (it would be ignored), and in the CPU job without the wheels
    before any engine starts."""
    from pathlib import Path

    from moe_rl.config import ConfigError, load_config
    from moe_rl.launch.config import ClusterConfig
    from moe_rl.runtime.config import RLConfig

    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match="trainer.p2p.backend='nixl' is used only by trainer.weight_transport='p2p'"):
        load_config(RLConfig, ["@", str(repo / "recipes/debug_cpu/rl.toml"), "--output-dir", "/tmp/x",
                               "--trainer.p2p.backend", "nixl"])
    with pytest.raises(ConfigError, match="weights.p2p_backend='nixl' is used only by weights.kind='p2p'"):
        load_config(ClusterConfig, ["@", str(repo / "recipes/glm5_1/rl.toml"), "--weights.p2p-backend", "nixl"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'moe_rl\[nixl\]'"):
        load_config(RLConfig, ["@", str(repo / "recipes/debug_cpu/rl.toml"), "--output-dir", "/tmp/x",
                               "--trainer.weight-transport", "p2p",
                               "--trainer.p2p.backend", "nixl"])
