"""Regression tests from the fresh-eyes review of issue 9 (inference at scale). Each test failed before its fix."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from moe_rl.inference.prefix_hash import prefix_block_hashes
from moe_rl.inference.router import RequestRouter, RouterConfig
from moe_rl.inference.version_skew import VersionSkewMonitor
from moe_rl.weights.broadcast import (
    BroadcastReceiver,
    WeightBroadcaster,
    WeightBroadcastError,
    broadcast_weights,
)
from moe_rl.weights.fp8 import quantize_state_dict_fp8
from moe_rl.weights.push import push_weights


# ---------------------------------------------------------------------------------------------------- router
def test_router_finish_keeps_the_salt_when_the_prompt_has_no_full_block():
    """on_start(decision=d) without cache_salt (as RoutedClient calls it): the prompt + output blocks inserted at
    on_finish must be hashed under the request's salt. With a prompt shorter than one block, block 0 of the
    finished sequence was hashed unsalted, so the next turn never matched."""
    bs, salt = 4, "moe_rl-v3-float32"
    r = RequestRouter(RouterConfig(block_size=bs), num_engines=2)
    prompt, output = [1, 2, 3], [4, 5, 6, 7, 8, 9]
    d = r.route(prompt, salt, session_id="s")
    assert d.block_hashes == [] and d.cache_salt == salt
    r.on_start(d.engine, "a", n_tokens=10, decision=d)
    r.on_finish(d.engine, "a", [prompt + output])
    turn2 = prompt + output + [10, 11]
    d2 = r.route(turn2, salt)
    # vLLM caches (9 - 1) // 4 = 2 blocks of the finished sequence, hashed with the salt in block 0
    assert d2.predicted_hit_blocks == [2, 0]
    cached = prefix_block_hashes(prompt + output, bs, salt)[:2]
    assert set(cached) <= set(r._engines[d.engine].blocks)
    assert not set(prefix_block_hashes(prompt + output, bs, None)) & set(r._engines[d.engine].blocks)


def test_router_on_start_rejects_a_salt_other_than_the_decisions():
    r = RequestRouter(RouterConfig(block_size=4), num_engines=1)
    d = r.route([1, 2, 3, 4, 5], "v1")
    with pytest.raises(ValueError, match=r"cache_salt='v2' differs from decision.cache_salt='v1'"):
        r.on_start(d.engine, "a", 8, cache_salt="v2", decision=d)
    r.on_start(d.engine, "a", 8, cache_salt="v1", decision=d)  # the same salt is fine


# ---------------------------------------------------------------------------------------------------- fp8
def test_fp8_transfer_keeps_the_mtp_layers_high_precision():
    """vLLM's deepseek_mtp.py / glm4_moe_mtp.py build ``eh_proj`` as a plain nn.Linear and ``shared_head.head`` as
    a ParallelLMHead: neither takes FP8 weights + weight_scale_inv (bf16 in the DeepSeek-V3 release)."""
    sd = {
        "model.layers.61.eh_proj.weight": torch.randn(64, 128),
        "model.layers.61.shared_head.head.weight": torch.randn(300, 64),
        "model.layers.61.enorm.weight": torch.randn(64),
        "model.layers.61.self_attn.o_proj.weight": torch.randn(64, 128),  # the MTP block's own linears: FP8
    }
    out, rep = quantize_state_dict_fp8(sd)
    assert out["model.layers.61.eh_proj.weight"] is sd["model.layers.61.eh_proj.weight"]
    assert out["model.layers.61.shared_head.head.weight"] is sd["model.layers.61.shared_head.head.weight"]
    assert "model.layers.61.eh_proj.weight_scale_inv" not in out
    assert "model.layers.61.shared_head.head.weight_scale_inv" not in out
    assert rep["quantized_names"] == ["model.layers.61.self_attn.o_proj.weight"]
    assert out["model.layers.61.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------------- push
class _Engine:
    """InferenceClient double whose pause can raise after pausing (a client-side timeout) and resume can fail."""

    def __init__(self, pause_raises: bool = False, resume_raises: bool = False):
        self.paused = False
        self.version = 0
        self.pause_raises, self.resume_raises = pause_raises, resume_raises

    async def generate(self, *a, **k):  # pragma: no cover - not used
        raise NotImplementedError

    async def update_weights(self, path, version):
        self.version = version
        return {"version": version}

    async def weight_version(self):
        return self.version

    async def pause(self, mode="keep", clear_cache=False):
        self.paused = True
        if self.pause_raises:
            raise TimeoutError("pause: no answer within timeout_s")

    async def resume(self):
        if self.resume_raises:
            raise ConnectionError("resume: connection refused")
        self.paused = False

    async def is_paused(self):
        return self.paused

    async def reset_prefix_cache(self, reset_running_requests=False):
        return True

    async def health(self):
        return True


def test_push_weights_resumes_an_engine_whose_pause_raised():
    slow = _Engine(pause_raises=True)
    out = asyncio.run(push_weights({"slow": slow, "ok": _Engine()}, "/w/step_2", 2))
    assert not slow.paused  # it paused server-side before the client gave up: resume() must still be sent
    assert out["errors"] == {"slow": "TimeoutError: pause: no answer within timeout_s"}
    assert set(out["results"]) == {"ok"}


def test_push_weights_says_when_an_engine_may_be_left_paused():
    stuck = _Engine(resume_raises=True)
    out = asyncio.run(push_weights({"stuck": stuck}, "/w/step_1", 1))
    assert "updated to version 1, but resume() failed" in out["errors"]["stuck"]
    assert "may still be PAUSED" in out["errors"]["stuck"]
    both = _Engine(pause_raises=True, resume_raises=True)
    out = asyncio.run(push_weights({"both": both}, "/w/step_1", 1))
    msg = out["errors"]["both"]
    assert msg.startswith("RuntimeError: TimeoutError: pause: no answer") and "may still be PAUSED" in msg


# ---------------------------------------------------------------------------------------------------- skew
def test_version_skew_flags_an_engine_ahead_of_the_pushed_version():
    """After a failed push of version 5 (e.g. a trainer resumed from an older checkpoint), an engine still serving
    7 is not 'ok': its rollouts would be stamped with a version the trainer has not produced."""
    m = VersionSkewMonitor(max_skew=0)
    rep = m.evaluate({"a": 5, "b": 7}, expected=5)
    assert not rep.ok and rep.ahead == {"b": 2} and rep.lagging == {}
    assert "ahead of the expected version b by 2 (at 7)" in rep.describe()
    assert m.evaluate({"a": 5, "b": 5}, expected=5).ok
    assert m.evaluate({"a": 5, "b": 7}).ahead == {}  # without expected, the newest served is the target


# ---------------------------------------------------------------------------------------------------- broadcast
class _RecordingClient:
    def __init__(self):
        self.calls = 0

    async def update_weights_from_broadcast(self, version):
        self.calls += 1
        return {"version": version}


def test_broadcast_weights_rejects_bad_tensors_before_any_engine_rpc():
    """A repeated name used to fail only inside the trainer's send thread, after every engine RPC was already
    waiting for a header: each waited timeout_s and dropped the group."""
    b = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=5.0)
    try:
        client = _RecordingClient()
        items = [("w", torch.zeros(2)), ("w", torch.ones(2))]
        with pytest.raises(ValueError, match="tensor name 'w' appears twice"):
            asyncio.run(broadcast_weights(b, [client], items, version=1))
        assert client.calls == 0
    finally:
        b.close()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_send_marks_the_group_broken_when_packing_fails_after_the_header():
    """A tensor that cannot be packed (here a sparse one) fails after the header went out: the receivers are
    mid-update, so the broadcaster must refuse to reuse the group (it used to stay usable)."""
    b = WeightBroadcaster("127.0.0.1", 0, 2, timeout_s=3.0)
    got: dict[str, object] = {}

    def receiver() -> None:
        try:
            rx = BroadcastReceiver("127.0.0.1", b.port, 1, 2, timeout_s=3.0)
            got["plan"] = rx.receive_header()
            list(rx.stream(got["plan"]))
        except Exception as exc:  # the bucket never comes: timeout
            got["error"] = exc

    t = threading.Thread(target=receiver, daemon=True)
    t.start()
    b.connect()
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (4,))
    with pytest.raises(Exception) as first:
        b.send([("dense", torch.ones(3)), ("sparse", sparse)], version=1)
    assert not isinstance(first.value, WeightBroadcastError)
    assert b.stats["failures"] == 1
    with pytest.raises(WeightBroadcastError, match="the group broke earlier"):
        b.send([("dense", torch.ones(3))], version=2)
    t.join(10)
    assert got["plan"].version == 1 and isinstance(got.get("error"), WeightBroadcastError)
    b.close()


# ---------------------------------------------------------------------------------------------------- routed client
class _SlowOrFailing:
    def __init__(self, fail: bool, delay_s: float):
        self.fail, self.delay_s, self.version = fail, delay_s, 0

    async def update_weights(self, path, version):
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError(f"cannot read {path}")
        self.version = version
        return {"version": version}

    async def aclose(self):
        pass


def test_routed_client_fan_out_raises_only_after_every_engine_finished():
    """``RoutedClient.update_weights`` documented "the others still ran" but raised while they were still running
    (plain ``gather``): the caller then saw a mixed, still-changing state."""
    from moe_rl.inference.routed_client import RoutedClient

    bad, slow = _SlowOrFailing(fail=True, delay_s=0.0), _SlowOrFailing(fail=False, delay_s=0.2)

    async def body():
        rc = RoutedClient([bad, slow], RequestRouter(RouterConfig(), 2))
        with pytest.raises(RuntimeError, match="cannot read /w/step_4") as exc:
            await rc.update_weights("/w/step_4", 4)
        return exc.value

    err = asyncio.run(body())
    assert slow.version == 4  # finished before the error surfaced
    assert "failed on engines [0] of 2" in "".join(err.__notes__)
