"""A small TCP proxy for tests: forwards to Redis, and can drop every open connection on demand."""

from __future__ import annotations

import contextlib
import socket
import threading


class DropProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.drops = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self.lock:
                self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def drop_all(self) -> None:
        """Reset every open connection, as a flaky network or a restarted load balancer would."""
        with self.lock:
            conns, self.conns = self.conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
        self.drops += 1

    def close(self) -> None:
        self.server.close()
        self.drop_all()
