"""``moe_rl.weights.broadcast`` without vLLM: bucket planning, and a real 2-process gloo group (trainer rank 0
in the test process, a receiver process as rank 1) checked bit for bit, plus the failure modes: a dead peer, a
silent peer (timeout) and a group nobody joins. The vLLM worker side is tested in
``test_pause_broadcast_vllm.py``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_rl.fp8 import quantize_128x128
from moe_rl.weights.broadcast import (
    BroadcastPlan,
    WeightBroadcaster,
    WeightBroadcastError,
    plan_buckets,
)

WORKER = Path(__file__).with_name("_broadcast_worker.py")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes, scales = quantize_128x128(torch.randn(130, 200, generator=g))
    wide = torch.randn(6, 10, generator=g)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(24, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": codes,            # float8_e4m3fn
        "model.layers.0.self_attn.q_proj.weight_scale_inv": scales,  # fp32 [2, 2]
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8, generator=g, dtype=torch.float64),
        "counter": torch.tensor(7, dtype=torch.int64),                # 0-d
        "flags": torch.tensor([True, False, True]),
        "strided": wide[:, ::3],                                      # non-contiguous
        "empty": torch.empty(0, 4),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _start_worker(*args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    line = p.stdout.readline().strip()
    assert line == "ready", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def _join(p: subprocess.Popen, b: WeightBroadcaster) -> None:
    p.stdin.write(f"{b.port}\n")
    p.stdin.flush()
    b.connect()


# ---------------------------------------------------------------------------------------------------- planning
def test_plan_buckets_bounds_and_alignment():
    ts = [("a", torch.zeros(3)), ("b", torch.zeros(5, dtype=torch.float64)), ("c", torch.zeros(40)),
          ("d", torch.zeros(2, dtype=torch.bfloat16))]  # fmt: skip
    plan = plan_buckets(ts, version=4, bucket_bytes=64)
    # a: 12 B at 0; b: 40 B at 16 (aligned) -> 56 <= 64; c: 160 B alone (larger than the bound); d: 4 B
    assert [[m.name for m in b] for b in plan.buckets] == [["a", "b"], ["c"], ["d"]]
    assert [[m.offset for m in b] for b in plan.buckets] == [[0, 16], [0], [0]]
    assert plan.bucket_nbytes == [56, 160, 4] and plan.total_bytes == 220 and plan.num_tensors == 4
    back = BroadcastPlan.from_bytes(plan.to_bytes())
    assert back == plan and back.buckets[0][1].shape == (5,) and back.buckets[0][1].dtype == "float64"


def test_plan_and_broadcaster_reject_bad_input():
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 0)
    with pytest.raises(TypeError, match="not a \\(name: str, tensor"):
        plan_buckets([("a", [1.0])], 0)
    with pytest.raises(ValueError, match="bucket_bytes=0 must be >= 1"):
        plan_buckets([], 0, bucket_bytes=0)
    with pytest.raises(ValueError, match="version=-1 must be >= 0"):
        plan_buckets([], -1)
    with pytest.raises(WeightBroadcastError, match="protocol=99"):
        BroadcastPlan.from_bytes(b'{"protocol": 99, "version": 0, "buckets": [], "bucket_nbytes": []}')
    with pytest.raises(ValueError, match="world_size=1 must be >= 2"):
        WeightBroadcaster("127.0.0.1", 0, 1)
    with pytest.raises(ValueError, match="backend='mpi'"):
        WeightBroadcaster("127.0.0.1", 0, 2, backend="mpi")
    with pytest.raises(RuntimeError, match="call connect\\(\\) first"):
        WeightBroadcaster("127.0.0.1", 0, 2).send({}, 0)


# ---------------------------------------------------------------------------------------------------- 2 processes
@pytest.mark.multirank  # two processes on a gloo group (own launcher, not launch_ranks)
def test_two_process_transfer_is_bit_exact_then_dead_peer_raises(tmp_path):
    """Two updates (9 tensors of 7 dtypes incl. float8_e4m3fn, 0-d, empty, non-contiguous; 64-byte buckets so
    most tensors travel alone and one bucket holds several) arrive bit-identical; after the receiver exits, the
    next send fails at once with a dead-peer error naming the step."""
    p = _start_worker("receive", "2", str(tmp_path))
    try:
        b = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=20.0, bucket_bytes=64)
        _join(p, b)
        sent = {3: _tensors(0), 4: _tensors(1)}
        infos = [b.send(sent[3], 3), b.send(list(sent[4].items()), 4)]
        assert p.stdout.readline().strip() == "joined"
        assert p.stdout.readline().strip() == "done"
        p.wait(timeout=30)
        t0 = time.perf_counter()
        with pytest.raises(WeightBroadcastError, match=r"failed at header length .*(closed|reset|Broken pipe)"):
            b.send(sent[3], 5)
        assert time.perf_counter() - t0 < 10.0  # detected from the socket, not by waiting out timeout_s=20
        with pytest.raises(WeightBroadcastError, match="the group broke earlier"):
            b.send(sent[3], 6)
    finally:
        p.kill()
        p.wait()
    assert [i["tensors"] for i in infos] == [9, 9] and infos[0]["buckets"] >= 5
    assert b.stats["updates"] == 2 and b.stats["failures"] == 1
    for i, version in enumerate((3, 4)):
        got_version, got = torch.load(tmp_path / f"update{i}.pt")
        assert got_version == version and list(got) == list(sent[version])
        for name, t in sent[version].items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(_bits(got[name]), _bits(t)), name


@pytest.mark.multirank  # two processes on a gloo group (own launcher, not launch_ranks)
def test_silent_peer_times_out_and_nobody_joining_times_out():
    p = _start_worker("silent")
    try:
        b = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=2.0)
        _join(p, b)
        t0 = time.perf_counter()
        with pytest.raises(WeightBroadcastError, match=r"failed at header length .*[Tt]imed out"):
            b.send({"w": torch.ones(4)}, 1)
        assert 1.5 < time.perf_counter() - t0 < 15.0
    finally:
        p.kill()
        p.wait()
    lonely = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=0.5)
    with pytest.raises(WeightBroadcastError, match=r"could not join the gloo group .* rank 0 of 2 within timeout_s=0.5"):
        lonely.connect()
