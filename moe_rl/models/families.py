"""The model families, in one table: which config class, model class and ``state_dict`` module belong together.

Every family lives in its own subpackage ``moe_rl.models.<name>`` with the same three modules: ``config``
(the pydantic config class), ``model`` (the ``nn.Module``) and ``state_dict`` (the Hugging Face checkpoint
functions of :data:`moe_rl.models.common.state_dict.STATE_DICT_API`). :data:`FAMILIES` names them;
:func:`family_of` finds the family of a config or model instance, and :func:`config_class`,
:func:`model_class` and :func:`state_dict_module` import what a family needs on first use.

Importing this module loads no torch and no pydantic: the table holds names, not classes. :func:`family_of` imports
nothing either (an instance's class is already loaded), so ``family_of(cfg)`` on a config stays torch-free.

Resolution follows the instance's class MRO, most derived class first: ``GlmMoeDsaConfig`` and ``DeepseekV3Config``
share the base :class:`moe_rl.models.common.config.MlaMoeConfig` (not a family), so each resolves to its own family,
and a subclass of a family class (such as the ``FSDP<Model>`` class FSDP2's ``fully_shard`` swaps in) resolves to
the family of the nearest registered class.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "config_class",
    "family_of",
    "get_family",
    "model_class",
    "state_dict_module",
]


@dataclass(frozen=True)
class ModelFamily:
    """One model family: the names of its classes, imported on use.

    Attributes:
        name: the subpackage under ``moe_rl.models`` (and the launcher's ``model.architecture``), e.g.
            ``"glm4_moe"``.
        config_name: the config class in ``moe_rl.models.<name>.config``, e.g. ``"GlmMoeConfig"``.
        model_name: the model class in ``moe_rl.models.<name>.model``, e.g. ``"GlmMoeForCausalLM"``.
        mtp_keys_optional: the family's ``hf_key_ignored`` / ``hf_key_names`` take ``with_mtp=`` (its model may be
            built with or without the MTP layers the checkpoint holds; ``glm_moe_dsa``).
    """

    name: str
    config_name: str
    model_name: str
    mtp_keys_optional: bool = False

    def module(self, submodule: str) -> str:
        """The dotted path of one of the family's modules (``"config"``, ``"model"`` or ``"state_dict"``)."""
        return f"moe_rl.models.{self.name}.{submodule}"

    def class_name(self, submodule: str) -> str:
        """:attr:`config_name` for ``"config"``, :attr:`model_name` for ``"model"``."""
        return self.config_name if submodule == "config" else self.model_name


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("glm4_moe", "GlmMoeConfig", "GlmMoeForCausalLM"),
    ModelFamily("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", mtp_keys_optional=True),
    ModelFamily("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    ModelFamily("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM"),
)
"""Every model family, in the order error messages list them."""

_BY_NAME = {f.name: f for f in FAMILIES}


def get_family(name: str) -> ModelFamily:
    """The family called ``name``.

    Args:
        name: a :attr:`ModelFamily.name`, e.g. ``"deepseek_v3"``.

    Returns:
        Its :class:`ModelFamily`.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is not a family (the message lists them).
    """
    if not isinstance(name, str):
        raise TypeError(f"get_family: name={name!r} has type {type(name).__name__}; pass a family name (a str), one "
                        f"of {list(_BY_NAME)}")
    if name not in _BY_NAME:
        raise ValueError(f"model family {name!r} does not exist; use one of {list(_BY_NAME)}")
    return _BY_NAME[name]


def _loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` is already imported, else None (no instance of it can exist then)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def family_of(obj: Any, *, kind: Literal["config", "model"] | None = None) -> ModelFamily:
    """The family of a config or model instance (or of an instance of a subclass of one).

    Args:
        obj: an instance of a family's config class (``GlmMoeConfig``, ``GlmMoeDsaConfig``, ``DeepseekV3Config``,
            ``NemotronHConfig``) or model class (``GlmMoeForCausalLM``, ...), or of a subclass of one: the most
            derived registered class in ``type(obj).__mro__`` decides.
        kind: ``"config"`` or ``"model"`` accepts only that kind of class; None (default) accepts both.

    Returns:
        Its :class:`ModelFamily`. Imports nothing.

    Raises:
        TypeError: ``obj`` is an instance of none of the accepted classes (the message names them and
            ``type(obj)``).
        ValueError: ``kind`` is not ``"config"``, ``"model"`` or None.
    """
    if kind not in ("config", "model", None):
        raise ValueError(f"family_of: kind={kind!r} is not 'config', 'model' or None; pick one of them")
    kinds = ("config", "model") if kind is None else (kind,)
    registered: dict[type, ModelFamily] = {}
    for fam in FAMILIES:
        for submodule in kinds:
            cls = _loaded_class(fam.module(submodule), fam.class_name(submodule))
            if cls is not None:
                registered[cls] = fam
    for cls in type(obj).__mro__:
        if cls in registered:
            return registered[cls]
    accepted = " or ".join(f"{k} ({', '.join(f.class_name(k) for f in FAMILIES)})" for k in kinds)
    if isinstance(obj, type):
        raise TypeError(f"family_of: got the class {obj.__name__}, not an instance; pass an instance of a model "
                        f"family's {accepted} (e.g. {obj.__name__}.tiny_debug() for a config)")
    raise TypeError(f"family_of: expected an instance of a model family's {accepted}, got {type(obj).__name__}")


def _as_family(family: ModelFamily | str | Any) -> ModelFamily:
    if isinstance(family, ModelFamily):
        return family
    if isinstance(family, str):
        return get_family(family)
    return family_of(family)


def config_class(family: ModelFamily | str | Any) -> type:
    """The config class of a family, e.g. ``GlmMoeConfig`` (imports its ``config`` module: pydantic, no torch).

    Args:
        family: a :class:`ModelFamily`, a family name (``"glm4_moe"``) or a config / model instance
            (:func:`family_of`).

    Returns:
        The class; ``config_class("glm4_moe").tiny_debug()`` is the 2-layer CPU config.

    Raises:
        ValueError: an unknown family name. TypeError: an instance of no family (:func:`family_of`).
    """
    return _family_class(family, "config")


def model_class(family: ModelFamily | str | Any) -> type:
    """The ``nn.Module`` class of a family, e.g. ``GlmMoeForCausalLM`` (imports its ``model`` module, and so torch);
    ``model_class(cfg)(cfg)`` builds the model of ``cfg``. Arguments, result and errors as for
    :func:`config_class`."""
    return _family_class(family, "model")


def _family_class(family: ModelFamily | str | Any, submodule: str) -> type:
    fam = _as_family(family)
    return getattr(importlib.import_module(fam.module(submodule)), fam.class_name(submodule))


def state_dict_module(family: ModelFamily | str | Any) -> ModuleType:
    """The ``state_dict`` module of a family (imports it, and so torch).

    Args:
        family: as for :func:`config_class`.

    Returns:
        ``moe_rl.models.<name>.state_dict``, which defines every function of
        :data:`moe_rl.models.common.state_dict.STATE_DICT_API` (``hf_sources``, ``hf_key_ignored``, ...).

    Raises:
        ValueError: an unknown family name. TypeError: an instance of no family (:func:`family_of`).
    """
    return importlib.import_module(_as_family(family).module("state_dict"))
