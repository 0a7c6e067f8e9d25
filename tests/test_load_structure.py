"""Layout (issue 19): loading is one package, normexport/load/, whose modules import each other
without cycles; torch-side preparation is normexport/prepare/; the reference models live in the
top-level models/ folder and install as normexport.models (editable and wheel installs)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "normexport"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules: set[str] = frozenset()) -> set[str]:
    """Absolute names of the normexport modules `path` imports (anywhere in the file, lazy imports
    too); `from PKG import name` counts as importing PKG.name when that is one of `modules`, else PKG."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("normexport"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("normexport"):
                continue
            for a in node.names:  # `from . import pt2` imports a module; `from .x import f` imports x
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return found


def _graph(folder: Path) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in folder.rglob("*.py")}
    return {name: {m for m in _imports(p, set(files)) if m in files and m != name} for name, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("folder", ["load", "prepare"])
def test_no_import_cycles(folder):
    graph = _graph(PKG / folder)
    assert len(graph) >= (10 if folder == "load" else 4), sorted(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # nothing inside imports the package's __init__ back (it imports them)
    init = f"normexport.{folder}"
    assert not [n for n, deps in graph.items() if init in deps and n != init]


def test_load_modules_import_nothing_above_but_leaves():
    """load/ depends only on errors, ops, capture and jsonfile (leaves: they import errors only; a pipeline
    folder is run with it, normexport.load.pipeline) — no export / rewriter / parity: the pipeline
    reads load -> prepare -> export -> rewriter -> parity -> trt."""
    allowed = {"normexport", "normexport.errors", "normexport.ops", "normexport.capture", "normexport.jsonfile"}
    for path in (PKG / "load").rglob("*.py"):
        outside = {m for m in _imports(path) if not m.startswith("normexport.load")} - allowed
        assert not outside, (path.name, outside)


def test_old_top_level_modules_are_gone():
    for name in ("loaders", "hf", "call", "inputs", "submodule", "pytree_types", "swap", "fold_bn", "nn"):
        assert not (PKG / f"{name}.py").exists(), name
    assert not (PKG / "models").exists() and (ROOT / "models" / "dit.py").is_file()


def test_package_list_matches_the_tree():
    """pyproject lists every package (find cannot combine with the models/ package-dir mapping)."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {_module_name(p.parent) for p in PKG.rglob("__init__.py")}
    assert set(conf["packages"]) == tree | {"normexport.models"}
    assert conf["package-dir"] == {"normexport.models": "models"}


def test_callable_packages():
    import normexport
    import normexport.load
    import normexport.prepare

    assert normexport.load.load is normexport.load.__dict__["load"]
    assert callable(normexport.load) and callable(normexport.prepare)
    loaded = normexport.load("normexport.models.llama:tiny")
    assert loaded.kind == "factory" and loaded.input_names


def test_editable_install_maps_models():
    out = subprocess.run([sys.executable, "-c", "import normexport.models.dit as d; print(d.__file__)"],
                         cwd="/", capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out) == ROOT / "models" / "dit.py"


def test_wheel_installs_models_as_normexport_models(tmp_path):
    """A wheel built from the tree, installed into a fresh venv (torch etc. from this one, via
    --system-site-packages is not enough for a venv-in-venv, so the parent's site-packages is put
    on a .pth): normexport.models.dit imports from the wheel, and no top-level `models` is installed."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("normexport-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "normexport/models/dit.py" in names and "normexport/load/pt2.py" in names
    assert not [n for n in names if n.startswith("models/")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the parent env's packages (torch, onnx, ...) after the venv's own, so normexport comes from the wheel
    parent = sysconfig.get_paths()["purelib"]
    (Path(site) / "zz_parent.pth").write_text(parent + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site,
                    str(wheel)], check=True, capture_output=True)
    code = ("import normexport, normexport.models.dit as d, torch; m = d.tiny(); y = m(*m.example_inputs()); "
            "print(normexport.__file__); print(d.__file__); print(tuple(y.shape))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    res = subprocess.run([str(py), "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    assert lines[0].startswith(site) and lines[1] == str(Path(site) / "normexport" / "models" / "dit.py"), lines
    assert not (Path(site) / "models").exists()
