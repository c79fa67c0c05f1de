"""The documentation site: every ``python`` example in ``docs/`` runs, and ``mkdocs build --strict`` is clean.

Examples: each page's ```` ```python ```` blocks run in order in a fresh process of their own (CUDA hidden), sharing
one namespace, so a later block can use names from an earlier one. The processes are forked from one server
process that imported torch and moe_rl once (saves ~3 s of CPU per page). A block is left out only when the last
non-blank line before its fence is ``<!-- docs: skip: REASON -->`` (for blocks that need a GPU or a running
server); the reason is mandatory. Tracebacks name the Markdown file and its line numbers. Keep examples tiny:
CPU, a second or two each.

Site: ``mkdocs build --strict`` into a temporary folder; any WARNING line fails the test (strict mode already
aborts on warnings; the output check also catches warnings printed by plugins that strict mode does not count).

Also here: ``benchmarks/gpu/run_all.sh`` parses (``bash -n``), plans its steps (``--dry-run``) and, on CPU with
ad-hoc steps, records failed / timed-out / passed steps without stopping at the first failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RUN_ALL = REPO / "benchmarks" / "gpu" / "run_all.sh"

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\n]*)$")
_SKIP = re.compile(r"^<!--\s*docs:\s*skip\b(?P<rest>.*?)-->\s*$")


def extract_blocks(text: str, name: str = "<md>") -> list[dict]:
    """Fenced code blocks of a Markdown text: ``{"lang", "code", "line" (1-based first code line), "skip"}``.

    Raises:
        ValueError: a skip marker without a reason, or a fence that is never closed.
    """
    lines = text.splitlines()
    blocks, i, prev = [], 0, ""
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                prev = lines[i].strip()
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip()
        start = i + 1
        j = start
        while j < len(lines) and not re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{name}:{i + 1}: code fence {fence!r} is never closed")
        skip = _SKIP.match(prev)
        if skip and not skip["rest"].strip(" :"):
            raise ValueError(f"{name}:{i}: '<!-- docs: skip -->' needs a reason, e.g. '<!-- docs: skip: needs a GPU -->'")
        lang = info.split()[0].lstrip(".{").rstrip("}") if info else ""
        blocks.append({"lang": lang, "code": "\n".join(lines[start:j]), "line": start + 1, "skip": bool(skip)})
        prev, i = "", j + 1
    return blocks


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md"))


def _runnable(page: Path) -> list[dict]:
    return [b for b in extract_blocks(page.read_text(), str(page)) if b["lang"] in ("python", "py") and not b["skip"]]


PAGES_WITH_EXAMPLES = [p for p in _pages() if _runnable(p)]

# Runs the blocks of one page in order, in one namespace; line numbers in tracebacks are the Markdown file's.
_RUN_PAGE = r"""
def run_page(blocks):
    ns = {"__name__": "__main__"}
    for b in blocks:
        exec(compile("\n" * (b["line"] - 1) + b["code"], b["file"], "exec"), ns)
    print("DOCS-EXAMPLES-OK", len(blocks))
"""

# A small fork server: imports torch and moe_rl once, then runs every page in its own forked child process
# (fresh namespace, fresh process state: process groups, RNG, globals), which saves one torch import per page.
# Protocol: one JSON line per page on stdin -> the child's exit code on stdout; the child's output in a file.
_FORK_SERVER = _RUN_PAGE + r"""
import json, os, sys, traceback
import torch, pydantic, moe_rl.config, moe_rl.moe, moe_rl.fp8, moe_rl.models  # shared, imported once
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1); os.dup2(fd, 2)
        code = 0
        try:
            run_page(req["blocks"])
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


def _example_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # examples are CPU-only; a GPU must not change what they print
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # also: no OpenMP pool exists in the server before it forks
    return env


@pytest.fixture(scope="module")
def page_runner():
    proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=_example_env())
    yield proc
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page: Path, page_runner, tmp_path: Path) -> None:
    blocks = [{**b, "file": str(page.relative_to(REPO))} for b in _runnable(page)]
    log = tmp_path / "page.log"
    page_runner.stdin.write(json.dumps({"blocks": blocks, "log": str(log)}) + "\n")
    page_runner.stdin.flush()
    reply = page_runner.stdout.readline().strip()  # pytest-timeout bounds a hung page
    out = log.read_text() if log.exists() else ""
    assert reply == "0", f"examples of {page.relative_to(REPO)} failed (exit {reply!r}):\n{out[-8000:]}"
    assert f"DOCS-EXAMPLES-OK {len(blocks)}" in out


