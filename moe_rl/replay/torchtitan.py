"""Router replay (R3) for torchtitan MoE models: the same replay input as ``moe_rl``'s own models.

torchtitan (0.3.0, ``torchtitan/models/common/moe.py``) routes with ``TokenChoiceTopKRouter.forward(x_BLD,
expert_bias_E) -> (topk_scores_BLK, topk_expert_ids_BLK, scores_BLE)``: gate in fp32, sigmoid or softmax,
optional bias and node-limited groups for *selection*, scores gathered from the unbiased ``scores_BLE``,
optional ``route_norm`` (+1e-20), times ``route_scale``. Its ``MoE.forward`` takes the ids from the router
and dispatches them, so replaying at the router is enough (EP dispatch included).

:func:`convert_routers_for_replay` swaps every router's class for :class:`ReplayTokenChoiceTopKRouter` (a
subclass with no new state, so checkpoints, FSDP and the config are untouched). Inside
``with replay_routing(model, routed_experts):`` each router replaces its selected ids by its layer's
replayed ids (sentinel rows as in :mod:`moe_rl.replay.layout`: ``-1`` pad fill spread over the experts,
``-2`` keep the router's own choice) and recomputes the gate weights from its own ``scores_BLE`` at those ids,
then applies its ``route_norm`` and ``route_scale``: the weights carry gradient to the gate rows of every
replayed expert (ISEEKYAN/Megatron-LM PR #79). Outside the context the routers behave exactly like torchtitan's.

Shape legend: B batch, L sequence, D hidden, E experts, K top_k, M MoE layers (in model order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from moe_rl.replay.fill import installed_replay_ids, resolve_replay_ids

__all__ = ["ReplayTokenChoiceTopKRouter", "convert_routers_for_replay", "moe_routers", "replay_routing"]


def _router_base() -> type:
    try:
        from torchtitan.models.common.moe import TokenChoiceTopKRouter
    except ImportError as exc:  # pragma: no cover - torchtitan is an optional dependency
        raise ImportError(
            "moe_rl.replay.torchtitan needs torchtitan (pip install torchtitan==0.3.0)"
        ) from exc
    return TokenChoiceTopKRouter


_BASE = _router_base()


class ReplayTokenChoiceTopKRouter(_BASE):  # type: ignore[misc, valid-type]
    """torchtitan ``TokenChoiceTopKRouter`` that replays ``replay_ids_BLK`` when set (see module docstring).

    Attributes:
        replay_ids_BLK: ``[B, L, K]`` integer ids with sentinel rows, or None (torchtitan's own routing).
    """

    replay_ids_BLK: Tensor | None = None

    def forward(self, x_BLD: Tensor, expert_bias_E: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """As torchtitan's forward; with ``replay_ids_BLK`` set, its ids and recomputed weights.

        Raises:
            ValueError: the replayed ids are not ``[B, L, K]`` for this input, or hold an id outside
                ``[0, E)`` in a non-sentinel row.
        """
        topk_scores_BLK, own_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        replay = self.replay_ids_BLK
        if replay is None:
            return topk_scores_BLK, own_ids_BLK, scores_BLE
        expected = (*x_BLD.shape[:-1], self.top_k)
        if tuple(replay.shape) != expected:
            raise ValueError(
                f"replayed routed experts have shape {tuple(replay.shape)} but this router's input "
                f"{tuple(x_BLD.shape)} needs [B, L, K] = {expected}"
            )
        ids_TK = resolve_replay_ids(
            replay.reshape(-1, self.top_k).to(own_ids_BLK.device), self.num_experts, own_ids_BLK.reshape(-1, self.top_k)
        )
        ids_BLK = ids_TK.reshape(expected)
        weights_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)
        if self.route_norm:
            weights_BLK = weights_BLK / (weights_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_BLK * self.route_scale, ids_BLK, scores_BLE


def moe_routers(model: nn.Module) -> list[Any]:
    """Every ``TokenChoiceTopKRouter`` of ``model`` in module order (= decoder order of its MoE layers)."""
    return [m for m in model.modules() if isinstance(m, _BASE)]


def convert_routers_for_replay(model: nn.Module) -> int:
    """Swap each torchtitan router of ``model`` to :class:`ReplayTokenChoiceTopKRouter` in place.

    Returns:
        The number of routers (MoE layers) converted.

    Raises:
        ValueError: ``model`` has no torchtitan ``TokenChoiceTopKRouter``.
    """
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"convert_routers_for_replay: {type(model).__name__} has no torchtitan TokenChoiceTopKRouter")
    for r in routers:
        if not isinstance(r, ReplayTokenChoiceTopKRouter):
            r.__class__ = ReplayTokenChoiceTopKRouter
    return len(routers)


@contextmanager
def replay_routing(model: nn.Module, routed_experts: Tensor | Sequence[Tensor | None]) -> Iterator[None]:
    """Replay ``routed_experts`` in every converted router of ``model`` for the duration of the block.

    Args:
        model: a model passed through :func:`convert_routers_for_replay`.
        routed_experts: ``[B, L, M, K]`` ids (M = the model's MoE layers, in order; the batch's
            ``routed_experts`` after :func:`moe_rl.replay.fill.model_replay_ids`-style decoding) or a list of
            M per-layer ``[B, L, K]`` tensors (None = that layer routes itself).

    Raises:
        ValueError: the routers are not converted, or ``M`` does not match the model (both counts named).
    """
    routers = moe_routers(model)
    if not all(isinstance(r, ReplayTokenChoiceTopKRouter) for r in routers):
        raise ValueError("replay_routing: call convert_routers_for_replay(model) first")
    per_layer = list(routed_experts) if isinstance(routed_experts, (list, tuple)) else [
        routed_experts[:, :, j] for j in range(routed_experts.shape[2])
    ]
    if len(per_layer) != len(routers):
        shape = tuple(routed_experts.shape) if isinstance(routed_experts, Tensor) else f"{len(per_layer)} layers"
        raise ValueError(
            f"routed_experts {shape} gives {len(per_layer)} MoE layers but the model has {len(routers)} routers"
        )
    with installed_replay_ids(routers, per_layer, "replay_ids_BLK"):
        yield
