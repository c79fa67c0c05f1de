"""Off-policy-corrected policy-gradient losses and train/inference mismatch metrics.

Shape legend: ``B`` sequences, ``T`` tokens (positions of the *predicted* token; index t is the
log-probability of token t+1 given tokens 0..t, aligned with ``inference_logprobs``).

All float inputs are float32 (float64 in tests; float16, bfloat16 and integer log-probs or advantages raise
``TypeError``); ``loss_mask`` is bool, ``token_versions`` int64.

There is no separate "old policy" recompute (as in prime-rl 0.6.0): per loss token the ratio is
``r = exp(logprobs - inference_logprobs) = p_train / p_inf``, so it covers both the staleness of the
token (the engine sampled it with an older policy) and the engine/trainer numerical mismatch. Every kind
below is one optimizer step per batch, so "old" trainer policy == current trainer policy.

Kinds (``LossConfig.kind``), per loss token with advantage ``A`` (``sg`` = stop-gradient):

============ ======================================================================== ==================
kind         policy-gradient term                                                     normaliser
============ ======================================================================== ==================
``dppo_kl``  ``-keep * A * r``, keep = not(A>0 and p-p_inf > high or A<0 and p-p_inf     loss tokens
             < -low) (prime-rl 0.6.0 default "DPPO-Binary-TV")
``tis``      ``-A * sg(min(r, C) / r) * r``: value ``-A min(r, C)``, gradient               loss tokens
             ``-A min(r, C) dlogp`` (Yao et al. 2025, truncated IS)
``mis``      ``-keep * A * r``, keep = token ratio in [low, high] and/or sequence ratio    loss tokens
             in [seq_low, seq_high] (masked IS; Liu et al. 2025 "When speed kills
             stability")
``icepop``   ``-keep * A * r``, keep = alpha <= r <= beta (double-sided; Ling team 2025,   loss tokens
             Ring-1T "IcePop")
``gspo``     per sequence ``-min(s A, clip(s, 1-eps_low, 1+eps_high) A)``, ``s =         sequences
             exp(mean_t log r_t)`` (Zheng et al. 2025, GSPO)
============ ======================================================================== ==================

Every kind adds ``kl_tau * (log r)^2`` per token (a squared-log-ratio pull toward the behaviour policy,
prime-rl's "Kimi-K2.5 KL"; for ``gspo`` the per-sequence mean of it) and scales the policy-gradient term
by ``adv_tau``. Optional token-age weighting (``LossConfig.age``) multiplies each token's whole loss by
``decay ** (trainer_version - token_version)`` and zeroes tokens older than ``max_age``.

**Supervised rows.** ``compute_loss(..., sft=rows)`` trains the loss tokens of rows flagged ``sft`` with
cross-entropy beside the RL rows: per token ``sft_weight * (-log p)`` for token-level kinds; for ``gspo`` each SFT row
contributes its per-token mean of ``-log p`` (a sequence weighs the same, as every GSPO sequence). Their tokens (or
sequences) count in the one normaliser, so mixed batches have one loss normalisation per optimizer step. They take
no part in the RL terms, the ratios or the mismatch metrics.

**Normalisation.** ``compute_loss`` returns *sums*. The caller divides by ``loss_normalizer(cfg,
global_loss_mask)``, computed on the *whole* batch across data-parallel ranks: the number of loss tokens
for token-level kinds (masked/weighted tokens still count, as in prime-rl), the number of sequences with at
least one loss token for ``gspo`` (each sequence's loss is already a per-token mean, so a sequence weighs
the same whatever its length, as in the GSPO paper's ``1/G sum_i``). A batch split over ranks therefore
gives exactly the single-process loss and gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, model_validator

from moe_rl.config import BaseConfig

__all__ = [
    "LossKind",
    "LossConfig",
    "TisConfig",
    "MisConfig",
    "IcePopConfig",
    "GspoConfig",
    "AgeWeightConfig",
    "LossOutput",
    "compute_loss",
    "loss_normalizer",
    "ratio_quantiles",
    "dppo_kl_loss",
    "mismatch_kl",
]

LossKind = Literal["dppo_kl", "tis", "mis", "icepop", "gspo"]


class TisConfig(BaseConfig):
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): the trainer/inference ratio is capped at ``cap`` and used as a constant weight."""

    cap: float = Field(2.0, gt=0.0)
    """``C`` in ``min(p_train / p_inf, C)``."""