def test_every_building_block_page_has_a_runnable_example() -> None:
    pages = sorted((DOCS / "blocks").glob("*.md"))
    assert len(pages) >= 6, pages
    assert set(pages) <= set(PAGES_WITH_EXAMPLES), sorted(set(pages) - set(PAGES_WITH_EXAMPLES))
    assert DOCS / "index.md" in PAGES_WITH_EXAMPLES


def test_extract_blocks_rules() -> None:
    md = (
        "text\n```python\nx = 1\n```\n\n<!-- docs: skip: needs a GPU -->\n```python\ncuda()\n```\n"
        "````markdown\n```python\nnot a block\n```\n````\n```bash\nls\n```\n"
    )
    blocks = extract_blocks(md)
    assert [(b["lang"], b["line"], b["skip"]) for b in blocks] == [
        ("python", 3, False), ("python", 8, True), ("markdown", 11, False), ("bash", 16, False)
    ]
    with pytest.raises(ValueError, match="needs a reason"):
        extract_blocks("<!-- docs: skip -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        extract_blocks("```python\nx = 1\n")


def test_runner_reports_the_markdown_line(page_runner, tmp_path: Path) -> None:
    blocks = [{"code": "a = 1", "line": 3, "file": "docs/x.md"},
              {"code": "b = a\nraise KeyError(b)", "line": 10, "file": "docs/x.md"}]
    log = tmp_path / "x.log"
    page_runner.stdin.write(json.dumps({"blocks": blocks, "log": str(log)}) + "\n")
    page_runner.stdin.flush()
    assert page_runner.stdout.readline().strip() == "1"
    out = log.read_text()
    assert 'File "docs/x.md", line 11' in out and "KeyError: 1" in out and "DOCS-EXAMPLES-OK" not in out


@pytest.mark.slow  # builds the whole site in a subprocess: 20-50 s on 2 cores
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=600,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"mkdocs build --strict failed (install the dev extra: pip install -e '.[dev]'):\n{out[-6000:]}"
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    # The API reference really rendered the docstrings (not an empty page per package).
    fp8 = (tmp_path / "site" / "reference" / "fp8" / "index.html").read_text()
    assert 'id="moe_rl.fp8.quant.quantize_1x128"' in fp8 and "Parameters:" in fp8  # Args sections were parsed


# --------------------------------------------------------------------------- API pages


def test_api_pages_are_generated_from_the_current_source() -> None:
    """``docs/api/*.md`` (signatures + docstring summaries, readable in the repository) match the source."""
    res = subprocess.run([sys.executable, str(DOCS / "_ext" / "api_pages.py"), "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_public_package_has_a_summary_page_and_a_full_reference_in_the_nav() -> None:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import api_pages
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    nav = (REPO / "mkdocs.yml").read_text()
    modules = api_pages.public_modules()
    assert {"moe_rl.config", "moe_rl.moe", "moe_rl.rl", "moe_rl.fp8"} <= set(modules), modules
    for module in modules:
        slug = module.split(".")[-1]
        assert f": api/{slug}.md" in nav and f": reference/{slug}.md" in nav, (module, "missing from mkdocs.yml nav")
        ref = (DOCS / "reference" / f"{slug}.md").read_text()
        rendered = set(re.findall(r"^::: (\S+)$", ref, re.MULTILINE))
        missing = {where for _, where in api_pages.exported(module) if where not in rendered and module not in rendered}
        assert not missing, f"docs/reference/{slug}.md renders no `::: {sorted(missing)}` (a public name's module)"
        names = [name for name, _ in api_pages.exported(module)]
        page = (DOCS / "api" / f"{slug}.md").read_text()
        assert all(f"## `{name}`" in page for name in names), (module, "a public name has no section")
    pages = {p.stem for p in (DOCS / "api").glob("*.md")} | {p.stem for p in (DOCS / "reference").glob("*.md")}
    assert pages == {m.split(".")[-1] for m in modules}, "a page documents no public package (remove it)"


# --------------------------------------------------------------------------- benchmarks/gpu/run_all.sh


def test_run_all_parses_and_plans() -> None:
    subprocess.run(["bash", "-n", str(RUN_ALL)], check=True)
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    one = subprocess.run(["bash", str(RUN_ALL), "--dry-run", "--gpus", "1", "--out", "/nonexistent"],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO).stdout
    lines = one.splitlines()
    assert lines[0].startswith("run_all.sh plan:") and "gpus=1" in lines[0]
    assert any(line.startswith("STEP provenance |") for line in lines)
    pytest_line = next(line for line in lines if line.startswith("STEP pytest_gpu |"))
    assert "-m pytest -m gpu" in pytest_line and "tests/fp8/test_fp8_gemm.py" in pytest_line
    marked = re.compile(r"pytest\.mark\.gpu\b|^pytestmark *=.*\bgpu\b", re.MULTILINE)
    want = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py") if marked.search(p.read_text())}
    assert {t for t in pytest_line.split() if t.startswith("tests/")} == want  # every gpu-marked test file
    assert any(re.match(r"SKIP ep_deepep \| needs >= 2 GPUs, this machine has 1", line) for line in lines), one
    scripts = sorted(p.stem for p in (REPO / "benchmarks" / "gpu").glob("*.py") if not p.name.startswith("_"))
    for name in scripts:  # every prepared GPU script is planned, run or skipped with a reason
        assert any(re.match(rf"(STEP|SKIP) {re.escape(name)} \|", line) for line in lines), (name, one)
    eight = subprocess.run(["bash", str(RUN_ALL), "--dry-run", "--gpus", "8"], capture_output=True, text=True,
                           check=True, env=env, cwd=REPO).stdout
    assert re.search(r"STEP ep_deepep \| timeout \d+s \| .*torch\.distributed\.run .*--nproc_per_node=8 "
                     r"benchmarks/gpu/ep_deepep\.py --out", eight), eight
    bad = subprocess.run(["bash", str(RUN_ALL), "--budget", "soon"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--budget needs seconds" in bad.stderr


@pytest.mark.slow  # runs benchmarks/gpu/run_all.sh end to end (fake steps): ~10-20 s
def test_run_all_keeps_going_and_records_each_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    res = subprocess.run(
        ["bash", str(RUN_ALL), "--out", str(out), "--allow-no-gpu", "--only", "^(bad|slow|ok|ep_deepep)$",
         "--step", "bad=echo broken >&2; exit 3", "--step", "slow=sleep 60", "--step", "ok=echo fine",
         "--step-timeout", "3"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=180,
    )
    assert res.returncode == 1, res.stdout + res.stderr  # a step failed, the script still ran to the end
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]][-3:] == ["bad", "slow", "ok"]
    assert steps["bad"]["status"] == "failed" and steps["bad"]["exit_code"] == 3 and "broken" in steps["bad"]["log_tail"]
    assert steps["slow"]["status"] == "timeout" and steps["slow"]["exit_code"] == 124 and steps["slow"]["seconds"] < 30
    assert steps["ok"]["status"] == "passed" and (out / "logs" / "ok.log").read_text() == "fine\n"
    assert steps["ep_deepep"]["status"] == "skipped" and "needs >= 2 GPUs" in steps["ep_deepep"]["reason"]
    assert steps["provenance"]["status"] == "passed"
    assert summary["ok"] is False and summary["counts"]["failed"] == 1 and summary["counts"]["timeout"] == 1
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["gpus"] == 0 and prov["versions"]["torch"].startswith("2.")
    assert len(prov["commit"]) == 40 or prov["commit"] == "unknown"


@pytest.mark.slow  # runs benchmarks/gpu/run_all.sh: ~5-13 s
def test_run_all_refuses_without_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    res = subprocess.run(["bash", str(RUN_ALL), "--out", str(tmp_path), "--only", "none"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert res.returncode == 2 and "no CUDA GPU" in res.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["state"] == "no GPU"


def test_quickstart_repeats_the_readme_commands() -> None:
    readme = [b["code"] for b in extract_blocks((REPO / "README.md").read_text()) if b["lang"] == "bash"]
    index = [b["code"] for b in extract_blocks((DOCS / "index.md").read_text()) if b["lang"] == "bash"]
    assert len(readme) >= 2 and readme[:2] == index[:2]
