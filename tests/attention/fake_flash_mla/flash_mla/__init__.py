"""CPU stand-in for FlashMLA's sparse kernels (tests only): the documented contracts in plain torch.

Source of the contracts: github.com/deepseek-ai/FlashMLA (``flash_mla/flash_mla_interface.py`` signatures and
docstrings, the argument checks of ``csrc/api/sparse_fwd.h`` / ``csrc/api/sparse_decode.h``, and the semantics of
``tests/ref.py::ref_sparse_attn_fwd`` / ``ref_sparse_attn_decode``, ``tests/quant.py`` for the FP8 cache layout).
Signatures are the real ones. The checks the CUDA code does with TORCH_CHECK / KU_ASSERT raise AssertionError here
(the real ones raise RuntimeError), including the SM90 sparse-prefill rule ``topk % 128 == 0``. Only the sparse
paths are served: the dense decode path (``indices=None``) raises NotImplementedError.

Math as in the reference: fp32 logits ``sm_scale * q . k`` over the valid indices, natural log-sum-exp, a query
with no valid index gets ``out = 0`` and ``lse = +inf``; ``out`` is returned in bf16.
"""

from __future__ import annotations

import dataclasses

import torch

__version__ = "1.0.0+cpu-standin"


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False
    config: tuple | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    return FlashMLASchedMeta(), None


def _attend(q: torch.Tensor, gathered: torch.Tensor, invalid: torch.Tensor, sm_scale: float, d_v: int,
            attn_sink: torch.Tensor | None):
    """q [n, h, d] fp32, gathered [n, topk, d] fp32, invalid [n, topk] -> out fp32 [n, h, d_v], max_logits, lse."""
    p = torch.einsum("nhd,nkd->nhk", q, gathered) * sm_scale
    p = p.masked_fill(invalid[:, None, :], float("-inf"))
    lse = torch.logsumexp(p, dim=-1)  # [n, h]
    max_logits = p.max(dim=-1).values
    lse_for_o = lse
    if attn_sink is not None:
        lse_for_o = torch.logsumexp(torch.stack([lse, attn_sink.float()[None, :].expand_as(lse)]), dim=0)
    lse_for_o = torch.where(lse_for_o == float("-inf"), torch.full_like(lse_for_o, float("inf")), lse_for_o)
    out = torch.einsum("nhk,nkd->nhd", torch.exp(p - lse_for_o[..., None]), gathered[..., :d_v])
    lse = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)
    return out, max_logits, lse


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, _ = kv.shape
    topk = indices.shape[2]
    assert d_qk in (576, 512), f"Invalid d_qk: {d_qk}"
    assert d_v == 512, f"Invalid d_v {d_v}"
    assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
    assert kv.shape == (s_kv, h_kv, d_qk) and indices.shape == (s_q, h_kv, topk)
    assert h_kv == 1, "the reference (tests/ref.py) covers h_kv == 1 (MQA)"
    assert h_q in (64, 128), f"Unsupported h_q: {h_q}"
    assert topk % 128 == 0, "SM90 sparse prefill: params.topk % (2*B_TOPK) == 0"
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
    idx = indices[:, 0, :].long().clone()
    if topk_length is not None:
        assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)
        idx[torch.arange(topk)[None, :] >= topk_length.long()[:, None]] = -1
    invalid = (idx < 0) | (idx >= s_kv)
    idx[invalid] = 0
    gathered = kv[:, 0, :].float().index_select(0, idx.reshape(-1)).view(s_q, topk, d_qk)
    out, max_logits, lse = _attend(q.float(), gathered, invalid, sm_scale, d_v, attn_sink)
    return out.to(torch.bfloat16), max_logits, lse


def _dequant_v32(k_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, 1, 656] float8_e4m3fn -> [num_blocks * block_size, 576] fp32 (tests/quant.py)."""
    nb, bs, hk, nbytes = k_cache.shape
    assert hk == 1 and nbytes == 656
    raw = k_cache.view(torch.uint8).reshape(nb * bs, nbytes)
    nope = raw[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scale = raw[:, 512:528].contiguous().view(torch.float32)  # [n, 4]
    rope = raw[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).reshape(-1, 512), rope], dim=1)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta), "tile_scheduler_metadata must be FlashMLASchedMeta"
    assert num_splits is None, "num_splits must be None"
    if indices is None:
        raise NotImplementedError("the CPU stand-in serves the sparse path only (indices given)")
    assert not causal, "causal must be False when sparse attention is enabled"
    assert is_fp8_kvcache, "is_fp8_kvcache must be True when sparse attention is enabled"
    assert extra_k_cache is None and extra_indices_in_kvcache is None and extra_topk_length is None, \
        "the CPU stand-in does not serve extra_k_cache"
    b, s_q, h_q, d_qk = q.shape
    assert q.dtype == torch.bfloat16 and indices.dtype == torch.int32
    assert d_qk == 576 and head_dim_v == 512, "V3.2 FP8 sparse layout: head_dim 576, head_dim_v 512"
    assert h_q in (64, 128), f"Unsupported h_q: {h_q}"
    topk = indices.shape[-1]
    assert indices.shape == (b, s_q, topk) and topk % 64 == 0, "topk % TOPK_BLOCK_SIZE (64) == 0"
    assert k_cache.stride(1) == k_cache.shape[-1], "The whole block must be contiguous"
    scale = d_qk ** -0.5 if softmax_scale is None else softmax_scale
    flat = _dequant_v32(k_cache)
    idx = indices.long().reshape(b * s_q, topk)
    invalid = idx == -1
    if topk_length is not None:
        invalid = invalid | (torch.arange(topk)[None, :] >= topk_length.long().repeat_interleave(s_q)[:, None])
    gathered = flat.index_select(0, idx.clamp(min=0).reshape(-1)).view(b * s_q, topk, d_qk)
    gathered = torch.nan_to_num(gathered, nan=0.0)
    out, _, lse = _attend(q.float().reshape(b * s_q, h_q, d_qk), gathered, invalid, scale, head_dim_v, attn_sink)
    out = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(out), out)
    tile_scheduler_metadata.have_initialized = True
    return out.view(b, s_q, h_q, head_dim_v).to(torch.bfloat16), lse.view(b, s_q, h_q).transpose(1, 2)
