"""Chunked LM head + token log-probs (``moe_rl.models.common.head``, ``trainer.loss_chunk_tokens``): peak
memory and time of one forward + backward vs the full-logits path, fp32 on CPU.

Shapes: N = 8192 tokens, D = 512, V = 32768 (logits ``[N, V]`` fp32 = 1 GiB). Each entry computes the token
log-probs of random labels from ``hidden [N, D]`` and ``weight [V, D]`` (both requiring grad) and backpropagates a
random upstream gradient:

* ``baseline``: ``chunk_tokens=None``, the trainer's path today (``lm_head(h).float()``, ``log_softmax``, ``gather``;
  autograd keeps the logits' log-softmax and builds ``[N, V]`` gradients);
* ``chunk 4096`` / ``chunk 1024``: :func:`moe_rl.models.common.head.chunked_label_logprobs` (backward
  recomputes the head matmul per chunk: ~4/3 of the baseline's matmul FLOPs).

Memory: each configuration runs once in a fresh subprocess (this file with ``--peak``): after the inputs exist and
a small warm-up call has loaded the BLAS kernels, the RSS high-water mark is reset (``/proc/self/clear_refs``) and
``peak_rss_growth_mib = VmHWM - VmRSS`` over one forward + backward (large tensors are ``mmap``-ed by glibc, so freed
blocks leave RSS and the high-water mark is the peak of live tensors plus allocator slack). Not ``ru_maxrss``: a
child inherits its parent's RSS peak there. ``peak_ratio_vs_unchunked`` divides by the baseline's growth measured in the same
run. The growth includes the returned ``dh`` (16 MiB) and ``dW`` (64 MiB). Time: median of the pytest-benchmark
rounds (one thread, ``benchmarks/conftest.py``); ``ratio_to_baseline`` in the JSON.

Run: ``.venv/bin/pytest benchmarks/test_bench_chunked_logprobs.py --benchmark-json
benchmarks/results/chunked_logprobs_cpu_<date>.json``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

N, D, V = 8192, 512, 32768
CHUNKS = [None, 4096, 1024]
GROUP = f"head+logprobs fwd+bwd N={N} D={D} V={V} fp32"
PEAK_MIB: dict[str, float] = {}


def _inputs(n: int = N):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=g)
    up = torch.randn(n, generator=g)
    return h, w, labels, up


def _step(h, w, labels, up, chunk) -> None:
    from moe_rl.models.common.head import head_label_logprobs

    lp = head_label_logprobs(h[None], w, labels[None], 1.0, chunk)[0]
    dh, dw = torch.autograd.grad(lp, (h, w), up)
    assert dh.shape == h.shape and dw.shape == w.shape


def _status_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in KiB (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _peak_in_subprocess(chunk) -> float:
    """Peak RSS growth (MiB) of one forward + backward in a fresh Python process."""
    res = subprocess.run([sys.executable, __file__, "--peak", "none" if chunk is None else str(chunk)],
                         capture_output=True, text=True, timeout=600, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1",
                                  PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    if res.returncode != 0:
        raise RuntimeError(f"peak subprocess failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_rss_growth_mib"]


def _label(chunk) -> str:
    return "unchunked" if chunk is None else f"chunk {chunk}"


@pytest.mark.parametrize("chunk", CHUNKS, ids=_label)
def test_head_logprobs_fwd_bwd(benchmark, chunk):
    torch.set_num_threads(1)
    key = _label(chunk)
    PEAK_MIB[key] = _peak_in_subprocess(chunk)
    if "unchunked" not in PEAK_MIB:
        PEAK_MIB["unchunked"] = _peak_in_subprocess(None)
    benchmark.group = GROUP
    benchmark.extra_info["role"] = "baseline" if chunk is None else "candidate"
    benchmark.extra_info["chunk_tokens"] = chunk
    benchmark.extra_info["peak_rss_growth_mib"] = PEAK_MIB[key]
    benchmark.extra_info["peak_ratio_vs_unchunked"] = PEAK_MIB[key] / PEAK_MIB["unchunked"]
    benchmark.extra_info["logits_fp32_mib"] = N * V * 4 / 2**20
    h, w, labels, up = _inputs()
    benchmark.pedantic(_step, args=(h, w, labels, up, chunk), rounds=2, warmup_rounds=0)
    print(f"\n{key}: peak RSS growth {PEAK_MIB[key]:.0f} MiB = {PEAK_MIB[key] / PEAK_MIB['unchunked']:.3f} x unchunked")


def _main_peak(arg: str) -> None:
    torch.set_num_threads(1)
    chunk = None if arg == "none" else int(arg)
    _step(*_inputs(64), 16 if chunk is not None else None)  # load kernels, allocator arenas
    h, w, labels, up = _inputs()
    before_kib = _status_kib("VmRSS")
    try:  # reset this process's RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then VmHWM also covers building the inputs, whose transient peak is < 100 MiB above VmRSS
    _step(h, w, labels, up, chunk)
    peak_kib = _status_kib("VmHWM")
    print(json.dumps({"chunk": chunk, "peak_rss_growth_mib": (peak_kib - before_kib) / 1024}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peak":
        _main_peak(sys.argv[2])
    else:
        sys.exit("usage: python test_bench_chunked_logprobs.py --peak none|CHUNK")