class MisConfig(BaseConfig):
    """Masked importance sampling (Liu et al. 2025, "When speed kills stability: demystifying RL collapse
    from the training-inference mismatch"; prime-rl's former AIPO token/sequence masks): tokens, or whole
    sequences, whose ratio leaves a band get no policy gradient (instead of a truncated one)."""

    level: Literal["token", "sequence", "both"] = "token"
    """Which masks apply."""
    token_low: float = Field(0.5, ge=0.0)
    """Token mask: keep a token only if ``token_low <= r_t <= token_high``."""
    token_high: float = Field(2.0, gt=0.0)
    seq_low: float = Field(0.5, ge=0.0)
    """Sequence mask: keep a sequence only if ``seq_low <= s_b <= seq_high``."""
    seq_high: float = Field(2.0, gt=0.0)
    seq_ratio: Literal["geometric", "product"] = "geometric"
    """``s_b``: ``exp(mean_t log r_t)`` (geometric mean, length-independent) or ``exp(sum_t log r_t)`` (the
    sequence likelihood ratio of Liu et al.) over the sequence's loss tokens."""

    @model_validator(mode="after")
    def _check(self) -> MisConfig:
        if self.token_low > self.token_high or self.seq_low > self.seq_high:
            raise ValueError(
                f"mis bands must satisfy low <= high: token [{self.token_low}, {self.token_high}], sequence "
                f"[{self.seq_low}, {self.seq_high}]; swap the bounds"
            )
        return self


class IcePopConfig(BaseConfig):
    """IcePop (Ling team 2025, "Every step evolves: scaling RL for trillion-scale thinking model", Ring-1T):
    double-sided token masking of the train/inference probability ratio ``k = p_train / p_inf``. With one
    optimizer step per batch it equals token-level MIS with the band ``[alpha, beta]``."""

    alpha: float = Field(0.5, ge=0.0)
    """Lower bound of the kept band (the paper uses 0.5)."""
    beta: float = Field(5.0, gt=0.0)
    """Upper bound of the kept band (the paper uses 5)."""

    @model_validator(mode="after")
    def _check(self) -> IcePopConfig:
        if self.alpha > self.beta:
            raise ValueError(f"icepop alpha={self.alpha} must be <= beta={self.beta}; swap them")
        return self


class GspoConfig(BaseConfig):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a clipped sequence-level ratio
    ``s = exp(mean_t log r_t)``."""

    clip_low: float = Field(3e-4, ge=0.0, lt=1.0)
    """``eps_low`` in ``clip(s, 1 - eps_low, 1 + eps_high)`` (paper: 3e-4)."""
    clip_high: float = Field(4e-4, ge=0.0)
    """``eps_high`` (paper: 4e-4)."""


class AgeWeightConfig(BaseConfig):
    """Per-token age weighting: ``age = trainer_version - token_version`` (the number of optimizer steps since
    the policy that sampled the token). Needs ``token_versions`` when enabled."""

    decay: float = Field(1.0, gt=0.0, le=1.0)
    """Each token's loss is multiplied by ``decay ** age``; 1 disables the weighting."""
    max_age: int | None = Field(None, ge=0)
    """Tokens with ``age > max_age`` get weight 0 (the token-level ``mask`` staleness policy); None: no bound."""

    @property
    def enabled(self) -> bool:
        return self.decay != 1.0 or self.max_age is not None


