"""LM head + next-token log-probs computed in token chunks, never holding the ``[N, V]`` logits.

Shape legend:
    N   tokens (rows of the flattened batch, N = B * S)
    B   rows, S columns (tokens per row)
    D   hidden size
    V   vocabulary
    C   tokens per chunk (``chunk_tokens``), the last chunk may be shorter

The RL loss needs only ``log softmax(h W^T / temperature)[label]`` per token. At 131k-token rows and a 154k
vocabulary the fp32 logits, their log-softmax and both gradients are tens of GB; here the head runs on C tokens at a
time: forward keeps one ``[C, V]`` fp32 block (plus its ``[C, V]`` matmul output in the weight's dtype while it is
cast, when that is not fp32), saves only ``h``, ``W``, the labels and the ``[N]`` fp32 logsumexp,
and backward recomputes each chunk's logits to accumulate ``dh`` and ``dW``. Peak extra memory is O(C V) instead of
O(N V) (plus one fp32 ``[V, D]`` gradient accumulator and a ``[V, D]`` per-chunk product when ``W`` is not fp32).

Numerics follow the unchunked path of :func:`moe_rl.runtime.trainer.step.token_logprobs` (``lm_head(h).float()`` then
``log_softmax(logits / temperature)``): the matmul runs in the weight's dtype, its result is cast to fp32, then divided
by the temperature; the gradient of the log-prob w.r.t. the fp32 logits, ``g (onehot - softmax) / temperature``, is cast
back to the weight's dtype before the two backward matmuls, as autograd does. Results therefore match the unchunked
path to rounding (matmul blocking and summation order differ).

Idea: Liger-Kernel's fused linear cross entropy (github.com/linkedin/Liger-Kernel,
``ops/fused_linear_cross_entropy.py``) and prime-rl's chunked LM head (``fused_lm_head_token_chunk_size``); this is an
independent pure-PyTorch implementation (no fused kernel; the gradient is recomputed, not precomputed in forward).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["chunked_label_logprobs", "head_label_logprobs", "lm_head_label_logprobs"]


def _check_temperature(temperature: Any) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature={temperature!r} must be a float; pass the sampler's temperature, e.g. 1.0")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0; pass the sampler's temperature")
    return float(temperature)


def _check_chunk(chunk_tokens: Any) -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"chunk_tokens={chunk_tokens!r} must be an int >= 1 (tokens per head chunk), e.g. 4096")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (tokens per head chunk); use e.g. 4096")
    return chunk_tokens


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, D] and weight [V, D]; got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}; "
            "flatten the batch with hidden.reshape(-1, D)"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden has D={hidden.shape[1]} but weight {tuple(weight.shape)} has D={weight.shape[1]}; "
            "pass the lm_head weight [V, D] of the model that produced hidden"
        )
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same floating dtype (the head "
            "matmul runs in it); cast hidden to the weight's dtype"
        )
    if labels.dtype != torch.int64 or tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(
            f"labels must be [N] = [{hidden.shape[0]}] int64, got {tuple(labels.shape)} {labels.dtype}; "
            "pass one next-token id per row of hidden"
        )
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) must be on one device"
        )


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[C, V]`` fp32 ``F.linear(h, weight).float() / temperature`` in one fresh buffer (the division in place;
    dividing by 1.0 is exact, so it is skipped)."""
    z = F.linear(h, weight).float()  # a new tensor either way: the matmul output, or its fp32 copy
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLabelLogprobs(torch.autograd.Function):
    """Forward/backward over token chunks; see :func:`chunked_label_logprobs`."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk: int) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _scaled_logits(hidden[s:e], weight, temperature)  # [C, V] fp32
            m = z.amax(dim=-1, keepdim=True)  # [C, 1]
            z.sub_(m)
            z_label = z.gather(1, labels[s:e, None]).squeeze(1)  # [C]
            log_sum = z.exp_().sum(dim=-1).log_()  # [C]
            out[s:e] = z_label - log_sum  # (x_label - max) - log sum exp(x - max), log_softmax's order
            lse[s:e] = m.squeeze(1) + log_sum
            del z  # before the next chunk's matmul: one [C, V] block alive at a time
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        hidden, weight, labels, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        g = grad_out.float()
        dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # contiguous
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h_c, g_c = hidden[s:e], g[s:e, None]  # [C, D], [C, 1]
            z = _scaled_logits(h_c, weight, temperature)  # [C, V] recomputed
            # d lp / d z = g (onehot(label) - softmax(z)); softmax(z) = exp(z - lse)
            grad_z = z.sub_(lse[s:e, None]).exp_().mul_(-g_c)
            grad_z.scatter_add_(1, labels[s:e, None], g_c)
            if temperature != 1.0:
                grad_z.div_(temperature)  # backward of "/ T"
            grad_logits = grad_z.to(weight.dtype)  # backward of ".float()" (no copy for fp32 weights)
            del z, grad_z
            if need_h:
                torch.mm(grad_logits, weight, out=dh[s:e])  # [C, D] (rows of a contiguous dh: contiguous)
            if need_w and dw.dtype == weight.dtype:
                dw.addmm_(grad_logits.t(), h_c)  # fp32 weights: accumulate in place, no [V, D] temporary
            elif need_w:
                dw.add_(grad_logits.t() @ h_c)  # [V, D] in the weight's dtype, accumulated in fp32
            del grad_logits
        if need_w:
            dw = dw.to(weight.dtype)
        return dh, dw, None, None, None


def chunked_label_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           temperature: float = 1.0, chunk_tokens: int = 4096) -> torch.Tensor:
    """``log softmax(hidden @ weight.T / temperature)[labels]`` per token, in chunks of ``chunk_tokens`` tokens.

    Equal (to rounding) to ``F.log_softmax(F.linear(hidden, weight).float() / temperature, -1).gather(-1,
    labels[:, None])[:, 0]``, differentiable w.r.t. ``hidden`` and ``weight``, but neither forward nor backward holds
    more than one ``[chunk_tokens, V]`` fp32 block of logits: backward recomputes each chunk's logits from the saved
    ``hidden`` and ``weight`` (one extra head matmul per chunk) and the ``[N]`` fp32 logsumexp.

    Args:
        hidden: ``[N, D]`` float (fp32 or bf16/fp16), the final-normed hidden states.
        weight: ``[V, D]`` the head matrix (``lm_head.weight``, no bias), same dtype and device as ``hidden``.
        labels: ``[N]`` int64 token ids in ``[0, V)`` (out-of-range ids fail in ``torch.gather``).
        temperature: finite, > 0; the fp32 logits are divided by it (must match the sampler).
        chunk_tokens: tokens per chunk, >= 1 (need not divide N).

    Returns:
        ``[N]`` float32 log-probabilities (nats). Backward returns ``dh`` in ``hidden``'s dtype and ``dW`` in
        ``weight``'s dtype (accumulated over chunks in fp32: for bf16/fp16 weights an fp32 ``[V, D]`` buffer and a
        ``[V, D]`` per-chunk product live during backward).
        Double backward is not supported.

    Raises:
        TypeError: a non-tensor input, a non-number ``temperature`` or a non-int ``chunk_tokens``.
        ValueError: wrong shapes, dtypes or devices, ``temperature <= 0`` or ``chunk_tokens < 1``.

    Source: the chunked / fused linear cross-entropy idea of Liger-Kernel and prime-rl (see the module docstring).
    """
    _check_inputs(hidden, weight, labels)
    t = _check_temperature(temperature)
    c = _check_chunk(chunk_tokens)
    return _ChunkedLabelLogprobs.apply(hidden, weight, labels, t, c)


def head_label_logprobs(hidden_BSD: torch.Tensor, weight: torch.Tensor, labels_BS: torch.Tensor,
                        temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """The models' ``token_logprobs`` head: ``[B, S, D]`` hidden states and ``[B, S]`` labels -> ``[B, S]`` fp32.

    Args:
        hidden_BSD: ``[B, S, D]`` final-normed hidden states.
        weight: ``[V, D]`` ``lm_head.weight`` (same dtype as ``hidden_BSD``).
        labels_BS: ``[B, S]`` int64: the token whose log-prob is wanted at each position.
        temperature: finite, > 0.
        chunk_tokens: ``None``: the unchunked path (``[B, S, V]`` fp32 logits, then ``log_softmax`` and ``gather``,
            the numerics of ``lm_head(h).float()`` + :func:`moe_rl.runtime.trainer.step.token_logprobs`); an int >= 1:
            :func:`chunked_label_logprobs` over the ``B * S`` flattened tokens.

    Returns:
        ``[B, S]`` float32 log-probabilities.

    Raises:
        TypeError: as :func:`chunked_label_logprobs`.
        ValueError: as :func:`chunked_label_logprobs`, or ``hidden_BSD`` / ``labels_BS`` not of shape ``[B, S, D]`` /
            ``[B, S]``.
    """
    if not isinstance(hidden_BSD, torch.Tensor) or hidden_BSD.dim() != 3:
        shape = tuple(hidden_BSD.shape) if isinstance(hidden_BSD, torch.Tensor) else type(hidden_BSD).__name__
        raise ValueError(f"hidden_BSD must be a [B, S, D] tensor, got {shape}")
    if not isinstance(labels_BS, torch.Tensor) or tuple(labels_BS.shape) != tuple(hidden_BSD.shape[:2]):
        shape = tuple(labels_BS.shape) if isinstance(labels_BS, torch.Tensor) else type(labels_BS).__name__
        raise ValueError(
            f"labels must be [B, S] = {tuple(hidden_BSD.shape[:2])} like input_ids, got {shape}; "
            "pass one label per column (e.g. the next token, any valid id in the last column)"
        )
    b, s, d = hidden_BSD.shape
    if chunk_tokens is None:
        t = _check_temperature(temperature)
        _check_inputs(hidden_BSD.reshape(-1, d), weight, labels_BS.reshape(-1))
        lp = F.log_softmax(F.linear(hidden_BSD, weight).float() / t, dim=-1)
        return lp.gather(-1, labels_BS[..., None]).squeeze(-1)
    out = chunked_label_logprobs(hidden_BSD.reshape(b * s, d), weight, labels_BS.reshape(b * s), temperature,
                                 chunk_tokens)
    return out.view(b, s)


def lm_head_label_logprobs(hidden_BSD: torch.Tensor, lm_head: torch.nn.Module, labels_BS: torch.Tensor,
                           temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """:func:`head_label_logprobs` with a model's ``lm_head`` module (what both models' ``token_logprobs`` call).

    Raises:
        ValueError: ``lm_head`` is not a plain bias-free ``nn.Linear`` (e.g. converted to FP8), or as
            :func:`head_label_logprobs`.
        TypeError: as :func:`head_label_logprobs`.
    """
    if type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
        raise ValueError(
            f"token_logprobs needs lm_head to be a bias-free nn.Linear, got {type(lm_head).__name__}; "
            "keep lm_head out of FP8 conversion (the default filter) or use forward()"
        )
    return head_label_logprobs(hidden_BSD, lm_head.weight, labels_BS, temperature, chunk_tokens)
