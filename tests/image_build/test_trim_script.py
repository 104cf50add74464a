"""The wheels stage's trim, run by /bin/sh (dash, as in the Debian base) on a folder standing in for
site-packages: what it removes, what it keeps, and its refusals (which remove nothing)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from images.builder.layers import TRIM_REFUSED, trim_script
from images.builder.spec import Trim


def site(tmp_path: Path) -> Path:
    root = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    files = {"pkg/lib/a_static.a": 300, "pkg/lib/b_static.a": 200, "pkg/lib/libkeep.so": 50,
             "flavours/cu12/lib/x.so": 1000, "flavours/cu12/include/x.h": 10, "flavours/cu13/lib/x.so": 1000,
             "flavours/_ir.cu12.cpython-311.so": 70, "flavours/_ir.cu13.cpython-311.so": 70}
    for rel, size in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    return root


def run(site_packages: Path, *paths: str) -> subprocess.CompletedProcess:
    script = "set -eu\n" + trim_script(str(site_packages), [Trim(p, "test") for p in paths])
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)


def remaining(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_removes_each_entry_and_reports_its_bytes(tmp_path):
    root = site(tmp_path)
    out = run(root, "pkg/lib/*_static.a", "flavours/cu12", "flavours/_ir.cu12.*.so")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "trim: pkg/lib/*_static.a: 500 bytes" and lines[2] == "trim: flavours/_ir.cu12.*.so: 70 bytes", lines
    folder = int(lines[1].removeprefix("trim: flavours/cu12: ").removesuffix(" bytes"))  # files plus the folders' own size
    assert 1010 <= folder <= 1010 + 4 * 4096 and len(lines) == 3, lines
    assert remaining(root) == {"pkg/lib/libkeep.so", "flavours/cu13/lib/x.so", "flavours/_ir.cu13.cpython-311.so"}


def test_an_entry_that_matches_nothing_refuses_before_removing_anything(tmp_path):
    root = site(tmp_path)
    before = remaining(root)
    out = run(root, "pkg/lib/*_static.a", "flavours/cu11")
    assert out.returncode == TRIM_REFUSED
    assert out.stdout.strip().splitlines()[-1] == f"trim: flavours/cu11 matches nothing under {root}"
    assert remaining(root) == before


def test_a_match_that_leads_outside_site_packages_is_refused(tmp_path):
    root = site(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not ours\n")
    (root / "pkg" / "elsewhere").symlink_to(outside)
    before = remaining(root)
    for entry in ("pkg/elsewhere/*", "pkg/elsewhere"):
        out = run(root, entry)
        assert out.returncode == TRIM_REFUSED and "resolves outside" in out.stdout, out.stdout
        assert (outside / "precious").read_text() == "not ours\n" and remaining(root) == before
