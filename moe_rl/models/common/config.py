"""Config pieces the model families share: consistency checks of the routed-MoE fields (Hugging Face names:
``n_routed_experts``, ``num_experts_per_tok``, ``n_group``, ``topk_group``; with leading dense layers also
``first_k_dense_replace``, ``num_hidden_layers``) and of the token ids, the Hugging Face ``config.json`` round trip
of the GLM families, and :class:`MlaMoeConfig`, the fields, checks and ``config.json`` conversion of the MLA
families (``glm_moe_dsa``, ``deepseek_v3``).

``glm4_moe`` and ``nemotron_h`` keep their own fields (each mirrors its Hugging Face config class); their validators
call :func:`expert_routing_problems` (``glm4_moe`` through :func:`moe_routing_problems`) and
:func:`token_id_problems`, and ``glm4_moe``'s ``config.json`` round trip uses :func:`hf_config_dict` and
:func:`hf_config_values`. The MLA families subclass ``MlaMoeConfig.with_defaults(...)`` (their published model's
defaults) and add their own fields and checks.

This module does not import torch or transformers.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from moe_rl.config import BaseConfig

__all__ = [
    "MlaMoeConfig",
    "MoeRoutingFields",
    "RoutedExpertFields",
    "TokenIdFields",
    "check_mla_kv_heads",
    "expert_routing_problems",
    "hf_config_dict",
    "hf_config_values",
    "mla_problems",
    "moe_routing_problems",
    "token_id_problems",
]


class RoutedExpertFields(Protocol):
    """The config fields :func:`expert_routing_problems` reads."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int


class MoeRoutingFields(RoutedExpertFields, Protocol):
    """The config fields :func:`moe_routing_problems` reads: the routing fields and the leading dense layers."""

    first_k_dense_replace: int
    num_hidden_layers: int


def expert_routing_problems(cfg: RoutedExpertFields) -> list[str]:
    """What is wrong with the routed-expert fields of ``cfg``, one sentence (the rule and the values) per problem.

    The rules follow the group-limited top-k of :func:`moe_rl.moe.router.topk_route` (DeepSeek-V3 node-limited
    routing): K <= E; ``n_group`` divides E with at least 2 experts per group (a group's score sums its top-2
    experts); ``topk_group <= n_group``; and K <= the experts left after the group limit
    (``topk_group * E / n_group``).

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
        if cfg.n_routed_experts >= cfg.num_experts_per_tok > kept:  # K > E is reported above
            problems.append(
                f"num_experts_per_tok={cfg.num_experts_per_tok} must be <= topk_group * n_routed_experts / "
                f"n_group = {kept} (the experts left after the group limit)"
            )
    return problems


def moe_routing_problems(cfg: MoeRoutingFields) -> list[str]:
    """What is wrong with the MoE fields of a config with leading dense layers, one sentence (the rule and the values)
    per problem: the routing rules of :func:`expert_routing_problems`, and ``first_k_dense_replace <=
    num_hidden_layers``.

    Returns:
        The problems (empty when the fields are consistent); the caller raises ``ValueError`` with them.
    """
    problems = expert_routing_problems(cfg)
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        problems.append(
            f"first_k_dense_replace={cfg.first_k_dense_replace} must be <= num_hidden_layers="
            f"{cfg.num_hidden_layers}"
        )
    return problems


class TokenIdFields(Protocol):
    """The config fields :func:`token_id_problems` reads."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None


def token_id_problems(cfg: TokenIdFields) -> list[str]:
    """What is wrong with the token ids of ``cfg``: each of ``bos_token_id``, ``eos_token_id`` (one id or several)
    and ``pad_token_id`` that is not None must be in ``[0, vocab_size)`` (a row of the embedding); one sentence
    (rule, value, fix) per bad id.

    Returns:
        The problems (empty when every id is a token of the vocabulary); the caller raises ``ValueError`` with them.
    """
    problems = []
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    for name, ids in (("bos_token_id", [cfg.bos_token_id]), ("eos_token_id", eos), ("pad_token_id", [cfg.pad_token_id])):
        for v in ids:
            if v is not None and not 0 <= v < cfg.vocab_size:
                problems.append(
                    f"{name}={v} must be in [0, vocab_size={cfg.vocab_size}) (a row of the embedding); set it to a "
                    "token of this vocabulary or None"
                )
    return problems


