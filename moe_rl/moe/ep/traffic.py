"""Analytical per-GPU communication bytes of one MoE layer: expert parallelism (tokens travel) vs FSDP
all-gathering the routed experts' weights (weights travel).

Shape legend (per MoE layer):
    T  tokens per GPU going through the layer in one step (forward + backward)
    D  hidden size
    F  routed expert FFN width (moe_intermediate_size)
    E  routed experts
    K  experts per token (top_k)
    R  expert-parallel group size (ep); N the FSDP sharding group size

**EP** (``moe_rl.moe.ep``, per-slot rows as the ``torch`` backend sends them). A slot leaves its GPU with probability
``f = (R - 1) / R`` under uniform routing, so per GPU and per direction ``T * K * f`` rows cross the network. Four
row exchanges per layer and step, each symmetric (every GPU sends what it receives, on average)::

    dispatch fwd     tokens  -> experts   T*K*f * row(dispatch dtype)   FP8 e4m3 + 1x128 fp32 scales in DeepSeek-V3
    combine fwd      experts -> tokens    T*K*f * row(combine dtype)    BF16 in DeepSeek-V3
    combine bwd      tokens  -> experts   T*K*f * row(dispatch dtype)   grads of the expert outputs (DSV3: FP8)
    dispatch bwd     experts -> tokens    T*K*f * row(combine dtype)    grads of the dispatched tokens (DSV3: BF16)

``row(bf16) = 2 D``, ``row(fp8) = D + 4 * ceil(D / 128)`` (the DeepEP / DeepGEMM 1x128 scale layout). DeepSeek-V3
(arXiv 2412.19437, section 3.3) keeps both combines in BF16 and sends the activations and the activation gradients
that enter the experts in FP8. With ``dedup=True`` a token is sent once per destination *rank* however many of its
K experts live there (DeepEP's normal kernels): rows per token ``(R - 1) * (1 - C(E - L, K) / C(E, K))``, L = E / R.

**FSDP** of the routed experts (``3 * E * D * F`` weights: gate, up and down projections), each GPU holding ``1/N``.
Per GPU a ring all-gather sends (and receives) ``(N - 1) / N`` of the layer's weight bytes; ``gathers`` of them
per step (2 with ``reshard_after_forward``: forward and again for backward) plus one reduce-scatter of the gradients
in ``grad_dtype``. This cost does not depend on T, so EP wins below the crossover::

    T* = fsdp_bytes / ep_bytes_per_token

``python -m moe_rl.moe.ep.traffic`` prints the markdown table of :func:`traffic_table`; ``--out docs/ep_traffic.md``
writes it. Pure Python (no torch import).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "MODELS",
    "EPTraffic",
    "FSDPTraffic",
    "MoELayerShape",
    "TrafficRow",
    "crossover_tokens",
    "ep_rows_per_token",
    "ep_token_bytes",
    "fsdp_expert_bytes",
    "markdown_report",
    "row_bytes",
    "traffic_table",
]

WireDtype = Literal["fp32", "bf16", "fp8"]
"""Element format on the wire; ``fp8`` is e4m3 with one fp32 scale per 128 elements (1x128 blocks)."""

FP8_BLOCK = 128


@dataclass(frozen=True, kw_only=True, slots=True)
class MoELayerShape:
    """The routed-expert part of one MoE layer."""

    name: str
    num_experts: int
    """E, routed experts."""
    hidden: int
    """D."""
    moe_ffn: int
    """F, each routed expert's intermediate width."""
    top_k: int
    """K."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for field in ("num_experts", "hidden", "moe_ffn", "top_k"):
            if getattr(self, field) < 1:
                raise ValueError(f"MoELayerShape.{field}={getattr(self, field)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoELayerShape.top_k={self.top_k} must be <= num_experts={self.num_experts}")

    @property
    def expert_params(self) -> int:
        """Routed expert weights of the layer, ``3 * E * D * F`` (SwiGLU gate, up, down)."""
        return 3 * self.num_experts * self.hidden * self.moe_ffn


MODELS: dict[str, MoELayerShape] = {
    name: MoELayerShape(name=name, num_experts=e, hidden=d, moe_ffn=f, top_k=k, source=source)
    for name, e, d, f, k, source in (
        # (name, E routed experts, D hidden, F expert width, K top-k, where the numbers come from)
        ("DeepSeek-V3 671B", 256, 7168, 2048, 8, "deepseek-ai/DeepSeek-V3 config.json"),
        ("GLM-4.5-Air 106B", 128, 4096, 1408, 8,
         "moe_rl.models.glm4_moe.GlmMoeConfig defaults (zai-org/GLM-4.5-Air)"),
        ("GLM-5.1 744B", 256, 6144, 2048, 8, "project brief (issue 6 work notes)"),
        ("Kimi-K2 1T", 384, 7168, 2048, 8, "moonshotai/Kimi-K2 config.json"),
    )
}
"""The routed-expert layers of the models the traffic tables cover, by name."""


def row_bytes(hidden: int, dtype: WireDtype) -> float:
    """Bytes of one token row of width ``hidden`` on the wire (``fp8``: e4m3 plus fp32 1x128 scales)."""
    if dtype == "fp32":
        return 4.0 * hidden
    if dtype == "bf16":
        return 2.0 * hidden
    if dtype == "fp8":
        return hidden + 4.0 * math.ceil(hidden / FP8_BLOCK)
    raise ValueError(f"dtype={dtype!r} is not supported; use 'fp32', 'bf16' or 'fp8'")


def ep_rows_per_token(shape: MoELayerShape, ep: int, *, dedup: bool = False) -> float:
    """Rows one token sends off its GPU per exchange under uniform routing (top-K without replacement).

    ``dedup=False``: one row per slot, ``K * (ep - 1) / ep`` (the ``torch`` backend). ``dedup=True``: one row per
    distinct remote rank, ``(ep - 1) * (1 - C(E - L, K) / C(E, K))`` (DeepEP normal mode).
    """
    if ep < 1 or shape.num_experts % ep:
        raise ValueError(f"ep={ep} must be >= 1 and divide num_experts={shape.num_experts}")
    if not dedup:
        return shape.top_k * (ep - 1) / ep
    local = shape.num_experts // ep
    miss = math.comb(shape.num_experts - local, shape.top_k) / math.comb(shape.num_experts, shape.top_k)
    return (ep - 1) * (1.0 - miss)


@dataclass(frozen=True, slots=True)
class EPTraffic:
    """Bytes one GPU sends for one MoE layer and step (it receives as much on average)."""

    dispatch_fwd: float
    combine_fwd: float
    combine_bwd: float
    dispatch_bwd: float

    @property
    def total(self) -> float:
        return self.dispatch_fwd + self.combine_fwd + self.combine_bwd + self.dispatch_bwd


def ep_token_bytes(
    shape: MoELayerShape,
    tokens_per_gpu: int,
    ep: int,
    *,
    dispatch_dtype: WireDtype = "bf16",
    combine_dtype: WireDtype = "bf16",
    backward: bool = True,
    dedup: bool = False,
) -> EPTraffic:
    """EP token traffic of one layer: the four row exchanges (see the module docstring).

    Args:
        shape: the layer.
        tokens_per_gpu: T.
        ep: R, the expert-parallel group size (divides E).
        dispatch_dtype: format of rows moving tokens -> experts (forward dispatch, backward of combine).
        combine_dtype: format of rows moving experts -> tokens (forward combine, backward of dispatch).
        backward: include the two backward exchanges (False: inference / forward only).
        dedup: one row per (token, remote rank) instead of per slot.
    """
    if tokens_per_gpu < 0:
        raise ValueError(f"tokens_per_gpu={tokens_per_gpu} must be >= 0")
    rows = tokens_per_gpu * ep_rows_per_token(shape, ep, dedup=dedup)
    to_experts = rows * row_bytes(shape.hidden, dispatch_dtype)
    to_tokens = rows * row_bytes(shape.hidden, combine_dtype)
    bwd = 1.0 if backward else 0.0
    return EPTraffic(to_experts, to_tokens, bwd * to_experts, bwd * to_tokens)


@dataclass(frozen=True, slots=True)
class FSDPTraffic:
    """Bytes one GPU sends for one layer and step when FSDP shards the routed experts over N GPUs."""

    all_gather: float
    """All ``gathers`` all-gathers of the weights together."""
    reduce_scatter: float
    """The reduce-scatter of the weight gradients."""

    @property
    def total(self) -> float:
        return self.all_gather + self.reduce_scatter


def fsdp_expert_bytes(
    shape: MoELayerShape,
    fsdp: int,
    *,
    weight_dtype: WireDtype = "bf16",
    grad_dtype: WireDtype = "fp32",
    gathers: int = 2,
    backward: bool = True,
) -> FSDPTraffic:
    """Ring all-gather(s) of the routed experts' weights plus the gradient reduce-scatter, per GPU.

    Args:
        shape: the layer.
        fsdp: N, GPUs the weights are sharded over.
        weight_dtype: format of the gathered weights (``bf16`` mixed precision; ``fp32`` without it).
        grad_dtype: format of the reduce-scattered gradients.
        gathers: all-gathers per step (2 with reshard-after-forward, 1 without).
        backward: include the reduce-scatter (False: forward only).
    """
    if fsdp < 1 or gathers < 0:
        raise ValueError(f"fsdp={fsdp} must be >= 1 and gathers={gathers} >= 0")
    if weight_dtype == "fp8" or grad_dtype == "fp8":  # row_bytes(1, fp8) would charge a scale per element
        raise ValueError("fsdp_expert_bytes models fp32/bf16 weights and gradients only")
    share = (fsdp - 1) / fsdp
    weights = shape.expert_params * row_bytes(1, weight_dtype) * share
    grads = shape.expert_params * row_bytes(1, grad_dtype) * share if backward else 0.0
    return FSDPTraffic(gathers * weights, grads)


def crossover_tokens(ep_bytes_per_token: float, fsdp_bytes: float) -> float:
    """T at which EP moves as many bytes as FSDP; EP moves fewer below it."""
    return math.inf if ep_bytes_per_token == 0 else fsdp_bytes / ep_bytes_per_token


@dataclass(frozen=True, slots=True)
class TrafficRow:
    model: str
    tokens_per_gpu: int
    ep_bf16: float
    """EP bytes with bf16 rows both ways."""
    ep_fp8: float
    """EP bytes with the DeepSeek-V3 recipe: FP8 to the experts, BF16 back."""
    fsdp: float
    """FSDP bytes (bf16 all-gathers, fp32 gradient reduce-scatter)."""
    crossover_fp8: float
    """T* for the FP8-dispatch EP recipe."""


def traffic_table(
    models: Sequence[MoELayerShape] = tuple(MODELS.values()),
    tokens: Sequence[int] = (4096, 16384, 65536),
    *,
    ep: int = 8,
    fsdp: int = 8,
    gathers: int = 2,
) -> list[TrafficRow]:
    """One row per (model, tokens per GPU): EP bytes (bf16; FP8 dispatch + BF16 combine) vs FSDP bytes."""
    rows = []
    for m in models:
        fsdp_b = fsdp_expert_bytes(m, fsdp, gathers=gathers).total
        per_token = ep_token_bytes(m, 1, ep, dispatch_dtype="fp8", combine_dtype="bf16").total
        for t in tokens:
            rows.append(
                TrafficRow(
                    model=m.name,
                    tokens_per_gpu=t,
                    ep_bf16=ep_token_bytes(m, t, ep).total,
                    ep_fp8=ep_token_bytes(m, t, ep, dispatch_dtype="fp8", combine_dtype="bf16").total,
                    fsdp=fsdp_b,
                    crossover_fp8=crossover_tokens(per_token, fsdp_b),
                )
            )
    return rows


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def markdown_report(
    tokens: Sequence[int] = (4096, 16384, 65536), *, ep: int = 8, fsdp: int = 8, gathers: int = 2
) -> str:
    """The commit-ready markdown of ``docs/ep_traffic.md``."""
    rows = traffic_table(tokens=tokens, ep=ep, fsdp=fsdp, gathers=gathers)
    smallest = min(rows, key=lambda r: r.crossover_fp8)
    lines = [
        "# EP token traffic vs FSDP all-gather of the experts, per GPU and MoE layer",
        "",
        "Generated by `python -m moe_rl.moe.ep.traffic --out docs/ep_traffic.md` (formulas in the module docstring of",
        "`moe_rl/moe/ep/traffic.py`). Bytes one GPU sends per MoE layer and training step (forward + backward); it",
        "receives as much on average. Uniform routing, one row per token-slot (the `torch` backend; DeepEP's",
        "per-rank dedup sends less, `dedup=True`).",
        "",
        f"- **EP** over {ep} GPUs: dispatch + combine, forward + backward, a fraction (ep-1)/ep = {(ep - 1) / ep:.3f}",
        "  of the T*K slots leaves the GPU. `bf16`: BF16 rows both ways. `fp8`: the DeepSeek-V3 recipe, FP8 e4m3",
        "  + 1x128 fp32 scales towards the experts (forward dispatch, backward of combine), BF16 back.",
        f"- **FSDP** over {fsdp} GPUs of the routed experts (3*E*D*F weights): {gathers} BF16 all-gathers (forward,",
        "  and again for backward after resharding) + one FP32 reduce-scatter of the gradients; independent of T.",
        "- **T\\*** = tokens per GPU where EP (fp8 recipe) costs as much as FSDP; EP moves fewer bytes below it.",
        "",
        "| model | E | D | F | K | tokens/GPU | EP bf16 (GB) | EP fp8 (GB) | FSDP (GB) | FSDP / EP fp8 | fewer bytes | T\\* |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        m = MODELS[r.model]
        lines.append(
            f"| {r.model} | {m.num_experts} | {m.hidden} | {m.moe_ffn} | {m.top_k} | {r.tokens_per_gpu:,} | "
            f"{_gb(r.ep_bf16)} | {_gb(r.ep_fp8)} | {_gb(r.fsdp)} | {r.fsdp / r.ep_fp8:.1f}x | "
            f"{'EP' if r.ep_fp8 < r.fsdp else 'FSDP'} | {r.crossover_fp8:,.0f} |"
        )
    lines += [
        "",
        "Reading: per layer, FSDP moves the whole routed-expert weight set (twice, plus the gradients) whatever",
        "the batch, while EP moves only the routed token rows, so EP moves fewer bytes below T\\* "
        f"(smallest here: {min(r.crossover_fp8 for r in rows):,.0f} tokens per GPU, {smallest.model}).",
        "Bytes are not time: EP's all-to-all sits on the critical path between router and experts, while FSDP's",
        "all-gather can be prefetched a layer ahead; EP also keeps only E/ep experts' weights and optimizer state",
        "resident per GPU.",
        "",
        "Sources: " + "; ".join(f"{m.name}: {m.source}" for m in MODELS.values()) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown here (default: print it)")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--fsdp", type=int, default=8)
    parser.add_argument("--gathers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    args = parser.parse_args(argv)
    text = markdown_report(args.tokens, ep=args.ep, fsdp=args.fsdp, gathers=args.gathers)
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
