"""build and verify: resolve every input to a digest, build, check, push, write the receipt."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from images.builder import layers
from images.builder.dockerenv import (
    CACHE,
    REPO_ROOT,
    BuildError,
    check_stream,
    dump_json,
    engine,
    engine_versions,
    ensure_local_registry,
    progress,
    pull_by_digest,
    push,
    split_ref,
)
from images.builder.spec import Spec, load

RECEIPTS = CACHE / "receipts"
CONTRACTS_DIR = "/opt/sparkcache"


def git(*args: str, cwd: Path = REPO_ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


# What the image is made from in this checkout: the sparkcache wheel's sources, and the trees the
# overlay bakes in under CONTRACTS_DIR (the transforms with their lock, the contract suite and what
# it shares with the tests); the spec and the Dockerfile template are added by build().
BAKED_TREES = ("transforms", "contracts", "testing")
OVERLAY_SOURCES = ("sparkcache", *BAKED_TREES)
PROJECT_FILE = "pyproject.toml"
DOCKERFILE_TEMPLATE = REPO_ROOT / "images" / "Dockerfile.in"


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """Every file of the checkout at root that goes into an image: pyproject.toml and what
    ``layers.baked`` takes under OVERLAY_SOURCES (caches and dotfiles left out, as the overlay does)."""
    files = [p for p in (root / PROJECT_FILE,) if p.is_file()]
    for d in OVERLAY_SOURCES:
        files += [p for p in sorted((root / d).rglob("*")) if layers.baked(p, root / d)]
    return files


def worktree_state(root: Path = REPO_ROOT, extra: tuple[Path, ...] = ()) -> str:
    """One hash of HEAD and the bytes of every file an image is made from (``source_files`` plus
    ``extra``): a build compares it at its start and once the overlay is written."""
    h = hashlib.sha256((git("rev-parse", "HEAD", cwd=root) or "no git").encode())
    for p in [*source_files(root), *extra]:
        try:
            data = layers.sha256_file(p)
        except OSError:
            data = "<unreadable>"
        h.update(f"{p}\0{data}\0".encode())
    return h.hexdigest()


def revision_of(root: Path = REPO_ROOT) -> str:
    """HEAD, with ``-dirty`` when a tracked file differs from it or an image source is untracked;
    ``uncommitted`` outside git."""
    head = git("rev-parse", "HEAD", cwd=root)
    if head is None:
        return "uncommitted"
    tracked = set((git("ls-files", "-z", "--", PROJECT_FILE, *OVERLAY_SOURCES, cwd=root) or "").split("\0"))
    untracked = [p for p in source_files(root) if p.relative_to(root).as_posix() not in tracked]
    return head + "-dirty" if untracked or git("status", "--porcelain", "--untracked-files=no", cwd=root) else head


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set, else the commit time of HEAD, else 0 (documented in --help)."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        try:
            return int(os.environ["SOURCE_DATE_EPOCH"])
        except ValueError:
            raise BuildError(f"SOURCE_DATE_EPOCH={os.environ['SOURCE_DATE_EPOCH']!r} is not an integer; fix: seconds since 1970, e.g. $(git log -1 --format=%ct)") from None
    ct = git("log", "-1", "--format=%ct")
    return int(ct) if ct else 0


def parse_registry(value: str | None, spec: Spec) -> str:
    """--registry HOST:PORT/REPO -> the repository to push to; none: the local registry's."""
    if value is None:
        host = ensure_local_registry()
        return f"{host}/{spec.repository}"
    if "/" not in value or ":" not in value.split("/")[0] or value.endswith("/"):
        raise BuildError(f"--registry {value!r}: expected HOST:PORT/REPO, e.g. 127.0.0.1:5050/sparkcache/{spec.name}; fix: name the host, its port and the repository")
    if "@" in value or ":" in value.split("/", 1)[1]:
        raise BuildError(f"--registry {value!r}: name a repository, not a tag or digest; fix: drop the ':TAG' / '@sha256:...'")
    return value


def lock_info():
    from transforms import engine as tengine

    lock = tengine.load_lock()
    return lock, tengine.LOCK_PATH if hasattr(tengine, "LOCK_PATH") else REPO_ROOT / "transforms" / f"vllm-{lock.vllm_version}.lock.json"


