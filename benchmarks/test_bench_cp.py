"""Context-parallel attention on gloo (CPU, fp32): time vs the single-process run, activation memory and bytes.

This process is rank 0 and does the timing; ranks 1..cp-1 run ``_cp_bench_peer.py`` (command protocol, shapes:
T=1024 tokens, causal, zigzag; ring / Ulysses with H=8, Hkv=2, D=64; DSA with H=8, latent 576/512,
index_topk=256, 4x64 indexer). For cp = 2 and 4:

* time: one forward + backward of ``ring_attention``, ``ulysses_attention`` (group ``attention``) and
  ``dsa_cp_attention`` (group ``dsa``), each relative to the single-process function on all T tokens (the
  baseline: same total work, one process). On this 2-core machine cp ranks share 2 cores, so the ratio
  measures overhead, not speed-up;
* memory and traffic (deterministic, in ``extra_info``): per-rank bytes saved for the backward and payload
  bytes sent, and ``saved_ratio_vs_cp1`` = saved bytes at cp over those of the same function on a 1-rank group.
  The goal is memory proportional to 1/cp: ``test_activation_memory_scales_as_one_over_cp`` asserts it within
  10% for all three. (DSA's gathered latent ``[Tp, 576]`` is transient: the gather's backward needs only the
  indices, so it is not saved; the torch reference's saved ``[Tl, K, 576]`` selected rows dominate.)

Run: ``.venv/bin/pytest benchmarks/test_bench_cp.py --benchmark-json benchmarks/results/cp_<hw>_<date>.json``.
"""

from __future__ import annotations

from pathlib import Path

import _cp_bench_peer as peer  # benchmarks/ is on sys.path (conftest.py)
import pytest
import torch
import torch.distributed as dist

_PEER = Path(__file__).with_name("_cp_bench_peer.py")  # ranks 1..world-1 run it; rank 0 (here) imports it

ROUNDS, WARMUP = 5, 1
MEASURED: dict[tuple[int, str], dict[str, float]] = {}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def cp_group(request, tmp_path_factory, gloo_peers):
    cp = request.param
    with gloo_peers(_PEER, lambda: peer.command(0), cp, tmp_path_factory.mktemp(f"cp_bench{cp}") / "init", 600):
        yield cp


def _measure(cp: int, case: str) -> dict[str, float]:
    """Saved/sent bytes of ``case`` at this cp (all ranks) and on a 1-rank group (rank 0 alone)."""
    if (cp, case) not in MEASURED:
        peer.command(2, peer.CASES.index(case), 1)
        saved, sent = peer.measure(peer.make_case(case))
        solo = dist.new_group([0])  # collective over the world; only rank 0 uses it
        saved1, _ = peer.measure(peer.make_case(case, solo), solo)
        MEASURED[(cp, case)] = dict(saved_bytes=saved, sent_bytes=sent, saved_bytes_cp1=saved1,
                                    saved_ratio_vs_cp1=saved / saved1)
    return MEASURED[(cp, case)]


@pytest.mark.parametrize(
    "group_name, case, role",
    [
        ("attention", "reference", "baseline"),
        ("attention", "ring", "candidate"),
        ("attention", "ulysses", "candidate"),
        ("dsa", "dsa_reference", "baseline"),
        ("dsa", "dsa_cp", "candidate"),
    ],
)
def test_cp_attention(benchmark, cp_group, group_name, case, role):
    cp = cp_group
    calls = 1 if benchmark.disabled else ROUNDS + WARMUP
    if role == "candidate":
        benchmark.extra_info.update(_measure(cp, case))
    peer.command(1, peer.CASES.index(case), calls)
    step = peer.make_case(case)
    benchmark.group = f"{group_name} fwd+bwd CP={cp} gloo T={peer.T} fp32 causal zigzag"
    benchmark.extra_info.update(role=role, cp=cp, threads=torch.get_num_threads())
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP)


@pytest.mark.parametrize("case", ["ring", "ulysses", "dsa_cp"])
def test_activation_memory_scales_as_one_over_cp(cp_group, case):
    cp = cp_group
    m = _measure(cp, case)
    ratio = m["saved_ratio_vs_cp1"]
    print(f"{case} cp={cp}: saved {m['saved_bytes'] / 2**20:.2f} MiB (cp=1: {m['saved_bytes_cp1'] / 2**20:.2f} MiB), "
          f"ratio {ratio:.3f} vs 1/cp = {1 / cp:.3f}; sent {m['sent_bytes'] / 2**20:.2f} MiB per rank")
    assert abs(ratio * cp - 1) <= 0.10, (case, cp, m, ratio)
