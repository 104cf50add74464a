"""Statement-level libcst edits that fail closed.

A transform is a list of :class:`Edit` values. Each edit names one function
(``Class.method`` or ``function``) and an *anchor*: one statement, or a run of
consecutive statements, written exactly as it appears in the pinned source.
The edit finds that anchor inside the function's body (at any nesting depth)
and replaces it, or inserts new statements before or after it.

Fail closed: an anchor found zero times, or more than once, raises
:class:`EditError` naming the file, the function and the anchor. An edit whose
new statements are already present is recognised as applied and changes
nothing, so a second pass over transformed source is a no-op; :func:`apply_file`
proves that without running the second pass, by finding every edit's new
statements in what it produced.

One file is parsed once for all its edits. Blocks are found by walking
statements only (never expressions), each statement's source is rendered once
and remembered, and an edit rebuilds only the nodes on the path from the
module down to the block it changes.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

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


# One step from a node to its child: (parent, field, index in the field's sequence or None).
_Step = tuple[cst.CSTNode, str, "int | None"]
_Path = tuple[_Step, ...]

# Fields of compound statements (and their clauses) that hold statement blocks or clauses.
_BLOCK_FIELDS = ("body", "orelse", "handlers", "finalbody", "cases")
_CLAUSES = (cst.BaseCompoundStatement, cst.Else, cst.ExceptHandler, cst.ExceptStarHandler, cst.Finally, cst.MatchCase)


def _normalize(code: str) -> str:
    lines = [line.rstrip() for line in textwrap.dedent(code).strip("\n").splitlines()]
    return "\n".join(line for line in lines if line)


def _parse_statements(code: str) -> list[cst.BaseStatement]:
    module = cst.parse_module(textwrap.dedent(code).strip("\n") + "\n")
    return list(module.body)


def _blocks(node: cst.CSTNode, path: _Path) -> Iterator[tuple[cst.IndentedBlock, _Path]]:
    """Every statement block under node (a statement or clause), outermost first, with its path."""
    for field in _BLOCK_FIELDS:
        value = getattr(node, field, None)
        children = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, child in children:
            step = path + ((node, field, index),)
            if isinstance(child, cst.IndentedBlock):
                yield child, step
                for i, stmt in enumerate(child.body):
                    yield from _blocks(stmt, step + ((child, "body", i),))
            elif isinstance(child, _CLAUSES):
                yield from _blocks(child, step)


def _rebuild(path: _Path, new: cst.CSTNode) -> cst.CSTNode:
    """The root of path with the node at its end replaced by new (only the path's nodes are copied)."""
    for parent, field, index in reversed(path):
        if index is not None:
            items = list(getattr(parent, field))
            items[index] = new
            new = parent.with_changes(**{field: items})
        else:
            new = parent.with_changes(**{field: new})
    return new


class _File:
    """One parsed file under edit: each statement's normalised source is rendered once."""

    def __init__(self, source: str) -> None:
        self.module = cst.parse_module(source)
        self._codes: dict[int, tuple[cst.CSTNode, str]] = {}

    def code(self, stmt: cst.CSTNode) -> str:
        hit = self._codes.get(id(stmt))
        if hit is not None and hit[0] is stmt:
            return hit[1]
        bare = stmt.with_changes(leading_lines=()) if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) else stmt
        code = _normalize(self.module.code_for_node(bare))
        self._codes[id(stmt)] = (stmt, code)
        return code

    def target(self, qualname: str, want_class: bool) -> tuple[cst.CSTNode, _Path]:
        """The one class or function named qualname (``Class.method`` or ``name``), with its path."""
        *classes, last = qualname.split(".")
        owners: list[tuple[cst.CSTNode, _Path]] = [(self.module, ())]
        for name in classes:
            owners = [(n, p) for o, op in owners for n, p in _members(o, op) if isinstance(n, cst.ClassDef) and n.name.value == name]
        kind = cst.ClassDef if want_class else cst.FunctionDef
        found = [(n, p) for o, op in owners for n, p in _members(o, op) if isinstance(n, kind) and n.name.value == last]
        if len(found) != 1:
            raise EditError(f"expected exactly one definition of {qualname!r}, found {len(found)}")
        return found[0]

    def locate(self, scope: cst.CSTNode, path: _Path, statements: str) -> list[tuple[cst.IndentedBlock, _Path, int]]:
        """Every place where the run of statements appears: (block, its path, index).

        In a function: its blocks at any depth. In a class: its own body only (what
        ``append_to_class`` adds to), not its methods' blocks.
        """
        wanted = [self.code(s) for s in _parse_statements(statements)]
        n = len(wanted)
        hits = []
        if isinstance(scope, cst.ClassDef):
            blocks = [(scope.body, path + ((scope, "body", None),))] if isinstance(scope.body, cst.IndentedBlock) else []
        else:
            blocks = list(_blocks(scope, path))
        for block, block_path in blocks:
            body = block.body
            for i in range(len(body) - n + 1):
                if all(self.code(body[i + k]) == wanted[k] for k in range(n)):
                    hits.append((block, block_path, i))
        return hits

    def applied(self, edit: Edit, where: str) -> bool:
        scope, path = self._scope(edit, where)
        return bool(self.locate(scope, path, edit.new))

    def _scope(self, edit: Edit, where: str) -> tuple[cst.CSTNode, _Path]:
        try:
            return self.target(edit.function, want_class=edit.mode == "append_to_class")
        except EditError as exc:
            raise EditError(f"{where}: {exc}; the pinned source has drifted, refresh the transform") from None

    def apply(self, edit: Edit, where: str) -> None:
        """Apply edit; nothing changes if it is already applied."""
        scope, path = self._scope(edit, where)
        if self.locate(scope, path, edit.new):
            return
        new_stmts = _parse_statements(edit.new)
        if edit.mode == "append_to_class":
            block = scope.body
            if not isinstance(block, cst.IndentedBlock):
                raise EditError(f"{where}: {edit.function}: a one-line class body cannot be appended to")
            self.module = _rebuild(path + ((scope, "body", None),), block.with_changes(body=[*block.body, *new_stmts]))
            return
        hits = self.locate(scope, path, edit.anchor)
        if len(hits) != 1:
            first = _normalize(edit.anchor).splitlines()[0] if edit.anchor.strip() else "<empty>"
            raise EditError(
                f"{where}: {edit.function}: anchor starting {first!r} found {len(hits)} times, expected exactly 1; "
                "the pinned source has drifted from the transform, refresh the anchor"
            )
        block, block_path, index = hits[0]
        count = len(_parse_statements(edit.anchor))
        body = list(block.body)
        if edit.mode == "replace":
            # Keep the anchor's leading comments/blank lines on the first new statement.
            lead = getattr(body[index], "leading_lines", ())
            if new_stmts and hasattr(new_stmts[0], "leading_lines") and lead:
                new_stmts[0] = new_stmts[0].with_changes(leading_lines=[*lead, *new_stmts[0].leading_lines])
            body[index : index + count] = new_stmts
        elif edit.mode == "insert_before":
            body[index:index] = new_stmts
        elif edit.mode == "insert_after":
            body[index + count : index + count] = new_stmts
        else:  # pragma: no cover - Literal guards this
            raise EditError(f"{where}: {edit.function}: unknown edit mode {edit.mode!r}")
        self.module = _rebuild(block_path, block.with_changes(body=body))


