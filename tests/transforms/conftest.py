"""One interpreter per tree for every scheduler scenario the collected transform tests need.

A test module lists its calls in ``SCENARIO_CALLS`` as ``(tree, module, kwargs)`` with tree
"pristine" or "transformed"; the ``scenario`` fixture runs all the collected modules' calls
once, one interpreter (one vLLM import) per tree, and hands each test a copy of its result.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

import pytest

from testing.scenarios import run_scenarios

TREES = ("pristine", "transformed")


def _key(module: str, kwargs: dict) -> str:
    return module + json.dumps(kwargs, sort_keys=True)


@pytest.fixture(scope="session")
def scenario(request: pytest.FixtureRequest) -> Callable[..., dict]:
    declared: dict[str, dict[str, tuple[str, dict]]] = {tree: {} for tree in TREES}
    for module in {item.module for item in request.session.items}:
        for tree, name, kwargs in getattr(module, "SCENARIO_CALLS", ()):
            if tree not in TREES:
                raise ValueError(f"{module.__file__}: SCENARIO_CALLS names tree {tree!r}; use one of {TREES}")
            declared[tree][_key(name, kwargs)] = (name, kwargs)
    results: dict[str, dict[str, dict]] = {}
    for tree, calls in declared.items():
        if not calls:
            continue
        root: Path | None = request.getfixturevalue("transformed_tree") if tree == "transformed" else None
        results[tree] = dict(zip(calls, run_scenarios(root, list(calls.values()))))

    def get(tree: str, module: str, **kwargs) -> dict:
        try:
            return copy.deepcopy(results[tree][_key(module, kwargs)])
        except KeyError:
            raise LookupError(f"add ({tree!r}, {module!r}, {kwargs!r}) to the test module's SCENARIO_CALLS") from None

    return get
