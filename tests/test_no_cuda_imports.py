"""The CPU suite never imports CUDA-only packages: importing any moe_rl module (CUDA hidden) leaves deep_gemm,
deep_ep, mooncake, vllm._C and friends out of ``sys.modules``, and only the code that runs inside the vLLM
process may import vllm at all.

Every module under ``moe_rl/`` is imported, one after the other, in one fresh interpreter; after each import
the new entries of ``sys.modules`` are checked, so a forbidden import is charged to the first moe_rl module
that pulls it in (directly or through another moe_rl module).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "moe_rl"

# CUDA-only packages (top-level names; submodules match too) and CUDA extension modules.
CUDA_ONLY = ("deep_gemm", "deep_ep", "mooncake", "vllm._C", "vllm._moe_C", "vllm._flashmla_C", "flash_attn",
             "flash_mla", "transformer_engine", "nvshmem", "sgl_kernel")
# vllm itself may be imported only by modules that run inside the vLLM server process (loaded there by
# --worker-extension-cls); today they import it lazily, inside their methods, so nothing imports it at import
# time. A module listed here would be allowed to import vllm at import time; nothing else is. The Mooncake KV
# connector subclasses vLLM's connector base at module level and is loaded only by vLLM (kv_connector_module_path).
VLLM_ALLOWED = ("moe_rl.inference.vllm_worker_ext", "moe_rl.inference.routing_capture", "moe_rl.weights.engine",
                "moe_rl.inference.mooncake.kv_connector")

_CHECKER = r"""
import importlib, json, sys
forbidden_cuda, vllm_allowed, modules = json.loads(sys.argv[1])

def hits(names, prefixes):
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))

report = {"cuda": {}, "vllm": {}, "errors": {}}
for name in modules:
    before = set(sys.modules)
    try:
        importlib.import_module(name)
    except Exception as exc:
        report["errors"][name] = f"{type(exc).__name__}: {exc}"
        continue
    new = set(sys.modules) - before
    if hits(new, forbidden_cuda):
        report["cuda"][name] = hits(new, forbidden_cuda)
    if hits(new, ["vllm"]) and name not in vllm_allowed:
        report["vllm"][name] = hits(new, ["vllm"])[:5]
report["imported"] = sorted(m for m in sys.modules if m == "moe_rl" or m.startswith("moe_rl."))
print(json.dumps(report))
"""


def all_modules() -> list[str]:
    """Every module of the package, found on disk (no import side effects), packages before their modules."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts))
    return sorted(names, key=lambda n: (n.count("."), n))


def _check(modules: list[str], extra_path: str | None = None) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _CHECKER, json.dumps([CUDA_ONLY, VLLM_ALLOWED, modules])],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # imports every moe_rl module in a fresh interpreter: 15-35 s
def test_no_moe_rl_module_imports_cuda_only_packages():
    modules = all_modules()
    # The walk sees the whole package (a guard against an empty or wrong walk making the test vacuous).
    assert {"moe_rl", "moe_rl.fp8.gemm", "moe_rl.moe.ep.deepep", "moe_rl.inference.vllm_worker_ext"} <= set(modules)
    # Non-inference packages first: if they pulled vllm in, an inference module must not be blamed for it.
    order = [m for m in modules if not m.startswith("moe_rl.inference")] + [
        m for m in modules if m.startswith("moe_rl.inference")]
    report = _check(order)
    assert report["errors"] == {}, f"modules that fail to import on CPU: {report['errors']}"
    assert set(modules) <= set(report["imported"])
    assert report["cuda"] == {}, f"CUDA-only packages imported as a side effect: {report['cuda']}"
    assert report["vllm"] == {}, (
        f"modules that import vllm at import time: {report['vllm']}; import it inside the function that needs it "
        f"(only {VLLM_ALLOWED}, which run inside the vLLM process, may import it at module level)"
    )


def test_checker_catches_forbidden_imports(tmp_path):
    # Stand-in packages named deep_gemm and vllm on the path; each import is charged to the module that made it.
    for pkg in ("deep_gemm", "vllm"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / f"uses_{pkg}.py").write_text(f"import {pkg}\n")
    report = _check(["moe_rl", "uses_deep_gemm", "uses_vllm"], extra_path=str(tmp_path))
    assert report["errors"] == {}
    assert report["cuda"] == {"uses_deep_gemm": ["deep_gemm"]} and report["vllm"] == {"uses_vllm": ["vllm"]}


# --------------------------------------------------------------------------------------- the gpu marker

_NEEDS_CUDA = re.compile(r"skipif\(\s*not\s+(torch\.)?cuda\.is_available\(\)|"
                         r"if\s+not\s+(torch\.)?cuda\.is_available\(\)\s*:\s*\n?\s*pytest\.skip")


def gpu_marked_files() -> list[Path]:
    """Test files that use the gpu marker (what benchmarks/gpu/run_all.sh hands to ``pytest -m gpu``)."""
    pat = re.compile(r"pytest\.mark\.gpu\b|^pytestmark *=.*\bgpu\b", re.MULTILINE)  # the grep of run_all.sh
    return sorted(p for p in (REPO / "tests").rglob("*.py") if pat.search(p.read_text()))


def test_gpu_marker_is_registered_and_cuda_tests_carry_it():
    import tomllib

    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("gpu:") for m in markers), markers
    unmarked = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        module_gpu = any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
            and "gpu" in ast.get_source_segment(text, node.value)
            for node in tree.body
        )
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test_"):
                continue
            decorators = " ".join(ast.get_source_segment(text, d) for d in node.decorator_list)
            source = decorators + "\n" + ast.get_source_segment(text, node)
            if _NEEDS_CUDA.search(source) and not (module_gpu or "mark.gpu" in decorators):
                unmarked.append(f"{path.relative_to(REPO)}::{node.name}")
    assert not unmarked, f"tests that need CUDA but lack the gpu marker (run_all.sh would miss them): {unmarked}"


@pytest.mark.slow  # a nested pytest run of every gpu-marked test: 10-25 s
def test_gpu_tests_skip_cleanly_on_cpu(tmp_path):
    files = gpu_marked_files()
    assert files, "no test uses the gpu marker"
    xml = tmp_path / "gpu.xml"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
         *map(str, files)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    import xml.etree.ElementTree as ET

    cases = list(ET.parse(xml).getroot().iter("testcase"))
    assert cases, res.stdout[-2000:]
    not_skipped = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("skipped") is None]
    assert not not_skipped, f"gpu tests that ran (or failed) without a GPU: {not_skipped}"
