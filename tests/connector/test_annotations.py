"""sparkcache's annotations name real types: every annotation in every module of ``sparkcache``
(the connector, the hooks, the store, and settings, metrics and the CLI) resolves, those under
``if TYPE_CHECKING:`` (vLLM's Request, SchedulerOutput, KVCacheBlocks, ...) included, so a type
renamed or moved by a vLLM upgrade fails here instead of misleading a reader. (The product
imports them only for type checkers.) ``sparkcache.__main__`` is the one module not imported:
importing it runs the CLI; it defines nothing to annotate (checked below)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import typing

import pytest

import sparkcache

MAIN = "sparkcache.__main__"  # importing it runs the CLI (``sys.exit(main())``)
MODULES = sorted({"sparkcache", *(m.name for m in pkgutil.walk_packages(sparkcache.__path__, "sparkcache."))}
                 - {MAIN})


def unresolved(modname: str) -> list[str]:
    """``qualname: error`` of each function, method, property or class in ``modname`` whose
    annotations do not resolve in its globals plus its ``TYPE_CHECKING`` imports."""
    mod = importlib.import_module(modname)
    names = dict(vars(mod))
    for node in ast.parse(inspect.getsource(mod)).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            exec(compile(ast.Module(node.body, []), modname, "exec"), names)
    out = []
    for obj in list(vars(mod).values()):
        members = list(vars(obj).values()) if inspect.isclass(obj) and obj.__module__ == modname else []
        for o in [obj, *members]:
            f = o.fget if isinstance(o, property) else getattr(o, "__func__", o)
            if (inspect.isfunction(f) or inspect.isclass(f)) and getattr(f, "__module__", None) == modname:
                try:
                    typing.get_type_hints(f, globalns=names)
                except Exception as exc:  # NameError, AttributeError: what a reader would trip on
                    out.append(f"{f.__qualname__}: {exc!r}")
    return out


@pytest.mark.parametrize("modname", MODULES)
def test_every_annotation_resolves(modname):
    assert unresolved(modname) == []


def test_every_module_is_checked():
    """The walk finds the subpackages' modules and the top-level ones; the one left out
    (``__main__``) has no function, class or annotated name to check."""
    assert {"sparkcache.settings", "sparkcache.metrics", "sparkcache.cli", "sparkcache.connector.connector",
            "sparkcache.hooks.lease_accounting", "sparkcache.store.pagestore"} <= set(MODULES)
    main = ast.parse(importlib.util.find_spec(MAIN).loader.get_source(MAIN))
    assert not [n for n in ast.walk(main) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                             ast.ClassDef, ast.AnnAssign))]


def test_a_wrong_name_is_found(tmp_path, monkeypatch):
    (tmp_path / "wrongly_annotated.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from vllm.v1.request import Request\n"
        "def ok(r: Request) -> None: ...\n"
        "def wrong(r: SchedulerOutputt) -> None: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [line.split(":")[0] for line in unresolved("wrongly_annotated")] == ["wrong"]
