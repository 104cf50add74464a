"""The Docker Engine and the local OCI registry the builder talks to.

Every container runs with network_mode="none"; the registry listens on 127.0.0.1 only.
Errors are BuildError with one line: what failed, the value, the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SPARKCACHE_BUILD_CACHE", REPO_ROOT / ".cache"))
DEFAULT_REGISTRY_PORT = int(os.environ.get("SPARKCACHE_REGISTRY_PORT", "5050"))
MANIFEST_ACCEPT = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.index.v1+json",
    ]
)


class BuildError(Exception):
    """A build or verify step refused: one line naming the thing, the value and the fix."""


def progress(msg: str) -> None:
    print(f"build: {msg}", file=sys.stderr, flush=True)


def engine(setup: bool = True):
    """A docker client whose engine answers; on Debian as root, set one up when none answers."""
    import docker

    def ping():
        client = docker.from_env(timeout=600)
        client.ping()
        return client

    try:
        return ping()
    except Exception as first:  # noqa: BLE001 - any failure to reach the engine
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        if not setup or "DOCKER_HOST" in os.environ:
            raise BuildError(
                f"no Docker Engine answers at {host} ({type(first).__name__}); fix: start one "
                "(`bash images/setup-docker.sh` on Debian as root: dockerd --bridge=none --iptables=false --ip-masq=false) or point DOCKER_HOST at one"
            ) from None
        progress(f"no Docker Engine answers at {host}; running images/setup-docker.sh")
        env = dict(os.environ, PYTHON=sys.executable)
        proc = subprocess.run(["bash", str(REPO_ROOT / "images" / "setup-docker.sh")], env=env)
        if proc.returncode != 0:
            raise BuildError(f"no Docker Engine answers at {host} and images/setup-docker.sh exited {proc.returncode}; fix: see its message above") from None
        return ping()


def check_stream(lines, what: str, on_line=None) -> list[dict]:
    """Consume a decoded Docker stream; raise on any error in it (the SDK does not)."""
    seen = []
    for item in lines:
        if not isinstance(item, dict):
            continue
        seen.append(item)
        if "error" in item or "errorDetail" in item:
            detail = item.get("error") or item.get("errorDetail", {}).get("message")
            raise BuildError(f"{what} failed: {str(detail).strip().splitlines()[0] if detail else item}")
        if on_line:
            on_line(item)
    return seen


# --- the local registry ------------------------------------------------------------------------

def registry_api(host: str, path: str, method: str = "GET", accept: str | None = None, timeout: float = 10):
    """A request to a registry's HTTP API. Only loopback registries are spoken to directly."""
    hostname = host.split(":")[0]
    if hostname not in ("127.0.0.1", "localhost"):
        raise BuildError(f"registry {host}: the builder queries only loopback registries over its API; fix: use 127.0.0.1:PORT")
    req = urllib.request.Request(f"http://{host}{path}", method=method)
    if accept:
        req.add_header("Accept", accept)
    return urllib.request.urlopen(req, timeout=timeout)


