"""Consistency checks of the MoE fields both GLM family configs share (Hugging Face names: ``n_routed_experts``,
``num_experts_per_tok``, ``n_group``, ``topk_group``, ``first_k_dense_replace``, ``num_hidden_layers``).

The configs keep their own fields (each family's defaults and field documentation, and the field order their
``config.json`` is written in); their validators call :func:`moe_routing_problems`, and their Hugging Face
``config.json`` round trip uses :func:`hf_config_dict` and :func:`hf_config_values`.

This module does not import torch or transformers.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

__all__ = ["MoeRoutingFields", "hf_config_dict", "hf_config_values", "moe_routing_problems"]


class MoeRoutingFields(Protocol):
    """The config fields :func:`moe_routing_problems` reads."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    num_hidden_layers: int


def moe_routing_problems(cfg: MoeRoutingFields) -> list[str]:
    """What is wrong with the MoE routing fields of ``cfg``, one sentence (rule, values, fix) per problem.

    The rules follow the group-limited top-k of :func:`moe_rl.moe.router.topk_route` (DeepSeek-V3 node-limited
    routing): K <= E; ``n_group`` divides E with at least 2 experts per group (a group's score sums its top-2
    experts); ``topk_group <= n_group``; K <= the experts left after the group limit
    (``topk_group * E / n_group``); and ``first_k_dense_replace <= num_hidden_layers``.

    Returns:
        The problems (empty when the fields are consistent); the caller raises ``ValueError`` with them.
    """
    problems = []
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        problems.append(
            f"num_experts_per_tok={cfg.num_experts_per_tok} must be <= n_routed_experts={cfg.n_routed_experts}"
        )
    if cfg.n_routed_experts % cfg.n_group:
        problems.append(f"n_routed_experts={cfg.n_routed_experts} must be divisible by n_group={cfg.n_group}")
    elif cfg.n_group > 1 and cfg.n_routed_experts // cfg.n_group < 2:
        problems.append(
            f"n_group={cfg.n_group} leaves {cfg.n_routed_experts // cfg.n_group} expert per group; the group "
            "score sums the top-2 experts of a group, so each group needs >= 2 (lower n_group)"
        )
    if cfg.topk_group > cfg.n_group:
        problems.append(f"topk_group={cfg.topk_group} must be <= n_group={cfg.n_group}")
    elif not cfg.n_routed_experts % cfg.n_group:
        kept = cfg.topk_group * (cfg.n_routed_experts // cfg.n_group)
        if cfg.num_experts_per_tok > kept:
            problems.append(
                f"num_experts_per_tok={cfg.num_experts_per_tok} must be <= topk_group * n_routed_experts / "
                f"n_group = {kept} (the experts left after the group limit)"
            )
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        problems.append(
            f"first_k_dense_replace={cfg.first_k_dense_replace} must be <= num_hidden_layers="
            f"{cfg.num_hidden_layers}"
        )
    return problems


def hf_config_dict(
    cfg: BaseModel,
    *,
    architecture: str,
    model_type: str,
    torch_dtype: Any,
    extra: dict[str, Any],
    replace: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The ``config.json`` dict of a GLM family config (Hugging Face key order, which ``config.json`` keeps).

    Keys, in order: ``architectures = [architecture]``, ``model_type``, every field of ``cfg`` (values from
    ``replace`` where given, ``drop`` left out), ``hidden_act="silu"``, ``attention_dropout=0.0``, the ``extra``
    keys, ``use_cache=True``, and the weights' dtype name as both ``dtype`` (transformers 5) and ``torch_dtype``
    (older readers).

    Args:
        cfg: the pydantic config.
        architecture: the Hugging Face model class name, e.g. ``"Glm4MoeForCausalLM"``.
        model_type: the Hugging Face ``model_type``, e.g. ``"glm4_moe"``.
        torch_dtype: a ``torch.dtype`` or its name (``"bfloat16"``).
        extra: family keys that are not fields (e.g. ``rope_parameters``).
        replace: field values written differently from ``model_dump`` (e.g. spelled out per layer).
        drop: fields that are not Hugging Face keys (e.g. an execution choice).

    Returns:
        A JSON-serializable dict.

    Raises:
        KeyError: a name in ``drop`` is not a field.
    """
    dtype_name = str(torch_dtype).removeprefix("torch.")
    d: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    d.update(cfg.model_dump())
    d.update(replace or {})
    for key in drop:
        d.pop(key)
    d.update(hidden_act="silu", attention_dropout=0.0, **extra, use_cache=True, dtype=dtype_name, torch_dtype=dtype_name)
    return d


def hf_config_values(
    cls: type[BaseModel], d: dict[str, Any], *, model_type: str, model_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checks every GLM family makes on a Hugging Face ``config.json`` dict, and what it reads from it.

    Args:
        cls: the config class (its fields are the keys kept).
        d: the ``config.json`` dict.
        model_type: the only ``model_type`` accepted (a missing one counts as this).
        model_name: the model class, for the activation error.

    Returns:
        ``(values, rope)``: the keys of ``d`` that are fields of ``cls``, and the rotary dict
        (``rope_parameters``, else ``rope_scaling``, else empty).

    Raises:
        ValueError: another ``model_type``, ``hidden_act`` other than silu, or a rotary type other than
            ``"default"`` (YaRN and other scalings are not implemented).
    """
    got = d.get("model_type", model_type)
    if got != model_type:
        raise ValueError(f"model_type={got!r} in config.json; {cls.__name__} reads only {model_type!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; {model_name} uses silu")
    values = {k: v for k, v in d.items() if k in cls.model_fields}
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported; only 'default' rotary")
    return values, rope
