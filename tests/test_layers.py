"""The package's layers: every import points down, and no two subpackages import each other.

Layers, lowest first (a subpackage may import only subpackages of LOWER layers; subpackages of one layer are peers
and import neither each other nor anything above them):

====  ==================  ==========================================================================================
rank  layer               members (``moe_rl.<name>``)
====  ==================  ==========================================================================================
0     foundations         the package root, ``config``, ``procs``, ``_triton``, ``_triton_device``, ``_lazy``, ``_hf``
1     numerics blocks     ``fp8``, ``attention``, ``replay``, ``ssm``
2     MoE                 ``moe``
3     parallelism         ``distributed`` (generic: it imports no model family)
4     models              ``models``
5     RL blocks           ``rl`` (buffer, salt, advantages, losses, batch, token versions, simulator)
6     clients and tasks   ``inference`` (engine clients and engine-side code), ``envs`` (tasks)
7     weight sync         ``weights`` (trainer -> engine weight transports, announcements, the engine-side loads)
8     runtime             ``runtime`` (orchestrator and trainer processes, ``RLConfig``, run directory)
9     launch              ``launch`` (cluster plan and launch files)
10    entry points        ``entrypoints``
11    CLI                 ``cli``
====  ==================  ==========================================================================================

Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:`` (type-only imports get no
exemption: they point down too), plus ``importlib.import_module("moe_rl...")`` with a literal name. Imports are
read from the source with ``ast`` (nothing is imported), so the test is fast and sees imports that only run on
some code paths.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "moe_rl"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("", "config", "procs", "_triton", "_triton_device", "_lazy", "_hf")),
    ("numerics blocks", ("fp8", "attention", "replay", "ssm")),
    ("MoE", ("moe",)),
    ("parallelism", ("distributed",)),
    ("models", ("models",)),
    ("RL blocks", ("rl",)),
    ("clients and tasks", ("inference", "envs")),
    ("weight sync", ("weights",)),
    ("runtime", ("runtime",)),
    ("launch", ("launch",)),
    ("entry points", ("entrypoints",)),
    ("CLI", ("cli",)),
)
RANK = {member: rank for rank, (_, members) in enumerate(LAYERS) for member in members}
LAYER_NAME = {member: name for name, members in LAYERS for member in members}

# Upward edges not yet removed, each with the reason; the test fails when one of them is gone (delete it here).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# File-level import circles inside one subpackage not yet untied (the test fails when one is gone).
KNOWN_FILE_CIRCLES: set[frozenset[str]] = set()


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    path: str  # importing file, repository-relative
    line: int
    text: str  # the import statement as written

    @property
    def src_sub(self) -> str:
        return _subpackage(self.src)

    @property
    def dst_sub(self) -> str:
        return _subpackage(self.dst)


def _subpackage(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    return parts[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _known_modules() -> set[str]:
    return {_module_name(p) for p in PKG.rglob("*.py")}


def _resolve(target: str, names: list[str], known: set[str]) -> list[str]:
    """``from target import names``: the modules it loads (a name that is a submodule counts as that module)."""
    out = []
    for name in names:
        sub = f"{target}.{name}"
        out.append(sub if sub in known else target)
    return out or [target]


def edges_of(mod: str, src: str, path: str, is_pkg: bool, known: set[str]) -> list[Edge]:
    """The ``moe_rl`` imports of one module's source (module level, in functions, TYPE_CHECKING, import_module)."""
    lines = src.splitlines()
    edges = []
    for node in ast.walk(ast.parse(src, filename=path)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = _resolve(target, [a.name for a in node.names], known)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for t in targets:
            if t == "moe_rl" or t.startswith("moe_rl."):
                edges.append(Edge(mod, t, path, node.lineno, lines[node.lineno - 1].strip()))
    return edges


def import_edges() -> list[Edge]:
    """Every import of a ``moe_rl`` module by a ``moe_rl`` module."""
    known = _known_modules()
    edges = []
    for path in sorted(PKG.rglob("*.py")):
        edges += edges_of(_module_name(path), path.read_text(), str(path.relative_to(REPO)),
                          path.name == "__init__.py", known)
    return edges


EDGES = import_edges()


def test_every_subpackage_has_a_layer():
    subs = {_subpackage(_module_name(p)) for p in PKG.rglob("*.py")}
    missing = sorted(s for s in subs if s not in RANK)
    assert not missing, f"moe_rl subpackages/modules without a layer: {missing}; add each to LAYERS in {__file__}"


def upward_problems(edges: list[Edge]) -> tuple[list[str], set[tuple[str, str]]]:
    """Messages for imports that point up (or sideways between peers), and the KNOWN_UPWARD pairs seen."""
    problems = []
    seen_known = set()
    for e in edges:
        a, b = e.src_sub, e.dst_sub
        if a == b or b == "":  # inside one subpackage; the root package only hands out lazy names
            continue
        if RANK[b] < RANK[a]:
            continue
        if (a, b) in KNOWN_UPWARD:
            seen_known.add((a, b))
            continue
        rule = "peers of one layer import each other" if RANK[a] == RANK[b] else "an import points up a layer"
        problems.append(
            f"{e.path}:{e.line}: `{e.text}`: moe_rl.{a or '<root>'} ({LAYER_NAME[a]}, layer {RANK[a]}) imports "
            f"moe_rl.{b} ({LAYER_NAME[b]}, layer {RANK[b]}): {rule}; move the code it needs down (or this code up)"
        )
    return problems, seen_known


def test_imports_point_down():
    problems, seen_known = upward_problems(EDGES)
    assert not problems, "\n".join(problems)
    gone = set(KNOWN_UPWARD) - seen_known
    assert not gone, f"known upward edges no longer present (remove them from KNOWN_UPWARD): {sorted(gone)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Edge] = {}
    for e in EDGES:
        a, b = e.src_sub, e.dst_sub
        if a != b and b != "":
            graph.setdefault(a, set()).add(b)
            where.setdefault((a, b), e)
    cycles = _cycles(graph)
    msgs = []
    for comp in cycles:
        ties = [f"{where[(a, b)].path}:{where[(a, b)].line} `{where[(a, b)].text}`"
                for a in comp for b in comp if (a, b) in where]
        msgs.append(f"subpackages {comp} import each other: " + "; ".join(ties))
    assert not msgs, "\n".join(msgs)


def test_no_new_file_circles():
    known = _known_modules()
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        if e.dst in known and e.src != e.dst and e.src_sub == e.dst_sub and not e.dst == e.src.rpartition(".")[0]:
            graph.setdefault(e.src, set()).add(e.dst)
    # a package's __init__ that re-exports its modules is not a circle with them: drop edges into __init__s
    packages = {_module_name(p) for p in PKG.rglob("__init__.py")}
    graph = {a: {b for b in bs if b not in packages} for a, bs in graph.items()}
    found = {frozenset(c) for c in _cycles(graph)}
    new = found - KNOWN_FILE_CIRCLES
    assert not new, f"file-level import circles: {[sorted(c) for c in new]}; untie them (move the shared part down)"
    gone = KNOWN_FILE_CIRCLES - found
    assert not gone, f"known circles no longer present (remove from KNOWN_FILE_CIRCLES): {[sorted(c) for c in gone]}"


def test_rules_catch_upward_imports_anywhere_in_a_module():
    """Function-level, TYPE_CHECKING and import_module imports are all seen, and each names file, line and rule."""
    src = ("from typing import TYPE_CHECKING\n"
           "from moe_rl.rl import buffer\n"
           "if TYPE_CHECKING:\n    from moe_rl.runtime.config import RLConfig\n"
           "def f():\n    from moe_rl.envs import addition\n    import importlib\n"
           "    return importlib.import_module('moe_rl.cli')\n")
    edges = edges_of("moe_rl.models.fake", src, "moe_rl/models/fake.py", False, _known_modules())
    assert [(e.line, e.dst) for e in edges] == [
        (2, "moe_rl.rl.buffer"), (4, "moe_rl.runtime.config"), (6, "moe_rl.envs.addition"), (8, "moe_rl.cli")]
    problems, _ = upward_problems(edges)
    assert len(problems) == 4
    assert problems[1].startswith("moe_rl/models/fake.py:4: `from moe_rl.runtime.config import RLConfig`: ")
    assert "moe_rl.models (models, layer 4) imports moe_rl.runtime (runtime, layer 8)" in problems[1]
    peers = edges_of("moe_rl.envs.fake", "from moe_rl.inference import client\n", "moe_rl/envs/fake.py", False,
                     _known_modules())
    assert "peers of one layer import each other" in upward_problems(peers)[0][0]
    cyc = _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cyc == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(RANK))
def test_layer_members_exist(name):
    if name == "":
        return
    assert (PKG / name).is_dir() or (PKG / f"{name}.py").is_file(), f"LAYERS names moe_rl.{name}, which is gone"
