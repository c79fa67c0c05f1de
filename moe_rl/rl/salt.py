"""KV-cache salt derivation.

vLLM mixes a request's ``cache_salt`` into the hash of the first prefix-cache block; later blocks chain
from it, so only requests with equal salts share KV (vLLM PR #17045). An RL run salts each rollout with
the policy version that *started* it: new rollouts never reuse KV computed by older weights, while all
turns of one rollout and all members of one group keep sharing their own prompt KV
(prime-rl PR #1650; prime-rl ``orchestrator/dispatcher.py`` uses ``str(policy_version_at_start)``).

The salt is a pure function of what changes the KV (the weights' version and dtype, and the run), never of
the trainer step alone: a frozen model keeps its cache (prime-rl PR #2266 review finding).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WEIGHT_DTYPES", "cache_salt_for", "canonical_weight_dtype"]

# canonical name (torch's) -> accepted spellings (compared lower-cased, surrounding spaces stripped)
_DTYPE_ALIASES: dict[str, tuple[str, ...]] = {
    "float32": ("float32", "fp32", "f32", "float", "torch.float32", "torch.float"),
    "bfloat16": ("bfloat16", "bf16", "torch.bfloat16"),
    "float16": ("float16", "fp16", "f16", "half", "torch.float16", "torch.half"),
    "float64": ("float64", "fp64", "f64", "double", "torch.float64", "torch.double"),
    "float8_e4m3fn": ("float8_e4m3fn", "fp8", "fp8_e4m3", "e4m3", "torch.float8_e4m3fn"),
    "float8_e5m2": ("float8_e5m2", "fp8_e5m2", "e5m2", "torch.float8_e5m2"),
}
WEIGHT_DTYPES: tuple[str, ...] = tuple(_DTYPE_ALIASES)
"""The canonical ``weight_dtype`` names a salt is built from (torch's dtype names)."""
_ALIAS_TO_CANONICAL = {alias: name for name, aliases in _DTYPE_ALIASES.items() for alias in aliases}


def canonical_weight_dtype(weight_dtype: Any) -> str:
    """One canonical spelling (torch's dtype name) for a dtype given as a string alias or a ``torch.dtype``.

    ``"bf16"``, ``"bfloat16"``, ``"BF16"``, ``"torch.bfloat16"`` and ``torch.bfloat16`` all give ``"bfloat16"``;
    ``"fp8"`` means E4M3 (``"float8_e4m3fn"``, the FP8 weight format of DeepSeek-V3 and vLLM). Accepted
    spellings per canonical name are in ``_DTYPE_ALIASES``. A ``torch.dtype`` is recognised by duck typing
    (``str()`` of it), so this module never imports torch.

    Args:
        weight_dtype: a ``str`` or a ``torch.dtype``.

    Returns:
        One of :data:`WEIGHT_DTYPES`.

    Raises:
        TypeError: ``weight_dtype`` is neither a string nor a ``torch.dtype``.
        ValueError: an unknown name (``"auto"`` included: resolve it to the dtype the engine really computes
            in); the message lists the accepted spellings.
    """
    kind = type(weight_dtype)
    if isinstance(weight_dtype, str):
        key = weight_dtype.strip().lower()
    elif kind.__name__ == "dtype" and kind.__module__.split(".")[0] == "torch":
        key = str(weight_dtype).lower()  # "torch.bfloat16"
    else:
        raise TypeError(
            f"weight_dtype={weight_dtype!r} has type {kind.__name__}; pass the engine's dtype as a string (e.g. "
            f"'bfloat16') or a torch.dtype"
        )
    name = _ALIAS_TO_CANONICAL.get(key)
    if name is None:
        accepted = "; ".join(f"{n}: {', '.join(a)}" for n, a in _DTYPE_ALIASES.items())
        raise ValueError(
            f"weight_dtype={weight_dtype!r} is not a known dtype; pass the dtype the engine computes KV in, one of "
            f"({accepted}) or a torch.dtype ('auto' is refused: resolve it to the engine's actual dtype)"
        )
    return name


def cache_salt_for(policy_version: int, *, weight_dtype: Any = "float32", run_id: str = "") -> str:
    """Return the ``cache_salt`` for a rollout that starts under ``policy_version``.

    Args:
        policy_version: version of the weights the engine serves when the rollout starts (>= 0).
        weight_dtype: dtype the engine computes KV in (a dtype change changes KV): a ``torch.dtype`` or a
            string alias; normalized by :func:`canonical_weight_dtype`, so ``"bf16"``, ``"bfloat16"``,
            ``"torch.bfloat16"`` and ``torch.bfloat16`` give the same salt.
        run_id: distinguishes runs that share an engine (optional).

    Returns:
        A stable string, e.g. ``"moe_rl-v3-float32"``; equal inputs give equal salts in every process.

    Raises:
        TypeError: ``policy_version`` is not an int; ``weight_dtype`` is neither a string nor a ``torch.dtype``.
        ValueError: ``policy_version`` is negative; ``weight_dtype`` is not a known dtype name.
    """
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__} {policy_version!r}")
    if policy_version < 0:
        raise ValueError(f"policy_version={policy_version} must be >= 0")
    dtype = canonical_weight_dtype(weight_dtype)
    run = f"-{run_id}" if run_id else ""
    return f"moe_rl{run}-v{policy_version}-{dtype}"
