"""The three stages of an image: base, wheels, overlay.

base     a Debian root filesystem made by debootstrap (cached tar, keyed by its inputs), imported,
         pushed and then named by digest; or an image named by digest in the spec.
wheels   the spec's wheels, downloaded into a hash-checked wheelhouse, installed in a container
         from the base with no network (pip --no-index --no-deps --require-hashes), committed.
overlay  one deterministic tar (sorted, uid/gid 0, every mtime SOURCE_DATE_EPOCH, no .pyc):
         the transformed vLLM files, the sparkcache wheel's files, transforms/ and contracts/.
         ADDed by the rendered Dockerfile; the same inputs give the same layer digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from images.builder.dockerenv import CACHE, REPO_ROOT, BuildError, check_stream, progress, push, registry_manifest_digest
from images.builder.pinning import platform_tags
from images.builder.spec import Spec


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def short_key(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


# --- base ----------------------------------------------------------------------------------------

def debootstrap_tar(spec: Spec) -> tuple[Path, dict]:
    """The cached root filesystem tar for the spec's debootstrap inputs (made once, then reused)."""
    d = spec.debootstrap
    key = short_key(d.key())
    out = CACHE / "base" / f"debian-{d.suite}-{d.variant}-{key}.tar"
    if not out.exists():
        if shutil.which("debootstrap") is None:
            raise BuildError("debootstrap is not installed; fix: `bash images/setup-docker.sh` (Debian: apt-get install debootstrap)")
        out.parent.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="rootfs-", dir=out.parent))
        progress(f"debootstrap --variant={d.variant} --include={','.join(d.include)} {d.suite} from {d.mirror} (about a minute)")
        t0 = time.monotonic()
        cmd = ["debootstrap", f"--variant={d.variant}", f"--include={','.join(d.include)}", d.suite, str(root), d.mirror]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = proc.stdout.strip().splitlines()[-1:] or ["?"]
            shutil.rmtree(root, ignore_errors=True)
            raise BuildError(f"debootstrap {d.suite} from {d.mirror} failed ({tail[0]}); fix: check that the mirror answers (apt-get update)")
        progress(f"debootstrap took {time.monotonic() - t0:.0f} s")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "var/log"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tmp = out.with_suffix(".tar.tmp")
        subprocess.run(
            ["tar", "-C", str(root), "--sort=name", "--numeric-owner", "--exclude=./proc/*", "--exclude=./sys/*",
             "--exclude=./dev/*", "--exclude=./run/*", "--exclude=./tmp/*", "-cf", str(tmp), "."],
            check=True,
        )
        os.replace(tmp, out)
        shutil.rmtree(root, ignore_errors=True)
    return out, {"debootstrap": d.key(), "rootfs_tar": out.name, "rootfs_sha256": sha256_file(out)}


