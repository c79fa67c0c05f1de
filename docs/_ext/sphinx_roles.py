"""Griffe extension for the API reference: render Sphinx cross-reference roles as inline code.

moe_rl docstrings are Google style but name other objects with Sphinx roles (``:func:`quantize_1x128```); the
mkdocstrings Google parser would print the role literally. This rewrites ``:role:`~a.b.c``` to ```a.b.c``` in
every docstring before it is parsed. Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings...extensions``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|type):`~?([^`]+)`")


class SphinxRolesToCode(griffe.Extension):
    """``:func:`x``` -> ```x``` in docstrings."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
