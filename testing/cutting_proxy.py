"""A TCP proxy on 127.0.0.1 in front of a real HTTP server, that can end the server in the middle
of a response or of a request: what a client sees when its S3 server dies while it downloads or
uploads.

    proxy = CuttingProxy(("127.0.0.1", server_port)).start()
    proxy.url                                   # give the client this endpoint
    proxy.arm(b"GET ", b"/objects/", after_bytes=100_000, action=server.kill)
    proxy.arm(b"PUT ", b"/objects/", after_bytes=100_000, action=server.kill, request=True)

Every connection is forwarded byte for byte both ways. Armed, the first request whose request
line (``GET <path> HTTP/1.1``) starts with ``method`` and whose path holds ``path_part`` is cut
once ``after_bytes`` of its response (or, ``request=True``, of the request itself: line, headers
and body) have been forwarded: ``action`` runs (the test kills the server there), and both
connections are closed without the rest, as a dead server's would be. Once cut it forwards
again (a new connection to a dead server is refused: the proxy closes the client's).
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass
from typing import Callable

_REQUEST_LINE = re.compile(rb"^(?:GET|HEAD|PUT|POST|DELETE) \S+ HTTP/1\.[01]\r\n")
_CHUNK = 1 << 16


class CuttingProxy:
    """See the module docstring."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._armed: _Armed | None = None
        self.cut: list[str] = []  # the request lines whose request or response was cut
        self._closing = False

    def start(self) -> "CuttingProxy":
        threading.Thread(target=self._accept, name="cutting-proxy", daemon=True).start()
        return self

    def arm(self, method: bytes, path_part: bytes, after_bytes: int, action: Callable[[], None],
            request: bool = False) -> None:
        with self._lock:
            self._armed = _Armed(method, path_part, after_bytes, action, request)

    def _fire(self, line: bytes, sent: int, more: int, request: bool) -> _Armed | None:
        """The armed cut, taken (it fires once), when ``more`` bytes past ``sent`` of ``line``'s
        request (``request``) or response would pass its bound; else None."""
        with self._lock:
            armed = self._armed
            if armed is None or not armed.matches(line, request) or sent + more <= armed.after_bytes:
                return None
            self._armed = None
        self.cut.append(line.decode(errors="replace").strip())
        return armed

    def close(self) -> None:
        self._closing = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        line: list[bytes] = [b""]  # the last request line the client sent on this connection
        threading.Thread(target=self._pipe, args=(client, server, line, True), daemon=True).start()
        self._pipe(server, client, line, False)

    def _pipe(self, src: socket.socket, dst: socket.socket, line: list[bytes], request: bool) -> None:
        """One direction: client to server (``request``: notes each request's line) or server to
        client; cuts the armed request or response of that direction."""
        sent, counted = 0, b""  # bytes of ``counted``'s request (or response) forwarded so far
        try:
            while data := src.recv(_CHUNK):
                found = _REQUEST_LINE.match(data) if request else None
                if found:
                    line[0] = found.group(0)
                if line[0] is not counted:  # a new request (each line is its own bytes)
                    sent, counted = 0, line[0]
                armed = self._fire(counted, sent, len(data), request)
                if armed is not None:
                    dst.sendall(data[:max(0, armed.after_bytes - sent)])
                    armed.action()
                    return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            _shut(dst)
            _shut(src)


@dataclass(frozen=True)
class _Armed:
    method: bytes
    path_part: bytes
    after_bytes: int
    action: Callable[[], None]
    request: bool

    def matches(self, line: bytes, request: bool) -> bool:
        return request == self.request and line.startswith(self.method) and self.path_part in line


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


__all__ = ["CuttingProxy"]