def mla_problems(cfg: Any) -> list[str]:
    """What is wrong with the token and rotary fields of an MLA config, one sentence (rule, values, fix) per
    problem: every token id (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) must be a row of the embedding
    (:func:`token_id_problems`) and ``qk_rope_head_dim`` even (rotary pairs).

    Returns:
        The problems (empty when the fields are consistent); the caller raises ``ValueError`` with them.
    """
    problems = token_id_problems(cfg)
    if cfg.qk_rope_head_dim % 2:
        problems.append(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")
    return problems


def check_mla_kv_heads(cls: type[BaseModel], d: dict[str, Any], values: dict[str, Any]) -> None:
    """Check that a ``config.json`` dict ``d`` of an MLA model has no grouped KV heads: its
    ``num_key_value_heads``, when present and not null, must equal ``num_attention_heads`` (from ``values``, else
    ``cls``' default).

    Raises:
        ValueError: ``num_key_value_heads`` differs from ``num_attention_heads`` (both values named).
    """
    heads = values.get("num_attention_heads", cls.model_fields["num_attention_heads"].default)
    if d.get("num_key_value_heads", heads) not in (heads, None):
        raise ValueError(
            f"num_key_value_heads={d['num_key_value_heads']} must equal num_attention_heads={heads} (MLA has "
            "no grouped KV heads)"
        )


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


class MlaMoeConfig(BaseConfig):
    """The hyper-parameters of a DeepSeek-V3-layout decoder (Hugging Face ``DeepseekV3Config`` names): multi-head
    latent attention with a low-rank query, a sigmoid-routed MoE with expert bias, group-limited top-k, shared
    experts and leading dense layers. Defaults = DeepSeek-V3 (``deepseek-ai/DeepSeek-V3`` ``config.json``).

    A family subclasses ``MlaMoeConfig.with_defaults(...)`` (:meth:`with_defaults`: its published model's values),
    names its Hugging Face classes in ``_hf_architecture`` / ``_hf_model_types`` (the first is written), adds its
    own fields and, through the hooks :meth:`_family_problems`, :meth:`_hf_rope_parameters`,
    :meth:`_hf_family_values` and ``_hf_replace`` / ``_hf_drop``, its own checks and ``config.json`` keys.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    _hf_architecture: ClassVar[str] = ""
    _hf_model_types: ClassVar[tuple[str, ...]] = ()
    _hf_rope_types: ClassVar[tuple[str, ...]] = ("default",)
    """The ``rope_parameters.rope_type`` values the family implements."""
    _hf_drop: ClassVar[tuple[str, ...]] = ()
    """Fields that are not Hugging Face keys (execution choices), left out of ``config.json``."""

    vocab_size: int = Field(129280, ge=1)
    """Token ids (rows of the embedding and of the output head)."""
    hidden_size: int = Field(7168, ge=1)
    """Residual stream width D."""
    intermediate_size: int = Field(18432, ge=1)
    """Width of the dense SwiGLU MLP of the first ``first_k_dense_replace`` layers."""
    moe_intermediate_size: int = Field(2048, ge=1)
    """Width F of each routed and shared expert."""
    num_hidden_layers: int = Field(61, ge=1)
    """Decoder layers (the MTP layers are counted by ``num_nextn_predict_layers``)."""
    num_nextn_predict_layers: int = Field(1, ge=0)
    """Multi-token-prediction layers of the checkpoint (``model.layers.{L + m}.*``, each: ``enorm``, ``hnorm``,
    ``eh_proj [D, 2D]``, ``shared_head.norm`` and one MoE decoder layer; embedding and head shared with the main
    model). Whether the model builds them is the family's choice (its model class says)."""
    num_attention_heads: int = Field(128, ge=1)
    """Query heads H (MLA: as many key/value heads)."""
    q_lora_rank: int = Field(1536, ge=1)
    """Rank of the query down-projection ``q_a_proj [q_lora_rank, D]`` (checkpoints without it, DeepSeek-V2-Lite's
    ``q_proj``, are not supported)."""
    kv_lora_rank: int = Field(512, ge=1)
    """Rank of the compressed KV latent (the part of ``kv_a_proj_with_mqa`` before the rope key)."""
    qk_nope_head_dim: int = Field(128, ge=1)
    """Per-head query/key dims without rotary."""
    qk_rope_head_dim: int = Field(64, ge=2)
    """Per-head rotary query dims; the rotary key (one, shared by all heads) has the same width."""
    v_head_dim: int = Field(128, ge=1)
    """Per-head value width."""
    first_k_dense_replace: int = Field(3, ge=0)
    """Leading layers with a dense MLP instead of MoE."""
    n_routed_experts: int = Field(256, ge=1)
    """Routed experts E per MoE layer."""
    num_experts_per_tok: int = Field(8, ge=1)
    """Experts K per token (top_k)."""
    n_shared_experts: int = Field(1, ge=0)
    """Always-on shared experts (one SwiGLU of width ``n_shared_experts * moe_intermediate_size``)."""
    n_group: int = Field(8, ge=1)
    """Expert groups for group-limited (node-limited) routing."""
    topk_group: int = Field(4, ge=1)
    """Groups kept per token."""
    norm_topk_prob: bool = True
    """Renormalize the K gathered sigmoid scores."""
    routed_scaling_factor: float = Field(2.5, gt=0.0)
    """Multiplier of the routed gate weights."""
    rms_norm_eps: float = Field(1e-6, gt=0.0)
    """Epsilon of the decoder RMSNorms (the two MLA latent norms use 1e-6, as transformers hard-codes)."""
    rope_theta: float = Field(10000.0, gt=0.0)
    """Rotary base."""
    max_position_embeddings: int = Field(163840, ge=1)
    """Longest supported context."""
    attention_bias: bool = False
    """Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    bos_token_id: int | None = Field(0, ge=0)
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = Field(None, ge=0)
    initializer_range: float = Field(0.02, ge=0.0)

    @classmethod
    def with_defaults(cls, **defaults: Any) -> type[MlaMoeConfig]:
        """A subclass of ``cls`` whose fields named in ``defaults`` default to the given values (annotation,
        constraints and description kept), for a family to subclass: ``class GlmMoeDsaConfig(MlaMoeConfig.
        with_defaults(vocab_size=154880, ...))``. Field order is unchanged.

        Raises:
            TypeError: a name that is not a field of ``cls``.
        """
        unknown = sorted(set(defaults) - set(cls.model_fields))
        if unknown:
            raise TypeError(f"with_defaults: {unknown} are not fields of {cls.__name__}; name existing fields only")
        fields: dict[str, Any] = {}
        for name, value in defaults.items():
            info = cls.model_fields[name]
            bounds = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
            fields[name] = (info.annotation, Field(value, description=info.description, **bounds))
        return create_model(f"{cls.__name__}Defaults", __base__=cls, __module__=cls.__module__, **fields)

    @model_validator(mode="after")
    def _check(self) -> MlaMoeConfig:
        problems = moe_routing_problems(self) + mla_problems(self) + self._family_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _family_problems(self) -> list[str]:
        """What is wrong with the family's own fields (one sentence per problem); none here."""
        return []

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when decoder layer ``layer_idx`` uses the MoE block (``layer_idx >= first_k_dense_replace``; MTP
        layers, ``layer_idx >= num_hidden_layers``, are MoE layers)."""
        return layer_idx >= self.first_k_dense_replace

    # ------------------------------------------------------------------ Hugging Face config.json

    def _hf_rope_parameters(self) -> dict[str, Any]:
        """The ``rope_parameters`` of ``config.json`` (here: plain RoPE)."""
        return {"rope_type": "default", "rope_theta": self.rope_theta}

    def _hf_replace(self) -> dict[str, Any]:
        """Field values written differently from ``model_dump`` (none here; GLM-5: ``indexer_types``)."""
        return {}

    def to_hf_config_dict(self, torch_dtype: Any = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that transformers' config class of this family reads.

        Args:
            torch_dtype: dtype of the saved weights, a ``torch.dtype`` or its name; written as ``dtype`` and
                ``torch_dtype``.

        Returns:
            JSON-serializable dict (:func:`hf_config_dict`): the family's ``model_type`` and ``architectures``,
            every Hugging Face field here, ``num_key_value_heads = num_attention_heads``, ``rope_parameters``
            (with ``rope_theta``; the family's rotary scaling, if any) and the routing the model implements,
            ``scoring_func="sigmoid"`` and ``topk_method="noaux_tc"``, as the published ``config.json`` files write
            them (transformers does not read them; vLLM does: without them its DeepSeek-V2/V3 MoE scores with
            softmax and has no ``e_score_correction_bias``, so loading the checkpoint fails).
        """
        return hf_config_dict(
            self,
            architecture=self._hf_architecture,
            model_type=self._hf_model_types[0],
            torch_dtype=torch_dtype,
            extra={"num_key_value_heads": self.num_attention_heads, "rope_parameters": self._hf_rope_parameters(),
                   "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
            replace=self._hf_replace(),
            drop=("rope_theta", *self._hf_drop),
        )

    @classmethod
    def _hf_family_values(
        cls, d: dict[str, Any], values: dict[str, Any], rope_type: str, rope: dict[str, Any]
    ) -> None:
        """Read the family's own keys of ``config.json`` dict ``d`` into ``values`` (none here).

        Args:
            d: the ``config.json`` dict. values: the field values read so far (updated in place).
            rope_type: the rotary type (``rope_parameters.rope_type``, one of ``_hf_rope_types``). rope: the other
                rotary keys.
        """

    @classmethod
    def from_hf_config_dict(cls, d: dict[str, Any]) -> MlaMoeConfig:
        """Build a config from a Hugging Face ``config.json`` dict of this family.

        Keys that are not fields here are ignored. ``rope_theta`` is read from ``rope_parameters`` (transformers 5),
        else ``rope_scaling``, else the top level (published ``config.json`` files); ``type`` is accepted for
        ``rope_type``; ``num_mtp_layers`` is read as ``num_nextn_predict_layers`` when that is absent.

        Raises:
            ValueError: another ``model_type``; ``hidden_act`` other than silu, ``scoring_func`` other than sigmoid
                or ``topk_method`` other than noaux_tc; ``q_lora_rank`` null (the ``q_proj`` layout is not
                implemented); ``num_key_value_heads`` other than ``num_attention_heads``; a rotary type the family
                does not implement; or the values fail validation.
        """
        got = d.get("model_type", cls._hf_model_types[0])
        if got not in cls._hf_model_types:
            raise ValueError(f"model_type={got!r} in config.json; {cls.__name__} reads only {list(cls._hf_model_types)}")
        for key, want in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if d.get(key, want) != want:
                raise ValueError(f"{key}={d[key]!r} in config.json is not supported; {cls.__name__} uses {want!r}")
        if "q_lora_rank" in d and d["q_lora_rank"] is None:
            raise ValueError(
                "q_lora_rank=None (a plain q_proj, DeepSeek-V2-Lite) is not supported; the MLA families build the "
                "q_a_proj/q_b_proj low-rank query of DeepSeek-V3, Kimi-K2 and GLM-5"
            )
        values = {k: v for k, v in d.items() if k in cls.model_fields and k not in ("rope_scaling", "rope_theta")}
        check_mla_kv_heads(cls, d, values)
        if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
            values["num_nextn_predict_layers"] = d["num_mtp_layers"]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta"))
        if theta is not None:
            values["rope_theta"] = theta
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in cls._hf_rope_types:
            raise ValueError(
                f"rope_parameters.rope_type={rope_type!r} is not supported; {cls.__name__} reads "
                f"{list(cls._hf_rope_types)}"
            )
        cls._hf_family_values(d, values, rope_type, rope)
        return cls(**values)
