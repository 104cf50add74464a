"""docs/RUNTIME_CONTRACT.md's configuration keys are the settings table's transform rows.

The block between the markers is ``render_transform_options_markdown()``; regenerate it with
``python -m tests.test_runtime_contract`` after changing a transform row of sparkcache/settings.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from sparkcache.settings import (SETTINGS_TABLE, SettingsError, render_transform_options_markdown,
                                 transform_option)

DOC = Path(__file__).resolve().parents[1] / "docs" / "RUNTIME_CONTRACT.md"
BEGIN = ("<!-- BEGIN transform options: generated from sparkcache/settings.py by "
         "`python -m tests.test_runtime_contract`; do not edit by hand -->")
END = "<!-- END transform options -->"
_BLOCK = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)


def regenerated(doc: str) -> str:
    """``doc`` with the block between the markers replaced by the table's rendering."""
    if len(_BLOCK.findall(doc)) != 1:
        raise AssertionError(f"{DOC}: expected one block between {BEGIN!r} and {END!r}")
    return _BLOCK.sub(lambda _: f"{BEGIN}\n{render_transform_options_markdown()}\n{END}", doc)


def test_the_doc_shows_the_table_as_generated():
    doc = DOC.read_text()
    assert doc == regenerated(doc), "docs/RUNTIME_CONTRACT.md: run `python -m tests.test_runtime_contract`"


def test_every_transform_key_is_documented_once_with_what_the_parser_accepts():
    block = _BLOCK.search(DOC.read_text()).group(1)
    rows = [r for r in SETTINGS_TABLE if r.transform]
    assert rows
    for row in rows:
        (line,) = [l for l in block.splitlines() if l.startswith(f"| `{row.key}` |")]
        accepted = line.split(" | ")[1]
        assert accepted == row.allowed()
        # what the doc says is refused, the parser refuses
        refused = ["false", "true", "5", None, 1] if row.type == "json_bool" else \
            ["5", True, None, float("nan"), float("inf"), row.minimum / 2, row.maximum * 2]
        for value in refused:
            try:
                transform_option({row.key: value}, row.key)
            except SettingsError as exc:
                assert row.key in str(exc) and repr(value) in str(exc) and accepted in str(exc)
            else:
                raise AssertionError(f"{row.key}={value!r} accepted; the doc says {accepted!r}")
        assert transform_option({}, row.key) == row.default


if __name__ == "__main__":
    text = DOC.read_text()
    new = regenerated(text)
    if new != text:
        DOC.write_text(new)
        print(f"rewrote {DOC}", file=sys.stderr)
