"""The Slurm job's control-token fragment, run with bash: it takes a good token from the environment or the run
directory, makes a fresh one otherwise, refuses bad ones (short, unsafe characters, too few distinct characters, a
file that is not a regular 0600 file of the user's) with exit code 2, and never shows the token, not even under
``set -x`` (``moe_rl.launch.slurm.render_sbatch``)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.inference.control_plane import TOKEN_MIN_CHARS, new_token
from moe_rl.launch.config import ClusterConfig
from moe_rl.launch.plan import build_plan
from moe_rl.launch.slurm import render_sbatch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fragment() -> str:
    text = render_sbatch(build_plan(load_config(ClusterConfig, ["@", str(REPO / "recipes/glm5_1/rl.toml")])))
    start, end = text.index("# >>> control token\n"), text.index("# <<< control token\n")
    return text[start:end]


def _run(fragment: str, run_dir: Path, token: str | None = None, xtrace: bool = True):
    script = run_dir.parent / "token.sh"
    script.write_text(
        "set -uo pipefail\n" + ("set -x\n" if xtrace else "")
        + f"RUN_DIR={run_dir}\n" + fragment
        # after the fragment: xtrace is back as it was, the token is exported to the steps, VLLM_API_KEY equals it
        # (checked with the trace off: the checks themselves name the token)
        + 'echo ":)"; case $- in *x*) echo XTRACE_ON ;; *) echo XTRACE_OFF ;; esac; { set +x; } 2>/dev/null\n'
        + 'env | grep -q "^MOE_RL_CONTROL_TOKEN=" && [ "$VLLM_API_KEY" = "$MOE_RL_CONTROL_TOKEN" ] && echo EXPORTED\n'
        + 'echo "LEN ${#MOE_RL_CONTROL_TOKEN}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_RL_CONTROL_TOKEN", "VLLM_API_KEY")}
    if token is not None:
        env["MOE_RL_CONTROL_TOKEN"] = token
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


def test_a_token_from_the_environment_is_kept_0600_and_never_traced(fragment, run_dir):
    token = new_token()
    res = _run(fragment, run_dir, token)
    assert res.returncode == 0, res.stderr
    assert "EXPORTED" in res.stdout and "XTRACE_ON" in res.stdout  # set -x restored after the fragment
    assert "+ echo ':)'" in res.stderr  # the trace was on after the fragment: the check below can fail
    assert token not in res.stdout + res.stderr
    f = run_dir / "control_token"
    assert f.read_text() == token + "\n" and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert not list(run_dir.glob(".control_token.*"))  # no temporary file left


def test_a_fresh_token_when_none_is_given_then_the_file_is_reused(fragment, run_dir):
    res = _run(fragment, run_dir, xtrace=False)
    assert res.returncode == 0, res.stderr
    assert "XTRACE_OFF" in res.stdout and "LEN 43" in res.stdout
    token = (run_dir / "control_token").read_text().strip()
    assert len(token) == 43 and token not in res.stdout + res.stderr
    again = _run(fragment, run_dir)
    assert again.returncode == 0, again.stderr
    assert (run_dir / "control_token").read_text().strip() == token and token not in again.stdout + again.stderr


@pytest.mark.parametrize("token,reason", [
    ("s3cret-but-short-" + "x" * 5, f"fewer than {TOKEN_MIN_CHARS}"),
    ("abcdefgh" * 4 + " spaced", "outside"),
    ("abcdefgh" * 4 + "$(touch pwned)", "outside"),
    ("abcdefgh" * 4 + "'\"", "outside"),
    ("abcdefgh" * 4 + "é", "outside"),
    ("ab" * 24, "distinct"),
])
def test_bad_tokens_from_the_environment_are_refused_unquoted(fragment, run_dir, token, reason):
    res = _run(fragment, run_dir, token)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "control token refused" in res.stderr and reason in res.stderr and "$MOE_RL_CONTROL_TOKEN" in res.stderr
    assert token not in res.stdout + res.stderr
    assert not (run_dir / "control_token").exists() and not (run_dir / "pwned").exists()
    assert "EXPORTED" not in res.stdout


def test_a_token_file_must_be_a_0600_regular_file_of_the_user(fragment, run_dir, tmp_path):
    token = new_token()
    f = run_dir / "control_token"
    f.write_text(token + "\n")
    f.chmod(0o644)
    res = _run(fragment, run_dir)
    assert res.returncode == 2 and "mode 644, not 600" in res.stderr and token not in res.stdout + res.stderr
    f.chmod(0o600)
    res = _run(fragment, run_dir)
    assert res.returncode == 0 and "EXPORTED" in res.stdout, res.stderr
    f.unlink()
    elsewhere = tmp_path / "elsewhere_token"
    elsewhere.write_text(token + "\n")
    elsewhere.chmod(0o600)
    f.symlink_to(elsewhere)
    res = _run(fragment, run_dir)
    assert res.returncode == 2 and "symbolic link" in res.stderr and token not in res.stdout + res.stderr
    f.unlink()
    f.write_text("")
    f.chmod(0o600)
    res = _run(fragment, run_dir)
    assert res.returncode == 2 and "is empty" in res.stderr
    f.write_text("ab" * 24)  # no newline at the end, too few distinct characters: the file is named as the source
    res = _run(fragment, run_dir)
    assert res.returncode == 2 and "distinct" in res.stderr and str(f) in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_token_file_of_another_user_is_refused(fragment, run_dir):
    f = run_dir / "control_token"
    f.write_text(new_token() + "\n")
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    res = _run(fragment, run_dir)
    assert res.returncode == 2 and "owned by uid 65534" in res.stderr, res.stderr
