"""CPU stand-in for DeepGEMM's indexer-logits kernels (tests only): the documented contract in plain torch.

Source of the contract: github.com/deepseek-ai/DeepGEMM (``csrc/apis/attention.hpp``: ``fp8_fp4_mqa_logits`` and
the legacy ``fp8_mqa_logits``, their pybind signatures and DG_HOST_ASSERT checks (SM90 rules: 32 or 64 heads); README
"V3.2 MQA kernels for the indexer"; ``tests/test_attention.py::ref_fp8_mqa_logits``). Failed checks raise
AssertionError (the real ones raise RuntimeError). Only the FP8 path is served (``q = (q_fp8, None)``).

``logits[i, j] = sum_h weights[i, h] * ReLU(q[i, h] . (kv_fp8[j] * kv_sf[j]))`` in fp32 for ``j`` in
``[ks[i], ke[i])``; ``-inf`` elsewhere with ``clean_logits=True``, else unspecified there (the real kernel leaves
memory unwritten; this stand-in writes NaN so that a caller relying on it fails). The result is a
``[seq_len, seq_len_kv]`` view of a wider buffer (row stride aligned as in the real allocation).
"""

from __future__ import annotations

from typing import Any

import torch

__version__ = "2.x+cpu-standin"


def _mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    q_fp, q_sf = q
    assert q_sf is None, "the CPU stand-in serves the FP8 path only"
    kv_fp, kv_sf = kv
    seq_len, num_heads, head_dim = q_fp.shape
    assert num_heads in (32, 64), "SM90: num_heads == 32 or 64"
    assert head_dim in (32, 64, 128)
    assert q_fp.is_contiguous() and q_fp.dtype == torch.float8_e4m3fn
    seq_len_kv, hd = kv_fp.shape
    assert hd == head_dim and kv_fp.is_contiguous() and kv_fp.dtype == torch.float8_e4m3fn
    assert kv_sf.shape == (seq_len_kv,) and kv_sf.is_contiguous() and kv_sf.dtype == torch.float32
    assert weights.shape == (seq_len, num_heads) and weights.stride(1) == 1 and weights.dtype == torch.float32
    for t in (cu_seq_len_k_start, cu_seq_len_k_end):
        assert t.shape == (seq_len,) and t.is_contiguous() and t.dtype == torch.int32
    assert logits_dtype in (torch.float32, torch.bfloat16)
    block_kv, align = 256, 1024 // torch.empty((), dtype=logits_dtype).element_size()
    k = kv_fp.float() * kv_sf[:, None]
    s = torch.relu(torch.einsum("mhd,nd->mhn", q_fp.float(), k))
    full = torch.einsum("mhn,mh->mn", s, weights)  # [seq_len, seq_len_kv]
    cols = torch.arange(seq_len_kv)
    ks, ke = cu_seq_len_k_start.long(), cu_seq_len_k_end.long()
    mask = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    if max_seqlen_k == 0:
        stride = -(-(seq_len_kv + block_kv) // align) * align
        buf = torch.full((seq_len, stride), float("nan"), dtype=logits_dtype)
        out = buf[:, :seq_len_kv]
        out[mask] = full[mask].to(logits_dtype)
        if clean_logits:
            out[~mask] = float("-inf")
        return out
    assert not clean_logits, "max_seqlen_k > 0 needs clean_logits=False"
    stride = -(-(-(-max_seqlen_k // block_kv) * block_kv) // align) * align
    buf = torch.full((seq_len, stride), float("nan"), dtype=logits_dtype)
    out = buf[:, :max_seqlen_k]
    for i in range(seq_len):
        n = max(0, min(int(ke[i]), seq_len_kv) - int(ks[i]))
        out[i, :n] = full[i, int(ks[i]):int(ks[i]) + n].to(logits_dtype)
    return out


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """The legacy entry point: ``fp8_fp4_mqa_logits((q, None), kv, ...)`` without ``logits_dtype`` (fp32 logits)."""
    assert len(args) <= 5 and "logits_dtype" not in kwargs, "fp8_mqa_logits takes no logits_dtype (fp32 logits)"
    return _mqa_logits((q, None), kv, *args, **kwargs)


fp8_fp4_mqa_logits = _mqa_logits  # the current entry point (a test deletes it to stand in for an older DeepGEMM)