def _members(owner: cst.CSTNode, path: _Path) -> Iterator[tuple[cst.CSTNode, _Path]]:
    """The statements directly in a module's or a class's body, with their paths."""
    if isinstance(owner, cst.Module):
        for i, stmt in enumerate(owner.body):
            yield stmt, path + ((owner, "body", i),)
    elif isinstance(owner, cst.ClassDef) and isinstance(owner.body, cst.IndentedBlock):
        block_path = path + ((owner, "body", None),)
        for i, stmt in enumerate(owner.body.body):
            yield stmt, block_path + ((owner.body, "body", i),)


def apply_file(source: str, groups: Sequence[tuple[str, Sequence[Edit]]], check_idempotent: bool = True) -> str:
    """Apply each group's edits in order (group: (where, edits)); one parse for the whole file.

    With check_idempotent, every edit's new statements must be found in the result, which is
    exactly what makes a second pass over it a no-op; otherwise EditError.
    """
    file = _File(source)
    for where, edits in groups:
        for edit in edits:
            file.apply(edit, where)
    out = file.module.code
    if check_idempotent:
        again = _File(out)
        for where, edits in groups:
            for edit in edits:
                if not again.applied(edit, where):
                    raise EditError(
                        f"{where}: {edit.function}: the edit's new statements are not in its result, so a second "
                        "pass would change the file again; transforms must be idempotent (a later edit rewrote them?)"
                    )
    return out


def apply_edits(source: str, edits: Sequence[Edit], where: str) -> str:
    """Apply edits to source in order (a second application is a no-op)."""
    return apply_file(source, [(where, edits)], check_idempotent=False)
