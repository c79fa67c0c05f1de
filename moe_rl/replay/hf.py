"""Router replay (R3) and a trainer-side routing recorder for Hugging Face ``transformers`` MoE models.

Supported router modules (``transformers`` 5.x, the modeling code of each family):

==============================  ==================================================================================
router class                    routing math (gate logits ``z = x W^T``, ``[T, E]``)
==============================  ==================================================================================
``Qwen3MoeTopKRouter``          ``p = softmax(z, fp32)``; top-k of ``p``; weights ``p[ids]``, divided by their sum
                                when ``norm_topk_prob``; cast to ``z``'s dtype
``MixtralTopKRouter``           ``p = softmax(z.float())``; top-k of ``p``; weights ``p[ids] / sum`` (= softmax over
                                the top-k logits); fp32
``DeepseekV3TopkRouter``        ``s = sigmoid(z)`` (fp32); selection on ``s + e_score_correction_bias`` restricted to
``Glm4MoeTopkRouter``           the ``topk_group`` best of ``n_group`` groups (group score = sum of its 2 best);
                                weights ``s[ids]`` (unbiased), ``/ (sum + 1e-20)`` when ``norm_topk_prob``, times
                                ``routed_scaling_factor``; fp32
==============================  ==================================================================================

Each router returns ``(router_logits [T, E], weights [T, K], ids [T, K])`` from ``hidden_states`` flattened to
``[T, D]`` (``T = B * L`` tokens in the batch's row-major order); its MoE block hands ``ids`` and ``weights`` to the
fused experts, so replaying at the router replays the whole layer.

:func:`convert_hf_moe_routers` swaps each router's class for a subclass with no new state (parameters, buffers,
``state_dict`` and ``config`` untouched). Outside the two contexts below the subclass returns exactly the parent's
result. Inside ``with replay_hf_routing(model, routed_experts):`` each router takes its layer's ids (sentinel rows
as in :mod:`moe_rl.replay.layout`: ``-1`` pad rows get a spread fill, ``-2`` keep the router's own choice) and
recomputes the weights from its own scores at those ids with its family's normalisation, so the weights carry
gradient to the gate row of every replayed expert. Inside ``with record_hf_routing(model) as rec:`` each router
records the ids it dispatched (the replayed ones when both contexts are active).

Determinism: replaying a model's own recorded ids reproduces its forward bit for bit (same ids in the same order,
so the same gather, the same normalising sum and the same expert loop). Ids in another order within a row give
the same routing; the outputs then differ only by fp32 summation order (``sum`` of K weights, ``index_add`` of K
expert outputs), i.e. within ``K * eps`` relative.

Shape legend: B batch, L sequence, T = B*L tokens, D hidden, E routed experts, K top_k, M MoE layers (model order).

Importing this module does not import ``transformers``; :func:`convert_hf_moe_routers` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moe_rl.replay.fill import installed_replay_ids, resolve_replay_ids

__all__ = [
    "SUPPORTED_HF_ROUTERS",
    "HfRoutingRecord",
    "convert_hf_moe_routers",
    "hf_moe_routers",
    "record_hf_routing",
    "replay_hf_routing",
]

SUPPORTED_HF_ROUTERS: dict[str, tuple[str, str]] = {
    "Qwen3MoeTopKRouter": ("qwen3_moe", "Qwen3-MoE"),
    "MixtralTopKRouter": ("mixtral", "Mixtral"),
    "DeepseekV3TopkRouter": ("deepseek_v3", "DeepSeek-V3"),
    "Glm4MoeTopkRouter": ("glm4_moe", "GLM-4.5 MoE (Glm4Moe)"),
}
"""Router class name -> (``transformers.models`` subpackage, family)."""


def _supported_text() -> str:
    return ", ".join(f"{fam} ({cls})" for cls, (_, fam) in SUPPORTED_HF_ROUTERS.items())


def _softmax_weights(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    # Qwen3-MoE: softmax in fp32, optional renormalisation, cast back to the logits' dtype.
    w = torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(1, ids_TK)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits_TE.dtype)


def _mixtral_weights(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    # Mixtral: softmax of the fp32 logits, always renormalised over the top-k, left in fp32.
    w = torch.softmax(logits_TE.float(), dim=-1).gather(1, ids_TK)
    return w / w.sum(dim=-1, keepdim=True)


def _sigmoid_weights(router: nn.Module, logits_TE: Tensor, ids_TK: Tensor) -> Tensor:
    # DeepSeek-V3 / GLM-4.5: unbiased sigmoid scores (the bias only selects), +1e-20 renorm, scaling factor.
    w = logits_TE.sigmoid().gather(1, ids_TK)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


_WEIGHTS: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_weights,
    "MixtralTopKRouter": _mixtral_weights,
    "DeepseekV3TopkRouter": _sigmoid_weights,
    "Glm4MoeTopkRouter": _sigmoid_weights,
}


def _router_classes() -> dict[type, str]:
    """Importable router classes of the installed ``transformers`` -> their name (families it lacks are left out)."""
    from moe_rl._hf import installed_hf_classes

    return installed_hf_classes({name: pkg for name, (pkg, _) in SUPPORTED_HF_ROUTERS.items()})


@dataclass
class HfRoutingRecord:
    """Per-layer ids recorded by :func:`record_hf_routing`, one entry per router call.

    Attributes:
        calls: ``M`` lists (one per MoE layer, model order) of ``[T, K]`` int64 CPU-or-device tensors, one per
            forward through that router while recording (gradient-checkpoint recomputation adds a call).
    """

    calls: list[list[Tensor]] = field(default_factory=list)

    @property
    def num_calls(self) -> int:
        """Forward passes recorded (equal for every layer, else a ValueError)."""
        counts = {len(c) for c in self.calls}
        if len(counts) > 1:
            raise ValueError(
                f"record_hf_routing: the MoE layers recorded different numbers of calls ({[len(c) for c in self.calls]}); "
                "a forward stopped part-way or a layer ran outside the model's forward"
            )
        return counts.pop() if counts else 0

    def routed_experts(self, batch_shape: tuple[int, ...] | None = None, *, call: int = -1) -> Tensor:
        """The ids of one forward, stacked over layers.

        Args:
            batch_shape: ``(B, L)`` to get ``[B, L, M, K]`` (the layout of vLLM's ``routed_experts`` and of
                :func:`replay_hf_routing`); None gives ``[T, M, K]``.
            call: which recorded forward (default the last).

        Returns:
            int64 ``[T, M, K]`` or ``[*batch_shape, M, K]``, on the device the routers ran on.

        Raises:
            ValueError: nothing was recorded, layers disagree on the number of calls or on ``T``, or
                ``batch_shape`` does not multiply to ``T`` (both named).
        """
        n = self.num_calls
        if n == 0:
            raise ValueError("record_hf_routing recorded no forward; run the model inside the `with` block")
        per_layer = [c[call] for c in self.calls]
        tokens = {int(t.shape[0]) for t in per_layer}
        if len(tokens) != 1:
            raise ValueError(f"recorded layers saw different token counts {sorted(tokens)}")
        ids_TMK = torch.stack(per_layer, dim=1)
        if batch_shape is None:
            return ids_TMK
        t = int(ids_TMK.shape[0])
        if int(torch.Size(batch_shape).numel()) != t:
            raise ValueError(
                f"batch_shape={tuple(batch_shape)} holds {int(torch.Size(batch_shape).numel())} tokens but the "
                f"routers saw T={t}; pass the (B, L) of the input_ids that were forwarded"
            )
        return ids_TMK.reshape(*batch_shape, *ids_TMK.shape[1:])


_replay_cache: dict[type, type] = {}


def _replay_cls(base: type, name: str) -> type:
    if base in _replay_cache:
        return _replay_cache[base]
    weights_fn = _WEIGHTS[name]

    class _Replay(base):  # type: ignore[valid-type, misc]
        # Class attributes, shadowed per instance only while a context is active: no new state.
        replay_ids_TK: Tensor | None = None
        routing_record: list[Tensor] | None = None

        def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            logits_TE, weights_TK, ids_TK = super().forward(hidden_states)
            replay = self.replay_ids_TK
            if replay is not None:
                t = int(logits_TE.shape[0])
                if replay.dim() < 1 or replay.shape[-1] != self.top_k or replay.numel() != t * self.top_k:
                    raise ValueError(
                        f"{type(self).__name__}: replayed routed experts have shape {tuple(replay.shape)} but this "
                        f"router saw T={t} tokens with top_k={self.top_k}; expected [..., K] with T*K ids "
                        "([B, L, K] of the forwarded batch)"
                    )
                ids_TK = resolve_replay_ids(replay.reshape(t, self.top_k).to(ids_TK.device), self.num_experts, ids_TK)
                weights_TK = weights_fn(self, logits_TE, ids_TK)
            if self.routing_record is not None:
                self.routing_record.append(ids_TK.detach().to(torch.int64))
            return logits_TE, weights_TK, ids_TK

    _Replay.__name__ = _Replay.__qualname__ = f"Replay{base.__name__}"
    _replay_cache[base] = _Replay
    return _Replay


def _is_converted(module: nn.Module) -> bool:
    return type(module) in _replay_cache.values()


def hf_moe_routers(model: nn.Module) -> list[nn.Module]:
    """Every supported router of ``model`` (converted or not) in module order (= decoder order of its MoE layers).

    Raises:
        ImportError: ``transformers`` is not installed.
    """
    classes = tuple(_router_classes())
    return [m for m in model.modules() if isinstance(m, classes)]


def convert_hf_moe_routers(model: nn.Module) -> int:
    """Make every MoE router of a ``transformers`` model replayable and recordable, in place (idempotent).

    Args:
        model: e.g. ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``DeepseekV3ForCausalLM``,
            ``Glm4MoeForCausalLM`` (or their bare ``*Model``), on any device and dtype; call before FSDP wrapping
            or after, the class swap adds no parameter.

    Returns:
        M, the number of routers (MoE layers) converted.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or has no supported router (its class and the supported
            families are named).
        ImportError: ``transformers`` is not installed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_hf_moe_routers: model is a {type(model).__name__}; expected a torch nn.Module")
    classes = _router_classes()
    routers = [(m, classes[type(m)] if type(m) in classes else None) for m in model.modules()]
    found = []
    for m, name in routers:
        if _is_converted(m):
            found.append(m)
            continue
        if name is None:
            for cls, cname in classes.items():
                if isinstance(m, cls):
                    raise TypeError(
                        f"convert_hf_moe_routers: {type(m).__name__} subclasses {cname} and may route differently; "
                        f"supported router classes: {_supported_text()}"
                    )
            continue
        found.append(m)
    if not found:
        raise TypeError(
            f"convert_hf_moe_routers: {type(model).__name__} has no supported transformers MoE router; supported: "
            f"{_supported_text()}. For torchtitan models use moe_rl.replay.torchtitan.convert_routers_for_replay; "
            "moe_rl's own models take replay_ids= directly"
        )
    for m in found:
        if not _is_converted(m):
            m.__class__ = _replay_cls(type(m), classes[type(m)])
    return len(found)


