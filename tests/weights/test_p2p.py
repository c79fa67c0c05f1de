"""The ``p2p`` weight transport (``moe_rl.weights.p2p``): engine workers pull the pieces they need from the trainer
ranks that own them over gloo point-to-point.

- 2 gloo trainer ranks (FSDP2) and 2 puller processes (``_p2p_worker.py`` / ``_p2p_puller.py``): the pulled
  tensors equal the unsharded model's checkpoint tensors bit for bit (same values, same casts), versions are
  snapshots, a CRC-32 mismatch on the wire is a counted re-pull, a corrupt held copy / an evicted version / a
  transfer that stops part-way each raise and return nothing.
- 2 trainer ranks, ``publish(..., on_ready=)``: no per-version collective, rank 0's index thread collects rank 1's
  piece list, writes the index with the snapshots' CRC-32s and only then calls ``on_ready``; a missing part fails
  that version by name and the next ``publish`` raises.
- In one process: the trainer rank's publish never waits for an engine (nor, with ``on_ready``, for the index
  thread); a trainer rank that is gone; bad input.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _p2p_pieces import row_half_pieces

WORKER = Path(__file__).with_name("_p2p_worker.py")


@pytest.fixture(scope="module")
def results(launch_ranks, tmp_path_factory):
    return launch_ranks(WORKER, 2, tmp_path_factory.mktemp("p2p"), timeout_s=600)


def test_two_trainer_ranks_two_pullers(results, check_scenario):
    check_scenario(results, "p2p_fsdp2_two_pullers")
    pubs = [results[r]["publish"][f"rank{r}"] for r in (0, 1)]
    for v in range(4):  # every rank published only its own half of the model
        assert pubs[0][v]["bytes"] > 0 and pubs[1][v]["bytes"] > 0


def test_background_index_two_ranks(results, check_scenario):
    check_scenario(results, "p2p_background_index")



def test_publish_does_not_wait_for_engines_and_versions_are_snapshots(tmp_path):
    from moe_rl.weights.p2p import P2PPublisher, P2PTransportConfig, PiecePuller, index_path, read_index

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    pub = P2PPublisher(tmp_path, P2PTransportConfig(timeout_s=30, keep_versions=2))
    st = pub.publish({"w": w}, 1)  # no engine has joined: returns anyway (a plain state dict: sent as given)
    assert st.transport == "p2p" and st.bytes == 4 * 3 * 4 and st.extra["held_versions"] == [1]
    w.add_(100)  # the trainer updates in place after publishing
    assert read_index(index_path(tmp_path, 1), 1)["ranks"][0][0][0] == "w@0_0@4_3"
    puller = PiecePuller(pub.endpoints, 1, 2, timeout_s=30)
    got, rep = puller.pull(index_path(tmp_path, 1), 1)
    assert torch.equal(got[0][1], torch.arange(12.0).reshape(4, 3)) and rep["retries"] == 0
    with pytest.raises(ValueError, match="must exceed the latest held version 1"):
        pub.publish({"w": w}, 1)
    for bad in (2.0, "2", True):  # refused up front, not later on the index thread
        with pytest.raises(TypeError, match=r"version=.* pass the policy version as an int"):
            pub.publish({"w": w}, bad)
    with pytest.raises(TypeError, match="on_ready=True is not callable"):
        pub.publish({"w": w}, 2, on_ready=True)
    pub.close()


def test_background_publish_returns_before_the_index_and_announces_after_it(tmp_path):
    """``on_ready``: ``publish`` returns after the snapshot while the index thread is still busy (here held up by
    ``on_ready`` itself); ``on_ready`` sees the index, CRC-32s of the snapshot; its failure is raised next time."""
    import threading
    import zlib

    from moe_rl.weights import p2p

    gate, seen = threading.Event(), []

    def on_ready(st):
        seen.append((st.version, p2p.read_index(p2p.index_path(tmp_path, st.version), st.version)["ranks"][0][0][4]))
        assert gate.wait(30)

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    pub = p2p.P2PPublisher(tmp_path, p2p.P2PTransportConfig(timeout_s=30))
    st = pub.publish({"w": w}, 1, on_ready=on_ready)
    assert st.extra["background"] and st.bytes == 48 and "index" not in st.extra
    w.add_(100)  # the next step, in place, while the index job may still run
    end = time.monotonic() + 30
    while not seen and time.monotonic() < end:
        time.sleep(0.005)
    assert seen == [(1, zlib.crc32(torch.arange(12, dtype=torch.float32).numpy()))]
    assert not pub._pending[0][1].done()  # on_ready is still waiting: publish did not
    gate.set()
    pub.flush()
    got, _ = p2p.PiecePuller(pub.endpoints, 1, 2, timeout_s=30).pull(p2p.index_path(tmp_path, 1), 1)
    assert torch.equal(got[0][1], torch.arange(12.0).reshape(4, 3))

    def broken(st):
        raise OSError("disk full")

    pub.publish({"w": w}, 2, on_ready=broken)
    pub._pending[-1][1].exception(timeout=30)  # the job of version 2 has ended
    with pytest.raises(p2p.P2PError, match="an earlier version's index job failed: version 2: OSError: disk full"):
        pub.publish({"w": w}, 3, on_ready=lambda st: None)
    assert not p2p.index_path(tmp_path, 3).exists()
    pub.close()


def test_truncated_transfer_returns_nothing_and_closes_the_groups(tmp_path):
    from moe_rl.weights.p2p import P2PTransferError, PiecePuller, PieceServer, write_index

    sd = {"a": torch.randn(64, 8), "b": torch.randn(32)}
    servers = [PieceServer("127.0.0.1", 2, timeout_s=3, bucket_bytes=256, rank=r) for r in range(2)]
    puller = PiecePuller([["127.0.0.1", s.port] for s in servers], 1, 2, timeout_s=3)
    idx = write_index(tmp_path, 1, [s.hold(1, ps) for s, ps in zip(servers, row_half_pieces(sd), strict=True)])
    servers[1].fault = "stop_after_first_bucket"
    with pytest.raises(P2PTransferError, match="nothing loaded.*groups are closed"):
        puller.pull(idx, 1)
    with pytest.raises(P2PTransferError, match="closed after an earlier failure"):
        puller.pull(idx, 1)
    for s in servers:
        s.close()


def test_owner_rank_gone_is_a_clear_error(tmp_path):
    """A trainer rank's process dies (SIGKILL) after publishing: the pull names the rank, returns nothing."""
    from moe_rl.weights.p2p import P2PTransferError, PiecePuller, index_path

    script = textwrap.dedent(f"""
        import json, sys, time, torch
        from moe_rl.weights.p2p import P2PPublisher, P2PTransportConfig
        pub = P2PPublisher({str(tmp_path)!r}, P2PTransportConfig(timeout_s=30))
        pub.publish({{"w": torch.ones(8, 4)}}, 1)
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        import json

        g = json.loads((tmp_path / "announce" / "p2p_group.json").read_text())
        puller = PiecePuller(g["endpoints"], 1, 2, timeout_s=5)
        got, _ = puller.pull(index_path(tmp_path, 1), 1)
        assert torch.equal(got[0][1], torch.ones(8, 4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        t0 = time.monotonic()
        with pytest.raises(P2PTransferError, match="trainer rank 0 .*nothing loaded"):
            puller.pull(index_path(tmp_path, 1), 1)
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_bad_input_names_the_argument(tmp_path):
    from moe_rl.weights.p2p import P2PError, PiecePuller, PieceServer, read_index, write_index

    with pytest.raises(ValueError, match="world_size=1 must be >= 2"):
        PieceServer("127.0.0.1", 1)
    with pytest.raises(ValueError, match="rank=0 must be in 1..world_size-1=1"):
        PiecePuller([["127.0.0.1", 1]], 0, 2)
    with pytest.raises(ValueError, match="endpoints=\\[\\]"):
        PiecePuller([], 1, 2)
    with pytest.raises(ValueError, match="hold 6 of its 8 elements"):
        write_index(tmp_path, 1, [[["w@0@8", "float32", [6], 24, 0]]])
    with pytest.raises(P2PError, match="no p2p index"):
        read_index(tmp_path / "nope.json", 3)
    with pytest.raises(P2PError, match="expected 'moe_rl.weights.p2p/1', version 3"):
        read_index({"format": "moe_rl.weights.p2p/1", "version": 2, "ranks": []}, 3)
