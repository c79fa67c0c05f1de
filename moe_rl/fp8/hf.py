"""FP8 block conversion of Hugging Face ``transformers`` MoE models: linears *and* fused routed experts.

:func:`moe_rl.fp8.convert_to_fp8_block_linear` swaps ``nn.Linear`` only. ``transformers`` 5.x MoE families
(Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5 MoE, ...) keep their routed experts in one fused module of 3-D
parameters, which it cannot see::

    gate_up_proj  [E, 2F, D]   rows 0..F-1 the gate projection, F..2F-1 the up projection (nn.Linear layout)
    down_proj     [E, D, F]
    forward(hidden_states [T, D], top_k_index [T, K] int64, top_k_weights [T, K]) -> [T, D]
    out[t] = sum_k w[t, k] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])),  e = top_k_index[t, k]

:func:`convert_hf_moe_to_fp8` runs that forward (and its backward) with both grouped GEMMs in FP8 block scaling
(DeepSeek-V3 recipe: 1x128 activations, 128x128 weight blocks per expert, Wgrad 128x1 along tokens;
:func:`moe_rl.fp8.grouped.fp8_grouped_linear` on the padded contiguous layout): token-slots are sorted by expert
(stable), padded per expert to 128 rows, run through ``gate_up_proj``, the module's own gate (``_apply_gate``,
else ``act_fn(gate) * up``), ``down_proj``, weighted by ``top_k_weights`` and summed back per token in fp32 order
of the sorted slots. Ids outside ``[0, E)`` (``transformers``' expert-parallel mask uses ``E``) contribute
nothing, as in the eager forward. The swap is a class swap to a subclass with no new state: parameters (high
precision masters, re-quantized every forward), ``state_dict`` and ``config`` are unchanged.

Refusals: a fused experts module with biases (``has_bias``), transposed weights (``is_transposed``), an
interleaved gate/up layout (``is_concatenated=False``), no gate (``has_gate=False``), or a class that is not a
known fused-experts class but holds 3-D ``gate_up_proj``/``down_proj``/``up_proj`` parameters is *skipped*,
named in the report's ``skipped`` and in one ``UserWarning``; nothing is skipped silently.

Importing this module does not import ``transformers``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moe_rl.fp8.gemm import Backend, check_backend
from moe_rl.fp8.grouped import contiguous_layout, fp8_grouped_linear
from moe_rl.fp8.linear import Fp8BlockLinear, convert_to_fp8_block_linear, default_fp8_filter

__all__ = ["SUPPORTED_HF_EXPERTS", "HfFp8Report", "convert_hf_moe_to_fp8", "fp8_hf_experts_forward", "is_fp8_hf_experts"]

SUPPORTED_HF_EXPERTS: dict[str, str] = {
    "Qwen3MoeExperts": "qwen3_moe",
    "MixtralExperts": "mixtral",
    "DeepseekV3Experts": "deepseek_v3",
    "Glm4MoeExperts": "glm4_moe",
}
"""Fused experts class name -> ``transformers.models`` subpackage (same weight layout and forward contract)."""

_EXPERT_PARAM_NAMES = ("gate_up_proj", "down_proj", "up_proj")


@dataclass
class HfFp8Report:
    """What :func:`convert_hf_moe_to_fp8` converted.

    Attributes:
        linear: ``nn.Linear`` modules now :class:`moe_rl.fp8.Fp8BlockLinear`.
        skipped_linear: ``nn.Linear`` modules kept high precision (router/gate, ``lm_head``, or ``filter_fn``).
        expert_modules: fused experts modules converted (one per MoE layer).
        experts: routed experts converted, summed over those modules (``sum of E``).
        skipped: qualified names of expert-like modules left high precision, each with the reason.
    """

    linear: int = 0
    skipped_linear: int = 0
    expert_modules: int = 0
    experts: int = 0
    skipped: list[str] = field(default_factory=list)


def _experts_classes() -> dict[type, str]:
    from moe_rl._hf import installed_hf_classes

    return installed_hf_classes(SUPPORTED_HF_EXPERTS)


def _default_gate(module: nn.Module, gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def fp8_hf_experts_forward(
    module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, backend: Backend = "torch"
) -> Tensor:
    """The fused-experts forward of a ``transformers`` MoE layer with both grouped GEMMs in FP8 (autograd).

    Args:
        module: a fused experts module with ``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``, ``num_experts``
            and ``act_fn`` (or ``_apply_gate``).
        hidden_states: ``[T, D]`` float (fp32/bf16); the output has its dtype.
        top_k_index: ``[T, K]`` integer expert ids; ids outside ``[0, E)`` are dropped.
        top_k_weights: ``[T, K]`` float routing weights (gradient flows to them).
        backend: grouped GEMM backend (:func:`moe_rl.fp8.fp8_grouped_gemm`).

    Returns:
        ``[T, D]`` in ``hidden_states``' dtype.

    Raises:
        TypeError: ``hidden_states`` is not floating point or ``top_k_index`` is not integer.
        ValueError: shapes disagree (named); non-finite input/weights (the quantizers refuse inf/NaN).
    """
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states has dtype {hidden_states.dtype}; expected a floating-point [T, D] tensor")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index has dtype {top_k_index.dtype}; expected integer expert ids [T, K]")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0] \
            or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)}, top_k_index {tuple(top_k_index.shape)}, top_k_weights "
            f"{tuple(top_k_weights.shape)}: expected [T, D], [T, K], [T, K]"
        )
    num_experts = int(module.gate_up_proj.shape[0])
    k = int(top_k_index.shape[1])
    flat = top_k_index.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    # Invalid ids sort after every expert (key E) and are cut off below.
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    n_real = int(counts.sum())
    order = order[:n_real]
    token = order // k
    lay = contiguous_layout(counts)
    x = hidden_states.new_zeros(lay.num_rows, hidden_states.shape[1]).index_copy(0, lay.rows, hidden_states[token])
    h = fp8_grouped_linear(x, module.gate_up_proj, lay, backend)
    gate_fn: Callable[[Tensor], Tensor] = getattr(module, "_apply_gate", None) or (lambda g: _default_gate(module, g))
    a = gate_fn(h)
    # Padding rows: act(0) * 0 = 0 for the usual gates; zero them anyway so no gate can leak into the next GEMM.
    a = a.masked_fill((lay.m_indices < 0)[:, None], 0)
    y = fp8_grouped_linear(a, module.down_proj, lay, backend)[lay.rows]
    y = y * top_k_weights.reshape(-1)[order][:, None].to(y.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token, y.to(out.dtype))


_fp8_cache: dict[type, type] = {}


def _fp8_cls(base: type) -> type:
    if base in _fp8_cache:
        return _fp8_cache[base]

    class _Fp8(base):  # type: ignore[valid-type, misc]
        fp8_backend: str = "torch"

        def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            return fp8_hf_experts_forward(self, hidden_states, top_k_index, top_k_weights, self.fp8_backend)

    _Fp8.__name__ = _Fp8.__qualname__ = f"Fp8{base.__name__}"
    _fp8_cache[base] = _Fp8
    return _Fp8


def is_fp8_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module converted by :func:`convert_hf_moe_to_fp8`."""
    return type(module) in _fp8_cache.values()


