"""The registered markers stay true: a test that needs an engine, Docker or root says so.

Read from the test modules' source (no collection, no vLLM): a module that starts an engine
life (``run_engine``, ``engine_driver``, ``vllm serve``'s API server) carries ``engine``; one
that uses the image build's fixtures (``client``, ``built``) carries ``docker``; a test that
mounts (``small_tmpfs``, ``bind_mount``, ``read_only_view``, ``remount_read_only``) carries
``root``, on itself or its module. A marker missing from ``pyproject.toml`` fails collection
(``--strict-markers``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ENGINE = {"run_engine", "engine_driver", "vllm.entrypoints.openai.api_server"}
DOCKER_FIXTURES = {"client", "built"}
MOUNTS = {"small_tmpfs", "bind_mount", "read_only_view", "remount_read_only"}


def _marks(decorators: list[ast.expr]) -> set[str]:
    out = set()
    for d in decorators:
        for node in ast.walk(d):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "mark":
                out.add(node.attr)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            return _marks([node.value])
    return set()


def _names(node: ast.AST) -> set[str]:
    """Every name, attribute and string constant used under ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def missing_marks(source: str) -> list[str]:
    """What ``source`` (a test module) uses without the marker that says so."""
    tree = ast.parse(source)
    module = _module_marks(tree)
    problems = []
    if _names(tree) & ENGINE and "engine" not in module:
        problems.append("starts an engine life without pytestmark engine")
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        marks = module | _marks(node.decorator_list)
        if {a.arg for a in node.args.args} & DOCKER_FIXTURES and "docker" not in marks:
            problems.append(f"{node.name} uses the image build's fixtures without the docker mark")
        if _names(node) & MOUNTS and "root" not in marks:
            problems.append(f"{node.name} mounts without the root mark")
    # a fixture that mounts makes every module test root's
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("fixture" in _names(d) for d in node.decorator_list) \
                and _names(node) & MOUNTS and "root" not in module:
            problems.append(f"fixture {node.name} mounts without pytestmark root")
    return problems


MODULES = sorted(p for p in TESTS.rglob("test_*.py")
                 if "fixtures" not in p.parts and p != Path(__file__).resolve())  # its cases name the needs


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(TESTS)))
def test_each_module_names_what_it_needs(path):
    assert missing_marks(path.read_text()) == []


@pytest.mark.parametrize("source, expected", [
    ("from .conftest import run_engine\ndef test_a():\n    run_engine({})\n",
     ["starts an engine life without pytestmark engine"]),
    ("import pytest\npytestmark = [pytest.mark.engine]\ndef test_a():\n    run_engine({})\n", []),
    ("def test_a(tmp_path):\n    with small_tmpfs(tmp_path):\n        pass\n",
     ["test_a mounts without the root mark"]),
    ("import pytest\n@pytest.mark.root\ndef test_a(tmp_path):\n    with small_tmpfs(tmp_path):\n        pass\n", []),
    ("def test_a(client, built):\n    pass\n", ["test_a uses the image build's fixtures without the docker mark"]),
    ("import pytest\n@pytest.fixture\ndef ro(tmp_path):\n    with read_only_view(tmp_path, tmp_path):\n"
     "        yield\ndef test_a(ro):\n    pass\n", ["fixture ro mounts without pytestmark root"]),
])
def test_the_check_sees_each_need(source, expected):
    assert missing_marks(source) == expected
