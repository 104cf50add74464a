"""Statement-level libcst edits that fail closed.

A transform is a list of :class:`Edit` values. Each edit names one function
(``Class.method`` or ``function``) and an *anchor*: one statement, or a run of
consecutive statements, written exactly as it appears in the pinned source.
The edit finds that anchor inside the function's body (at any nesting depth)
and replaces it, or inserts new statements before or after it.

Fail closed: an anchor found zero times, or more than once, raises
:class:`EditError` naming the file, the function and the anchor. An edit whose
new statements are already present is recognised as applied and changes
nothing, so a second pass over transformed source is a no-op.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Literal, Sequence

import libcst as cst

Mode = Literal["replace", "insert_before", "insert_after", "append_to_class"]


class EditError(Exception):
    """A transform's matcher did not find exactly what it expects."""


@dataclass(frozen=True)
class Edit:
    """One change to one function (or, for ``append_to_class``, one class).

    function: ``Class.method`` or a module-level ``function`` name; for
        ``append_to_class`` the class name.
    anchor: statements exactly as in the pinned source (indentation is
        ignored); empty for ``append_to_class``.
    new: the statements that replace the anchor or are inserted next to it.
    """

    function: str
    mode: Mode
    new: str
    anchor: str = ""


def _normalize(code: str) -> str:
    lines = [line.rstrip() for line in textwrap.dedent(code).strip("\n").splitlines()]
    return "\n".join(line for line in lines if line)


def _parse_statements(code: str) -> list[cst.BaseStatement]:
    module = cst.parse_module(textwrap.dedent(code).strip("\n") + "\n")
    return list(module.body)


def _stmt_code(module: cst.Module, stmt: cst.CSTNode) -> str:
    if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        stmt = stmt.with_changes(leading_lines=())
    return _normalize(module.code_for_node(stmt))


def _find_target(module: cst.Module, qualname: str, want_class: bool) -> cst.CSTNode:
    """The one class or function named qualname (``Class.method`` or ``name``)."""
    *classes, last = qualname.split(".")
    bodies: list[Sequence[cst.CSTNode]] = [module.body]
    for name in classes:
        bodies = [n.body.body for body in bodies for n in body if isinstance(n, cst.ClassDef) and n.name.value == name]
    kind = cst.ClassDef if want_class else cst.FunctionDef
    found = [n for body in bodies for n in body if isinstance(n, kind) and n.name.value == last]
    if len(found) != 1:
        raise EditError(f"expected exactly one definition of {qualname!r}, found {len(found)}")
    return found[0]


def _suites(node: cst.CSTNode) -> list[cst.CSTNode]:
    """Every statement block (IndentedBlock) under node, outermost first."""
    blocks: list[cst.CSTNode] = []

    class Collect(cst.CSTVisitor):
        def visit_IndentedBlock(self, block: cst.IndentedBlock) -> None:
            blocks.append(block)

    node.visit(Collect())
    return blocks


def _runs(module: cst.Module, block: cst.IndentedBlock, wanted: list[str]) -> list[int]:
    codes = [_stmt_code(module, s) for s in block.body]
    n = len(wanted)
    return [i for i in range(len(codes) - n + 1) if codes[i : i + n] == wanted]


def _locate(module: cst.Module, scope: cst.CSTNode, statements: str) -> list[tuple[cst.IndentedBlock, int]]:
    wanted = [_stmt_code(module, s) for s in _parse_statements(statements)]
    hits = []
    for block in _suites(scope):
        hits.extend((block, i) for i in _runs(module, block, wanted))
    return hits


def apply_edit(module: cst.Module, edit: Edit, where: str) -> cst.Module:
    """Return module with edit applied; unchanged if already applied."""
    context = f"{where}: {edit.function}"
    try:
        if edit.mode == "append_to_class":
            cls = _find_target(module, edit.function, want_class=True)
        else:
            scope = _find_target(module, edit.function, want_class=False)
    except EditError as exc:
        raise EditError(f"{where}: {exc}; the pinned source has drifted, refresh the transform") from None

    new_stmts = _parse_statements(edit.new)
    if edit.mode == "append_to_class":
        if _locate(module, cls, edit.new):
            return module
        updated = cls.with_changes(body=cls.body.with_changes(body=[*cls.body.body, *new_stmts]))
        return module.deep_replace(cls, updated)

    if _locate(module, scope, edit.new):
        return module  # already applied
    hits = _locate(module, scope, edit.anchor)
    if len(hits) != 1:
        first = _normalize(edit.anchor).splitlines()[0] if edit.anchor.strip() else "<empty>"
        raise EditError(
            f"{context}: anchor starting {first!r} found {len(hits)} times, expected exactly 1; "
            "the pinned source has drifted from the transform, refresh the anchor"
        )
    block, index = hits[0]
    count = len(_parse_statements(edit.anchor))
    body = list(block.body)
    anchor_stmts = body[index : index + count]
    if edit.mode == "replace":
        # Keep the anchor's leading comments/blank lines on the first new statement.
        lead = getattr(anchor_stmts[0], "leading_lines", ())
        if new_stmts and hasattr(new_stmts[0], "leading_lines") and lead:
            new_stmts[0] = new_stmts[0].with_changes(leading_lines=[*lead, *new_stmts[0].leading_lines])
        body[index : index + count] = new_stmts
    elif edit.mode == "insert_before":
        body[index:index] = new_stmts
    elif edit.mode == "insert_after":
        body[index + count : index + count] = new_stmts
    else:  # pragma: no cover - Literal guards this
        raise EditError(f"{context}: unknown edit mode {edit.mode!r}")
    return module.deep_replace(block, block.with_changes(body=body))


def apply_edits(source: str, edits: Sequence[Edit], where: str) -> str:
    module = cst.parse_module(source)
    for edit in edits:
        module = apply_edit(module, edit, where)
    return module.code