def _refusal(mod: nn.Module) -> str | None:
    if getattr(mod, "has_bias", False):
        return "has expert biases (has_bias=True)"
    if getattr(mod, "is_transposed", False):
        return "stores transposed expert weights (is_transposed=True)"
    if not getattr(mod, "is_concatenated", True):
        return "interleaves gate/up rows (is_concatenated=False)"
    if not getattr(mod, "has_gate", True):
        return "has no gate projection (has_gate=False)"
    for name, nd in (("gate_up_proj", 3), ("down_proj", 3)):
        p = getattr(mod, name, None)
        if not isinstance(p, Tensor) or p.dim() != nd:
            return f"has no 3-D {name} parameter"
    e, f2, d = mod.gate_up_proj.shape
    if tuple(mod.down_proj.shape) != (e, d, f2 // 2) or f2 % 2:
        return f"gate_up_proj {tuple(mod.gate_up_proj.shape)} and down_proj {tuple(mod.down_proj.shape)} disagree"
    return None


def _expert_like(mod: nn.Module) -> bool:
    return any(isinstance(getattr(mod, n, None), Tensor) and getattr(mod, n).dim() == 3 for n in _EXPERT_PARAM_NAMES)


def convert_hf_moe_to_fp8(
    model: nn.Module,
    *,
    backend: Backend = "torch",
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    experts: bool = True,
) -> HfFp8Report:
    """Convert a ``transformers`` MoE model's linears and fused routed experts to FP8 block scaling, in place.

    Args:
        model: e.g. ``Qwen3MoeForCausalLM``; its parameters stay in their dtype (the masters).
        backend: GEMM backend of every converted module (``"auto"``, ``"torch"``, ``"triton"``, ``"deep_gemm"``).
        filter_fn: ``(fqn, module) -> bool`` for the linears (default
            :func:`moe_rl.fp8.linear.default_fp8_filter`: not the router/gate, not ``lm_head``). The routers of the
            supported families are not ``nn.Linear`` and always stay high precision.
        experts: also convert the fused experts (False: linears only, and every fused experts module is
            reported in ``skipped`` with that reason).

    Returns:
        :class:`HfFp8Report` with the counts and the skipped modules. A ``UserWarning`` lists the skipped
        expert-like modules, if any.

    Raises:
        ValueError: unknown ``backend`` (checked before anything is swapped).
        TypeError: ``model`` is not an ``nn.Module``.
        ImportError: ``transformers`` is not installed (only needed to recognise the fused experts classes).
    """
    check_backend(backend)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_hf_moe_to_fp8: model is a {type(model).__name__}; expected a torch nn.Module")
    filt = filter_fn or default_fp8_filter
    report = HfFp8Report()
    n_lin_before = sum(type(m) is nn.Linear for m in model.modules())
    already = sum(isinstance(m, Fp8BlockLinear) for m in model.modules())
    convert_to_fp8_block_linear(model, filter_fn=filt, backend=backend)
    report.linear = sum(isinstance(m, Fp8BlockLinear) for m in model.modules()) - already
    report.skipped_linear = n_lin_before - report.linear
    classes = _experts_classes()
    for fqn, mod in model.named_modules():
        cls = type(mod)
        if is_fp8_hf_experts(mod):  # converted earlier
            mod.fp8_backend = backend
            report.expert_modules += 1
            report.experts += int(mod.gate_up_proj.shape[0])
            continue
        known = cls in classes
        if not known and not _expert_like(mod):
            continue
        name = fqn or "<model>"
        if not experts:
            report.skipped.append(f"{name} ({cls.__name__}): experts=False")
            continue
        if not known:
            report.skipped.append(
                f"{name} ({cls.__name__}): not a supported fused-experts class ({', '.join(SUPPORTED_HF_EXPERTS)})"
            )
            continue
        why = _refusal(mod)
        if why is not None:
            report.skipped.append(f"{name} ({cls.__name__}): {why}")
            continue
        mod.__class__ = _fp8_cls(cls)
        mod.fp8_backend = backend
        report.expert_modules += 1
        report.experts += int(mod.gate_up_proj.shape[0])
    if report.skipped:
        warnings.warn(
            f"convert_hf_moe_to_fp8: {len(report.skipped)} expert module(s) left in high precision: "
            + "; ".join(report.skipped),
            UserWarning,
            stacklevel=2,
        )
    return report
