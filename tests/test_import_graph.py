"""One direction: the product (sparkcache/, transforms/, images/builder/, build.py) and the contract suite
baked into images (contracts/) never import the test suite or the benchmarks; tests and benchmarks may
import the product. The test-support package (testing/) is shared by tests, benchmarks and the contract
suite; the product never imports it either."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = [REPO / "sparkcache", REPO / "transforms", REPO / "images" / "builder", REPO / "build.py"]
BAKED = [*PRODUCT, REPO / "contracts"]


def python_files(where: Path) -> list[Path]:
    return [where] if where.is_file() else sorted(p for p in where.rglob("*.py") if "__pycache__" not in p.parts)


def suite_module_names() -> set[str]:
    """Top-level names an import could reach the suite or the benchmarks by: the packages themselves and
    every module under them (importable bare once their folder is on sys.path)."""
    names = {"tests", "bench"}
    for folder in ("tests", "bench"):
        names |= {p.stem for p in (REPO / folder).rglob("*.py") if p.stem != "__init__"}
    return names


def offending_imports(path: Path, forbidden: set[str], root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"{path.relative_to(root)}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in forbidden]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in forbidden:
            out.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func, args = ast.unparse(node.func), node.args
            if (func in ("importlib.import_module", "import_module", "__import__") and args and isinstance(args[0], ast.Constant)
                    and isinstance(args[0].value, str) and args[0].value.split(".")[0] in forbidden):
                out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
            elif ((func.startswith("sys.path.") or func == "site.addsitedir")
                  and any(w in ast.unparse(node) for w in ('"tests"', '"bench"', "'tests'", "'bench'"))):
                out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_product_never_imports_tests_or_bench():
    forbidden = suite_module_names()
    found = [line for where in BAKED for p in python_files(where) for line in offending_imports(p, forbidden)]
    assert found == []


def test_the_product_never_imports_the_test_support_package():
    found = [line for where in PRODUCT for p in python_files(where) for line in offending_imports(p, {"testing"})]
    assert found == []


def test_the_check_sees_each_way_in(tmp_path):
    """The scan itself: each way a module could reach the suite is reported (so the test above can fail)."""
    forbidden = suite_module_names()
    assert {"tests", "bench", "store_helpers", "mounts", "replay_a"} <= forbidden
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\n"
        "from tests.connector.conftest import run_engine\n"
        "import bench.replay_a\n"
        "def f():\n"
        "    from store_helpers import make_store\n"
        "    sys.path.insert(0, str(REPO / 'tests'))\n"
        "    importlib.import_module('tests.store.store_helpers')\n"
        "    sys.path.extend([str(REPO / 'bench')])\n"
        "    importlib.import_module('sparkcache.store')\n"
        "from sparkcache.store import PageStore\n"
        "from . import sibling\n"
    )
    lines = [line.split(": ", 1)[1] for line in sorted(offending_imports(bad, forbidden, root=tmp_path), key=lambda l: int(l.split(":")[1]))]
    assert lines == ["from tests.connector.conftest import ...", "import bench.replay_a", "from store_helpers import ...",
                     "sys.path.insert(0, str(REPO / 'tests'))",
                     "importlib.import_module('tests.store.store_helpers')", "sys.path.extend([str(REPO / 'bench')])"], lines



def sibling_imports(path: Path) -> set[str]:
    """The modules of ``path``'s own package it imports when it is loaded or type-checked:
    ``from .x import ...`` and ``from . import x`` at module level (inside ``if TYPE_CHECKING:``
    and ``try:`` included; an import inside a function is left out: it runs only when called)."""
    out: set[str] = set()
    body = list(ast.parse(path.read_text(), filename=str(path)).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return out


def import_circle(package: Path) -> list[str]:
    """One circle of module-level imports among a package's modules (``a -> b -> a``), or []."""
    graph = {p.stem: sibling_imports(p) for p in package.glob("*.py")}
    done: set[str] = set()

    def walk(name: str, path: list[str]) -> list[str]:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done or name not in graph:
            return []
        for nxt in sorted(graph[name]):
            found = walk(nxt, path + [name])
            if found:
                return found
        done.add(name)
        return []

    for start in sorted(graph):
        found = walk(start, [])
        if found:
            return found
    return []


def test_the_stores_parts_import_no_circle():
    """Each part of the store receives the parts it uses: none imports a part that imports it
    back, not even for its types."""
    assert import_circle(REPO / "sparkcache" / "store") == []


def test_the_circle_check_sees_one(tmp_path):
    (tmp_path / "a.py").write_text("from .b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (tmp_path / "c.py").write_text("def f():\n    from .a import A\n")
    assert import_circle(tmp_path) == []  # an import inside a function is no circle
    (tmp_path / "c.py").write_text("from . import a\n")
    assert import_circle(tmp_path) == ["a", "b", "c", "a"]