class LossConfig(BaseConfig):
    """The RL loss, selected by ``kind``. The default is prime-rl 0.6.0's "DPPO-Binary-TV + KL"
    (``trainer/rl/loss.py``); the flat ``dppo_*`` fields are its options, the sub-tables those of the others."""

    kind: LossKind = "dppo_kl"
    """Which loss (see the module docstring)."""
    dppo_mask_low: float = Field(0.2, ge=0.0, le=1.0)
    """Mask a token with negative advantage when ``p_train - p_inf < -dppo_mask_low`` (probability space)."""
    dppo_mask_high: float = Field(0.2, ge=0.0, le=1.0)
    """Mask a token with positive advantage when ``p_train - p_inf > dppo_mask_high``."""
    adv_tau: float = Field(1.0, gt=0.0)
    """Scale of the policy-gradient term (every kind)."""
    kl_tau: float = Field(1e-3, ge=0.0)
    """Weight of the squared-log-ratio term ``(log r)^2`` over all loss tokens (every kind)."""
    tis: TisConfig = TisConfig()
    mis: MisConfig = MisConfig()
    icepop: IcePopConfig = IcePopConfig()
    gspo: GspoConfig = GspoConfig()
    age: AgeWeightConfig = AgeWeightConfig()


@dataclass
class LossOutput:
    """Result of a loss call on one shard of a batch.

    Attributes:
        loss_sum: scalar, differentiable; divide by ``loss_normalizer`` of the global batch.
        num_tokens: loss tokens in this shard (int).
        num_sequences: sequences with at least one loss token in this shard (int).
        normalizer: ``"tokens"`` or ``"sequences"``: what ``loss_normalizer`` counts for this kind.
        mismatch_kl_sum: scalar, detached; sum over loss tokens of the k3 estimator ``r - log r - 1``.
        masked_sum: scalar, detached; loss tokens whose policy-gradient term the kind's mask removed (DPPO
            mask, MIS token/sequence masks, IcePop band; 0 for ``tis`` and ``gspo``).
        metrics: detached scalar *sums* over this shard's loss tokens (all-reduce them, then divide by the
            global loss-token count): ``masked_tokens`` (= ``masked_sum``), ``masked_low`` / ``masked_high``
            (ratio or probability difference below / above the band), ``clipped_tokens`` (TIS cap active, or
            the tokens of GSPO sequences whose clipped term is selected), ``masked_sequences_tokens`` (tokens
            of MIS-masked sequences), ``age_sum``, ``age_weight_sum``, ``age_masked_tokens``, ``sft_tokens`` and
            ``sft_nll_sum`` (supervised rows' loss tokens and their summed ``-log p``).
        ratios: ``[num_tokens]`` detached ratios ``r`` of the loss tokens (for quantiles across ranks).
    """

    loss_sum: torch.Tensor
    num_tokens: int
    mismatch_kl_sum: torch.Tensor
    masked_sum: torch.Tensor
    num_sequences: int = 0
    normalizer: Literal["tokens", "sequences"] = "tokens"
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    ratios: torch.Tensor | None = None


METRIC_KEYS = ("masked_tokens", "masked_low", "masked_high", "clipped_tokens", "masked_sequences_tokens",
               "age_sum", "age_weight_sum", "age_masked_tokens", "sft_tokens", "sft_nll_sum")
"""Keys of ``LossOutput.metrics``, in a fixed order (so ranks can all-reduce a stacked vector)."""


