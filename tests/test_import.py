"""``import moe_rl`` is cheap, quiet and CPU-safe."""

import subprocess
import sys


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
