"""Lazy package exports: the module ``__getattr__`` (PEP 562) every ``moe_rl`` subpackage uses.

A subpackage lists its public names in ``_EXPORTS`` (``{name: submodule}``) and sets
``__getattr__ = lazy_getattr(__name__, _EXPORTS)``: a name imports only its own submodule, on first use, so
importing a subpackage stays cheap (no torch, no optional backend until a name that needs it is touched). It also
sets ``__dir__ = lazy_dir(globals(), _EXPORTS)`` so that ``dir(package)`` (and tab completion) lists the exports
before they are loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_dir", "lazy_getattr"]


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that loads ``exports[name]`` on first access of ``name``.

    Args:
        package: the package's dotted name (its ``__name__``, e.g. ``"moe_rl.inference"``).
        exports: ``{public name: submodule of package that defines it}``.

    Returns:
        ``__getattr__(name)``: ``getattr(import_module(f"{package}.{exports[name]}"), name)``.

    Raises:
        AttributeError: (from the returned function) ``name`` is not in ``exports``, as for any missing module
            attribute (so ``hasattr`` and ``from package import name`` behave as usual).
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def lazy_dir(namespace: Mapping[str, Any], exports: Mapping[str, str]) -> Callable[[], list[str]]:
    """A module-level ``__dir__`` (PEP 562) that lists a lazy package's exports next to its loaded names.

    Args:
        namespace: the package's live namespace (pass ``globals()``; it is read on each call, so names bound later,
            such as loaded submodules, are listed too).
        exports: ``{public name: submodule of package that defines it}`` (the same mapping as for
            :func:`lazy_getattr`).

    Returns:
        ``__dir__()``: ``sorted(set(namespace) | set(exports))``; it imports nothing.
    """

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __dir__
