"""Bad input to the memory-bounded DSA entry points gets a ValueError/TypeError naming the argument and the rule.

Before these checks, a wrong ``index_weights`` shape broadcast silently in ``chunked_indexer_topk`` (a wrong
top-k, no error), and ``sparse_latent_attention_chunked`` accepted float indices, ``-2`` slots, a broadcastable
``valid``, ``v_head_dim = 0`` and mixed q/kv dtypes, or failed with torch's IndexError / einsum messages.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.attention import chunked_indexer_topk, select_topk, sparse_latent_attention_chunked

Tq, HI, DI, H, DK = 6, 2, 4, 2, 5


def _indexer():
    g = torch.Generator().manual_seed(0)
    iq, iw, ik = torch.randn(Tq, HI, DI, generator=g), torch.randn(Tq, HI, generator=g), torch.randn(Tq, DI, generator=g)
    ks, ke = torch.zeros(Tq, dtype=torch.long), torch.arange(1, Tq + 1)
    return iq, iw, ik, ks, ke


def _sparse():
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(Tq, H, DK, generator=g), torch.randn(Tq, DK, generator=g)
    idx = torch.tensor([[0, 1], [1, -1], [2, 0], [3, 1], [4, 2], [5, 0]])
    return q, kv, idx


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "index_weights": a["index_weights"][:, :1]}, r"index_weights \(6, 1\) must be \[Tq, HI\]"),
    (lambda a: {**a, "index_q": a["index_q"][:, 0]}, r"index_q \[Tq, HI, DI\]"),
    (lambda a: {**a, "index_k": a["index_k"][:, :3]}, r"index_k head dim 3 != index_q head dim 4"),
    (lambda a: {**a, "ks": a["ks"][:3]}, r"ks must be a \[Tq=6\] int32/int64 tensor"),
    (lambda a: {**a, "ke": a["ke"].float()}, r"ke must be a \[Tq=6\] int32/int64 tensor"),
])
def test_chunked_indexer_topk_rejects_bad_shapes(change, match):
    iq, iw, ik, ks, ke = _indexer()
    args = change({"index_q": iq, "index_weights": iw, "index_k": ik, "ks": ks, "ke": ke})
    with pytest.raises(ValueError, match=match):
        chunked_indexer_topk(args["index_q"], args["index_weights"], args["index_k"], 2, ks=args["ks"], ke=args["ke"])


def test_chunked_indexer_topk_good_input_still_matches_select_topk():
    """The checks refuse nothing valid: the streamed top-k equals select_topk of the dense scores."""
    iq, iw, ik, ks, ke = _indexer()
    iq, iw, ik = iq.double(), iw.double(), ik.double()
    scores = torch.einsum("ths,th->ts", torch.relu(torch.einsum("thd,sd->ths", iq, ik)), iw)
    got = chunked_indexer_topk(iq, iw, ik, 3, ks=ks, ke=ke, q_chunk_size=4, k_chunk_size=2)
    assert torch.equal(got, select_topk(scores, 3, ks=ks, ke=ke))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"topk_indices": "float"}, TypeError, r"topk_indices must be an int32/int64 tensor, got torch.float32"),
    ({"topk_indices": "minus2"}, ValueError, r"topk_indices must lie in \[-1, Tk=6\).*\[-3, 3\]"),
    ({"topk_indices": "too_big"}, ValueError, r"topk_indices must lie in \[-1, Tk=6\).*\[-1, 6\]"),
    ({"topk_indices": "rows"}, ValueError, r"topk_indices must be \[Tq=6, K\], got \(4, 2\)"),
    ({"valid": torch.ones(2, dtype=torch.bool)}, ValueError, r"valid must be a bool tensor of shape \(6, 2\)"),
    ({"valid": torch.ones(6, 2)}, ValueError, r"valid must be a bool tensor of shape \(6, 2\)"),
    ({"v_head_dim": 0}, ValueError, r"v_head_dim=0 must be an int in \[1, Dk=5\]"),
    ({"v_head_dim": 9}, ValueError, r"v_head_dim=9 must be an int in \[1, Dk=5\]"),
    ({"kv": "float64"}, TypeError, r"q is torch.float32 but kv is torch.float64"),
    ({"kv": "dk4"}, ValueError, r"q \[Tq, H, Dk\] and kv \[Tk, Dk\] with equal Dk"),
])
def test_sparse_latent_attention_chunked_rejects_bad_input(kwargs, exc, match):
    q, kv, idx = _sparse()
    variants = {"float": idx.float(), "minus2": idx - 2, "too_big": torch.where(idx == 5, 6, idx), "rows": idx[:4],
                "float64": kv.double(), "dk4": kv[:, :4]}
    args = {"q": q, "kv": kv, "topk_indices": idx, "v_head_dim": 3, "scale": 0.5}
    args.update({k: variants[v] if isinstance(v, str) else v for k, v in kwargs.items()})
    with pytest.raises(exc, match=match):
        sparse_latent_attention_chunked(**args)


def test_select_topk_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"scores must be a \[Tq, Tk\] tensor, got \(3,\)"):
        select_topk(torch.randn(3), 1, ks=torch.zeros(3, dtype=torch.long), ke=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ke must be a \[Tq=3\] integer tensor"):
        select_topk(torch.randn(3, 3), 1, ks=torch.zeros(3, dtype=torch.long), ke=torch.ones(2, dtype=torch.long))
