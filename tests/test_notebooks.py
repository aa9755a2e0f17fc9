"""The worked examples run end to end (fast mode), with real work in every cell."""

from __future__ import annotations

import pytest

from experiments.notebooks import NOTEBOOKS, execute

NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_notebooks_are_committed_with_outputs():
    import nbformat

    assert NAMES, "no notebooks"
    for name in NAMES:
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert code and all(c.get("outputs") is not None for c in code)
        assert any(c.outputs for c in code), f"{name} has no outputs committed"
        assert not any(o.get("output_type") == "error" for c in code for o in c.outputs), f"{name} has an error output"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_in_fast_mode(name, tmp_path):
    notebook = execute(NOTEBOOKS / name, fast=True, workdir=tmp_path, timeout=600)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs and not any(o.get("output_type") == "error" for o in outputs)
