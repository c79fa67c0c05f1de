"""Trainer -> engine weight transfer without the engine: filesystem handoff vs gloo broadcast, bf16 vs FP8.

Payload: a synthetic bf16 HF state dict of ``MIB`` MiB (GLM-4.5-shaped expert projections, 2048 x 1408 and
1408 x 2048, plus one bf16 embedding kept high precision by the FP8 filter). Each round moves the whole dict
once and the receiver has every tensor in memory at the end:

- ``baseline`` ``filesystem``: ``WeightPublisher.publish`` (safetensors + STABLE marker, atomic rename) then
  ``safetensors.torch.load_file`` (what a path reload reads; page cache warm on this machine);
- ``gloo_bf16``: ``WeightBroadcaster.send`` to a ``BroadcastReceiver`` in another thread (loopback TCP;
  64 MiB buckets);
- ``gloo_fp8``: ``quantize_state_dict_fp8`` (moe_rl.fp8 128x128, torch reference quantizer on CPU) then the same
  broadcast of the FP8 dict (~0.5x the bytes);
- ``gloo_fp8_prequantized``: the FP8 broadcast alone (on a GPU trainer the quantizer is the Triton kernel).

``extra_info`` records the bytes moved. On a 2-core shared CPU these are loopback/memory-bound figures; across
machines the wire bandwidth decides, where FP8 halves the bytes.

Run: ``.venv/bin/pytest benchmarks/test_bench_weight_transfer.py --benchmark-json
benchmarks/results/weight_transfer_cpu2core_<date>.json``
"""

from __future__ import annotations

import threading

import pytest
import torch

from moe_rl.inference.broadcast import BroadcastReceiver, WeightBroadcaster
from moe_rl.inference.fp8_transfer import quantize_state_dict_fp8
from moe_rl.inference.weights import WeightPublisher

MIB = 64
GROUP = "weight_transfer_64MiB"


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": (torch.randn(2048, 1024, generator=g) * 0.02).bfloat16()}
    per_pair = 2 * 2048 * 1408 * 2
    for i in range((MIB * 2**20 - 2048 * 1024 * 2) // per_pair):
        sd[f"model.layers.1.mlp.experts.{i}.up_proj.weight"] = (torch.randn(1408, 2048, generator=g) * 0.02).bfloat16()
        sd[f"model.layers.1.mlp.experts.{i}.down_proj.weight"] = (torch.randn(2048, 1408, generator=g) * 0.02).bfloat16()
    return sd


@pytest.fixture(scope="module")
def payload():
    return _state_dict()


@pytest.fixture(scope="module")
def group():
    """A trainer/receiver pair on one gloo group; the receiver thread takes ``n`` updates per request."""
    b = WeightBroadcaster("127.0.0.1", 0, world_size=2, timeout_s=120, bucket_bytes=64 * 2**20)
    box: dict = {}
    ready = threading.Event()

    def join():
        box["rx"] = BroadcastReceiver("127.0.0.1", b.port, 1, 2, timeout_s=120)
        ready.set()

    t = threading.Thread(target=join)
    t.start()
    b.connect()
    t.join()
    assert ready.is_set()
    yield b, box["rx"]
    b.close()


def _broadcast_once(b: WeightBroadcaster, rx: BroadcastReceiver, sd: dict[str, torch.Tensor]) -> dict:
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(zip(("version", "tensors"), rx.receive_all(), strict=True)))
    t.start()
    info = b.send(sd, 1)
    t.join()
    assert len(got["tensors"]) == len(sd)
    return info


@pytest.mark.benchmark(group=GROUP)
def test_filesystem_publish_and_load(benchmark, payload, tmp_path):
    from safetensors.torch import load_file

    pub = WeightPublisher(tmp_path, hf_config={"model_type": "glm4_moe"})
    counter = iter(range(10**6))

    def run():
        path = pub.publish(payload, next(counter))
        return load_file(str(path / "model.safetensors"))

    out = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert len(out) == len(payload)
    benchmark.extra_info.update(role="baseline", bytes=sum(t.numel() * t.element_size() for t in payload.values()))


@pytest.mark.benchmark(group=GROUP)
def test_gloo_broadcast_bf16(benchmark, payload, group):
    b, rx = group
    info = benchmark.pedantic(lambda: _broadcast_once(b, rx, payload), rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(bytes=info["bytes"], buckets=info["buckets"])


@pytest.mark.benchmark(group=GROUP)
def test_gloo_broadcast_fp8(benchmark, payload, group):
    b, rx = group

    def run():
        fp8, report = quantize_state_dict_fp8(payload)
        return _broadcast_once(b, rx, fp8), report

    info, report = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(bytes=info["bytes"], buckets=info["buckets"], ratio_vs_bf16=report["ratio_vs_bf16"])


@pytest.mark.benchmark(group=GROUP)
def test_gloo_broadcast_fp8_prequantized(benchmark, payload, group):
    """The FP8 broadcast alone (on a GPU trainer the quantization runs in the Triton kernel, not here)."""
    b, rx = group
    fp8, report = quantize_state_dict_fp8(payload)
    info = benchmark.pedantic(lambda: _broadcast_once(b, rx, fp8), rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(bytes=info["bytes"], buckets=info["buckets"], ratio_vs_bf16=report["ratio_vs_bf16"])
