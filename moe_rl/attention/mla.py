"""Multi-head Latent Attention (MLA) with the DSA lightning indexer: DeepSeek-V3.2 / GLM-5 (``glm_moe_dsa``).

Shape legend:
    T    tokens of this call (a packed stream, or one CP rank's shard of it)
    D    hidden size
    H    attention heads
    Cq   q_lora_rank; Ckv kv_lora_rank (the latent, also the absorbed value dim)
    Dn   qk_nope_head_dim; Dr qk_rope_head_dim; Dq = Dn + Dr; Dv v_head_dim
    HI   index_n_heads; DI index_head_dim

Parameter names are the Hugging Face ones (``transformers`` ``DeepseekV32Attention`` / ``GlmMoeDsaAttention``;
``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``, ``indexer.{wq_b, wk, k_norm, weights_proj}``), so a checkpoint's attention weights load unchanged::

    q_resid = q_a_layernorm(q_a_proj(x))                         [T, Cq]
    q       = q_b_proj(q_resid) -> [T, H, Dn | Dr]                q_pe gets RoPE
    c_kv | k_pe = kv_a_proj_with_mqa(x)                           [T, Ckv], [T, Dr] (one shared rope key)
    c_kv    = kv_a_layernorm(c_kv)
    kv_b_proj.weight -> W_UK [H, Dn, Ckv], W_UV [H, Dv, Ckv]

* **dense** form (no indexer): per-head keys ``[c_kv W_UK^T | k_pe]`` and values ``c_kv W_UV^T``; any
  attention (reference, ring, Ulysses).
* **absorbed** form (MQA mode, used by DSA): ``q_abs = [q_nope W_UK | q_pe]`` ``[T, H, Ckv + Dr]`` against the
  single latent head ``kv = [c_kv | k_pe]`` ``[T, Ckv + Dr]``; the latent output ``[T, H, Ckv]`` is mapped by
  ``W_UV``. Mathematically identical to the dense form (same logits, same weighted values).

RoPE: DeepSeek/GLM MLA rotates interleaved pairs (HF ``apply_rotary_pos_emb_interleave``, which also
de-interleaves its output); the DSA indexer rotates the *first* Dr dims of its heads, interleaved in GLM-5 and
half-split (``rotate_half``) in DeepSeek-V3.2 (``indexer_rope_interleave``). RoPE positions restart at 0 in every
packed sequence (``token index - sequence start``). The indexer runs without gradient by default (the RL
setting: frozen indexer; prime-rl v0.6.0); :meth:`DSAIndexer.forward` is differentiable for the warm-up KL.
YaRN (``rope_yarn``, DeepSeek-V3 / Kimi-K2 checkpoints; Peng et al., arXiv 2309.00071, with DeepSeek's ``mscale``
variant as transformers' ``_compute_yarn_parameters``): ramped inverse frequencies and cos/sin scaled by the
attention factor; the softmax ``mscale**2`` factor is the caller's ``softmax_scale``
(:func:`yarn_softmax_mscale`). ``rope_interleave=False`` rotates the half-split pairs instead (HF
``rope_interleave``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor, nn

from moe_rl.attention.core import attention_reference, default_cu_seqlens
from moe_rl.attention.dsa import dsa_attention
from moe_rl.attention.dsa_cp import dsa_cp_attention
from moe_rl.attention.ring import ring_attention
from moe_rl.attention.ulysses import ulysses_attention
from moe_rl.attention.yarn import YarnRope, yarn_inv_freq
from moe_rl.config import BaseConfig

__all__ = [
    "DSAIndexer",
    "MLAConfig",
    "MLAOutput",
    "MultiheadLatentAttention",
    "rope_positions",
]


CPMethod = Literal["ring", "ulysses", "dsa_allgather"]


class MLAConfig(BaseConfig):
    """MLA (+ DSA) attention sizes; field names follow the Hugging Face ``GlmMoeDsaConfig``."""

    hidden_size: int = Field(ge=1)
    """D."""
    num_attention_heads: int = Field(ge=1)
    """H."""
    q_lora_rank: int = Field(ge=1)
    """Cq: the query latent (2048 in GLM-5)."""
    kv_lora_rank: int = Field(ge=1)
    """Ckv: the KV latent (512)."""
    qk_nope_head_dim: int = Field(ge=1)
    """Dn (192 in GLM-5, 128 in DeepSeek-V3.2)."""
    qk_rope_head_dim: int = Field(ge=2, multiple_of=2)
    """Dr (64), even."""
    v_head_dim: int = Field(ge=1)
    """Dv (256 in GLM-5)."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base."""
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    """eps of q_a_layernorm / kv_a_layernorm."""
    attention_bias: bool = False
    """Bias on q_a_proj, kv_a_proj_with_mqa and o_proj."""
    rope_yarn: YarnRope | None = None
    """YaRN scaling of the rotary frequencies and cos/sin (None: plain RoPE)."""
    rope_interleave: bool = True
    """Rotate interleaved pairs (DeepSeek / GLM checkpoints, HF ``rope_interleave``); False: half-split pairs."""
    softmax_scale: float | None = Field(default=None, gt=0)
    """Override of the attention scale; default ``(Dn + Dr) ** -0.5``."""
    index_topk: int | None = Field(default=None, ge=1)
    """DSA top-k (2048); None = plain MLA without an indexer."""
    index_n_heads: int = Field(default=32, ge=1)
    """HI (32 in GLM-5, 64 in DeepSeek-V3.2)."""
    index_head_dim: int = Field(default=128, ge=2)
    """DI (128); must be >= Dr."""
    indexer_rope_interleave: bool = True
    """Interleaved RoPE in the indexer (GLM-5); False = half-split (DeepSeek-V3.2)."""
    dsa_backend: Literal["dense", "torch", "flashmla"] = "torch"
    """DSA kernel (:func:`moe_rl.attention.dsa_attention` ``backend``): ``"torch"`` the memory-bounded chunked
    path (O(T * index_topk) memory), ``"dense"`` the ``[T, T]``-score reference (equal results)."""
    own_indexer: bool = True
    """False: a DSA layer without its own indexer (IndexCache "shared" layer, HF ``indexer_types``; arXiv
    2603.12201) that attends over the ``topk_indices`` of a previous layer, which must then be passed."""


