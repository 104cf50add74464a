"""sparkcache's annotations name real types: every annotation in every module of ``sparkcache``
(the connector, the hooks, the store, and settings, metrics and the CLI) resolves, those under
``if TYPE_CHECKING:`` (vLLM's Request, SchedulerOutput, KVCacheBlocks, ...) included, so a type
renamed or moved by a vLLM upgrade fails here instead of misleading a reader. (The product
imports them only for type checkers.) ``sparkcache.__main__`` is the one module not imported:
importing it runs the CLI; it defines nothing to annotate (checked below). The uses of
``typing.Any`` left in sparkcache/ are counted, so they cannot creep back (``ANY_LEFT``)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import typing
from pathlib import Path

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


# ---------------------------------------------------------------------------- typing.Any, counted

# Every ``Any`` left in sparkcache/ stands for a value that really is of any type: vLLM's own
# signatures the connector overrides (``**kwargs`` of start_load_kv and save_kv_layer, the
# stats data of build_kv_connector_stats and SparkcachePromMetrics.observe) and a manifest's
# decoded JSON, each value checked before use (Identity.from_dict, manifests._from_fields).
# A known type is annotated as itself (vLLM's under ``if TYPE_CHECKING:``), a value only
# inspected or encoded as ``object``. Lower this when one goes; never raise it.
ANY_LEFT = 6
SPARKCACHE = Path(sparkcache.__file__).parent


def any_uses(path: Path, root: Path) -> list[str]:
    """``path:line: source`` of each use of ``typing.Any`` in ``path``'s code: bare or as
    ``typing.Any``, under any name it was imported as, in annotations (string ones included),
    aliases and casts alike. Prose (docstrings, comments) is not code and is not counted."""
    source = path.read_text()
    tree = ast.parse(source)
    names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             and n.module in ("typing", "typing_extensions") for a in n.names if a.name == "Any"}
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names if a.name in ("typing", "typing_extensions")}

    def uses(node: ast.AST, line_offset: int = 0) -> list[int]:
        found = []
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id in names:
                found.append(n.lineno + line_offset)
            elif isinstance(n, ast.Attribute) and n.attr == "Any" and getattr(n.value, "id", None) in modules:
                found.append(n.lineno + line_offset)
        return found

    lines = uses(tree)
    annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation]
    annotations += [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns]
    for annotation in annotations:  # a string annotation, whole or inside one (``dict[str, "Any"]``)
        for n in ast.walk(annotation):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                try:
                    lines += uses(ast.parse(n.value, mode="eval"), n.lineno - 1)
                except SyntaxError:
                    pass
    text = source.splitlines()
    return [f"{path.relative_to(root)}:{line}: {text[line - 1].strip()}" for line in sorted(lines)]


def any_in_sparkcache() -> list[str]:
    return [use for p in sorted(SPARKCACHE.rglob("*.py")) if "__pycache__" not in p.parts
            for use in any_uses(p, SPARKCACHE.parent)]


def test_any_does_not_creep_back():
    found = any_in_sparkcache()
    assert len(found) <= ANY_LEFT, (
        f"{len(found)} uses of typing.Any in sparkcache/ (at most {ANY_LEFT}); annotate the known "
        "types (vLLM's under `if TYPE_CHECKING:`), `object` for a value only inspected:\n" + "\n".join(found))


def test_every_use_of_any_is_counted(tmp_path):
    """The count itself: each way to write ``Any`` is seen, prose and imports are not."""
    (tmp_path / "uses_any.py").write_text(
        '"""Any prose is not counted."""\n'
        "import typing\nimport typing as t\nfrom typing import Any, Any as Whatever\n"
        "Alias = dict[str, Any]\n"                      # 5
        "def f(a: Any, *b: typing.Any) -> t.Any:\n"     # 6 (three)
        "    x: 'list[Any]' = []  # Any in a comment\n"  # 7
        "    y: dict[str, 'Whatever'] = {}\n"           # 8
        "    return typing.cast(Any, x)\n")             # 9
    lines = [int(use.split(":")[1]) for use in any_uses(tmp_path / "uses_any.py", tmp_path)]
    assert lines == [5, 6, 6, 6, 7, 8, 9], lines