def resolve_base(client, spec: Spec, registry: str) -> tuple[str, dict]:
    """Return (REPO@sha256:..., info) for the base; the image is present in the local engine afterwards."""
    from images.builder.dockerenv import pull_by_digest

    if spec.base_image:
        try:
            client.images.get(spec.base_image)
        except Exception:  # noqa: BLE001 - not present: pull it
            progress(f"pulling base {spec.base_image}")
            pull_by_digest(client, spec.base_image)
        return spec.base_image, {"name": spec.base_image.split("@")[0], "digest": spec.base_image.split("@")[1]}

    tar, info = debootstrap_tar(spec)
    repo = f"{registry.split('/')[0]}/sparkcache/debian-base"
    tag = f"{spec.debootstrap.suite}-{info['rootfs_sha256'][:20]}"
    digest = None
    if registry.split("/")[0].startswith(("127.0.0.1", "localhost")):
        try:
            digest = registry_manifest_digest(repo, tag)
        except BuildError as exc:  # the push below then fails with the engine's own reason
            progress(f"cannot ask {repo} for {tag}: {exc}")
    local = None
    try:
        local = client.images.get(f"{repo}:{tag}")
    except Exception:  # noqa: BLE001
        pass
    if digest and local is not None and f"{repo}@{digest}" in local.attrs.get("RepoDigests", []):
        progress(f"base {repo}@{digest} (cached)")
    else:
        if local is None:
            progress(f"docker import {tar.name} as {repo}:{tag}")
            t0 = time.monotonic()
            check_stream(
                client.api.import_image_from_file(str(tar), repository=repo, tag=tag, changes=["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "CMD [\"/bin/bash\"]"]),
                f"docker import of {tar}",
            )
            progress(f"import took {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        digest = push(client, repo, tag)
        progress(f"base pushed as {repo}@{digest} in {time.monotonic() - t0:.1f} s")
    ref = f"{repo}@{digest}"
    return ref, {"name": repo, "digest": digest, **info}


# --- wheels --------------------------------------------------------------------------------------

def _wheel_index(wheelhouse: Path) -> dict[str, Path]:
    """sha256 -> file, cached by (name, size, mtime)."""
    cache_file = wheelhouse / ".sha256-index.json"
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    out, fresh = {}, {}
    for f in sorted(wheelhouse.glob("*.whl")):
        st = f.stat()
        k = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        digest = cached.get(k) or sha256_file(f)
        fresh[k] = digest
        out[digest] = f
    cache_file.write_text(json.dumps(fresh, indent=0, sort_keys=True))
    return out


def pip_download(spec: Spec, pins: list[str], dest: Path) -> None:
    """The wheels for the image's Python (and, when its suite says, its glibc), not the host's."""
    platforms = [arg for tag in platform_tags(spec.release.glibc) for arg in ("--platform", tag)] if spec.release else []
    index, env = spec.pip()
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:", *index,
           "--python-version", spec.python_version, "--implementation", "cp", *platforms, "-d", str(dest), *pins]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode != 0:
        last = [l for l in proc.stdout.splitlines() if l.strip()][-1:] or ["?"]
        raise BuildError(f"pip download {' '.join(pins[:3])}{' ...' if len(pins) > 3 else ''} failed: {last[0]}; fix: check the pins exist as wheels for this Python")


def resolve_wheels(spec: Spec) -> tuple[Path, list[dict]]:
    """Every wheel of the spec in the wheelhouse, each checked against its pinned sha256.

    Returns the staging folder (hard links + requirements.txt with hashes) and the resolved list.
    """
    wheelhouse = CACHE / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    index = _wheel_index(wheelhouse)
    missing = [w for w in spec.wheels if w.sha256 not in index]
    if missing:
        progress(f"downloading {len(missing)} wheel(s) into {wheelhouse} (pip download --no-deps, by exact version)")
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=wheelhouse) as tmp:
            pip_download(spec, [w.pin for w in missing], Path(tmp))
            got = {}
            for f in Path(tmp).glob("*.whl"):
                got[norm(f.name.split("-")[0])] = f
            for i, w in enumerate(spec.wheels):
                if w not in missing:
                    continue
                f = got.get(norm(w.name))
                if f is None:
                    raise BuildError(f"{spec.path}: wheels[{i}] {w.pin}: pip downloaded no wheel for it; fix: check the name and version")
                digest = sha256_file(f)
                if digest != w.sha256:
                    raise BuildError(
                        f"{spec.path}: wheels[{i}] {w.pin}: the downloaded {f.name} has sha256 {digest}, the spec pins {w.sha256}; "
                        "fix: if the new file is trusted, pin its hash; otherwise the index served a different file"
                    )
                os.replace(f, wheelhouse / f.name)
        progress(f"wheelhouse download took {time.monotonic() - t0:.1f} s")
        index = _wheel_index(wheelhouse)
    resolved = []
    for w in spec.wheels:
        f = index[w.sha256]
        resolved.append({"name": w.name, "version": w.version, "file": f.name, "sha256": w.sha256})
    requirements = "".join(f"{w.requirement}\n" for w in spec.wheels)
    stage = CACHE / "stage" / short_key(requirements)
    if not (stage / "requirements.txt").exists():
        tmp = stage.with_name(stage.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for r in resolved:
            os.link(wheelhouse / r["file"], tmp / r["file"])
        (tmp / "requirements.txt").write_text(requirements)
        shutil.rmtree(stage, ignore_errors=True)
        os.replace(tmp, stage)
    return stage, resolved


# Exit statuses of the wheels stage's own refusals (pip's own are below 64).
WRONG_PYTHON = 65    # the base's python3 is not the spec's python_version
TRIM_REFUSED = 66    # a trim entry matches nothing, or a match resolves outside site-packages
INSTALL_SCRIPT = """set -eu
command -v python3 >/dev/null || {{ echo "python3 in the base is missing"; exit {wrong_python}; }}
got=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$got" != "{python_version}" ]; then echo "python3 in the base is $got"; exit {wrong_python}; fi
test -x {python} || python3 -m venv {venv}
{python} -m pip install --disable-pip-version-check --no-cache-dir --no-index --no-deps --require-hashes \\
  --find-links /wheelhouse -r /wheelhouse/requirements.txt
{trim}rm -rf /root/.cache /tmp/*
"""
# The spec's trim, in the install's own layer: every entry must match, inside site-packages (a link
# out of it is refused), before anything is removed.
TRIM_SCRIPT = """site=$(readlink -f {site_packages})
cd "$site"
for pattern in {patterns}; do
  set -- $pattern
  [ -e "$1" ] || {{ echo "trim: $pattern matches nothing under {site_packages}"; exit {refused}; }}
  for match in "$@"; do
    case "$(readlink -f "$match")" in
      "$site"/*) ;;
      *) echo "trim: $pattern: $match resolves outside {site_packages}"; exit {refused} ;;
    esac
  done
done
for pattern in {patterns}; do
  set -- $pattern
  echo "trim: $pattern: $(du -scb "$@" | tail -1 | cut -f1) bytes"
  rm -rf -- "$@"
done
cd /
"""


def trim_script(site_packages: str, trims) -> str:
    """The shell that removes a spec's trim entries (paths the spec validated: no quotes, spaces or '..')."""
    if not trims:
        return ""
    return TRIM_SCRIPT.format(site_packages=site_packages, patterns=" ".join(f"'{t.path}'" for t in trims),
                              refused=TRIM_REFUSED)


def wheels_image(client, spec: Spec, base_ref: str, stage: Path) -> tuple[str, dict]:
    """A local image: the base plus the venv with every wheel installed (no network). Cached by its inputs."""
    script = INSTALL_SCRIPT.format(python=spec.python, venv=spec.venv, python_version=spec.python_version,
                                   wrong_python=WRONG_PYTHON, trim=trim_script(spec.site_packages, spec.trim))
    requirements = (stage / "requirements.txt").read_text()
    key = short_key({"base": base_ref, "requirements": requirements, "script": script})
    tag = f"sparkcache-build/{spec.name}-wheels:{key}"
    try:
        image = client.images.get(tag)
        progress(f"wheels stage {tag} (cached)")
        return tag, {"image_id": image.id, "key": key}
    except Exception:  # noqa: BLE001
        pass
    progress(f"wheels stage: installing {len(spec.wheels)} wheels into {spec.venv} (no network, --no-index --require-hashes)")
    t0 = time.monotonic()
    container = client.containers.create(
        base_ref, command=["/bin/sh", "-c", script], network_mode="none",
        volumes={str(stage): {"bind": "/wheelhouse", "mode": "ro"}}, environment={"PIP_NO_INPUT": "1"},
    )
    try:
        container.start()
        for chunk in container.logs(stream=True, follow=True):
            sys.stderr.write("  | " + chunk.decode(errors="replace")) if chunk.strip() else None
        status = container.wait()["StatusCode"]
        if status != 0:
            tail = container.logs(tail=3).decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            if status == WRONG_PYTHON and tail[0].startswith("python3 in the base"):
                raise BuildError(
                    f"{spec.path}: python_version is {spec.python_version}, but {tail[0]} (base {base_ref}); "
                    f"fix: choose a base with Python {spec.python_version}, or state the base's version in python_version "
                    f"and re-pin the wheels for it (the pin-wheels command in the spec's header comment)")
            if status == TRIM_REFUSED and tail[0].startswith("trim: "):
                raise BuildError(
                    f"{spec.path}: {tail[0]} (base {base_ref}); fix: `unzip -l` the wheel that shipped it to see where "
                    f"its files are now, then correct or drop the trim entry")
            raise BuildError(f"{spec.path}: installing the wheels failed (exit {status}): {tail[0]}; fix: pin every dependency in 'wheels'")
        changes = [f"ENV PATH={spec.venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        changes += [f"ENV {k}={v}" for k, v in sorted(spec.env.items())]
        repo, t = tag.split(":")
        image = container.commit(repository=repo, tag=t, changes=changes)
    finally:
        container.remove(force=True)
    progress(f"wheels stage took {time.monotonic() - t0:.0f} s")
    return tag, {"image_id": image.id, "key": key}


def read_files(client, image: str, paths: list[str]) -> dict[str, bytes | None]:
    """The bytes of each absolute path inside image (None when absent), without starting it."""
    container = client.containers.create(image, command=["/bin/true"], network_mode="none")
    out = {}
    try:
        for p in paths:
            try:
                stream, _ = container.get_archive(p)
            except Exception:  # noqa: BLE001 - absent
                out[p] = None
                continue
            buf = io.BytesIO(b"".join(stream))
            with tarfile.open(fileobj=buf) as tf:
                member = tf.next()
                out[p] = tf.extractfile(member).read() if member and member.isfile() else None
    finally:
        container.remove(force=True)
    return out


# --- overlay -------------------------------------------------------------------------------------

@dataclass
class DeterministicTar:
    """Collects files and writes a byte-reproducible tar: sorted, root-owned, one mtime, parents included."""

    mtime: int
    files: dict  # path -> (bytes, mode)

    def add(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = path.lstrip("/")
        if path in self.files:
            raise BuildError(f"overlay: {path} added twice")
        self.files[path] = (data, mode)

    def write(self, out: Path) -> str:
        dirs = set()
        for p in self.files:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        entries = sorted([(d, None) for d in dirs] + [(p, v) for p, v in self.files.items()], key=lambda e: e[0])
        with open(out, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
                for path, value in entries:
                    info = tarfile.TarInfo(path)
                    info.mtime, info.uid, info.gid, info.uname, info.gname = self.mtime, 0, 0, "", ""
                    if value is None:
                        info.type, info.mode = tarfile.DIRTYPE, 0o755
                        tf.addfile(info)
                    else:
                        data, mode = value
                        info.size, info.mode = len(data), mode
                        tf.addfile(info, io.BytesIO(data))
        return sha256_file(out)


def baked(path: Path, root: Path) -> bool:
    """Whether the overlay takes this file of a tree under root: a regular file, not a cache, not
    hidden (nor under a hidden folder such as .pytest_cache), not a temporary."""
    parts = path.relative_to(root).parts
    return (path.is_file() and not any(part == "__pycache__" or part.startswith(".") for part in parts)
            and path.suffix not in (".pyc", ".pyo") and not path.name.endswith(".tmp"))


def tree_files(root: Path, prefix: str):
    """(image path, bytes, mode) for every file under root that ``baked`` takes."""
    for p in sorted(root.rglob("*")):
        if not baked(p, root):
            continue
        rel = p.relative_to(root).as_posix()
        yield f"{prefix}/{rel}", p.read_bytes(), 0o755 if os.access(p, os.X_OK) and p.suffix != ".py" else 0o644


def sparkcache_wheel(sde: int) -> tuple[Path, str, str]:
    """Build the sparkcache wheel from this checkout; return (file, sha256, version)."""
    out = CACHE / "sparkcache-wheel"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    progress("pip wheel --no-deps --no-build-isolation . (the sparkcache wheel)")
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(sde))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO_ROOT)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
    )
    wheels = list(out.glob("sparkcache-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise BuildError(f"building the sparkcache wheel failed: {(proc.stdout.strip().splitlines() or ['?'])[-1]}; fix: `pip wheel --no-deps --no-build-isolation .` must work in this checkout")
    version = wheels[0].name.split("-")[1]
    return wheels[0], sha256_file(wheels[0]), version


def add_wheel(tar: DeterministicTar, wheel: Path, site: str, venv: str) -> None:
    """Install a pure-Python wheel's files into the tar the way pip would (plus its console scripts)."""
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(zf.namelist())
        for n in names:
            if n.endswith("/"):
                continue
            tar.add(f"{site}/{n}", zf.read(n))
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        tar.add(f"{site}/{dist_info}/INSTALLER", b"sparkcache-build\n")
        ep = f"{dist_info}/entry_points.txt"
        if ep in names:
            section = None
            for line in zf.read(ep).decode().splitlines():
                line = line.strip()
                if line.startswith("["):
                    section = line.strip("[]")
                elif section == "console_scripts" and "=" in line:
                    name, target = (x.strip() for x in line.split("=", 1))
                    module, func = target.split(":")
                    script = (
                        f"#!{venv}/bin/python\nimport sys\nfrom {module} import {func}\n"
                        f"if __name__ == '__main__':\n    sys.exit({func}())\n"
                    )
                    tar.add(f"{venv}/bin/{name}", script.encode(), 0o755)