def _converted_routers(model: nn.Module, fn: str) -> list[nn.Module]:
    routers = [m for m in model.modules() if _is_converted(m)]
    if not routers:
        raise ValueError(f"{fn}: {type(model).__name__} has no converted router; call convert_hf_moe_routers(model) first")
    return routers


def _per_layer(routed_experts: Tensor | Sequence[Tensor | None], num_layers: int) -> list[Tensor | None]:
    if isinstance(routed_experts, Tensor):
        if routed_experts.dim() < 3:
            raise ValueError(
                f"routed_experts has shape {tuple(routed_experts.shape)}; expected [B, L, M, K] or [T, M, K] "
                "(M MoE layers in model order) or a list of M per-layer [B, L, K] tensors"
            )
        per = [routed_experts.select(-2, j) for j in range(routed_experts.shape[-2])]
        what = f"routed_experts {tuple(routed_experts.shape)}"
    else:
        per = list(routed_experts)
        what = f"routed_experts list of {len(per)}"
    if len(per) != num_layers:
        raise ValueError(f"{what} gives {len(per)} MoE layers but the model has {num_layers} MoE routers")
    return per


@contextmanager
def replay_hf_routing(model: nn.Module, routed_experts: Tensor | Sequence[Tensor | None]) -> Iterator[None]:
    """Force the given expert ids in every converted router of ``model`` for the duration of the block.

    Args:
        model: passed through :func:`convert_hf_moe_routers`.
        routed_experts: integer ids ``[B, L, M, K]`` (or ``[T, M, K]``) for the batch forwarded inside the block,
            or a list of M per-layer ``[B, L, K]`` / ``[T, K]`` tensors (None = that layer routes itself). Rows
            may be sentinel rows (all ``-1``: spread fill for pad tokens; all ``-2``: the router's own choice).

    Raises:
        ValueError: the model is not converted; ``M`` differs from the model's router count (both named).
            At the forward: a layer's ids do not match its ``T`` and ``K``, an id is outside ``[0, E)``, a row
            repeats an id or mixes sentinels (see :func:`moe_rl.replay.fill.resolve_replay_ids`).
        TypeError: (at the forward) float or bool ids.
    """
    routers = _converted_routers(model, "replay_hf_routing")
    per = _per_layer(routed_experts, len(routers))
    with installed_replay_ids(routers, per, "replay_ids_TK"):
        yield


@contextmanager
def record_hf_routing(model: nn.Module) -> Iterator[HfRoutingRecord]:
    """Record the ids every converted router dispatches while the block runs (the trainer-side recorder).

    Yields:
        :class:`HfRoutingRecord`; after a forward of ``input_ids [B, L]``,
        ``rec.routed_experts((B, L))`` is the ``[B, L, M, K]`` int64 replay input of :func:`replay_hf_routing`.

    Raises:
        ValueError: the model is not converted (call :func:`convert_hf_moe_routers` first).
    """
    routers = _converted_routers(model, "record_hf_routing")
    rec = HfRoutingRecord(calls=[[] for _ in routers])
    try:
        for r, calls in zip(routers, rec.calls, strict=True):
            r.routing_record = calls
        yield rec
    finally:
        for r in routers:
            r.__dict__.pop("routing_record", None)
