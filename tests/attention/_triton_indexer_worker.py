"""Runs the Triton lightning-indexer kernel in Triton's CPU interpreter; driven by ``test_triton_indexer.py``.

``TRITON_INTERPRET=1`` must be set before triton is first imported, hence a fresh process. Writes
``{case: "ok" | traceback}`` to ``OUT.json``. Usage: ``python _triton_indexer_worker.py OUT.json``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared tolerance rule

from _tolerance import assert_within, rounding_bound  # noqa: E402

from moe_rl.attention import key_windows, lightning_indexer  # noqa: E402
from moe_rl.attention.triton_indexer import indexer_scores_triton  # noqa: E402


def _check(Tq, Tk, HI, DI, cu, causal, seed, q_offset=None, bm=16, bn=16, strided=False):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(Tq, HI, DI, generator=g)
    if strided:  # non-contiguous [Tq, HI, DI] view
        iq = torch.randn(HI, Tq, DI, generator=g).transpose(0, 1)
    iw = torch.randn(Tq, HI, generator=g)
    ik = torch.randn(Tk, DI, generator=g)
    cu = torch.tensor(cu)
    q_idx = torch.arange(Tq) + (Tk - Tq if q_offset is None else q_offset)
    ks, ke = key_windows(q_idx, cu, causal=causal)
    got = indexer_scores_triton(iq, iw, ik, ks, ke, block_m=bm, block_n=bn)
    ref = lightning_indexer(iq.double(), iw.double(), ik.double(), causal=causal, cu_seqlens=cu,
                            q_token_idx=q_idx).scores
    tag = f"Tq={Tq} Tk={Tk} HI={HI} DI={DI} cu={cu.tolist()} causal={causal}"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{tag}: -inf pattern differs"
    # score[t, s] = sum_h w_th relu(q_th . k_s): DI-term fp32 dots (tl.dot in the interpreter, numpy's order),
    # then an HI-term weighted sum. Error <= bound(DI) + bound(HI) on scale[t, s] = sum_h |w_th| (|q_th| . |k_s|)
    # (tests/_tolerance.py). A wrong key window, a dropped head or a missing weight moves a score by ~|score|,
    # > 1e4 times this bound at these sizes; a wrong tile offset shows in the -inf pattern or the same way.
    scale = torch.einsum("th,ths->ts", iw.double().abs(),
                         torch.einsum("thd,sd->ths", iq.double().abs(), ik.double().abs()))
    bound = rounding_bound(scale, DI, torch.float32) + rounding_bound(scale, HI, torch.float32)
    assert_within(got, ref, bound, f"{tag} triton (block_m={bm}, block_n={bn})")
    # lightning_indexer(backend="triton") dispatches to the kernel with its default tiles: bit-equal to a direct
    # call with those tiles (same kernel, tiles, inputs and order). Other tile sizes reduce in another order
    # (the interpreter's tl.dot is a numpy matmul of the tile), so they only agree within the bound above.
    via_api = lightning_indexer(iq, iw, ik, causal=causal, cu_seqlens=cu, q_token_idx=q_idx, backend="triton").scores
    assert torch.equal(via_api, indexer_scores_triton(iq, iw, ik, ks, ke)), f"{tag}: backend='triton' dispatch"
    assert_within(via_api, ref, bound, f"{tag} backend='triton' (default tiles)")
    # and the torch fp32 backend (einsum through MKL: CPU-dependent order) is within the same bound
    t32 = lightning_indexer(iq, iw, ik, causal=causal, cu_seqlens=cu, q_token_idx=q_idx).scores
    assert_within(t32, ref, bound, f"{tag} backend='torch' fp32")

CASES = {
    "causal_packed": lambda: _check(40, 40, 3, 24, [0, 13, 40], True, 0),  # DI=24 -> padded BLOCK_D=32
    "noncausal_packed": lambda: _check(33, 33, 2, 16, [0, 20, 30], False, 1, bm=32, bn=16),  # padding rows 30..32
    "query_block_offset": lambda: _check(10, 37, 4, 16, [0, 37], True, 2),  # B08: queries are the last 10 tokens
    "strided_q": lambda: _check(17, 17, 2, 16, [0, 17], True, 3, strided=True),
}


def main() -> None:
    out = sys.argv[1]
    res = {}
    for name, fn in CASES.items():
        try:
            fn()
            res[name] = "ok"
        except Exception:
            res[name] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
