"""A module that fails at import (loader test)."""

raise RuntimeError("broken at import")
