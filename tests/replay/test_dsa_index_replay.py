"""DSA index replay through the TokenIndices codec: the replayed top-k gives the indexer run's exact output
and gradients (moe_rl.attention.dsa_attention, the reference DSA of the attention issue)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.replay import DsaIndices, TokenIndices

dsa = pytest.importorskip("moe_rl.attention")


def test_dsa_replay_equals_indexer_run_outputs_and_grads():
    torch.manual_seed(0)
    layers, T, H, Dk, Dv, HI, DI, topk = 2, 40, 4, 24, 16, 2, 8, 8
    cu = torch.tensor([0, 15, 40])  # two packed sequences: key windows restart at 15
    inputs = []
    for _ in range(layers):
        q = torch.randn(T, H, Dk, dtype=torch.float64, requires_grad=True)
        kv = torch.randn(T, Dk, dtype=torch.float64, requires_grad=True)
        iq, iw, ik = torch.randn(T, HI, DI), torch.rand(T, HI), torch.randn(T, DI)
        inputs.append((q, kv, iq, iw, ik))

    # Inference side: run the indexer, record [T, layers, topk] with -1 for unused slots.
    ran, recorded = [], []
    for q, kv, iq, iw, ik in inputs:
        res = dsa.dsa_attention(q, kv, v_head_dim=Dv, scale=0.3, index_q=iq, index_weights=iw, index_k=ik,
                                index_topk=topk, cu_seqlens=cu)
        ran.append(res)
        recorded.append(res.topk_indices)
    record = DsaIndices.from_array(torch.stack(recorded, dim=1), num_ids=T)
    assert record.ids.dtype.name == "int16" and (record.to_numpy() == -1).any()  # early queries see < topk keys
    wire = record.to_bytes(packed=True)  # 6 bits per id (41 values: -1..39)
    replayed = TokenIndices.from_bytes(wire).to_tensor()  # [T, layers, topk] int64
    assert torch.equal(replayed, torch.stack(recorded, dim=1))

    # Trainer side: replay each layer's ids; the indexer does not run.
    for layer, ((q, kv, *_), res) in enumerate(zip(inputs, ran, strict=True)):
        g = torch.randn_like(res.out)
        ga = torch.autograd.grad((res.out * g).sum(), (q, kv))
        rep = dsa.dsa_attention(q, kv, v_head_dim=Dv, scale=0.3, topk_indices=replayed[:, layer], cu_seqlens=cu)
        gb = torch.autograd.grad((rep.out * g).sum(), (q, kv))
        assert int(rep.num_dropped_indices) == 0
        # bit-equal: the replayed indices are the selection itself (same order), so the same sparse attention
        torch.testing.assert_close(rep.out, res.out, atol=0, rtol=0)
        torch.testing.assert_close(rep.lse, res.lse, atol=0, rtol=0)
        for a, b in zip(ga, gb, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    # A replay that differs (indices of another layer) changes the output: the test can fail.
    other = dsa.dsa_attention(inputs[0][0], inputs[0][1], v_head_dim=Dv, scale=0.3, topk_indices=replayed[:, 1],
                              cu_seqlens=cu)
    assert (other.out - ran[0].out).abs().max() > 1e-6
