"""No import cycle in normexport (issue 22, Structure): the import graph read from the source with
ast, imports inside functions included (a lazy import is still a cycle: it only moves the failure
to the first call that takes that path). An edge from a module to its own parent packages is not
a cycle (they are initialised first); `if TYPE_CHECKING:` blocks are skipped."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import normexport

ROOT = Path(normexport.__file__).resolve().parent


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        if pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, pkg)
    return out


def _type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    todo = [tree]
    while todo:
        n = todo.pop()
        for child in ast.iter_child_nodes(n):
            if isinstance(child, ast.If) and _type_checking(child):
                todo.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            todo.append(child)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, for the package at `root`."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, (path, pkg) in mods.items():
        base = name.split(".") if pkg else name.split(".")[:-1]
        edges: set[str] = set()
        for n in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            else:
                mod = ".".join(base[:len(base) - (n.level - 1)] + ([n.module] if n.module else [])) if n.level else n.module
                targets = [mod] + [f"{mod}.{a.name}" for a in n.names]
            for t in targets:
                # importing a.b.c runs a.b's __init__ too
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in mods and not (name == dep or name.startswith(dep + ".")):
                        edges.add(dep)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (each as a path that ends where it starts)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_normexport_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert "normexport.rewriter.driver" in graph and "normexport.sizes" in graph["normexport.rewriter.driver"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_a_lazy_cycle_through_a_subpackage_is_found(tmp_path):
    """The shape of the cycle issue 22 found: sizes imports sub._verify inside a function while
    sub's driver imports sizes at the top (importing sub._verify runs sub/__init__ -> driver)."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "sizes.py": "def f():\n    from .sub._verify import BF16\n",
        "sub/__init__.py": "from .driver import rewrite\n",
        "sub/driver.py": "from .. import sizes\nfrom . import _verify\n",
        "sub/_verify.py": "BF16 = 1\n",
    })
    found = cycles(import_graph(root))
    assert any(c[0] == c[-1] and "pkg.sizes" in c and "pkg.sub" in c for c in found), found


def test_parents_and_type_checking_are_not_cycles(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from . import a\n",
        "a.py": "from . import b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n",
        "b.py": "import pkg\n",
        "c.py": "from . import a\n",
    })
    assert cycles(import_graph(root)) == []


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def reaches(graph: dict[str, set[str]], low: str, high: str) -> list[str] | None:
    """A chain of imports from a module of package `low` to one of package `high` (directly or
    through other modules), or None."""
    parent: dict[str, str | None] = {m: None for m in graph if _in(m, low)}
    todo = list(parent)
    while todo:
        u = todo.pop()
        for d in sorted(graph.get(u, ())):
            if d in parent:
                continue
            parent[d] = u
            if _in(d, high):
                chain = [d]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                return chain[::-1]
            todo.append(d)
    return None


def test_parity_is_below_llm():
    """normexport.parity (the generic check layer) imports nothing of normexport.llm (a feature that
    uses it), not even through another module (issue 39 item 4): llm passes parity what it needs
    (the check by generation: llm.checking.run -> parity.cli.run(with_past=...))."""
    graph = import_graph(ROOT)
    assert any(_in(d, "normexport.parity") for d in graph["normexport.llm.checking"])  # the allowed direction
    chain = reaches(graph, "normexport.parity", "normexport.llm")
    assert chain is None, "normexport.parity imports normexport.llm: " + " -> ".join(chain)


def test_a_planted_upward_import_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "parity/__init__.py": "from .cli import run\n",
        "parity/cli.py": "from .. import load\n\ndef run():\n    from ..load import x\n",
        "load.py": "def x():\n    from .llm import causal_lm\n",
        "llm/__init__.py": "from .task import causal_lm\n",
        "llm/task.py": "from ..parity import run\ncausal_lm = 1\n",
    })
    graph = import_graph(root)
    assert reaches(graph, "pkg.parity", "pkg.llm") == ["pkg.parity.cli", "pkg.load", "pkg.llm"]
    (root / "load.py").write_text("def x():\n    return 1\n")  # the upward import gone: llm -> parity only
    graph = import_graph(root)
    assert reaches(graph, "pkg.parity", "pkg.llm") is None
    assert reaches(graph, "pkg.llm", "pkg.parity") == ["pkg.llm.task", "pkg.parity"]
