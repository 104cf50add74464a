"""The edit engine on small inline sources: one case per mode, per nesting, per refusal (LibCST's CodemodTest style).

Each case is (before, edits, after): the whole source before, the edits in order, the whole
source after. Every case that applies is also applied a second time and must not change.
The lock's pre/post hashes (tests/transforms/test_engine.py) are the whole-file check on the
pinned vLLM files.
"""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transforms.edits import Edit, EditError, apply_edits, apply_file


def _src(code: str) -> str:
    return textwrap.dedent(code).lstrip("\n")


CASES = {
    "insert_after one statement": (
        """
        def f():
            x = 1
            return x
        """,
        [Edit("f", "insert_after", anchor="x = 1", new="y = 2")],
        """
        def f():
            x = 1
            y = 2
            return x
        """,
    ),
    "insert_before a run of two statements": (
        """
        class A:
            def f(self):
                a = 1
                b = 2
                return a + b
        """,
        [Edit("A.f", "insert_before", anchor="a = 1\nb = 2", new="hook(self)")],
        """
        class A:
            def f(self):
                hook(self)
                a = 1
                b = 2
                return a + b
        """,
    ),
    "replace keeps the anchor's comment": (
        """
        def f():
            # why
            return 1
        """,
        [Edit("f", "replace", anchor="return 1", new="return 2")],
        """
        def f():
            # why
            return 2
        """,
    ),
    "replace one statement by two": (
        """
        def f(x):
            return x
        """,
        [Edit("f", "replace", anchor="return x", new="y = x + 1\nreturn y")],
        """
        def f(x):
            y = x + 1
            return y
        """,
    ),
    "anchor inside elif, else, except, finally and with": (
        """
        def f(x):
            if x:
                pass
            elif x > 1:
                a = 1
            else:
                b = 2
            try:
                c = 3
            except ValueError:
                d = 4
            finally:
                e = 5
            with open(x) as fh:
                g = 6
        """,
        [
            Edit("f", "insert_after", anchor="a = 1", new="a2 = 1"),
            Edit("f", "insert_after", anchor="b = 2", new="b2 = 2"),
            Edit("f", "insert_after", anchor="d = 4", new="d2 = 4"),
            Edit("f", "insert_after", anchor="e = 5", new="e2 = 5"),
            Edit("f", "insert_after", anchor="g = 6", new="g2 = 6"),
        ],
        """
        def f(x):
            if x:
                pass
            elif x > 1:
                a = 1
                a2 = 1
            else:
                b = 2
                b2 = 2
            try:
                c = 3
            except ValueError:
                d = 4
                d2 = 4
            finally:
                e = 5
                e2 = 5
            with open(x) as fh:
                g = 6
                g2 = 6
        """,
    ),
    "anchor inside for-else, while and match": (
        """
        def f(xs):
            for x in xs:
                pass
            else:
                a = 1
            while xs:
                b = 2
            match xs:
                case []:
                    c = 3
        """,
        [
            Edit("f", "insert_before", anchor="a = 1", new="a0 = 1"),
            Edit("f", "insert_before", anchor="b = 2", new="b0 = 2"),
            Edit("f", "insert_before", anchor="c = 3", new="c0 = 3"),
        ],
        """
        def f(xs):
            for x in xs:
                pass
            else:
                a0 = 1
                a = 1
            while xs:
                b0 = 2
                b = 2
            match xs:
                case []:
                    c0 = 3
                    c = 3
        """,
    ),
    "a compound anchor matches the whole statement": (
        """
        def f(x):
            if x:
                return 1
            return 2
        """,
        [Edit("f", "insert_after", anchor="if x:\n    return 1", new="log(x)")],
        """
        def f(x):
            if x:
                return 1
            log(x)
            return 2
        """,
    ),
    "append_to_class adds a method at the end": (
        """
        class A:
            x = 1
        """,
        [Edit("A", "append_to_class", new="def g(self):\n    return self.x")],
        """
        class A:
            x = 1
            def g(self):
                return self.x
        """,
    ),
    "append_to_class looks only at the class's own body": (
        """
        class A:
            def f(self):
                x = 1
        """,
        [Edit("A", "append_to_class", new="x = 1")],
        """
        class A:
            def f(self):
                x = 1
            x = 1
        """,
    ),
    "nested class method": (
        """
        class A:
            class B:
                def f(self):
                    return 1
        """,
        [Edit("A.B.f", "insert_before", anchor="return 1", new="hook()")],
        """
        class A:
            class B:
                def f(self):
                    hook()
                    return 1
        """,
    ),
    "a second edit anchors on the first one's statements": (
        """
        def f():
            x = 1
        """,
        [Edit("f", "insert_after", anchor="x = 1", new="y = 2"), Edit("f", "insert_after", anchor="y = 2", new="z = 3")],
        """
        def f():
            x = 1
            y = 2
            z = 3
        """,
    ),
    "the same anchor text in another function is not counted": (
        """
        def f():
            x = 1
        def g():
            x = 1
        """,
        [Edit("g", "replace", anchor="x = 1", new="x = 2")],
        """
        def f():
            x = 1
        def g():
            x = 2
        """,
    ),
    "already applied: no change": (
        """
        def f():
            x = 1
            y = 2
        """,
        [Edit("f", "insert_after", anchor="x = 1", new="y = 2")],
        """
        def f():
            x = 1
            y = 2
        """,
    ),
    "indentation and blank lines of an anchor are ignored": (
        """
        def f():
            if True:

                x = (1 +
                     2)
        """,
        [Edit("f", "insert_after", anchor="        x = (1 +\n             2)", new="y = x")],
        """
        def f():
            if True:

                x = (1 +
                     2)
                y = x
        """,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_case_before_to_after_and_again(name):
    before, edits, after = (_src(CASES[name][0]), CASES[name][1], _src(CASES[name][2]))
    out = apply_file(before, [("t.py", edits)])
    assert out == after
    assert apply_edits(out, edits, "t.py") == out


REFUSALS = {
    "anchor found twice": (
        "def f():\n    x = 1\n    if x:\n        x = 1\n",
        [Edit("f", "insert_after", anchor="x = 1", new="y = 2")],
        "t.py: f: anchor starting 'x = 1' found 2 times, expected exactly 1",
    ),
    "anchor found nowhere": (
        "def f():\n    x = 1\n",
        [Edit("f", "replace", anchor="z = 3", new="y = 2")],
        "t.py: f: anchor starting 'z = 3' found 0 times",
    ),
    "anchor only outside the named function": (
        "x = 1\ndef f():\n    pass\n",
        [Edit("f", "replace", anchor="x = 1", new="x = 2")],
        "found 0 times",
    ),
    "no such method": (
        "class A:\n    def f(self):\n        pass\n",
        [Edit("A.g", "replace", anchor="pass", new="return")],
        "t.py: expected exactly one definition of 'A.g', found 0; the pinned source has drifted",
    ),
    "two definitions of the function": (
        "def f():\n    pass\ndef f():\n    pass\n",
        [Edit("f", "replace", anchor="pass", new="return")],
        "expected exactly one definition of 'f', found 2",
    ),
    "append_to_class names a function": (
        "def A():\n    pass\n",
        [Edit("A", "append_to_class", new="x = 1")],
        "expected exactly one definition of 'A', found 0",
    ),
    "append_to_class on a one-line class body": (
        "class A: pass\n",
        [Edit("A", "append_to_class", new="x = 1")],
        "t.py: A: a one-line class body cannot be appended to",
    ),
    "a later edit rewrites an earlier one's statements (not idempotent)": (
        "def f():\n    x = 1\n",
        [Edit("f", "insert_after", anchor="x = 1", new="y = 2"), Edit("f", "replace", anchor="y = 2", new="y = 3")],
        "t.py: f: the edit's new statements are not in its result, so a second pass would change the file again",
    ),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refusal_names_the_file_function_and_anchor(name):
    source, edits, message = REFUSALS[name]
    with pytest.raises(EditError) as caught:
        apply_file(source, [("t.py", edits)])
    assert message in str(caught.value)


_NAMES = st.sampled_from("abcdefg")
_STATEMENT = st.builds(lambda n, v: f"{n} = {v}", _NAMES, st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(body=st.lists(_STATEMENT, min_size=1, max_size=8), new=_STATEMENT, pick=st.integers(0, 7), mode=st.sampled_from(["insert_after", "insert_before", "replace"]))
def test_an_edit_applies_where_its_anchor_is_unique_and_refuses_elsewhere(body, new, pick, mode):
    """Against a list edit of the statements: unique anchor -> that change; otherwise refused or already applied."""
    anchor = body[pick % len(body)]
    source = "def f():\n" + "".join(f"    {s}\n" for s in body)
    edit = Edit("f", mode, anchor=anchor, new=new)
    if new in body:
        assert apply_edits(source, [edit], "t.py") == source  # already applied
        return
    if body.count(anchor) != 1:
        with pytest.raises(EditError, match=f"found {body.count(anchor)} times"):
            apply_edits(source, [edit], "t.py")
        return
    i = body.index(anchor)
    expected = {"insert_after": body[: i + 1] + [new] + body[i + 1 :], "insert_before": body[:i] + [new] + body[i:], "replace": body[:i] + [new] + body[i + 1 :]}[mode]
    out = apply_file(source, [("t.py", [edit])])
    assert out == "def f():\n" + "".join(f"    {s}\n" for s in expected)
