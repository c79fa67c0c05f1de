"""Routed-experts recording overhead on the vLLM CPU engine: decode with vs without the capture hook (R3).

One in-process engine (fp32 here, bf16 with ``MOE_RL_BENCH_DTYPE=bfloat16``) serving a 4-layer GLM-4.5-shaped
model (3 MoE layers, 8 experts, top-2; the debug_cpu recipe's widths). Each round decodes 16 sequences x 64
tokens greedily from 16-token prompts (decode-dominated: 64 steps of 16 tokens after one small prefill).
``baseline``: capture off. ``candidate``: capture on (router callbacks + per-step scatter to requests and KV
blocks) **plus** fetching and serializing every request's record (``pop_routed_experts``), i.e. all the
recording work a rollout pays. Target: ratio < 1.03.

Wall times on a shared CPU are noisy (other jobs steal the core between the two entries), so the overhead is
also measured within the same steps: the recorder adds up the wall time spent in the hook (router callbacks
+ scatter) and the wall time of the model forwards themselves; ``hook_frac_of_forward`` is their ratio
(the same disturbance hits both). Also saved: ``hook_us_per_step`` (thread CPU time in the hook per step)
and ``hook_frac_of_fastest_step`` = that over the fastest baseline round's wall time per decode step.
The fetch (``pop_routed_experts``: serialize 16 records) is timed apart: ``pop_ms_per_request``; it runs
once per finished request in the client, off the engine's decode loop only when the server is idle, so it is
reported separately from the decode overhead. Finally ``PAIRS`` back-to-back rounds with the hook paused / on give ``paired_ratio_median`` (median of the
per-pair on/off ratios) and ``paired_min_ratio`` (fastest on / fastest off).

Run: ``.venv/bin/pytest benchmarks/test_bench_replay.py --benchmark-json benchmarks/results/r3_recording_cpu_<date>.json``
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

NUM_SEQS, PROMPT_LEN, MAX_TOKENS = 16, 16, 64
FASTEST: dict[str, float] = {}
PAIRS = 12
POP_S: list[float] = []


@pytest.fixture(scope="module")
def engine():
    import torch

    from moe_rl.models import GlmMoeForCausalLM
    from moe_rl.models.glm4_moe import GlmMoeConfig, save_hf_checkpoint

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        cfg = GlmMoeConfig.tiny_debug(num_hidden_layers=4)
        torch.manual_seed(0)
        save_hf_checkpoint(GlmMoeForCausalLM(cfg), cfg, Path(tmp) / "m")
        llm = LLM(model=str(Path(tmp) / "m"), dtype=os.environ.get("MOE_RL_BENCH_DTYPE", "float32"),
                  max_model_len=256, enforce_eager=True, seed=0, enable_prefix_caching=False, block_size=32,
                  kv_cache_memory_bytes=64 * 2**20, distributed_executor_backend="uni", skip_tokenizer_init=True,
                  worker_extension_cls="moe_rl.weights.engine.WeightSyncExtension")
        yield llm
        llm.llm_engine.engine_core.shutdown()


def _decode(llm, capture: bool) -> None:
    from vllm import SamplingParams


    prompts = [{"prompt_token_ids": [1] + [3 + (7 * i + j) % 29 for j in range(PROMPT_LEN - 1)]}
               for i in range(NUM_SEQS)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if capture:
        t0 = time.perf_counter()
        (popped,) = llm.collective_rpc("pop_routed_experts", args=([o.request_id for o in outs],))
        POP_S.append(time.perf_counter() - t0)
        assert len(popped["records"]) == NUM_SEQS


def test_decode_without_capture(benchmark, engine):
    benchmark.group = f"decode {NUM_SEQS}x{MAX_TOKENS} tokens, 3 MoE layers"
    benchmark.extra_info["role"] = "baseline"
    benchmark.pedantic(_decode, args=(engine, False), rounds=8, warmup_rounds=2)
    FASTEST["baseline_s"] = benchmark.stats.stats.min


def test_decode_with_capture(benchmark, engine):
    engine.collective_rpc("enable_routed_experts_capture")
    (before,) = engine.collective_rpc("routed_experts_capture_stats")
    benchmark.group = f"decode {NUM_SEQS}x{MAX_TOKENS} tokens, 3 MoE layers"
    benchmark.extra_info["role"] = "candidate"
    benchmark.pedantic(_decode, args=(engine, True), rounds=8, warmup_rounds=2)
    (after,) = engine.collective_rpc("routed_experts_capture_stats")
    # Paired rounds: capture paused / on, back to back, so load drift on a shared CPU hits both alike.
    off, on = [], []
    for _ in range(PAIRS):
        for paused, out in ((True, off), (False, on)):
            engine.collective_rpc("pause_routed_experts_capture", args=(paused,))
            t0 = time.perf_counter()
            _decode(engine, not paused)
            out.append(time.perf_counter() - t0)
    engine.collective_rpc("pause_routed_experts_capture", args=(False,))
    ratios = sorted(b / a for a, b in zip(off, on, strict=True))
    benchmark.extra_info["paired_rounds"] = PAIRS
    benchmark.extra_info["paired_ratio_median"] = statistics.median(ratios)
    benchmark.extra_info["paired_min_ratio"] = min(on) / min(off)
    benchmark.extra_info["pop_ms_per_request"] = 1e3 * statistics.median(POP_S) / NUM_SEQS
    benchmark.extra_info["pop_frac_of_fastest_round"] = statistics.median(POP_S) / min(off)
    steps = after["steps"] - before["steps"]
    hook_s_per_step = (after["capture_s"] - before["capture_s"]) / steps
    benchmark.extra_info["steps"] = steps
    benchmark.extra_info["hook_us_per_step"] = 1e6 * hook_s_per_step
    benchmark.extra_info["hook_frac_of_forward"] = (after["hook_wall_s"] - before["hook_wall_s"]) / (
        after["forward_wall_s"] - before["forward_wall_s"])
    if "baseline_s" in FASTEST:
        step_s = FASTEST["baseline_s"] / MAX_TOKENS
        benchmark.extra_info["fastest_baseline_ms_per_step"] = 1e3 * step_s
        benchmark.extra_info["hook_frac_of_fastest_step"] = hook_s_per_step / step_s
