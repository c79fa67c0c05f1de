"""Context-parallel attention (ring, Ulysses, DSA all-gather, the MLA module under CP) against single-process
attention on real gloo process groups of 2 and 4 ranks (one process per rank: ``tests/attention/_cp_worker.py``).

Each world size is launched once per module (a fixture) and runs every scenario; each test below checks one
scenario's result on every rank. Scenarios follow the global-reference-then-shard pattern with the library's
own :class:`moe_rl.attention.ShardPlan`:

* fp32 at atol 1e-5: output, LSE and dq/dk/dv of ring and Ulysses for zigzag and contiguous layouts, causal
  and non-causal, one sequence / packed sequences / lengths not divisible by 2*cp (padding);
* DSA all-gather CP with the memory-bounded path (``backend="torch"``) against the dense single-process
  reference: identical top-k indices, out, dq, d(latent KV) at atol 1e-5, replayed indices;
* DSA all-gather CP: top-k indices (global coordinates) identical to single-process, output, dq, d(latent KV)
  reduce-scattered to owners, d(index_k) through the indexer KL loss; the replay path (``topk_indices=``);
  index_topk larger than the stream (B10);
* bf16: the CP error against an fp64 reference is at most 2x that of the single-process bf16 reference
  (+1e-3; flash-attention's test criterion); the measured errors are in the worker's ``_stats``;
* the MLA module (DSA layer with ``dsa_allgather``, dense MLA layer with ring / Ulysses): outputs and every
  parameter gradient (all-reduced) equal the single-process module;
* batched rows ``[B, Tl, H, D]`` (the trainer's call): each row equals the single-process reference on that
  row alone, with shared ``[Tl]`` and per-row ``[B, Tl]`` token indices (rows in different layouts);
* cases B06 (2999 tokens at cp=4; 7 tokens), B07 (a, b, c), B08, and sizes that differ across ranks raising the
  same ValueError everywhere.

Cost: about 8 CPU-seconds for the 2-rank run and 22 for the 4-rank run (measured with ``time``, user+sys), mostly
process start-up and first-call warm-up. That is 30 s / 80 s of wall time on a 2-core machine at load average
15-20, and less when idle.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import check_scenario, ranks_fixture

WORKER = Path(__file__).with_name("_cp_worker.py")
TIMEOUT_S = 300


cp = ranks_fixture(WORKER, (2, 4), TIMEOUT_S)  # each world size launched once, every scenario at each


SCENARIOS = ["ring_fp32", "ulysses_fp32", "dsa_cp", "dsa_chunked_cp", "b06_length_2999", "b07_heads", "b08_ring_offsets", "bf16",
             "mla_module_cp", "batched_rows", "validation_errors"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cp(cp, scenario):
    check_scenario(cp, scenario)
