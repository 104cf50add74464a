"""The connector's and the store's annotations name real types: every annotation in
``sparkcache.connector``, ``sparkcache.hooks`` and ``sparkcache.store`` resolves, those under ``if TYPE_CHECKING:`` (vLLM's Request, SchedulerOutput, KVCacheBlocks,
...) included, so a type renamed or moved by a vLLM upgrade fails here instead of misleading a
reader. (The product imports them only for type checkers.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import typing

import pytest

import sparkcache.connector
import sparkcache.hooks
import sparkcache.store

MODULES = sorted(m.name for package in (sparkcache.connector, sparkcache.hooks, sparkcache.store)
                 for m in pkgutil.iter_modules(package.__path__, package.__name__ + "."))


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


def test_a_wrong_name_is_found(tmp_path, monkeypatch):
    (tmp_path / "wrongly_annotated.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from vllm.v1.request import Request\n"
        "def ok(r: Request) -> None: ...\n"
        "def wrong(r: SchedulerOutputt) -> None: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [line.split(":")[0] for line in unresolved("wrongly_annotated")] == ["wrong"]
