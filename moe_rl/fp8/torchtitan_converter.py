"""torchtitan model converter "moe_rl_fp8_block": swap a torchtitan model's linears and routed experts for
moe_rl's FP8 block-scaled ones (DeepSeek-V3 recipe: 1x128 activations, 128x128 weights, Wgrad along tokens).

torchtitan (0.3.0, the version pinned here) converts models at the *config* level: a
``ModelConfigConverter`` subclass (the pattern of ``torchtitan.components.quantization.float8.Float8LinearConverter``)
rewrites the model config tree before ``build()``, replacing ``Linear.Config`` nodes by the config of a drop-in
module, and ``GroupedExperts.Config`` nodes by a subclass that overrides ``GroupedExperts._grouped_mm`` (torchtitan's
seam for low-precision grouped GEMMs). Converters are passed by config, e.g.::

    from torchtitan.models.deepseek_v3 import model_registry
    from moe_rl.fp8.torchtitan_converter import MoeRlFp8BlockConverter
    spec = model_registry("debugmodel", converters=[MoeRlFp8BlockConverter.Config(backend="auto")])

torchtitan 0.3.0 has no converter name registry (converters are referenced by their Config class); this
module exports :data:`CONVERTER_NAME` = ``"moe_rl_fp8_block"`` and :data:`CONVERTERS` ``{name: Config}`` for
callers that select converters by name. Importing it imports torchtitan (an optional dependency).

Exclusions (DeepSeek-V3 §3.3): any ``Linear`` whose FQN has a component in ``filter_fqns`` (default: ``output``
= the LM head, ``gate`` = the MoE router's linear, ``router``); embeddings and norms are not ``Linear``. Unlike
torchtitan's float8 converter, no dimension is excluded for size: partial 128-blocks get their own scale (vllm-project/compressed-tensors PR #547)
and the deep_gemm backend zero-pads K.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from moe_rl.fp8.gemm import check_backend
from moe_rl.fp8.grouped import contiguous_layout, fp8_grouped_linear
from moe_rl.fp8.linear import fp8_block_linear

__all__ = ["CONVERTERS", "CONVERTER_NAME", "MoeRlFp8BlockConverter", "MoeRlFp8Linear", "fp8_grouped_mm"]

CONVERTER_NAME = "moe_rl_fp8_block"


class MoeRlFp8Linear(Linear):
    """torchtitan ``Linear`` whose three GEMMs run in FP8 block scaling (:func:`moe_rl.fp8.fp8_block_linear`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        fp8_backend: str = "auto"

    def __init__(self, config: Config):
        check_backend(config.fp8_backend, "fp8_backend")
        super().__init__(config)
        self.fp8_backend = config.fp8_backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(input, self.weight, self.bias, backend=self.fp8_backend)  # type: ignore[arg-type]


def fp8_grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """FP8 replacement for ``torch._grouped_mm(A, B_t, offs=offs)`` as torchtitan's ``GroupedExperts`` calls it.

    Args:
        A: ``[R, K]`` routed rows sorted by expert; rows at or beyond ``offs[-1]`` (dispatcher padding) give 0.
        B_t: ``[E, K, N]`` transposed expert weights (``w.transpose(-2, -1)``).
        offs: ``[E]`` int32 cumulative row ends.
        backend: grouped GEMM backend (:func:`moe_rl.fp8.fp8_grouped_gemm`).

    Returns:
        ``[R, N]`` in ``A``'s dtype.
    """
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    lay = contiguous_layout(counts)
    n_real = int(lay.rows.shape[0])
    x = A.new_zeros(lay.num_rows, A.shape[1]).index_copy(0, lay.rows, A[:n_real])
    y = fp8_grouped_linear(x, B_t.transpose(-2, -1), lay, backend)[lay.rows]  # type: ignore[arg-type]
    if n_real < A.shape[0]:
        y = F.pad(y, (0, 0, 0, A.shape[0] - n_real))
    return y


_experts_cache: dict[type, type] = {}


def _fp8_experts_cls(parent_cls: type) -> type:
    if parent_cls in _experts_cache:
        return _experts_cache[parent_cls]
    parent_config_cls = parent_cls.Config  # type: ignore[attr-defined]

    class MoeRlFp8GroupedExperts(parent_cls):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config_cls):  # type: ignore[misc]
            fp8_backend: str = "auto"

        def __init__(self, config: Config):
            check_backend(config.fp8_backend, "fp8_backend")
            super().__init__(config)
            self.fp8_backend = config.fp8_backend

        def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return fp8_grouped_mm(A, B_t, offs, self.fp8_backend)

    MoeRlFp8GroupedExperts.__name__ = MoeRlFp8GroupedExperts.__qualname__ = f"MoeRlFp8{parent_cls.__name__}"
    _experts_cache[parent_cls] = MoeRlFp8GroupedExperts
    return MoeRlFp8GroupedExperts


def _replace(model_config, parent, attr, new_config):
    if parent is None:
        return new_config
    if isinstance(parent, list):
        parent[attr] = new_config
    else:
        setattr(parent, attr, new_config)
    return model_config


class MoeRlFp8BlockConverter(QuantizationConverter):
    """Swap ``Linear`` -> :class:`MoeRlFp8Linear` and ``GroupedExperts`` -> an FP8 ``_grouped_mm`` subclass."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        backend: str = "auto"
        """GEMM backend: ``auto`` (deep_gemm on CUDA when importable, else torch), ``torch``, ``triton``,
        ``deep_gemm``."""
        filter_fqns: list[str] = field(default_factory=lambda: ["output", "gate", "router"])
        """Linears whose FQN has one of these as a dot-separated component stay high precision."""
        convert_experts: bool = True
        """Also run routed experts' grouped GEMMs in FP8."""

    def __init__(self, config: Config):
        check_backend(config.backend)
        self.config = config
        self.counts = {"linear": 0, "experts": 0, "skipped_linear": 0}

    def convert(self, model_config):
        cfg = self.config
        skip = set(cfg.filter_fqns)
        for fqn, lin, parent, attr in list(model_config.traverse(Linear.Config)):
            if type(lin) is not Linear.Config:
                continue  # already a special linear (another converter, or ours)
            if skip & set(fqn.split(".")):
                self.counts["skipped_linear"] += 1
                continue
            new = MoeRlFp8Linear.Config(**{f.name: getattr(lin, f.name) for f in fields(lin)},
                                        fp8_backend=cfg.backend)
            model_config = _replace(model_config, parent, attr, new)
            self.counts["linear"] += 1
        if cfg.convert_experts:
            for _fqn, exp, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
                cls = _fp8_experts_cls(type(exp)._owner)
                new = cls.Config(**{f.name: getattr(exp, f.name) for f in fields(exp)},  # type: ignore[attr-defined]
                                 fp8_backend=cfg.backend)
                model_config = _replace(model_config, parent, attr, new)
                self.counts["experts"] += 1
        return model_config


CONVERTERS = {CONVERTER_NAME: MoeRlFp8BlockConverter.Config}
"""Name -> converter Config class, for callers that pick converters by name."""
