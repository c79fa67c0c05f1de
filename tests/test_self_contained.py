"""User-facing text is self-contained: no pointers to files outside the repository, no internal case ids.

Scanned: every file under ``docs/`` and ``recipes/``, ``README.md``, ``mkdocs.yml`` (whole text), and the
comments and string literals (docstrings, error messages) of every ``moe_rl/**/*.py`` (identifiers are not
scanned). Refused: the team's working notes (``/work/shared``, ``shared/notes/...``, ``shared/cases``,
``shared/DESIGN.md``, ``notes/<name>.md``) and internal bug-case ids (``B01``-``B99``, ``N01``-``N99``). A fact
taken from a note is stated in the text, or cited by its public source (paper, upstream file, PR number).
Tests may keep case ids (they name the regression they guard).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN = [
    (
        "path to the team's working files",
        re.compile(r"/work/shared\b|\bshared/(?:notes|cases|DESIGN|STYLE)\b"),
    ),
    ("reference to an internal note", re.compile(r"(?<![\w.-])notes/[\w.-]+\.md\b")),
    ("internal case id", re.compile(r"(?<![\w#/.-])[BN][0-9]{2}(?![\w])")),
]

_TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING} | (
    {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set()
)


def find_references(text: str) -> list[tuple[int, str, str]]:
    """``(line, kind, match)`` for every forbidden reference in ``text`` (1-based line numbers)."""
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for kind, pat in FORBIDDEN:
            hits += [(lineno, kind, m.group(0)) for m in pat.finditer(line)]
    return hits


def python_text_hits(source: str) -> list[tuple[int, str, str]]:
    """Forbidden references inside the comments and string literals of Python ``source``."""
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _TEXT_TOKENS:
            hits += [(tok.start[0] + ln - 1, kind, m) for ln, kind, m in find_references(tok.string)]
    return hits


def _user_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "mkdocs.yml"]
    for top in ("docs", "recipes"):
        files += sorted(
            p
            for p in (REPO / top).rglob("*")
            if p.is_file() and p.suffix in {".md", ".toml", ".yml", ".yaml", ".py", ".txt"}
        )
    return [p for p in files if p.exists()]


def test_scanner_flags_and_passes():
    bad = (
        "see shared/notes/vllm-cpu.md §5\n(`shared/cases` B18)\nnotes/prime-rl.md\nfrom /work/shared/DESIGN.md\n"
        "case N07 and (B03)\n"
    )
    kinds = [(ln, kind) for ln, kind, _ in find_references(bad)]
    assert (1, "path to the team's working files") in kinds
    assert (2, "internal case id") in kinds and (2, "path to the team's working files") in kinds
    assert (3, "reference to an internal note") in kinds
    assert (4, "path to the team's working files") in kinds
    assert [m for ln, _, m in find_references(bad) if ln == 5] == ["N07", "B03"]
    good = (
        "prime-rl PR #1901; a B200 GPU; FilesystemWeightTransport('/shared/weights'); fp8 e4m3; sm_90; B1\n"
    )
    assert find_references(good) == []
    src = 'x_B12 = 1  # see B12\ndef f():\n    """From notes/specs.md."""\n    raise ValueError(f"bad {x_B12} N03")\n'
    assert sorted((ln, m) for ln, _, m in python_text_hits(src)) == [
        (1, "B12"),
        (3, "notes/specs.md"),
        (4, "N03"),
    ]


@pytest.mark.parametrize("path", _user_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_self_contained(path: Path):
    hits = find_references(path.read_text(encoding="utf-8"))
    assert not hits, (
        f"{path.relative_to(REPO)} references internal material: "
        + "; ".join(f"line {ln}: {kind} {m!r}" for ln, kind, m in hits)
        + ". State the fact itself, or cite its public source (paper, upstream file or PR)."
    )


def test_package_docstrings_and_comments_self_contained():
    bad = []
    for path in sorted((REPO / "moe_rl").rglob("*.py")):
        for ln, kind, m in python_text_hits(path.read_text(encoding="utf-8")):
            bad.append(f"{path.relative_to(REPO)}:{ln}: {kind} {m!r}")
    assert not bad, (
        "docstrings/comments/messages of moe_rl reference internal material (state the fact itself, or cite its "
        "public source):\n" + "\n".join(bad)
    )