class MLAOutput(NamedTuple):
    """``hidden``: ``[T, D]`` attention output after ``o_proj``; ``topk_indices``: ``[T, K]`` int64 DSA
    selection in token-index coordinates (``None`` without DSA)."""

    hidden: Tensor
    topk_indices: Tensor | None


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_positions(token_idx: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``[T]`` int64 RoPE positions: token index minus its sequence start (0 for padding tokens)."""
    cu = cu_seqlens.to(device=token_idx.device, dtype=torch.int64)
    t = token_idx.to(torch.int64)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, cu.numel() - 2)
    pos = t - cu[seq]
    return torch.where(t < cu[-1], pos, torch.zeros_like(pos))


def _cos_sin(pos: Tensor, dim: int, theta: float, yarn: YarnRope | None = None) -> tuple[Tensor, Tensor]:
    if yarn is None:
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=pos.device).float() / dim))
        f = pos.float()[:, None] * inv  # [T, Dr/2]
        return f.cos(), f.sin()
    inv, att = yarn_inv_freq(dim, theta, yarn, device=pos.device)
    f = pos.float()[:, None] * inv
    if att == 1.0:
        return f.cos(), f.sin()
    return f.cos() * att, f.sin() * att


def _rope_interleave(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved pairs (x0,x1),(x2,x3)...; output de-interleaved like HF. x [T, ..., Dr]; cos/sin [T, Dr/2]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split (``rotate_half``) convention. x [T, ..., Dr]; cos/sin [T, Dr/2]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class DSAIndexer(nn.Module):
    """The DSA lightning indexer's projections (HF ``DeepseekV32Indexer`` names: ``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``). Produces the inputs of :func:`moe_rl.attention.lightning_indexer`; the scales
    ``index_head_dim**-0.5 * index_n_heads**-0.5`` are folded into the weights."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ValueError(f"index_head_dim={cfg.index_head_dim} must be >= qk_rope_head_dim={cfg.qk_rope_head_dim}")
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def forward(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Args: x ``[T, D]``, q_resid ``[T, Cq]``, cos/sin ``[T, Dr/2]``.
        Returns ``(index_q [T, HI, DI], index_weights [T, HI] fp32, index_k [T, DI])``."""
        T = x.shape[0]
        rope = _rope_interleave if self.rope_interleave else _rope_half
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)
        q = torch.cat([rope(q[..., : self.rope_dim], cos, sin), q[..., self.rope_dim :]], dim=-1)
        k = self.k_norm(self.wk(x))
        k = torch.cat([rope(k[:, : self.rope_dim], cos, sin), k[:, self.rope_dim :]], dim=-1)
        w = self.weights_proj(x).float() * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, w, k


class MultiheadLatentAttention(nn.Module):
    """MLA attention block, optionally with DSA (``cfg.index_topk``), single-process or context-parallel.

    ``forward(x [T, D], *, cu_seqlens=None, token_idx=None, topk_indices=None, cp_group=None,
    cp_method=None) -> MLAOutput``:

    * ``cu_seqlens``: ``[N + 1]`` packed-sequence boundaries of the *global* stream (default: one sequence of
      T tokens); ``token_idx``: ``[T]`` token indices of the rows of ``x`` (default ``arange(T)``; under CP
      :meth:`ShardPlan.local_token_idx`).
    * DSA layers use the absorbed form with :func:`dsa_attention` (or :func:`dsa_cp_attention` when
      ``cp_group`` is given); ``topk_indices`` replays a recorded selection instead of running the indexer.
    * plain MLA layers use the dense form; under CP ``cp_method`` picks ``"ring"`` or ``"ulysses"``.
    """

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = _RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (Dn + Dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + Dr, bias=cfg.attention_bias)
        self.kv_a_layernorm = _RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (Dn + Dv), bias=False)
        self.o_proj = nn.Linear(H * Dv, cfg.hidden_size, bias=cfg.attention_bias)
        self.is_dsa = cfg.index_topk is not None
        self.indexer = DSAIndexer(cfg) if self.is_dsa and cfg.own_indexer else None
        self.scale = cfg.softmax_scale if cfg.softmax_scale is not None else (Dn + Dr) ** -0.5

    def _project(self, x: Tensor, token_idx: Tensor, cu_seqlens: Tensor):
        cfg = self.cfg
        T, H, Dn, Dr = x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        cos, sin = _cos_sin(rope_positions(token_idx, cu_seqlens), Dr, cfg.rope_theta, cfg.rope_yarn)
        rope = _rope_interleave if cfg.rope_interleave else _rope_half
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, H, Dn + Dr)
        q_nope, q_pe = q[..., :Dn], rope(q[..., Dn:], cos, sin)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, Dr], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = rope(k_pe, cos, sin)  # [T, Dr]
        w = self.kv_b_proj.weight.view(H, Dn + cfg.v_head_dim, cfg.kv_lora_rank)
        return q_resid, q_nope, q_pe, c_kv, k_pe, w[:, :Dn], w[:, Dn:], cos, sin

    def forward(
        self,
        x: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        token_idx: Tensor | None = None,
        topk_indices: Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
        cp_method: CPMethod | None = None,
        causal: bool = True,
    ) -> MLAOutput:
        cfg = self.cfg
        T, H = x.shape[0], cfg.num_attention_heads
        token_idx = torch.arange(T, device=x.device) if token_idx is None else token_idx
        cu_seqlens = default_cu_seqlens(T, x.device) if cu_seqlens is None else cu_seqlens
        q_resid, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, cos, sin = self._project(x, token_idx, cu_seqlens)
        sel = None
        if self.is_dsa:
            if topk_indices is None and self.indexer is None:
                raise ValueError("this DSA layer has no indexer of its own (own_indexer=False, an IndexCache "
                                 "'shared' layer): pass the topk_indices of the previous indexer layer")
            if cp_method not in (None, "dsa_allgather"):
                raise ValueError(f"cp_method={cp_method!r}: a DSA layer supports only 'dsa_allgather' context "
                                 "parallelism (one shared latent KV head; top-k needs every key)")
            q_abs = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], dim=-1)  # [T, H, Ckv + Dr]
            kv = torch.cat([c_kv, k_pe], dim=-1)  # [T, Ckv + Dr]
            kw = {}
            if topk_indices is None:
                with torch.no_grad():
                    iq, iw, ik = self.indexer(x, q_resid, cos, sin)
                kw = dict(index_q=iq, index_weights=iw, index_k=ik, index_topk=cfg.index_topk)
            if cp_group is None:
                res = dsa_attention(q_abs, kv, v_head_dim=cfg.kv_lora_rank, scale=self.scale, topk_indices=topk_indices,
                                    causal=causal, cu_seqlens=cu_seqlens, q_token_idx=token_idx,
                                    backend=cfg.dsa_backend, **kw)
            else:
                res = dsa_cp_attention(q_abs, kv, v_head_dim=cfg.kv_lora_rank, token_idx=token_idx,
                                       cu_seqlens=cu_seqlens, scale=self.scale, topk_indices=topk_indices,
                                       causal=causal, group=cp_group, backend=cfg.dsa_backend, **kw)
            out = torch.einsum("thc,hvc->thv", res.out, w_uv)
            sel = res.topk_indices
        else:
            if topk_indices is not None:
                raise ValueError("topk_indices given to an MLA layer without a DSA indexer (cfg.index_topk is None)")
            k_nope = torch.einsum("tc,hnc->thn", c_kv, w_uk)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, -1)], dim=-1)
            q = torch.cat([q_nope, q_pe], dim=-1)
            v = torch.einsum("tc,hvc->thv", c_kv, w_uv)
            if cp_group is None:
                out = attention_reference(q, k, v, causal=causal, cu_seqlens=cu_seqlens, q_token_idx=token_idx,
                                          k_token_idx=token_idx, scale=self.scale).out
            elif cp_method in ("ring", "ulysses"):
                fn = ring_attention if cp_method == "ring" else ulysses_attention
                out = fn(q, k, v, token_idx=token_idx, cu_seqlens=cu_seqlens, causal=causal, scale=self.scale,
                         group=cp_group).out
            else:
                raise ValueError(f"cp_method={cp_method!r}: a dense MLA layer under CP needs 'ring' or 'ulysses'")
        return MLAOutput(self.o_proj(out.reshape(T, -1)), sel)

