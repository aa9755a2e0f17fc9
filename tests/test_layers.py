"""The packages stack in layers (DESIGN.md): ``goodput`` (the core) < ``profilers`` < ``experiments`` < ``cli``, ``service``.

A package imports only from the packages below it. Every import counts, those inside functions too:
a lazy import is still a dependency.
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
