"""2-rank trainer side of ``test_p2p.py``: a FSDP2-sharded model published with the ``p2p`` transport (every rank
snapshots and serves its own pieces) to two engine-worker processes (``_p2p_puller.py``, started by rank 0), which
pull what they need from the owning ranks and compare it, bit for bit, with the unsharded model's checkpoint tensors
cast like the publisher. Steps (rank 0 releases each with ``<root>/step_<k>`` and waits for the pullers' answers):

1. versions 1 and 2 (2 after an in-place update; the model is updated again before the pulls, so the held copies
   must be snapshots), whole and a 3-tensor subset;
2. rank 1 flips a byte on the wire once: one re-pull in all, counted, the result still exact;
3. rank 1's held copy of version 2 is corrupted: every re-pull fails the CRC-32, nothing is returned;
4. versions 3 and 4 published with ``keep_versions=2``: a request for version 2 is refused by name, 4 pulls;
5. rank 1 stops after the first bucket: puller 1's transfer fails (timeout), nothing returned, its groups closed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _p2p_pieces import tiny_fsdp_glm  # noqa: E402
from _rank_worker import RankArgs, run_rank_worker  # noqa: E402

from moe_rl.models.glm4_moe import to_hf_state_dict  # noqa: E402
from moe_rl.models.glm4_moe.config import GlmMoeConfig  # noqa: E402
from moe_rl.models.glm4_moe.model import GlmMoeForCausalLM  # noqa: E402
from moe_rl.models.hf_io import keeps_fp32  # noqa: E402

ARGS = RankArgs.parse(sys.argv)
OUT: dict = {}
PULLER = Path(__file__).with_name("_p2p_puller.py")
PULLERS = (1, 2)


def hf_ref(model: GlmMoeForCausalLM, cfg: GlmMoeConfig) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.float32 if keeps_fp32(k) else torch.bfloat16).contiguous()
            for k, v in to_hf_state_dict(model.state_dict(), cfg).items()}


def bump(*models: torch.nn.Module) -> None:
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.mul_(1.0625).add_(0.125)  # an "optimizer step", in place (the same ops on shards and the full model)


def p2p_fsdp2_two_pullers() -> None:
    from safetensors.torch import save_file

    from moe_rl.weights.p2p import P2PPublisher, P2PTransportConfig

    root = ARGS.out_dir / "p2p"
    procs = []
    if ARGS.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        procs = [subprocess.Popen([sys.executable, str(PULLER), str(root), str(w), str(1 + len(PULLERS))],
                                  stdout=open(root / f"puller{w}.log", "w"), stderr=subprocess.STDOUT)
                 for w in PULLERS]
    cfg, ref_model, model = tiny_fsdp_glm()
    pub = P2PPublisher(root, P2PTransportConfig(engine_workers=len(PULLERS), timeout_s=60, keep_versions=2,
                                                bucket_bytes=4096), mcfg=cfg, dtype=torch.bfloat16)
    stats: list = []

    def publish(v: int) -> None:
        st = pub.publish(model, v)
        stats.append({"version": v, "blocking_s": round(st.blocking_s, 5), "snapshot_s":
                      round(st.extra["snapshot_s"], 5), "bytes": st.bytes, "tensors": st.tensors})
        if ARGS.rank == 0:
            save_file(hf_ref(ref_model, cfg), str(root / f"ref_{v}.safetensors"))

    def release(k: int) -> dict:
        dist.barrier()  # the faults of step k are set on every rank before any puller starts it
        answers: dict = {}
        if ARGS.rank == 0:
            (root / f"step_{k}").write_text("")
            for w in PULLERS:
                f = root / f"done_{k}_{w}.json"
                end = time.monotonic() + 120
                while not f.exists():
                    assert time.monotonic() < end, f"puller {w} did not finish step {k}: {(root / f'puller{w}.log').read_text()[-2000:]}"
                    time.sleep(0.01)
                answers[w] = json.loads(f.read_text())
                assert answers[w]["ok"], f"puller {w}, step {k}: {answers[w]['error']}"
        dist.barrier()
        return answers

    publish(1)
    bump(model, ref_model)
    publish(2)
    bump(model)  # the trainer's next step updates the parameters in place: the held version 2 must not change
    release(1)

    if ARGS.rank == 1:
        pub.server.fault = "corrupt_once"
    answers = release(2)
    if ARGS.rank == 0:
        assert sum(a["retries"] for a in answers.values()) == 1, answers

    if ARGS.rank == 1:
        held = pub.server._held[2]
        t = held[sorted(held)[0]]
        t.reshape(-1).view(torch.uint8)[0] ^= 0xFF
    release(3)

    bump(ref_model)
    publish(3)
    bump(model, ref_model)
    publish(4)
    assert pub.server.held_versions == [3, 4]
    release(4)

    if ARGS.rank == 1:
        pub.server.fault = "stop_after_first_bucket"
    release(5)
    for p in procs:
        assert p.wait(60) == 0, (root / "puller1.log").read_text()[-2000:]
    pub.close()
    OUT.setdefault("publish", {})[f"rank{ARGS.rank}"] = stats
    OUT["served"] = {f"rank{ARGS.rank}": dict(pub.server.stats)}


def p2p_background_index() -> None:
    """``publish(..., on_ready=...)``: no collective per version; rank 0's index thread collects rank 1's part from
    its TCPStore, writes the index (both ranks' pieces, CRC-32s of the snapshots) and only then calls ``on_ready``;
    a rank that never posts its part fails that version's index job by name (nothing announced), and the next
    ``publish`` raises."""
    import zlib

    from moe_rl.weights.p2p import P2PError, P2PPublisher, P2PTransportConfig, index_path, read_index
    from moe_rl.weights.regions import Piece

    root = ARGS.out_dir / "p2p_bg"
    pub = P2PPublisher(root, P2PTransportConfig(engine_workers=1, timeout_s=4, keep_versions=2))
    ready: list = []

    def on_ready(st) -> None:
        assert ARGS.rank == 0, "on_ready runs on rank 0 only"
        ready.append((st.version, index_path(root, st.version).exists(), st.bytes_total))

    def pieces(v: int) -> list:
        w = torch.arange(48, dtype=torch.float32).reshape(8, 6) * v
        b = torch.arange(5, dtype=torch.bfloat16) + v
        out = [Piece("w", (8, 6), (4 * ARGS.rank, 0), w[4 * ARGS.rank:4 * ARGS.rank + 4])]
        return out + ([Piece("b", (5,), (0,), b)] if ARGS.rank == 1 else [])

    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    for v in (1, 2, 3):
        src = pieces(v)
        st = pub.publish(src, v, on_ready=on_ready)
        assert st.extra["background"] and "index" not in st.extra and st.blocking_s < 2.0
        for p in src:
            p.tensor.add_(1000)  # the trainer's next step, in place: the index thread must checksum the snapshot
    pub.flush()
    if ARGS.rank == 0:
        assert ready == [(v, True, 4 * 6 * 4 * 2 + 5 * 2) for v in (1, 2, 3)], ready
        for v in (2, 3):  # version 1's index is removed with keep_versions=2 once version 3 is written
            idx = read_index(index_path(root, v), v)
            want = {p.key: crc(p.tensor) for p in pieces(v)}  # rank 0's own pieces
            assert {m[0]: m[4] for m in idx["ranks"][0]} == want
            assert [m[0] for m in idx["ranks"][1]] == ["w@4_0@8_6", "b@0@5"]
            assert idx["ranks"][1][0][4] == crc(torch.arange(48, dtype=torch.float32).reshape(8, 6)[4:] * v)
    dist.barrier()
    if ARGS.rank == 0:  # rank 1 never posts version 4: publish still returns at once, the job fails by name
        t0 = time.perf_counter()
        pub.publish(pieces(4), 4, on_ready=on_ready)
        assert time.perf_counter() - t0 < 2.0
        try:
            pub.flush()
        except P2PError as exc:
            assert "trainer ranks [1] did not post their part of version 4's index" in str(exc), exc
        else:
            raise AssertionError("flush did not raise")
        assert [r[0] for r in ready] == [1, 2, 3] and not index_path(root, 4).exists()
        try:
            pub.publish(pieces(5), 5, on_ready=on_ready)
        except P2PError as exc:
            assert "an earlier version's index job failed: version 4" in str(exc), exc
        else:
            raise AssertionError("publish after a failed index job did not raise")
    dist.barrier()
    pub.close()


run_rank_worker([p2p_fsdp2_two_pullers, p2p_background_index], started=STARTED, extras=OUT, barrier_after_each=True,
                timeout_s=300)
