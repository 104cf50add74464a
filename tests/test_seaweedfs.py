"""The S3 server the tests start (testing/seaweedfs.py) is what it says: on 127.0.0.1 only, every
port chosen, logs and sockets under its directory, ready only once it stores and serves an object,
the same server again after a SIGKILL, and a missing binary or a server that cannot start is an
error that says what to do."""

from __future__ import annotations

import os
import socket

import obstore
import psutil
import pytest

from testing.cutting_proxy import CuttingProxy
from testing.seaweedfs import LOOPBACK, SeaweedError, SeaweedFS, weed_binary


def test_it_listens_on_loopback_only_on_the_ports_it_chose(seaweedfs):
    listening = [c.laddr for c in psutil.Process(seaweedfs.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and {a.ip for a in listening} == {LOOPBACK}, listening
    assert {a.port for a in listening} <= set(seaweedfs.ports.values()), (listening, seaweedfs.ports)
    assert seaweedfs.endpoint.url == f"http://{LOOPBACK}:{seaweedfs.ports['s3']}"


def test_its_logs_sockets_and_identity_lie_under_its_directory(seaweedfs):
    command = " ".join(seaweedfs.command())
    for flag in ("-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
                 "-s3.port.lance=0", f"-ip.bind={LOOPBACK}"):
        assert flag in command
    assert (seaweedfs.dir / "s3.sock").exists() and seaweedfs.log_file.stat().st_size > 0
    assert any(seaweedfs.log_dir.iterdir())
    assert (seaweedfs.dir / "s3.json").stat().st_mode & 0o077 == 0  # the run's secret is the owner's only
    assert seaweedfs.endpoint.secret_key not in repr(seaweedfs.endpoint)
    assert seaweedfs.endpoint.access_key not in repr(seaweedfs.endpoint)


def _leave_a_socket(path: str) -> None:
    """A unix socket file at ``path`` whose server is gone, as a SIGKILLed weed leaves."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)


def _weed_sockets_left(server: SeaweedFS) -> list[str]:
    """The gRPC sockets weed makes in /tmp, named by its service and port, that are still there."""
    return [p for p in server.grpc_sockets() if os.path.lexists(p)]


def test_after_a_sigkill_the_same_server_comes_back_with_its_objects(tmp_path):
    server = SeaweedFS(tmp_path / "s")
    # what another life left in /tmp: a socket named by one of our ports but another service (not
    # ours, so it stays), and one named as weed names ours (weed binds over it; stopping removes it)
    foreign = f"/tmp/seaweedfs-elsewhere-grpc-{server.ports['s3']}.sock"
    stale = server.grpc_sockets()[0]
    for path in (foreign, stale):
        _leave_a_socket(path)
    try:
        with server:
            store = server.raw_store()
            obstore.put(store, "kept", b"before the kill", use_multipart=False)
            url = server.endpoint.url
            server.kill()
            assert not server.running()
            with pytest.raises(Exception):
                obstore.get(store, "kept")
            server.start()  # ready: a PUT and a GET of a probe went through
            assert server.endpoint.url == url and server.starts == 2
            assert bytes(obstore.get(store, "kept").bytes()) == b"before the kill"
            obstore.put(store, "after", b"written after the restart", use_multipart=False)
            server.kill()  # as a failing test leaves it: stopping it then still cleans up
        assert _weed_sockets_left(server) == [] and os.path.lexists(foreign)
    finally:
        os.unlink(foreign)


def test_the_cutting_proxy_kills_the_server_mid_response_and_mid_request(tmp_path):
    """testing/cutting_proxy.py: unarmed it forwards; armed on an object's GET, the client gets
    part of the response and an error, and the server is dead; armed on a PUT's body, the PUT
    fails, the server is dead, and after a restart the object is not there."""
    with SeaweedFS(tmp_path / "s") as server:
        proxy = CuttingProxy((LOOPBACK, server.ports["s3"])).start()
        try:
            via = server.raw_store(timeout_s=5.0, retries=2, url=proxy.url)
            body = bytes(range(256)) * 2048  # 512 KiB
            obstore.put(via, "objects/whole", body, use_multipart=False)
            assert bytes(obstore.get(via, "objects/whole").bytes()) == body and proxy.cut == []

            proxy.arm(b"GET ", b"/objects/", after_bytes=100_000, action=server.kill)
            with pytest.raises(Exception):
                obstore.get(via, "objects/whole").bytes()
            assert not server.running() and len(proxy.cut) == 1 and proxy.cut[0].startswith("GET ")
            server.start()

            proxy.arm(b"PUT ", b"/objects/", after_bytes=100_000, action=server.kill, request=True)
            with pytest.raises(Exception):
                obstore.put(via, "objects/cut", body, use_multipart=False)
            assert not server.running() and len(proxy.cut) == 2 and proxy.cut[1].startswith("PUT ")
            server.start()
            with pytest.raises(FileNotFoundError):
                obstore.head(server.raw_store(), "objects/cut")
            assert bytes(obstore.get(via, "objects/whole").bytes()) == body  # forwarding again
        finally:
            proxy.close()


def test_a_missing_binary_says_how_to_install_it(tmp_path):
    with pytest.raises(SeaweedError) as caught:
        weed_binary(venv_bin=tmp_path, path=str(tmp_path))
    assert "make test" in str(caught.value) and "requirements/test-s3.txt" in str(caught.value)


def test_a_server_that_cannot_start_names_its_log(tmp_path):
    server = SeaweedFS(tmp_path / "s", ready_deadline_s=20)
    with socket.socket() as taken:  # its S3 port, taken by another
        taken.bind((LOOPBACK, server.ports["s3"]))
        taken.listen()
        with pytest.raises(SeaweedError) as caught:
            server.start()
    assert str(server.log_file) in str(caught.value) and "log tail" in str(caught.value)
    assert not server.running() and _weed_sockets_left(server) == []
