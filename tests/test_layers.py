"""The packages stack in layers (DESIGN.md): ``goodput`` (the core) < ``profilers`` < ``experiments`` < ``cli``, ``service``.

A package imports only from the packages below it. Every import counts, those inside functions too:
a lazy import is still a dependency. Within the core, no module imports itself through others (issue 34:
no import circle among ``goodput``'s modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# each package, and the first-party packages it must not import
FORBIDDEN = {
    "goodput": {"profilers", "experiments", "cli", "service"},
    "profilers": {"experiments", "cli", "service"},
    "experiments": {"cli", "service"},
    "service": {"cli", "experiments"},  # the service sits beside the CLI; the CLI may start it
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in one source file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_imported_packages_reads_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\ndef f():\n    from experiments.x import y\n    import cli.demo\nfrom . import z\n")
    assert imported_packages(source) == {"os", "experiments", "cli"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_from_the_layers_above_it(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources found for {package}"
    offenders = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[package]) for f in files}
    assert not {f: names for f, names in offenders.items() if names}


def module_imports(package: str) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` for every module of ``package`` (dotted names; a
    package's ``__init__`` by the package's name), relative and absolute imports, those inside functions too."""
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                deps.update(t for t in [target, *(f"{target}.{alias.name}" for alias in node.names)] if t in modules)
        graph[name] = deps - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_import_cycles_are_found(tmp_path):
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_core_has_no_import_circle():
    """Issue 34: no module of ``goodput`` imports, directly or through others, one that imports it."""
    graph = module_imports("goodput")
    assert {"goodput.model", "goodput.hierarchy", "goodput.posterior"} <= graph.keys()
    assert "goodput.parametric" in graph["goodput.hierarchy"]  # relative imports are read
    assert import_cycles(graph) == []
