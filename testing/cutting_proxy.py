"""A TCP proxy on 127.0.0.1 in front of a real HTTP server, that can end the server in the middle
of a response: what a client sees when its S3 server dies while it downloads.

    proxy = CuttingProxy(("127.0.0.1", server_port)).start()
    proxy.url                                   # give the client this endpoint
    proxy.arm(b"/objects/", after_bytes=100_000, action=server.kill)

Every connection is forwarded byte for byte both ways. Armed, the first response to a request
whose request line (``GET <path> HTTP/1.1``) holds ``match`` is cut once ``after_bytes`` of it
(headers and body) have gone to the client: ``action`` runs (the test kills the server there),
and the client's connection is closed without the rest, as a dead server's would be. Once cut it
forwards again (a new connection to a dead server is refused: the proxy closes the client's).
"""

from __future__ import annotations

import re
import socket
import threading
from typing import Callable

_REQUEST_LINE = re.compile(rb"^(?:GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01]\r\n")
_CHUNK = 1 << 16


class CuttingProxy:
    """See the module docstring."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._armed: tuple[bytes, int, Callable[[], None]] | None = None
        self.cut: list[str] = []  # the paths whose responses were cut
        self._closing = False

    def start(self) -> "CuttingProxy":
        threading.Thread(target=self._accept, name="cutting-proxy", daemon=True).start()
        return self

    def arm(self, match: bytes, after_bytes: int, action: Callable[[], None]) -> None:
        with self._lock:
            self._armed = (match, after_bytes, action)

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
        path: list[bytes] = [b""]  # the last request line's path the client sent on this connection
        threading.Thread(target=self._upstream, args=(client, server, path), daemon=True).start()
        self._downstream(server, client, path)

    def _upstream(self, client: socket.socket, server: socket.socket, path: list[bytes]) -> None:
        """Client to server; notes each request's path."""
        try:
            while data := client.recv(_CHUNK):
                found = _REQUEST_LINE.match(data)
                if found:
                    path[0] = found.group(1)
                server.sendall(data)
        except OSError:
            pass
        finally:
            _shut(server)

    def _downstream(self, server: socket.socket, client: socket.socket, path: list[bytes]) -> None:
        """Server to client; cuts the armed response."""
        sent, sent_path = 0, b""
        try:
            while data := server.recv(_CHUNK):
                if path[0] != sent_path:
                    sent, sent_path = 0, path[0]
                with self._lock:
                    armed = self._armed
                if armed is not None and armed[0] in sent_path and sent + len(data) > armed[1]:
                    with self._lock:
                        if self._armed is not armed:
                            armed = None
                        self._armed = None
                    if armed is not None:
                        client.sendall(data[:max(0, armed[1] - sent)])
                        self.cut.append(sent_path.decode(errors="replace"))
                        armed[2]()
                        return
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            _shut(client)
            _shut(server)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


__all__ = ["CuttingProxy"]
