"""Off-policy-corrected token-level policy-gradient losses and train/inference mismatch metrics.

Shape legend: ``B`` sequences, ``T`` tokens (positions of the *predicted* token; index t is the
log-probability of token t+1 given tokens 0..t, aligned with ``inference_logprobs``).

All inputs are float32 (or float64 in tests); ``loss_mask`` is bool. Losses return a *sum* over loss
tokens: the caller divides by the global number of loss tokens across data-parallel ranks, so a batch
split over ranks gives exactly the single-process loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from moe_rl.config import BaseConfig

__all__ = ["LossConfig", "LossOutput", "dppo_kl_loss", "mismatch_kl"]


class LossConfig(BaseConfig):
    """prime-rl 0.6.0's default RL loss, "DPPO-Binary-TV + KL" (``trainer/rl/loss.py``)."""

    dppo_mask_low: float = Field(0.2, ge=0.0, le=1.0)
    """Mask a token with negative advantage when ``p_train - p_inf < -dppo_mask_low`` (probability space)."""
    dppo_mask_high: float = Field(0.2, ge=0.0, le=1.0)
    """Mask a token with positive advantage when ``p_train - p_inf > dppo_mask_high``."""
    adv_tau: float = Field(1.0, gt=0.0)
    """Scale of the policy-gradient term."""
    kl_tau: float = Field(1e-3, ge=0.0)
    """Weight of the squared-log-ratio term ``(log r)^2`` over all loss tokens."""


@dataclass
class LossOutput:
    """Result of a loss call.

    Attributes:
        loss_sum: scalar, differentiable; sum over loss tokens (divide by the global token count).
        num_tokens: number of loss tokens (int).
        mismatch_kl_sum: scalar, detached; sum of the k3 estimator over loss tokens.
        masked_sum: scalar, detached; number of loss tokens the DPPO mask removed.
    """

    loss_sum: torch.Tensor
    num_tokens: int
    mismatch_kl_sum: torch.Tensor
    masked_sum: torch.Tensor


def _check(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if logprobs.shape != inference_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, inference_logprobs {tuple(inference_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have the same [B, T] shape"
        )
    if loss_mask.dtype != torch.bool:
        raise TypeError(f"loss_mask must be torch.bool, got {loss_mask.dtype}")


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    """``r - log r - 1`` computed as ``expm1(log r) - log r`` (no cancellation near r = 1), clamped at 0:
    the estimator is non-negative and only rounding can push it below."""
    return (torch.expm1(log_r) - log_r).clamp_min(0.0)


def mismatch_kl(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(inference || trainer): ``r - log r - 1`` with ``r = p_train / p_inf``.

    Args:
        logprobs: ``[B, T]`` trainer log-probabilities of the sampled tokens.
        inference_logprobs: ``[B, T]`` the engine's log-probabilities of the same tokens.
        loss_mask: ``[B, T]`` bool, tokens to include.

    Returns:
        Scalar mean over masked tokens (0 if none), detached. Source: Schulman's k3 estimator, as used by
        prime-rl's ``mismatch_kl`` metric.
    """
    _check(logprobs, inference_logprobs, loss_mask)
    with torch.no_grad():
        k3 = _k3(logprobs - inference_logprobs)
        n = loss_mask.sum()
        return (k3 * loss_mask).sum() / n.clamp(min=1)


def dppo_kl_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig | None = None,
) -> LossOutput:
    """DPPO-Binary-TV policy gradient plus a squared-log-ratio KL term (prime-rl 0.6.0 default).

    Per loss token with ratio ``r = exp(logprobs - inference_logprobs)`` and advantage ``A``:

    - keep = not (A > 0 and p_train - p_inf > mask_high) and not (A < 0 and p_train - p_inf < -mask_low)
    - loss_t = -keep * adv_tau * A * r  +  kl_tau * (log r)^2

    The ratio is not clipped (as in prime-rl's code); ``r`` carries the gradient ``r * dlogp``.

    Args:
        logprobs: ``[B, T]`` float, trainer log-probs of the sampled tokens (requires grad).
        inference_logprobs: ``[B, T]`` float, the engine's log-probs (behaviour policy).
        advantages: ``[B]`` or ``[B, T]`` float.
        loss_mask: ``[B, T]`` bool.
        cfg: coefficients; defaults to ``LossConfig()``.

    Returns:
        ``LossOutput`` with the summed loss (divide by the global token count).

    Raises:
        ValueError / TypeError: shapes or dtypes disagree.
    """
    cfg = cfg or LossConfig()
    _check(logprobs, inference_logprobs, loss_mask)
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] with B={logprobs.shape[0]}")
        advantages = advantages[:, None].expand_as(logprobs)
    elif advantages.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T] = {tuple(logprobs.shape)}")
    mask = loss_mask.to(logprobs.dtype)
    log_r = logprobs - inference_logprobs
    ratio = torch.exp(log_r)
    with torch.no_grad():
        p_diff = torch.exp(logprobs) - torch.exp(inference_logprobs)
        masked_high = (advantages > 0) & (p_diff > cfg.dppo_mask_high)
        masked_low = (advantages < 0) & (p_diff < -cfg.dppo_mask_low)
        keep = (~(masked_high | masked_low)).to(logprobs.dtype)
        k3 = _k3(log_r)
    pg = -keep * cfg.adv_tau * advantages * ratio
    kl = cfg.kl_tau * log_r.pow(2)
    loss_sum = ((pg + kl) * mask).sum()
    return LossOutput(
        loss_sum=loss_sum,
        num_tokens=int(loss_mask.sum().item()),
        mismatch_kl_sum=(k3 * mask).sum().detach(),
        masked_sum=((1 - keep) * mask).sum().detach(),
    )
