"""The Triton lightning-indexer kernel (``moe_rl.attention.triton_indexer``) in Triton's CPU interpreter.

The kernel runs in one subprocess (``_triton_indexer_worker.py``) with ``TRITON_INTERPRET=1`` set before triton
is imported. Inputs are fp32: the interpreter's bf16 ``tl.dot`` is broken and its fp32->bf16 casts truncate
(/work/shared/notes/feasibility.md §2), and the kernel upcasts to fp32 before ``tl.dot`` anyway. Each case
compares against the float64 torch reference: the ``-inf`` pattern (key windows, packed sequences, padding,
a query block at an offset) must match exactly, finite scores within ``1e-5 * sum_j |w_j| * max|q| * max|k|``
(fp32 rounding of DI-term dots and an HI-term weighted sum), and ``lightning_indexer(backend="triton")`` must
return the kernel's result. Worker runtime: a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _triton_interp import import_without_triton, run_interpreter_worker

pytest.importorskip("triton")

WORKER = Path(__file__).with_name("_triton_indexer_worker.py")
CASES = ["causal_packed", "noncausal_packed", "query_block_offset", "strided_q"]


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory) -> dict[str, str]:
    return run_interpreter_worker(WORKER, tmp_path_factory.mktemp("triton_indexer") / "results.json")


@pytest.mark.parametrize("case", CASES)
def test_triton_indexer_in_interpreter(interp_results, case):
    assert interp_results.get(case) == "ok", interp_results.get(case, f"case {case!r} did not run")


def test_triton_backend_refuses_cpu_tensors_without_interpreter(monkeypatch):
    import torch

    from moe_rl.attention.triton_indexer import indexer_scores_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        indexer_scores_triton(torch.zeros(2, 1, 16), torch.zeros(2, 1), torch.zeros(2, 16), z, z)


def test_module_imports_without_triton(monkeypatch):
    import torch

    ti = import_without_triton(monkeypatch, "moe_rl.attention.triton_indexer")
    assert not ti.triton_available()
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ImportError, match="pip install triton"):
        ti.indexer_scores_triton(torch.zeros(2, 1, 16), torch.zeros(2, 1), torch.zeros(2, 16), z, z)
