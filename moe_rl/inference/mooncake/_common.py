"""What the Mooncake blocks share: how to install Mooncake (not public)."""

from __future__ import annotations

__all__ = ["INSTALL_HINT"]

INSTALL_HINT = (
    "install the Python package with `pip install 'moe_rl[mooncake]'` (mooncake-transfer-engine-non-cuda; "
    "the CUDA wheel mooncake-transfer-engine on GPU hosts) and the system library libibverbs.so.1 with "
    "`apt-get install libibverbs1` (Debian/Ubuntu; RHEL: `dnf install libibverbs`)"
)