def registry_answers(host: str) -> bool:
    try:
        with registry_api(host, "/v2/", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def ensure_local_registry(port: int = DEFAULT_REGISTRY_PORT) -> str:
    """Start Debian's docker-registry on 127.0.0.1:port (storage under .cache/registry) unless one answers.

    It is started detached and left running, so that a reference printed by a build can be pulled later.
    """
    host = f"127.0.0.1:{port}"
    if registry_answers(host):
        return host
    exe = shutil.which("docker-registry")
    if exe is None:
        raise BuildError("docker-registry is not installed; fix: `bash images/setup-docker.sh` (Debian: apt-get install docker-registry), or pass --registry HOST:PORT/REPO")
    root = CACHE / "registry"
    (root / "data").mkdir(parents=True, exist_ok=True)
    config = root / f"config-{port}.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {host}\n"
    )
    log = open(root / f"registry-{port}.log", "ab")
    progress(f"starting the local registry: docker-registry serve {config} (listening on {host})")
    proc = subprocess.Popen([exe, "serve", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    (root / f"registry-{port}.pid").write_text(str(proc.pid))
    for _ in range(100):
        if registry_answers(host):
            return host
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise BuildError(f"the local registry on {host} did not start; fix: see {root / f'registry-{port}.log'} (is the port taken? set SPARKCACHE_REGISTRY_PORT)")


def stop_local_registry(port: int = DEFAULT_REGISTRY_PORT) -> None:
    pidfile = CACHE / "registry" / f"registry-{port}.pid"
    if pidfile.exists():
        pid = int(pidfile.read_text())
        try:
            os.kill(pid, 15)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
        except ProcessLookupError:
            pass
        pidfile.unlink(missing_ok=True)


def registry_manifest_digest(repository: str, reference: str) -> str | None:
    """The digest the registry serves for REPOSITORY (HOST:PORT/NAME) at a tag or digest; None when absent."""
    host, name = repository.split("/", 1)
    try:
        with registry_api(host, f"/v2/{name}/manifests/{reference}", method="HEAD", accept=MANIFEST_ACCEPT) as resp:
            return resp.headers.get("Docker-Content-Digest")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise BuildError(f"registry {host}: HEAD /v2/{name}/manifests/{reference} answered {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BuildError(f"registry {host} does not answer ({exc}); fix: start it (build.py starts the local one when no --registry is given)") from None


def split_ref(ref: str) -> tuple[str, str]:
    """'HOST:PORT/REPO@sha256:HEX' -> (repository, digest)."""
    if "@" not in ref:
        raise BuildError(f"{ref!r} is not a reference by digest; fix: give REGISTRY/REPO@sha256:<64 hex> (what `make image` prints)")
    repo, digest = ref.split("@", 1)
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise BuildError(f"{ref!r}: digest {digest!r} is not sha256:<64 hex>; fix: copy the reference `make image` printed")
    return repo, digest


def push(client, repository: str, tag: str) -> str:
    """Push REPOSITORY:TAG; fail on any error in the push stream; return the manifest digest."""
    pushed = {"n": 0}

    def on_line(item):
        status = item.get("status", "")
        if status in ("Pushed", "Layer already exists", "Mounted from"):
            pushed["n"] += 1
            progress(f"push {repository}:{tag}: layer {item.get('id', '?')} {status.lower()}")

    try:
        stream = client.api.push(repository, tag=tag, stream=True, decode=True)
        items = check_stream(stream, f"push of {repository}:{tag}", on_line)
    except BuildError:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine refused before streaming
        raise BuildError(f"push of {repository}:{tag} failed: {str(exc).splitlines()[0]}") from None
    digest = None
    for item in items:
        aux = item.get("aux") or {}
        if aux.get("Digest"):
            digest = aux["Digest"]
    if digest is None:
        raise BuildError(f"push of {repository}:{tag} ended without a manifest digest; fix: check the registry's log")
    served = registry_manifest_digest(repository, tag) if repository.split("/")[0].split(":")[0] in ("127.0.0.1", "localhost") else digest
    if served != digest:
        raise BuildError(f"push of {repository}:{tag}: the engine reported {digest} but the registry serves {served}")
    return digest


def pull_by_digest(client, ref: str):
    repo, digest = split_ref(ref)
    try:
        check_stream(client.api.pull(repo, tag=digest, stream=True, decode=True), f"pull of {ref}")
    except BuildError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise BuildError(f"pull of {ref} failed: {str(exc).splitlines()[0]}") from None
    image = client.images.get(ref)
    if ref not in image.attrs.get("RepoDigests", []):
        raise BuildError(f"pull of {ref}: the engine's image does not carry that digest (has {image.attrs.get('RepoDigests')})")
    return image


def engine_versions(client) -> dict:
    import docker

    v = client.version()
    return {"docker_engine": v.get("Version"), "docker_api": v.get("ApiVersion"), "docker_sdk": docker.__version__}


def dump_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
