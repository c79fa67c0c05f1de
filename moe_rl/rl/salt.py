"""KV-cache salt derivation.

vLLM mixes a request's ``cache_salt`` into the hash of the first prefix-cache block; later blocks chain
from it, so only requests with equal salts share KV (vLLM PR #17045). An RL run salts each rollout with
the policy version that *started* it: new rollouts never reuse KV computed by older weights, while all
turns of one rollout and all members of one group keep sharing their own prompt KV
(prime-rl PR #1650; prime-rl ``orchestrator/dispatcher.py`` uses ``str(policy_version_at_start)``).

The salt is a pure function of what changes the KV (the weights' version and dtype, and the run), never of
the trainer step alone: a frozen model keeps its cache (prime-rl PR #2266 review finding).

Validity (vLLM 0.32, ``vllm/entrypoints/generate/base/protocol.py::validate_cache_salt``, applied by the OpenAI
completions / chat / responses request models): a ``cache_salt`` is None (no salt) or a non-empty ``str`` of at most
128 characters that holds none of ``'@'``, ``'/'``, ``'\\'`` and NUL; any other salt is a 400 from the server.
:func:`check_cache_salt` applies that rule; :func:`check_run_id` refuses a ``run_id`` that could not make a valid
salt for every int64 policy version and every :data:`WEIGHT_DTYPES` entry. Nothing is rewritten: a bad salt or
run id is refused, never silently transformed.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CACHE_SALT_FORBIDDEN_CHARS",
    "CACHE_SALT_MAX_CHARS",
    "RUN_ID_MAX_CHARS",
    "WEIGHT_DTYPES",
    "cache_salt_for",
    "canonical_weight_dtype",
    "check_cache_salt",
    "check_run_id",
]

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

CACHE_SALT_MAX_CHARS = 128
"""Longest ``cache_salt`` vLLM 0.32 accepts, in characters (``len`` of the ``str``)."""
CACHE_SALT_FORBIDDEN_CHARS = "@/\\\x00"
"""Characters vLLM 0.32 refuses in a ``cache_salt``: ``'@'``, ``'/'``, ``'\\'`` and NUL."""
_SALT_RULE = (f"vLLM accepts a cache_salt that is a non-empty str of at most {CACHE_SALT_MAX_CHARS} characters "
              "without '@', '/', a backslash or NUL")
_SALT_PREFIX = "moe_rl"
_MAX_VERSION_DIGITS = len(str(2**63 - 1))  # 19: every int64 policy version
RUN_ID_MAX_CHARS = (CACHE_SALT_MAX_CHARS - len(f"{_SALT_PREFIX}--v-") - _MAX_VERSION_DIGITS
                    - max(len(name) for name in WEIGHT_DTYPES))
"""Longest ``run_id`` (86 characters) whose salt stays valid for every int64 policy version and weight dtype."""


def _salt_problem(salt: str) -> str | None:
    """What makes the str ``salt`` invalid for vLLM, or None when it is valid."""
    if not salt:
        return "is empty"
    bad = sorted({c for c in salt if c in CACHE_SALT_FORBIDDEN_CHARS})
    if bad:
        return f"contains {', '.join(repr(c) for c in bad)}"
    if len(salt) > CACHE_SALT_MAX_CHARS:
        return f"is {len(salt)} characters long"
    return None


def check_cache_salt(salt: Any, *, name: str = "cache_salt") -> str | None:
    """Refuse a ``cache_salt`` that vLLM 0.32 would reject (module docstring: the rule).

    Args:
        salt: the salt: None (no salt) or a ``str``.
        name: how error messages call it (e.g. ``"cache_salt() result"``).

    Returns:
        ``salt`` unchanged.

    Raises:
        TypeError: ``salt`` is neither None nor a ``str``.
        ValueError: ``salt`` is empty, longer than :data:`CACHE_SALT_MAX_CHARS` characters, or holds a character of
            :data:`CACHE_SALT_FORBIDDEN_CHARS`; the message names the rule and the fix.
    """
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise TypeError(f"{name}={salt!r} has type {type(salt).__name__}; pass a str (or None for no salt)")
    problem = _salt_problem(salt)
    if problem is not None:
        raise ValueError(f"{name}={salt!r} {problem}; {_SALT_RULE}. Pass None for no salt, or a salt that obeys the "
                         "rule (e.g. moe_rl.rl.salt.cache_salt_for(version, run_id=...))")
    return salt


def check_run_id(run_id: Any, *, name: str = "run_id", reserve: int = 0) -> str:
    """Refuse a ``run_id`` that cannot make a valid ``cache_salt`` in :func:`cache_salt_for`.

    Args:
        run_id: the run's id; ``""`` means none.
        name: how error messages call it (e.g. ``"output_dir's name"``).
        reserve: characters the caller will append to ``run_id`` before salting (>= 0; e.g. 9 for a
            ``"-<8 hex>"`` suffix), counted against :data:`RUN_ID_MAX_CHARS`.

    Returns:
        ``run_id`` unchanged.

    Raises:
        TypeError: ``run_id`` is not a ``str``.
        ValueError: ``run_id`` holds a character of :data:`CACHE_SALT_FORBIDDEN_CHARS` or is longer than
            ``RUN_ID_MAX_CHARS - reserve`` characters (the message names the rule and the fix); ``reserve`` is not an
            int in ``[0, RUN_ID_MAX_CHARS)``.
    """
    if not isinstance(run_id, str):
        raise TypeError(f"{name}={run_id!r} has type {type(run_id).__name__}; pass a str ('' for none)")
    if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve < RUN_ID_MAX_CHARS:
        raise ValueError(f"check_run_id: reserve={reserve!r} must be an int in [0, {RUN_ID_MAX_CHARS}) (characters the "
                         "caller appends to the run id); pass e.g. 9 for a '-<8 hex>' suffix")
    limit = RUN_ID_MAX_CHARS - reserve
    bad = sorted({c for c in run_id if c in CACHE_SALT_FORBIDDEN_CHARS})
    if bad or len(run_id) > limit:
        problem = f"contains {', '.join(repr(c) for c in bad)}" if bad else f"is {len(run_id)} characters long"
        raise ValueError(
            f"{name}={run_id!r} {problem}, so it cannot make a valid cache_salt ({_SALT_RULE}; the salt adds the "
            f"policy version and dtype): {name} must be at most {limit} characters without '@', '/', a backslash or "
            "NUL. Shorten it and replace those characters (e.g. with '-')"
        )
    return run_id


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
        run_id: distinguishes runs that share an engine (optional): at most :data:`RUN_ID_MAX_CHARS` characters
            without ``'@'``, ``'/'``, ``'\\'`` or NUL (:func:`check_run_id`), so the salt is valid for vLLM.

    Returns:
        A stable string, e.g. ``"moe_rl-v3-float32"``; equal inputs give equal salts in every process; always
        valid for vLLM (:func:`check_cache_salt`).

    Raises:
        TypeError: ``policy_version`` is not an int; ``weight_dtype`` is neither a string nor a ``torch.dtype``;
            ``run_id`` is not a str.
        ValueError: ``policy_version`` is negative or beyond int64; ``weight_dtype`` is not a known dtype name;
            ``run_id`` cannot make a valid salt (:func:`check_run_id`).
    """
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__} {policy_version!r}")
    if not 0 <= policy_version < 2**63:
        raise ValueError(f"policy_version={policy_version} must be >= 0 and < 2**63 (an int64 counter)")
    dtype = canonical_weight_dtype(weight_dtype)
    run = f"-{check_run_id(run_id)}" if check_run_id(run_id) else ""
    return check_cache_salt(f"{_SALT_PREFIX}{run}-v{policy_version}-{dtype}")