def record_scenarios(lock) -> dict:
    """What the scheduler scenarios (testing/scenarios) give both ways on the host's transformed tree,
    as the image's contract suite compares them: ``python -m testing.scenarios record`` in its own
    interpreter (the builder imports nothing of testing/), cached by the lock and the sources it runs:
    testing/, the tree builder, and what the transformed scheduler imports when a scenario sets an
    option (sparkcache/hooks, the settings table that parses the options)."""
    from transforms import trees

    sources = {p.relative_to(REPO_ROOT).as_posix(): layers.sha256_file(p)
               for p in [*sorted((REPO_ROOT / "testing").rglob("*.py")), REPO_ROOT / "transforms" / "trees.py",
                         *sorted((REPO_ROOT / "sparkcache" / "hooks").glob("*.py")),
                         REPO_ROOT / "sparkcache" / "settings.py"]
               if layers.baked(p, REPO_ROOT)}
    key = layers.short_key({"lock": lock.sha256, "sources": sources})
    out = CACHE / "scenarios" / f"{key}.json"
    if out.exists():
        return json.loads(out.read_text())
    progress("recording the scheduler scenarios (testing/scenarios) on the host's transformed tree (once per lock and sources)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tree = trees.build_transformed_tree(Path(tmp) / "site")
        recorded = Path(tmp) / "scenarios.json"
        proc = subprocess.run(
            [sys.executable, "-m", "testing.scenarios", "record", str(tree), str(recorded)],
            cwd=REPO_ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise BuildError(f"testing/scenarios failed on the host's transformed tree: {last}")
        results = json.loads(recorded.read_text())
    progress(f"scenarios {', '.join(results)} recorded in {time.monotonic() - t0:.0f} s")
    dump_json(out, results)
    return results


def upstream_tests(lock):
    """(image path, bytes, mode) of upstream's tests from the lock's sdist, ready to run (contracts/test_upstream.py)."""
    from contracts.upstream import scratch_copy
    from transforms.sdist import fetch

    sdist = fetch(CACHE / "sdist")  # verified against the lock's sha256 (already there after `make test`)
    with tempfile.TemporaryDirectory(prefix="upstream-", dir=CACHE) as tmp:
        scratch = scratch_copy(sdist, Path(tmp) / "upstream")
        files = list(layers.tree_files(scratch, f"{CONTRACTS_DIR}/upstream"))
    progress(f"upstream tests from {lock.sdist['filename']}: {len(files)} files baked under {CONTRACTS_DIR}/upstream")
    return files


def transformed_files(client, wheels_tag: str, spec: Spec, lock) -> tuple[dict, dict]:
    """Check the installed targets against the lock's preimages, transform them with the engine.

    Returns ({relpath: transformed bytes}, the engine's manifest).
    """
    site = spec.site_packages
    targets = [f"{site}/{f.path}" for f in lock.files]
    found = layers.read_files(client, wheels_tag, targets)
    for f in lock.files:
        data = found[f"{site}/{f.path}"]
        if data is None:
            raise BuildError(f"{spec.path}: the base has no {site}/{f.path}; fix: the wheels must install vLLM {lock.vllm_version} into {spec.venv}")
        got = layers.hashlib.sha256(data).hexdigest()
        if got != f.preimage_sha256:
            raise BuildError(
                f"{site}/{f.path} in the base has sha256 {got}, the lock's preimage is {f.preimage_sha256}; "
                f"fix: the base must carry pristine vLLM {lock.vllm_version} ({spec.vllm_distribution}=={spec.vllm_version}), not a patched or other version"
            )
    progress(f"preimages verified: {len(lock.files)} vLLM target files in the base match the lock")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        for f in lock.files:
            p = tree / f.path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(found[f"{site}/{f.path}"])
        manifest_path = Path(tmp) / "manifest.json"
        proc = subprocess.run(
            [sys.executable, "-m", "transforms", "apply", "--tree", str(tree), "--manifest", str(manifest_path)],
            cwd=REPO_ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        )
        if proc.returncode != 0:
            raise BuildError(f"python -m transforms apply failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        manifest = json.loads(manifest_path.read_text())
        out = {}
        for f in lock.files:
            data = (tree / f.path).read_bytes()
            got = layers.hashlib.sha256(data).hexdigest()
            if got != f.postimage_sha256:
                raise BuildError(f"{f.path}: transformed sha256 {got}, the lock's postimage is {f.postimage_sha256}; fix: regenerate the lock (`python -m transforms lock`)")
            out[f.path] = data
    return out, manifest


def labels_for(spec: Spec, base: dict, lock, sc_version: str, sde: int, revision: str) -> dict:
    source = git("remote", "get-url", "origin") or "https://github.com/sparkcache/sparkcache"
    labels = {
        "org.opencontainers.image.source": source,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.version": sc_version,
        "org.opencontainers.image.created": dt.datetime.fromtimestamp(sde, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "org.opencontainers.image.base.name": base["name"],
        "org.opencontainers.image.base.digest": base["digest"],
        "io.sparkcache.vllm.version": spec.vllm_version,
        "io.sparkcache.transform-lock.sha256": lock.sha256,
        "io.sparkcache.version": sc_version,
        "io.sparkcache.spec": spec.name,
    }
    labels.update(spec.labels)
    return labels


def render_dockerfile(wheels_tag: str, spec: Spec, labels: dict) -> str:
    template = DOCKERFILE_TEMPLATE.read_text()
    env = {"PATH": f"{spec.venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **spec.env}
    env_lines = "\n".join(f"ENV {k}={json.dumps(v)}" for k, v in env.items())
    label_lines = "LABEL " + " \\\n      ".join(f"{json.dumps(k)}={json.dumps(v)}" for k, v in sorted(labels.items()))
    return template.format(wheels_image=wheels_tag, env_lines=env_lines, label_lines=label_lines)


def context_tar(dockerfile: str, overlay: Path) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
        tf.add(overlay, arcname="overlay.tar")
    buf.seek(0)
    return buf


def plan(spec: Spec, registry: str | None) -> dict:
    """What a build would use, every input by digest where one is known without building."""
    lock, lock_path = lock_info()
    wheelhouse = CACHE / "wheelhouse"
    have = {layers.sha256_file(p) for p in wheelhouse.glob("*.whl")} if wheelhouse.exists() else set()
    base = {"image": spec.base_image} if spec.base_image else {"debootstrap": spec.debootstrap.key()}
    return {
        "spec": str(spec.path),
        "repository": registry or f"127.0.0.1:<local registry>/{spec.repository}",
        "base": base,
        "python": {"interpreter": spec.python, "version": spec.python_version, "site_packages": spec.site_packages, "check": spec.python_check()},
        "wheels": [{"pin": w.pin, "sha256": w.sha256, "in_wheelhouse": w.sha256 in have} for w in spec.wheels],
        "trim": [{"path": t.path, "why": t.why} for t in spec.trim],
        "transform_lock": {"path": str(lock_path.relative_to(REPO_ROOT)), "sha256": lock.sha256, "order": list(lock.transform_order)},
        "files": [{"file": f.path, "pre": f.preimage_sha256, "post": f.postimage_sha256} for f in lock.files],
        "stages": ["base", "wheels (no network, --no-index --require-hashes)", "preimage check", "transform", "overlay (deterministic tar)", "postimage check", "push", "receipt"],
    }


def _timed(fn, *args):
    """(fn(*args), the seconds it took, for the receipt's stage timings)."""
    t = time.monotonic()
    return fn(*args), round(time.monotonic() - t, 1)


def build(spec_path: Path, registry_arg: str | None, dry_run: bool = False, no_cache: bool = False, receipt_path: Path | None = None) -> str:
    t_start = time.monotonic()
    started = dt.datetime.now(dt.timezone.utc)
    timings = {}
    read_from_checkout = (Path(spec_path), DOCKERFILE_TEMPLATE)
    inputs_at_start = worktree_state(extra=read_from_checkout)
    spec = load(spec_path)
    spec_sha256 = layers.sha256_file(spec.path)  # the bytes this build read (the receipt names them)
    if dry_run:
        print(json.dumps(plan(spec, registry_arg), indent=2))
        return ""
    client = engine()
    registry = parse_registry(registry_arg, spec)
    lock, lock_path = lock_info()
    sde = source_date_epoch()
    revision = revision_of()

    (base_ref, base), timings["base_s"] = _timed(layers.resolve_base, client, spec, registry)
    (stage, wheels), timings["wheelhouse_s"] = _timed(layers.resolve_wheels, spec)
    (wheels_tag, wheels_info), timings["wheels_stage_s"] = _timed(layers.wheels_image, client, spec, base_ref, stage)
    files, manifest = transformed_files(client, wheels_tag, spec, lock)
    scenarios = record_scenarios(lock)
    sc_wheel, sc_wheel_sha, sc_version = layers.sparkcache_wheel(sde)

    # The overlay: only inputs that are the same for the same sources (no times, no host paths).
    t = time.monotonic()
    tar = layers.DeterministicTar(sde, {})
    site = spec.site_packages
    for relpath, data in sorted(files.items()):
        tar.add(f"{site}/{relpath}", data)
    layers.add_wheel(tar, sc_wheel, site, spec.venv)
    for tree in BAKED_TREES:
        for path, data, mode in layers.tree_files(REPO_ROOT / tree, f"{CONTRACTS_DIR}/{tree}"):
            tar.add(path, data, mode)
    for path, data, mode in upstream_tests(lock):
        tar.add(path, data, mode)
    build_inputs = {
        "spec": spec.name,
        "vllm_version": spec.vllm_version,
        "site_packages": site,
        "python": spec.python,
        "base": {"name": base["name"], "digest": base["digest"]},
        "wheels": [{"name": w["name"], "version": w["version"], "sha256": w["sha256"]} for w in wheels],
        "trim": [t.path for t in spec.trim],
        "sparkcache": {"version": sc_version},
        "transform_lock_sha256": lock.sha256,
        "files": manifest["files"],
        "source_date_epoch": sde,
        "revision": revision,
    }
    tar.add(f"{CONTRACTS_DIR}/build-inputs.json", (json.dumps(build_inputs, indent=2, sort_keys=True) + "\n").encode())
    tar.add(f"{CONTRACTS_DIR}/expected/scenarios.json", (json.dumps(scenarios, indent=2, sort_keys=True) + "\n").encode())
    work = CACHE / "overlay" / spec.name
    work.mkdir(parents=True, exist_ok=True)
    overlay_tar = work / "overlay.tar"
    overlay_sha = tar.write(overlay_tar)
    progress(f"overlay tar {overlay_sha[:16]} ({overlay_tar.stat().st_size // 1024} KiB, {len(tar.files)} files)")

    labels = labels_for(spec, base, lock, sc_version, sde, revision)
    dockerfile = render_dockerfile(wheels_tag, spec, labels)
    if worktree_state(extra=read_from_checkout) != inputs_at_start:
        raise BuildError(
            f"the checkout changed while the build read it ({PROJECT_FILE}, {', '.join(d + '/' for d in OVERLAY_SOURCES)}, "
            f"the spec, the Dockerfile template or HEAD): the image would carry "
            f"files that its revision label ({revision}) and receipt do not name; fix: build again once the edits are done "
            f"(or from a clean clone)")
    progress(f"docker build (network none{', no cache' if no_cache else ''})")
    result = {}

    def on_line(item):
        if "stream" in item and item["stream"].strip():
            sys.stderr.write("  | " + item["stream"])
        if "aux" in item and "ID" in item["aux"]:
            result["id"] = item["aux"]["ID"]

    check_stream(
        client.api.build(fileobj=context_tar(dockerfile, overlay_tar), custom_context=True, network_mode="none",
                         rm=True, forcerm=True, nocache=no_cache, pull=False, decode=True),
        f"docker build of {spec.path}", on_line,
    )
    if "id" not in result:
        raise BuildError(f"docker build of {spec.path} reported no image id")
    image = client.images.get(result["id"])
    timings["overlay_build_s"] = round(time.monotonic() - t, 1)

    # Postimages, read back from the built image.
    back = layers.read_files(client, image.id, [f"{site}/{f.path}" for f in lock.files])
    for f in lock.files:
        data = back[f"{site}/{f.path}"]
        got = layers.hashlib.sha256(data).hexdigest() if data is not None else "nothing"
        if got != f.postimage_sha256:
            raise BuildError(f"{site}/{f.path} in the built image has sha256 {got}, the lock's postimage is {f.postimage_sha256}; fix: rebuild with --no-cache")
    progress(f"postimages verified: {len(lock.files)} transformed files in the image match the lock")

    tag = f"{spec.vllm_version}-{image.id.split(':')[1][:12]}"
    image.tag(registry, tag)
    digest, timings["push_s"] = _timed(push, client, registry, tag)
    ref = f"{registry}@{digest}"
    image.reload()
    rootfs = image.attrs["RootFS"]["Layers"]
    size = image.attrs.get("Size")

    receipt = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": registry, "digest": {"sha256": digest.split(":")[1]}, "tag": tag}],
        "predicateType": "https://slsa.dev/provenance/v1",
        "predicate": {
            "buildDefinition": {
                "buildType": "https://github.com/sparkcache/sparkcache/build.py@v1",
                "externalParameters": {"spec": str(spec.path.relative_to(REPO_ROOT)) if spec.path.is_absolute() and REPO_ROOT in spec.path.parents else str(spec.path),
                                       "spec_sha256": spec_sha256, "registry": registry, "source_date_epoch": sde},
                "resolvedDependencies": [
                    {"name": "base", "uri": f"{base['name']}@{base['digest']}", "digest": {"sha256": base["digest"].split(":")[1]},
                     **({"rootfs": {"file": base["rootfs_tar"], "sha256": base["rootfs_sha256"], "debootstrap": base["debootstrap"]}} if "rootfs_sha256" in base else {})},
                    *({"name": f"wheel:{w['name']}", "uri": f"pypi:{w['name']}=={w['version']}", "file": w["file"], "digest": {"sha256": w["sha256"]}} for w in wheels),
                    {"name": "sparkcache-wheel", "uri": f"file:{sc_wheel.name}", "version": sc_version, "digest": {"sha256": sc_wheel_sha}},
                    {"name": "transform-lock", "uri": str(lock_path.relative_to(REPO_ROOT)), "digest": {"sha256": lock.sha256}},
                    {"name": "vllm-sdist", "uri": lock.sdist["url"], "file": lock.sdist["filename"], "digest": {"sha256": lock.sdist["sha256"]}},
                    {"name": "source", "uri": labels["org.opencontainers.image.source"], "digest": {"gitCommit": revision}},
                ],
                "files": [{"file": f["file"], "pre": f["pre"], "post": f["post"], "transforms": f["transforms"]} for f in manifest["files"]],
            },
            "runDetails": {
                "builder": {"id": "build.py", "version": {**engine_versions(client), "python": platform.python_version(), "transforms_lock": lock.sha256}},
                "metadata": {"startedOn": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "finishedOn": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                             "timings": {**timings, "total_s": round(time.monotonic() - t_start, 1)}},
                "byproducts": [
                    {"name": "image-config", "digest": {"sha256": image.id.split(":")[1]}},
                    {"name": "overlay-layer", "diff_id": rootfs[-1], "tar_sha256": overlay_sha},
                    {"name": "layers", "diff_ids": rootfs},
                    {"name": "wheels-stage", "image": wheels_tag},
                    {"name": "size", "bytes": size},
                ],
            },
        },
        "labels": labels,
    }
    out = receipt_path or RECEIPTS / f"{spec.name}-{digest.split(':')[1]}.json"
    dump_json(out, receipt)
    if receipt_path:
        dump_json(RECEIPTS / f"{spec.name}-{digest.split(':')[1]}.json", receipt)
    progress(f"receipt {out}; image {size / 1e9:.2f} GB; total {time.monotonic() - t_start:.0f} s")
    return ref


def find_receipt(digest: str) -> Path | None:
    hits = sorted(RECEIPTS.glob(f"*-{digest.split(':')[1]}.json"))
    return hits[0] if hits else None


def verify(ref: str, receipt_path: Path | None = None, pytest_args: list[str] | None = None, upstream: str = "image") -> int:
    repo, digest = split_ref(ref)
    receipt_path = receipt_path or find_receipt(digest)
    if receipt_path is None or not Path(receipt_path).exists():
        raise BuildError(f"no build receipt for {digest} under {RECEIPTS}; fix: pass --receipt PATH (build.py writes one per build)")
    client = engine()
    t = time.monotonic()
    progress(f"pulling {ref}")
    image = pull_by_digest(client, ref)
    progress(f"pulled in {time.monotonic() - t:.1f} s")
    with tempfile.TemporaryDirectory(prefix="sparkcache-verify-") as tmp:
        os.chmod(tmp, 0o755)
        Path(tmp, "labels.json").write_text(json.dumps(image.attrs["Config"].get("Labels") or {}, indent=2))
        Path(tmp, "receipt.json").write_text(Path(receipt_path).read_text())
        Path(tmp, "image.json").write_text(json.dumps({"ref": ref, "digest": digest, "diff_ids": image.attrs["RootFS"]["Layers"], "image_id": image.id}))
        cmd = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{CONTRACTS_DIR}/contracts", *(pytest_args or [])]
        progress(f"running the contract suite in {ref} (network none)")
        t = time.monotonic()
        # vLLM's engine core allocates its shared-memory ring in /dev/shm (Docker's default is 64 MiB)
        container = client.containers.create(ref, command=cmd, network_mode="none", working_dir=CONTRACTS_DIR, shm_size="2g",
                                             volumes={tmp: {"bind": "/verify", "mode": "ro"}}, environment={"SPARKCACHE_VERIFY_DIR": "/verify", "SPARKCACHE_UPSTREAM_SCOPE": upstream})
        try:
            container.start()
            for chunk in container.logs(stream=True, follow=True):
                sys.stderr.write(chunk.decode(errors="replace"))
            status = container.wait()["StatusCode"]
        finally:
            container.remove(force=True)
    progress(f"contract suite exited {status} after {time.monotonic() - t:.0f} s")
    return status
