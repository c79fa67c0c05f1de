"""Runs the chunked DSA indexer with Triton-scored blocks in Triton's CPU interpreter; driven by
``test_dsa_chunked.py::test_chunked_indexer_triton_blocks_in_interpreter``.

``TRITON_INTERPRET=1`` must be set before triton is first imported, hence a fresh process. The indexer inputs are
multiples of 1/4, so every score is exact in fp32 in the kernel and in torch: the streaming top-k must return
the dense reference's indices exactly (ties included). Writes ``{case: "ok" | traceback}`` to ``OUT.json``.
Usage: ``python _triton_chunked_worker.py OUT.json``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("MOE_RL_TEST_THREADS", "1")))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the tolerance helpers
from _tolerance import assert_normwise_close  # noqa: E402

from moe_rl.attention import dsa_attention, key_windows, lightning_indexer, select_topk  # noqa: E402
from moe_rl.attention.dsa_chunked import chunked_indexer_topk  # noqa: E402


def _exact(shape, g):
    return torch.randint(-3, 4, shape, generator=g).float() / 4


def _case(T, cu, K, causal, qc, kc, seed, q_offset=0):
    g = torch.Generator().manual_seed(seed)
    Tq = T - q_offset
    iq, iw, ik = _exact((Tq, 2, 16), g), _exact((Tq, 2), g), _exact((T, 16), g)
    cu = torch.tensor(cu)
    q_idx = torch.arange(Tq) + q_offset
    ks, ke = key_windows(q_idx, cu, causal=causal)
    dense = select_topk(lightning_indexer(iq, iw, ik, causal=causal, cu_seqlens=cu, q_token_idx=q_idx).scores, K,
                        ks=ks, ke=ke)
    got = chunked_indexer_topk(iq, iw, ik, K, ks=ks, ke=ke, q_chunk_size=qc, k_chunk_size=kc, score_backend="triton")
    assert torch.equal(got, dense), f"T={T} cu={cu.tolist()} K={K} causal={causal}: indices differ"


def causal_packed():
    _case(40, [0, 13, 40], 6, True, 16, 16, 0)
    _case(37, [0, 37], 5, True, 7, 11, 1)  # chunks that are not powers of two / multiples


def noncausal_offset():
    _case(33, [0, 20, 30], 4, False, 8, 9, 2)
    _case(30, [0, 12, 30], 6, True, 5, 8, 3, q_offset=19)


def dsa_entry():
    g = torch.Generator().manual_seed(4)
    T = 24
    q, kv = torch.randn(T, 2, 12, generator=g), torch.randn(T, 12, generator=g)
    iq, iw, ik = _exact((T, 2, 16), g), _exact((T, 2), g), _exact((T, 16), g)
    kw = dict(v_head_dim=8, index_q=iq, index_weights=iw, index_k=ik, index_topk=5)
    a = dsa_attention(q, kv, backend="dense", **kw)
    b = dsa_attention(q, kv, backend="torch", indexer_backend="triton", q_chunk_size=8, k_chunk_size=16, **kw)
    assert torch.equal(a.topk_indices, b.topk_indices)  # exact indexer inputs: the same scores in any order
    # two fp32 attention paths (dense vs chunked: other orders) over the same keys: normwise bound of the scores
    # (12 terms), the softmax and the weighted sum (<= 24 keys), doubled (tests/_tolerance.py)
    assert_normwise_close(b.out, a.out, dtype=torch.float32, k=24, depth=2 * 3, what="dsa out")


def main() -> None:
    out = {}
    for fn in (causal_packed, noncausal_offset, dsa_entry):
        try:
            fn()
            out[fn.__name__] = "ok"
        except Exception:
            out[fn.__name__] = traceback.format_exc()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
