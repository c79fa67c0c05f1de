"""``import moe_rl`` is cheap, quiet and CPU-safe."""

import json
import subprocess
import sys

import pytest


def test_import_is_light_and_quiet():
    code = (
        "import sys, os; env = dict(os.environ); import moe_rl; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'triton', 'deep_gemm', 'deep_ep') if m in sys.modules]; "
        "print(repr(heavy)); assert dict(os.environ) == env"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
    assert res.stderr == ""


def test_subpackages_import_without_optional_backends():
    code = (
        "import sys; import moe_rl.rl, moe_rl.models, moe_rl.moe, moe_rl.envs, moe_rl.runtime.trainer, moe_rl.inference; "
        "print(repr([m for m in ('vllm', 'deep_gemm', 'deep_ep', 'mooncake') if m in sys.modules]))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_rl_buffer_and_salt_import_without_torch():
    """The async buffer and the cache salt are pure Python blocks: no torch, no pydantic."""
    code = "import moe_rl.rl.buffer, moe_rl.rl.salt, sys; print(repr([m for m in ('torch', 'pydantic') if m in sys.modules]))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


# Every block importable on its own (a fresh interpreter each), with what it pulls in. The blocks in TORCH_FREE
# must stay torch-free: their packages export lazily, and their modules import no torch.
BLOCKS = (
    "moe_rl", "moe_rl.config", "moe_rl.procs",
    "moe_rl.fp8", "moe_rl.attention", "moe_rl.replay",
    "moe_rl.moe", "moe_rl.distributed", "moe_rl.models", "moe_rl.models.common",
    "moe_rl.rl", "moe_rl.rl.buffer", "moe_rl.rl.salt", "moe_rl.rl.token_versions",
    "moe_rl.inference", "moe_rl.inference.mooncake", "moe_rl.envs",
    "moe_rl.runtime", "moe_rl.runtime.trainer", "moe_rl.launch", "moe_rl.entrypoints", "moe_rl.cli",
)
TORCH_FREE = {
    "moe_rl", "moe_rl.config", "moe_rl.procs", "moe_rl.fp8", "moe_rl.replay", "moe_rl.moe", "moe_rl.distributed",
    "moe_rl.attention", "moe_rl.models", "moe_rl.inference", "moe_rl.inference.mooncake",
    "moe_rl.rl", "moe_rl.rl.buffer", "moe_rl.rl.salt", "moe_rl.rl.token_versions", "moe_rl.runtime",
    "moe_rl.runtime.trainer", "moe_rl.launch", "moe_rl.entrypoints", "moe_rl.cli",
}
_PROBE = (
    "import json, sys, time; t = time.perf_counter(); import {mod}; dt = time.perf_counter() - t; "
    "print(json.dumps({{'seconds': dt, 'moe_rl': sorted(m for m in sys.modules if m.startswith('moe_rl')), "
    "'heavy': [m for m in ('torch', 'numpy', 'pydantic', 'transformers', 'vllm', 'triton', 'deep_gemm', 'deep_ep', "
    "'mooncake') if m in sys.modules]}}))"
)


@pytest.mark.parametrize("mod", BLOCKS)
def test_block_imports_alone(mod):
    """Each block imports in a fresh interpreter; prints its import time (contended CPUs make it noisy, so it is
    recorded, not asserted) and what it pulled in."""
    res = subprocess.run([sys.executable, "-c", _PROBE.format(mod=mod)], capture_output=True, text=True)
    assert res.returncode == 0, f"`import {mod}` fails on its own:\n{res.stderr[-3000:]}"
    info = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"{mod}: {info['seconds'] * 1e3:.0f} ms, {len(info['moe_rl'])} moe_rl modules, heavy={info['heavy']}")
    assert not {"vllm", "deep_gemm", "deep_ep", "mooncake"} & set(info["heavy"]), info["heavy"]
    if mod in TORCH_FREE:
        assert "torch" not in info["heavy"], f"`import {mod}` loads torch via {info['moe_rl']}"
    if mod == "moe_rl.fp8":
        assert not any(m.startswith("moe_rl.moe") for m in info["moe_rl"]), info["moe_rl"]


def _lazy_packages() -> list[str]:
    """Every ``moe_rl`` package whose ``__init__.py`` defines lazy ``_EXPORTS`` (found on disk, not by import)."""
    from pathlib import Path

    import moe_rl

    root = Path(moe_rl.__file__).parent
    found = []
    for init in sorted(root.rglob("__init__.py")):
        if "_EXPORTS" in init.read_text():
            parts = init.parent.relative_to(root.parent).parts
            found.append(".".join(parts))
    return found


LAZY_PACKAGES = _lazy_packages()


def test_lazy_packages_found():
    assert len(LAZY_PACKAGES) >= 15, LAZY_PACKAGES
    assert {"moe_rl.models", "moe_rl.models.glm4_moe", "moe_rl.inference"} <= set(LAZY_PACKAGES)


@pytest.mark.parametrize("mod", LAZY_PACKAGES)
def test_lazy_package_dir_lists_exports(mod):
    """``dir(package)`` lists every name in ``__all__`` (the module ``__dir__`` of :func:`moe_rl._lazy.lazy_dir`)
    without importing anything."""
    import importlib

    pkg = importlib.import_module(mod)
    assert set(pkg.__all__) <= set(pkg._EXPORTS), f"{mod}.__all__ names missing from _EXPORTS"
    loaded = set(sys.modules)
    listed = set(dir(pkg))
    assert set(pkg.__all__) <= listed, f"dir({mod}) lacks {sorted(set(pkg.__all__) - listed)}"
    assert "_EXPORTS" in listed  # the package's own globals stay listed
    assert set(sys.modules) == loaded, f"dir({mod}) imported {sorted(set(sys.modules) - loaded)}"
