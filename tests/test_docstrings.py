"""Every ``>>>`` example in the library's docstrings runs and holds."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import cli
import experiments
import goodput
import profilers


def _modules_with_examples() -> list[str]:
    names = []
    for package in (goodput, profilers, experiments, cli):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.endswith("__main__"):  # importing it runs the command line
                continue
            module = importlib.import_module(info.name)
            if any(test.examples for test in doctest.DocTestFinder().find(module)):
                names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    # modules whose docstrings are known to carry examples: a broken discovery would skip them all
    assert {"goodput.cluster", "goodput.parametric", "goodput.throughput", "goodput.sync_shape", "profilers.zoo",
            "experiments.accuracy_intervals", "experiments.accuracy_protocols", "experiments.accuracy_baselines",
            "experiments.accuracy_report", "goodput.lognormal", "goodput.table"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
