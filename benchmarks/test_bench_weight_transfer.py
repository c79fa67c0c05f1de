"""Trainer -> engine weight transfer without the engine: every CPU transport against the filesystem baseline.

Payload: a synthetic bf16 HF state dict of ``MIB`` MiB (GLM-4.5-shaped expert projections, 2048 x 1408 and
1408 x 2048, plus one bf16 embedding kept high precision by the FP8 filter). Each round moves one version and the
receiver has every tensor in memory at the end:

- ``baseline`` ``filesystem``: ``WeightPublisher.publish`` (safetensors + STABLE marker, atomic rename) then
  ``safetensors.torch.load_file`` (what a path reload reads; page cache warm on this machine);
- ``gloo_bf16``: ``WeightBroadcaster.send`` to a ``BroadcastReceiver`` in another thread (loopback TCP;
  64 MiB buckets);
- ``gloo_fp8``: ``quantize_state_dict_fp8`` (moe_rl.fp8 128x128, torch reference quantizer on CPU) then the same
  broadcast of the FP8 dict (~0.5x the bytes);
- ``gloo_fp8_prequantized``: the FP8 broadcast alone (on a GPU trainer the quantizer is the Triton kernel);
- ``gloo_p2p_bf16``: point-to-point ``send``/``recv`` of every tensor on a 2-rank gloo group (the stand-in of the
  ``p2p`` transport's pull on CPU), into preallocated receiver tensors (an engine's parameters);
- ``*_delta``: a new version in which ``DELTA_FRACTION`` of the bf16 elements moved by one ulp (an RL step),
  encoded against the previous one (``moe_rl.weights.delta``), sent (filesystem: one safetensors file, header in
  its metadata; gloo: the broadcast) and applied on the receiver, checksums verified. The change itself is made
  outside the timed region; encoding, transfer, decoding and applying are timed.

``extra_info`` records the bytes moved. On a 2-core shared CPU these are loopback/memory-bound figures; across
machines the wire bandwidth decides, where FP8 halves the bytes and a delta sends ~3-9% of them. The time model
of these transports at cluster scale is ``moe_rl.weights.sync_model`` (validated by
``benchmarks/weight_sync_validate.py``).

Run: ``.venv/bin/pytest benchmarks/test_bench_weight_transfer.py --benchmark-json
benchmarks/results/weight_transfer_cpu2core_<date>.json``
"""

from __future__ import annotations

import threading

import pytest
import torch

from moe_rl.weights.broadcast import BroadcastReceiver, WeightBroadcaster
from moe_rl.weights.delta import DeltaDecoder, DeltaEncoder, DeltaUpdate, bit_view
from moe_rl.weights.filesystem import WeightPublisher
from moe_rl.weights.fp8 import quantize_state_dict_fp8

MIB = 64
GROUP = "weight_transfer_64MiB"
DELTA_FRACTION = 0.02
HEADER_KEY = "__delta_header__"


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


@pytest.fixture(scope="module")
def p2p_pair():
    """Two ranks of a gloo group built on a TCPStore (rank 1 lives in the caller's receiver threads)."""
    import datetime

    import torch.distributed as dist

    td = datetime.timedelta(seconds=120)
    store0 = dist.TCPStore("127.0.0.1", 0, 2, True, td, wait_for_workers=False)
    box: dict = {}

    def join():
        box["pg"] = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", store0.port, 2, False, td), 1, 2, td)

    t = threading.Thread(target=join)
    t.start()
    pg0 = dist.ProcessGroupGloo(store0, 0, 2, td)
    t.join()
    yield pg0, box["pg"]


@pytest.mark.benchmark(group=GROUP)
def test_gloo_p2p_bf16(benchmark, payload, p2p_pair):
    pg0, pg1 = p2p_pair
    dst = {k: torch.empty_like(v) for k, v in payload.items()}

    def run():
        def pull():
            for w in [pg1.recv([t], 0, i) for i, t in enumerate(dst.values())]:
                w.wait()

        t = threading.Thread(target=pull)
        t.start()
        for w in [pg0.send([v], 1, i) for i, v in enumerate(payload.values())]:
            w.wait()
        t.join()

    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert all(torch.equal(dst[k], payload[k]) for k in payload)
    benchmark.extra_info.update(bytes=sum(t.numel() * t.element_size() for t in payload.values()))


class _DeltaStream:
    """The trainer's current version and encoder, the engine's decoder holding the previous version."""

    def __init__(self, payload: dict[str, torch.Tensor]) -> None:
        self.state = {k: v.clone() for k, v in payload.items()}
        self.encoder = DeltaEncoder(full_every=10**6)
        self.decoder = DeltaDecoder()
        self.version = 0
        self.decoder.apply(self.encoder.encode(self.state, self.version))
        self.gen = torch.Generator().manual_seed(1)
        self.wire = []

    def step(self) -> None:
        """An RL step outside the timed region: DELTA_FRACTION of the elements move by one ulp."""
        for t in self.state.values():
            bits = bit_view(t)
            bits[torch.randint(0, bits.numel(), (int(DELTA_FRACTION * bits.numel()),), generator=self.gen)] += 1
        self.version += 1

    def encode(self) -> tuple[str, dict[str, torch.Tensor], DeltaUpdate]:
        up = self.encoder.encode(self.state, self.version)
        self.wire.append(up.wire_bytes / up.raw_bytes)
        header, tensors = up.to_tensors()
        return header, tensors, up

    def check(self) -> None:
        assert self.decoder.version == self.version
        assert all(torch.equal(bit_view(self.decoder.state[k]), bit_view(self.state[k])) for k in self.state)


@pytest.mark.benchmark(group=GROUP)
def test_filesystem_delta(benchmark, payload, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    ds = _DeltaStream(payload)

    def run():
        header, tensors, _ = ds.encode()
        path = tmp_path / f"delta_{ds.version}.safetensors"
        save_file(tensors, str(path), metadata={"delta": header})
        with safe_open(str(path), framework="pt") as f:
            got = f.metadata()["delta"]
        ds.decoder.apply(DeltaUpdate.from_tensors(got, load_file(str(path))))
        path.unlink()

    benchmark.pedantic(run, setup=ds.step, rounds=5, warmup_rounds=1)
    ds.check()
    benchmark.extra_info.update(changed_fraction=DELTA_FRACTION, wire_ratio=sum(ds.wire) / len(ds.wire))


@pytest.mark.benchmark(group=GROUP)
def test_gloo_broadcast_bf16_delta(benchmark, payload, group):
    b, rx = group
    ds = _DeltaStream(payload)

    def run():
        header, tensors, _ = ds.encode()
        named = {HEADER_KEY: torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8), **tensors}
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(zip(("version", "tensors"), rx.receive_all(), strict=True)))
        t.start()
        info = b.send(named, ds.version)
        t.join()
        recv = got["tensors"]
        ds.decoder.apply(DeltaUpdate.from_tensors(bytes(recv.pop(HEADER_KEY).numpy()).decode(), recv))
        return info

    info = benchmark.pedantic(run, setup=ds.step, rounds=5, warmup_rounds=1)
    ds.check()
    benchmark.extra_info.update(bytes=info["bytes"], changed_fraction=DELTA_FRACTION,
                                wire_ratio=sum(ds.wire) / len(ds.wire))
