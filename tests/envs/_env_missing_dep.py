"""A module that imports a dependency that is not installed (loader test)."""

import moe_rl_no_such_dependency  # noqa: F401
