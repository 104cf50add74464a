"""Measurements live in docs/, not in code comments (issue "house", item 5).

A duration or a rate measured on one machine goes stale in a comment or a docstring, and some
did contradict the code. Such figures live in docs/RESULTS.md (or the doc that fits) with the
command that reproduces them; the code keeps the reason in words ("one import of vLLM instead of
three"). This test reads the comments, docstrings and argparse help of the product, test and
bench code, and fails with file:line where a duration, a rate or a speed-up sits next to a word
that says it was observed rather than set. A setting is no measurement: a quantity named by one
of SETTING_WORDS (a default, a timeout, a budget) is allowed, and that list stays short. Facts
that a test asserts (a scenario's block counts) carry no unit and may stay, naming the test.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("sparkcache", "transforms", "images", "contracts", "testing", "tests", "bench", "build.py", "Makefile")
SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".in")

# A duration or a rate, e.g. 466 s, 2 min, 542 MB/s.
QUANTITY = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|us|s|secs?|seconds?|mins?|minutes?|h|hours?|[KMGT]i?B/s)(?![\w/])")
# A speed-up (a number, then x or times, then slower or faster) always reads as measured.
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:x|times)\s+(?:slower|faster|quicker)\b", re.I)
# Words that say the quantity after them was observed: within CUE_WINDOW characters before it.
CUE = re.compile(
    r"~|\bmeasured\b|\btakes?\b|\btook\b|\btaking\b|\bcosts?\b|\binstead of\b|\bagainst\b|\bran\b"
    r"|\bruns? in\b|\bpassed in\b|\bon (?:this|the dev|\d+) (?:cpu|machine|box|vm|host|cores?)\b|\bdev box\b",
    re.I)
CUE_WINDOW = 60

# The allowlist: a quantity that one of these words names, right before it ("default 120 s", "a
# timeout of 600 s", "at most 10 s") or right after it ("a 30 s lease"), is a setting.
SETTING_WORDS = r"default|timeout|deadline|budget|lease|limit|at most|up to|every|sleeps?|sleeping|waits?"
SETTING_BEFORE = re.compile(rf"\b(?:{SETTING_WORDS})\b[^.;:]{{0,12}}$", re.I)
SETTING_AFTER = re.compile(rf"^\s*(?:{SETTING_WORDS})\b", re.I)


def measurements(text: str) -> list[tuple[int, str]]:
    """(line offset within text, that line) for each line of text with a quantity that reads as measured."""
    found = {}
    for match in [*QUANTITY.finditer(text), *RATIO.finditer(text)]:
        before = text[max(0, match.start() - CUE_WINDOW):match.start()]
        setting = SETTING_BEFORE.search(before) or SETTING_AFTER.match(text[match.end():])
        if RATIO.fullmatch(match.group()) or (CUE.search(before) and not setting):
            offset = text.count("\n", 0, match.start())
            found[offset] = text.splitlines()[offset].strip()
    return sorted(found.items())


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                yield first.value.lineno, first.value.value


def _help_strings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "help" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    yield kw.value.lineno, kw.value.value


def blocks(path: Path):
    """(first line, text) of every comment block, docstring and argparse help in one file.
    Consecutive comment lines form one block, so a word on the line above counts."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        tree = ast.parse(source)
        yield from _docstrings(tree)
        yield from _help_strings(tree)
        comments = [(t.start[0], t.string.lstrip("#").strip())
                    for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    else:
        comments = [(n, line.lstrip().lstrip("#").strip()) for n, line in enumerate(source.splitlines(), 1)
                    if line.lstrip().startswith("#")]
    run: list[tuple[int, str]] = []
    for n, text in comments:
        if run and n != run[-1][0] + 1:
            yield run[0][0], "\n".join(t for _, t in run)
            run = []
        run.append((n, text))
    if run:
        yield run[0][0], "\n".join(t for _, t in run)


def scanned_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--", *SCANNED], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return [REPO / name for name in listed if name.endswith(SUFFIXES) or name.rsplit("/", 1)[-1] == "Makefile"]


@pytest.mark.parametrize("text", [
    "import vLLM once instead of three times, ~20 s a life instead of ~58 s).",
    "the upstream subset takes 466 s alone",
    "verified store read rate (bench.store_throughput median on the dev box: 542 MB/s)",
    "assignment of uint8 rows is element-wise and ~50x slower on CPU).",
    "on a disk that other writers keep busy a publication's three sync\nrounds alone took over 30 s",
    "Upstream's full tests on both trees (slow: ~1 h on 2 cores).",
    "measured: 4.5 GB/s, 3 times faster than sha256",
    "the whole suite passed in 49.8 s",
])
def test_a_measurement_is_found(text):
    assert measurements(text), text


@pytest.mark.parametrize("text", [
    "once its publications settled (quiet for 2 s; the deadline, default 120 s, only guards against a hang",
    "Expiry (30 s lease, fake clock, no finished_sending)",
    "its budget, 100 ms by default, plus a slow fsync",
    "it takes the lock, with a timeout of 600 s",
    "the free-space alert waits 5 minutes under the floor first",
    "local hit 0 (attention 80, Mamba 0: tests/transforms/test_lease_accounting.py)",
    "at t=1440.7 s of the simulated clock",
])
def test_a_setting_or_an_asserted_count_is_not(text):
    assert not measurements(text), text


def test_no_measurement_in_comments_docstrings_or_help():
    files = scanned_files()
    assert REPO / "sparkcache" / "connector" / "worker_side.py" in files and REPO / "Makefile" in files
    problems = [f"{path.relative_to(REPO).as_posix()}:{first + offset}: {line}"
                for path in files for first, text in blocks(path) for offset, line in measurements(text)]
    assert not problems, ("measured figures in code: move each to docs/RESULTS.md with the command that "
                          "reproduces it and keep the reason in words (a setting: name it with one of "
                          "SETTING_WORDS):\n" + "\n".join(problems))
