"""Looking up classes of the installed Hugging Face ``transformers`` by name, lazily (``import moe_rl`` never imports
``transformers``)."""

from __future__ import annotations

import importlib

__all__ = ["installed_hf_classes"]


def installed_hf_classes(names_to_module: dict[str, str]) -> dict[type, str]:
    """Map class names to the installed classes.

    Args:
        names_to_module: class name -> the model package under ``transformers.models`` that defines it (e.g.
            ``{"Qwen3MoeExperts": "qwen3_moe"}``), looked up in ``transformers.models.<pkg>.modeling_<pkg>``.

    Returns:
        ``{class: name}`` for every class the installed ``transformers`` has; families an older or newer
        ``transformers`` lacks are left out (not an error); empty when ``transformers`` is not installed.
    """
    out: dict[type, str] = {}
    for name, pkg in names_to_module.items():
        try:
            mod = importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}")
        except ImportError:  # pragma: no cover - a transformers without this family
            continue
        cls = getattr(mod, name, None)
        if cls is not None:
            out[cls] = name
    return out
