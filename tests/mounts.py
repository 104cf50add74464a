"""A read-only view of a directory: a real bind mount, remounted read-only (needs root, as
CI and the developers' machines run)."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def read_only_view(root: Path, at: Path) -> Iterator[Path]:
    """``root`` bind-mounted read-only at ``at`` (created), unmounted afterwards."""
    at.mkdir()
    subprocess.run(["mount", "--bind", str(root), str(at)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(at)], check=True)
        yield at
    finally:
        subprocess.run(["umount", str(at)], check=True)
