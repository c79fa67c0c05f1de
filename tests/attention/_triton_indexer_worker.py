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

import torch  # noqa: E402

torch.set_num_threads(1)

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
    fin = torch.isfinite(ref)
    # fp32 dot products of DI terms and an HI-term weighted sum: error ~ eps32 * sum |w| |q||k|
    bound = 1e-5 * (iw.abs().sum(-1, keepdim=True) * iq.norm(dim=-1).max(-1, keepdim=True).values
                    * ik.norm(dim=-1).max()).expand_as(ref)
    err = (got.double() - ref).abs()
    assert bool((err[fin] <= bound[fin]).all()), f"{tag}: max err {err[fin].max().item()}"
    # and the torch fp32 backend agrees the same way
    t32 = lightning_indexer(iq, iw, ik, causal=causal, cu_seqlens=cu, q_token_idx=q_idx, backend="triton").scores
    assert torch.equal(t32, got)


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
