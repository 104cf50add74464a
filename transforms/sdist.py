"""Fetch the pinned vLLM sdist, check its sha256 against the lock, unpack it.

The archive is fetched as a file and never built (building it needs CUDA
torch). Its ``vllm/`` is the pristine source the transforms are written
against; its ``tests/`` holds upstream's own tests.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

from transforms.engine import Lock, TransformError, load_lock


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: Path, expected_size: int | None = None) -> None:
    tmp = dest.with_suffix(dest.suffix + ".part")
    with urllib.request.urlopen(url, timeout=120) as resp, tmp.open("wb") as out:
        total = expected_size or int(resp.headers.get("Content-Length") or 0)
        done, last = 0, -1
        while chunk := resp.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            pct = done * 100 // total if total else 0
            if pct // 10 != last:
                last = pct // 10
                print(f"fetch: {dest.name} {done >> 20}/{total >> 20} MiB", file=sys.stderr)
    tmp.replace(dest)


def verify_archive(archive: Path, lock: Lock) -> None:
    found = _sha256_file(archive)
    expected = lock.sdist["sha256"]
    if found != expected:
        raise TransformError(
            f"{archive}: sha256 {found} does not match the lock's {expected} for {lock.sdist['filename']}; "
            "delete the file and fetch again (it is not the pinned vLLM sdist)"
        )


def fetch(dest: Path, archive: Path | None = None) -> Path:
    """Ensure dest/vllm-X.Y.Z is the verified, unpacked sdist; return that directory."""
    lock = load_lock()
    dest.mkdir(parents=True, exist_ok=True)
    archive = archive or dest / lock.sdist["filename"]
    if not archive.exists():
        download(lock.sdist["url"], archive, lock.sdist.get("size"))
    verify_archive(archive, lock)
    root = dest / f"vllm-{lock.vllm_version}"
    marker = root / ".sdist-sha256"
    if marker.is_file() and marker.read_text().strip() == lock.sdist["sha256"]:
        return root
    if root.exists():
        shutil.rmtree(root)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    marker.write_text(lock.sdist["sha256"] + "\n")
    return root