def _check(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if logprobs.shape != inference_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, inference_logprobs {tuple(inference_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have the same [B, T] shape"
        )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if loss_mask.dtype != torch.bool:
        raise TypeError(f"loss_mask must be torch.bool, got {loss_mask.dtype}")
    for name, t in (("logprobs", logprobs), ("inference_logprobs", inference_logprobs)):
        if t.dtype not in _LOGPROB_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; log-probs must be float32 (or float64): lower precision rounds "
                f"the ratio exp(logprobs - inference_logprobs) away and integers are not log-probs -- pass "
                f"{name}.float() (the trainer computes log_softmax in float32)"
            )
    if logprobs.dtype != inference_logprobs.dtype:
        raise TypeError(
            f"logprobs ({logprobs.dtype}) and inference_logprobs ({inference_logprobs.dtype}) must have the same "
            "dtype; cast inference_logprobs to logprobs.dtype"
        )


_LOGPROB_DTYPES = (torch.float32, torch.float64)


def _check_advantages_dtype(advantages: torch.Tensor) -> None:
    if advantages.dtype not in _LOGPROB_DTYPES:
        raise TypeError(
            f"advantages has dtype {advantages.dtype}; it must be float32 or float64 (it is cast to logprobs' "
            "dtype) -- pass advantages.float()"
        )


def _check_finite_on_mask(loss_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first ``[B, T]`` tensor with a non-finite value at a loss token (one
    device-to-host sync for all tensors)."""
    counts = torch.stack([(~torch.isfinite(t.detach()) & loss_mask).sum() for t in tensors.values()]).tolist()
    for name, bad in zip(tensors, counts, strict=True):
        if bad:
            raise ValueError(
                f"{name} has {bad} non-finite value(s) (NaN/inf) at loss tokens (loss_mask True); a loss token "
                "needs finite log-probs and advantages -- fix the producer or take the token off the loss_mask"
            )


def _expand_advantages(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] with B={logprobs.shape[0]}")
        return advantages[:, None].expand_as(logprobs)
    if advantages.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T] = {tuple(logprobs.shape)}")
    return advantages


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
        Scalar mean over masked tokens, detached, in ``logprobs``' dtype. An empty mask (no token selected)
        gives exactly 0.0: no token, no measured mismatch. Values off the mask are never read (NaN/-inf there
        are fine). Source: Schulman's k3 estimator, as used by prime-rl's ``mismatch_kl`` metric.

    Raises:
        TypeError: ``loss_mask`` is not bool, or the log-probs are not float32/float64 of one dtype.
        ValueError: shapes differ or are not ``[B, T]``; a log-prob at a masked token is NaN or infinite (a
            NaN metric would hide the bad token; the message names the tensor and the count).
    """
    _check(logprobs, inference_logprobs, loss_mask)
    _check_finite_on_mask(loss_mask, logprobs=logprobs, inference_logprobs=inference_logprobs)
    with torch.no_grad():
        # off-mask values are selected away (not multiplied by 0), so NaN/-inf there never matter
        k3 = torch.where(loss_mask, _k3(torch.where(loss_mask, logprobs - inference_logprobs, 0.0)), 0.0)
        n = loss_mask.sum()
        return k3.sum() / n.clamp(min=1)


def loss_normalizer(cfg: LossConfig, loss_mask: torch.Tensor) -> int:
    """The divisor of ``LossOutput.loss_sum`` for ``cfg.kind``, computed on the *global* batch.

    Args:
        cfg: the loss config.
        loss_mask: ``[B, T]`` bool of the whole batch (all data-parallel ranks).

    Returns:
        Loss tokens (token-level kinds) or sequences with at least one loss token (``gspo``); at least 1.

    Raises:
        TypeError: ``loss_mask`` is not a bool tensor.
        ValueError: ``loss_mask`` is not 2-D ``[B, T]``.
    """
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dtype != torch.bool:
        got = loss_mask.dtype if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise TypeError(f"loss_mask must be a torch.bool tensor, got {got}; pass the batch's bool loss_mask")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    if cfg.kind == "gspo":
        return max(1, int(loss_mask.any(dim=-1).sum()))
    return max(1, int(loss_mask.sum()))


def ratio_quantiles(ratios: torch.Tensor, qs: tuple[float, ...] = (0.01, 0.5, 0.99)) -> dict[str, float]:
    """Quantiles of the train/inference ratio, e.g. ``{"ratio_p01", "ratio_p50", "ratio_p99"}``.

    Args:
        ratios: ``[N]`` float, the loss tokens' ratios (``LossOutput.ratios``, concatenated over ranks).
        qs: quantile levels in [0, 1] (linear interpolation, ``torch.quantile``).

    Returns:
        ``{"ratio_p<100q>": value}`` (``nan`` values when ``ratios`` is empty).
    """
    names = [f"ratio_p{round(q * 100):02d}" for q in qs]
    if ratios.numel() == 0:
        return dict.fromkeys(names, float("nan"))
    vals = torch.quantile(ratios.double().flatten(), torch.tensor(qs, dtype=torch.float64))
    return {n: float(v) for n, v in zip(names, vals, strict=True)}


def _age_weights(cfg: AgeWeightConfig, token_versions: torch.Tensor | None, trainer_version: int | None,
                 loss_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(weight [B, T], age [B, T])`` or ``(None, age-or-None)`` when the weighting is disabled."""
    if token_versions is None:
        if cfg.enabled:
            raise ValueError(
                f"age weighting is enabled (decay={cfg.decay}, max_age={cfg.max_age}) but token_versions=None; "
                "pass the batch's token_versions and trainer_version, or set age.decay=1 and age.max_age=None"
            )
        return None, None
    if token_versions.shape != loss_mask.shape:
        raise ValueError(
            f"token_versions {tuple(token_versions.shape)} must have the loss_mask's [B, T] shape "
            f"{tuple(loss_mask.shape)}"
        )
    if token_versions.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"token_versions must be int64, got {token_versions.dtype}")
    if trainer_version is None:
        raise ValueError("token_versions given without trainer_version; pass the trainer's policy version")
    lv = token_versions[loss_mask]
    if lv.numel() and int(lv.min()) < 0:
        raise ValueError(
            f"a loss token has token_version {int(lv.min())} < 0 (unknown); every loss token needs the version "
            "that sampled it (-1 is only allowed off the loss mask)"
        )
    if lv.numel() and int(lv.max()) > trainer_version:
        raise ValueError(
            f"a loss token has token_version {int(lv.max())} > trainer_version={trainer_version}: the engine "
            "cannot run a policy the trainer has not produced; check the version bookkeeping"
        )
    age = (trainer_version - token_versions).clamp_min(0) * loss_mask
    if not cfg.enabled:
        return None, age
    w = torch.pow(torch.tensor(cfg.decay, dtype=torch.float64), age.double()).to(dtype)
    if cfg.max_age is not None:
        w = w * (age <= cfg.max_age).to(dtype)
    return w * loss_mask.to(dtype), age


def compute_loss(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    token_versions: torch.Tensor | None = None,
    trainer_version: int | None = None,
    sft: torch.Tensor | None = None,
    sft_weight: float = 1.0,
) -> LossOutput:
    """The RL loss selected by ``cfg.kind`` (formulas and sources in the module docstring), plus cross-entropy on
    supervised rows (``sft``).

    Args:
        cfg: loss config.
        logprobs: ``[B, T]`` float, trainer log-probs of the sampled tokens (requires grad).
        inference_logprobs: ``[B, T]`` float, the engine's log-probs (behaviour policy).
        advantages: ``[B]`` or ``[B, T]`` float (``gspo``: ``[B]`` only, one advantage per sequence).
        loss_mask: ``[B, T]`` bool, the tokens that are trained.
        token_versions: ``[B, T]`` int64, the policy version that sampled each token (-1 off the loss mask);
            required when ``cfg.age`` is enabled, otherwise only used for the ``age_sum`` metric.
        trainer_version: the trainer's policy version (optimizer steps taken) when it trains this batch.
        sft: ``[B]`` bool, rows trained with cross-entropy (their ``inference_logprobs``, ``advantages`` and
            ``token_versions`` are not read); None: every row is an RL row.
        sft_weight: the cross-entropy term's weight (finite, >= 0).

    Returns:
        ``LossOutput``: ``loss_sum`` (divide by ``loss_normalizer(cfg, global_loss_mask)``) and metric sums.

    Values off the loss mask (``logprobs``, ``inference_logprobs``, ``advantages``) are never read: they are
    replaced by 0 with ``torch.where`` before any arithmetic, so NaN or -inf there (padding, prompt positions)
    changes neither the loss nor the gradient (which is exactly 0 off the mask).

    Raises:
        TypeError: ``logprobs`` / ``inference_logprobs`` not float32 or float64 (float16, bfloat16 and integer
            tensors are refused) or not of the same dtype; ``advantages`` not float32/float64; ``loss_mask``
            not bool; ``token_versions`` not int64/int32.
        ValueError: shapes disagree, a value at a loss token is NaN or infinite (the message names the tensor
            and the count), a loss token has no version while age weighting is on, or a token version is newer
            than ``trainer_version``.
    """
    _check(logprobs, inference_logprobs, loss_mask)
    if sft is not None:
        return _with_sft(cfg, logprobs, inference_logprobs, advantages, loss_mask, token_versions, trainer_version,
                         sft, sft_weight)
    _check_advantages_dtype(advantages)
    if cfg.kind == "gspo" and advantages.dim() != 1:
        raise ValueError(
            f"gspo needs one advantage per sequence: advantages must be [B], got {tuple(advantages.shape)}"
        )
    adv = _expand_advantages(advantages, logprobs)
    _check_finite_on_mask(loss_mask, logprobs=logprobs, inference_logprobs=inference_logprobs, advantages=adv)
    # off-mask values (padding, prompt, masked-out tokens) may be anything, NaN and -inf included: select them
    # away before any arithmetic, so they reach neither the loss nor the gradient (0 * NaN would be NaN)
    logprobs = torch.where(loss_mask, logprobs, 0.0)
    inference_logprobs = torch.where(loss_mask, inference_logprobs, 0.0)
    adv = torch.where(loss_mask, adv, 0.0)
    if advantages.dim() == 1:
        advantages = torch.where(loss_mask.any(dim=-1), advantages, 0.0)
    dtype = logprobs.dtype
    mask = loss_mask.to(dtype)
    age_w, age = _age_weights(cfg.age, token_versions, trainer_version, loss_mask, dtype)
    log_r = logprobs - inference_logprobs
    ratio = torch.exp(log_r)
    zero = torch.zeros((), dtype=dtype)
    m: dict[str, torch.Tensor] = dict.fromkeys(METRIC_KEYS, zero)
    with torch.no_grad():
        r_d = ratio.detach()
        k3 = _k3(log_r.detach())
    if cfg.kind == "gspo":
        loss_sum = _gspo(cfg, log_r, advantages.to(dtype), loss_mask, age_w, m)
    else:
        with torch.no_grad():
            low = torch.zeros_like(loss_mask)
            high = torch.zeros_like(loss_mask)
            if cfg.kind == "dppo_kl":
                p_diff = torch.exp(logprobs.detach()) - torch.exp(inference_logprobs)
                high = (adv > 0) & (p_diff > cfg.dppo_mask_high)
                low = (adv < 0) & (p_diff < -cfg.dppo_mask_low)
            elif cfg.kind == "icepop":
                low, high = r_d < cfg.icepop.alpha, r_d > cfg.icepop.beta
            elif cfg.kind == "mis":
                low, high = _mis_masks(cfg.mis, log_r.detach(), r_d, loss_mask, m)
            keep = (~(low | high)).to(dtype)
            m["masked_low"] = (low.to(dtype) * mask).sum()
            m["masked_high"] = (high.to(dtype) * mask).sum()
            m["masked_tokens"] = ((1 - keep) * mask).sum()
        if cfg.kind == "tis":
            with torch.no_grad():
                # min(r, C) / r in log space: no 0/0 when r underflows
                w_tis = torch.exp((math.log(cfg.tis.cap) - log_r.detach()).clamp(max=0.0))
                m["clipped_tokens"] = ((r_d > cfg.tis.cap).to(dtype) * mask).sum()
            pg = -cfg.adv_tau * adv * w_tis * ratio
        else:
            pg = -keep * cfg.adv_tau * adv * ratio
        per_token = pg + cfg.kl_tau * log_r.pow(2)
        weight = mask if age_w is None else age_w
        loss_sum = (per_token * weight).sum()
    if age is not None:
        m["age_sum"] = (age.to(dtype) * mask).sum()
        w = mask if age_w is None else age_w
        m["age_weight_sum"] = w.sum().detach()
        if cfg.age.max_age is not None:
            m["age_masked_tokens"] = ((age > cfg.age.max_age).to(dtype) * mask).sum()
    else:
        m["age_weight_sum"] = mask.sum()
    return LossOutput(
        loss_sum=loss_sum,
        num_tokens=int(loss_mask.sum().item()),
        mismatch_kl_sum=(k3 * mask).sum(),
        masked_sum=m["masked_tokens"],
        num_sequences=int(loss_mask.any(dim=-1).sum().item()),
        normalizer="sequences" if cfg.kind == "gspo" else "tokens",
        metrics={k: v.detach() for k, v in m.items()},
        ratios=r_d[loss_mask],
    )


def _with_sft(cfg: LossConfig, logprobs: torch.Tensor, inference_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, token_versions: torch.Tensor | None, trainer_version: int | None,
              sft: torch.Tensor, sft_weight: float) -> LossOutput:
    """:func:`compute_loss` on the RL rows plus ``sft_weight * (-log p)`` on the supervised rows' loss tokens."""
    if not isinstance(sft, torch.Tensor) or sft.dtype != torch.bool or tuple(sft.shape) != (logprobs.shape[0],):
        got = (sft.dtype, tuple(sft.shape)) if isinstance(sft, torch.Tensor) else type(sft).__name__
        raise ValueError(f"sft must be a [B] = [{logprobs.shape[0]}] torch.bool tensor (one flag per row), got {got}")
    if isinstance(sft_weight, bool) or not isinstance(sft_weight, (int, float)) or not (
            math.isfinite(sft_weight) and sft_weight >= 0):
        raise ValueError(f"sft_weight={sft_weight!r} must be a finite number >= 0")
    rl_mask = loss_mask & ~sft[:, None]
    sft_mask = loss_mask & sft[:, None]
    # the RL terms read nothing off their mask: the SFT rows' advantages, behaviour log-probs and versions are unused
    out = compute_loss(cfg, logprobs, inference_logprobs, advantages, rl_mask, token_versions, trainer_version)
    _check_finite_on_mask(sft_mask, logprobs=logprobs)
    dtype = logprobs.dtype
    nll = -torch.where(sft_mask, logprobs, 0.0)  # off-mask values (NaN, -inf) selected away
    n_row = sft_mask.sum(-1)
    if cfg.kind == "gspo":  # one term per sequence: its mean -log p
        sft_sum = (nll.sum(-1) / n_row.clamp(min=1).to(dtype)).sum()
    else:
        sft_sum = nll.sum()
    metrics = dict(out.metrics)
    metrics["sft_tokens"] = sft_mask.sum().to(dtype)
    metrics["sft_nll_sum"] = nll.detach().sum()
    return LossOutput(
        loss_sum=out.loss_sum + sft_weight * sft_sum,
        num_tokens=out.num_tokens + int(sft_mask.sum()),
        mismatch_kl_sum=out.mismatch_kl_sum,
        masked_sum=out.masked_sum,
        num_sequences=out.num_sequences + int((n_row > 0).sum()),
        normalizer=out.normalizer,
        metrics=metrics,
        ratios=out.ratios,
    )


def _mis_masks(cfg: MisConfig, log_r: torch.Tensor, r: torch.Tensor, loss_mask: torch.Tensor,
               m: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    low = torch.zeros_like(loss_mask)
    high = torch.zeros_like(loss_mask)
    if cfg.level in ("token", "both"):
        low = low | (r < cfg.token_low)
        high = high | (r > cfg.token_high)
    if cfg.level in ("sequence", "both"):
        lr_sum = (log_r * loss_mask).sum(-1)
        n = loss_mask.sum(-1)
        log_s = lr_sum / n.clamp(min=1) if cfg.seq_ratio == "geometric" else lr_sum
        s = torch.exp(log_s)
        seq_low = (s < cfg.seq_low) & (n > 0)
        seq_high = (s > cfg.seq_high) & (n > 0)
        m["masked_sequences_tokens"] = ((seq_low | seq_high)[:, None] & loss_mask).sum().to(log_r.dtype)
        low = low | seq_low[:, None]
        high = high | seq_high[:, None]
    return low, high


def _gspo(cfg: LossConfig, log_r: torch.Tensor, adv_b: torch.Tensor, loss_mask: torch.Tensor,
          age_w: torch.Tensor | None, m: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over sequences of ``w_b * (-adv_tau * min(s A, clip(s) A) + kl_tau * mean_t (log r_t)^2)``.

    ``s_b = exp(mean over the sequence's kept tokens of log r_t)``, where kept = loss tokens with a non-zero age
    weight; ``w_b`` = mean age weight of its loss tokens (1 without age weighting).
    """
    dtype = log_r.dtype
    mask = loss_mask.to(dtype)
    kept = mask if age_w is None else mask * (age_w > 0).to(dtype)
    n_kept = kept.sum(-1)
    has = n_kept > 0
    denom = n_kept.clamp(min=1)
    log_s = (log_r * kept).sum(-1) / denom
    s = torch.exp(log_s)
    eps_l, eps_h = cfg.gspo.clip_low, cfg.gspo.clip_high
    unclipped = s * adv_b
    clipped = s.clamp(1 - eps_l, 1 + eps_h) * adv_b
    seq_obj = torch.minimum(unclipped, clipped)
    kl = (log_r.pow(2) * kept).sum(-1) / denom
    seq_loss = -cfg.adv_tau * seq_obj + cfg.kl_tau * kl
    w_b = torch.ones_like(s) if age_w is None else (age_w * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    with torch.no_grad():
        # the clipped branch is selected (strictly lower) -> zero policy gradient for that sequence
        sel = has & (clipped.detach() < unclipped.detach())
        m["clipped_tokens"] = (mask.sum(-1) * sel.to(dtype)).sum()
    return (seq_loss * w_b * has.to(dtype)).sum()


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

    The ratio is not clipped (as in prime-rl's code); ``r`` carries the gradient ``r * dlogp``. Equal to
    ``compute_loss`` with ``kind="dppo_kl"`` (``cfg.kind`` is ignored here).

    Args:
        logprobs: ``[B, T]`` float, trainer log-probs of the sampled tokens (requires grad).
        inference_logprobs: ``[B, T]`` float, the engine's log-probs (behaviour policy).
        advantages: ``[B]`` or ``[B, T]`` float.
        loss_mask: ``[B, T]`` bool.
        cfg: coefficients; defaults to ``LossConfig()``.

    Returns:
        ``LossOutput`` with the summed loss (divide by the global token count).

    Raises:
        TypeError / ValueError: as :func:`compute_loss` (dtypes, shapes, non-finite values at loss tokens).
    """
    cfg = cfg or LossConfig()
    if cfg.kind != "dppo_kl" or cfg.age.enabled:
        cfg = cfg.model_copy(update={"kind": "dppo_kl", "age": AgeWeightConfig()})
    return compute_loss(cfg, logprobs, inference_logprobs, advantages, loss_mask)
