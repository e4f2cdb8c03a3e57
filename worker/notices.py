"""Delivering completion notices: a finished batch that asked for an HTTP POST gets one, from a worker,
with retries and backoff, and only to a URL the worker's allowlist admits (a producer cannot make the GPU
box call an arbitrary address)."""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
import redis.exceptions
from redis import Redis
from redis.exceptions import RedisError

from shared.keys import Keys
from shared.quarantine import Quarantine, clear_the_way
from shared.store import read_batch

log = logging.getLogger("kevlaya.worker")

POST_TIMEOUT_S = 10.0  # one try, all of it: a receiver trickling its answer gets no more
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)  # after the first try: five tries over ~15 s


def allowed(url: str, allow: Sequence[str]) -> bool:
    """Scheme, host and port equal to an allowed URL's, and its path under that URL's path: a bare string
    prefix would admit `https://hooks.example.com.evil.net/` or `https://hooks.example.com@evil.net/`."""
    try:
        got = urlsplit(url)
        got_port = got.port
    except ValueError:
        return False
    if got.username or got.password:
        return False
    # `/hooks/../admin` starts with `/hooks` but is `/admin` to any server that resolves dot segments.
    if any(seg in (".", "..") for seg in unquote(got.path).replace("\\", "/").split("/")):
        return False
    for prefix in allow:
        want = urlsplit(prefix)
        same_origin = (got.scheme, got.hostname, got_port) == (want.scheme, want.hostname, want.port)
        if same_origin and got.path.startswith(want.path or "/"):
            return True
    return False


class Notifier:
    """A daemon thread: takes notices from the outbox reliably (LMOVE into its own list) and POSTs them."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        worker: str,
        *,
        allow: Sequence[str],
        stop: threading.Event,
        on_redis_down: Callable[[RedisError], None] | None = None,
    ) -> None:
        self.redis = redis
        # Where a Redis that cannot be reached is reported: the worker's (worker.presence) says it once per outage,
        # where this thread's own warning came once a second for as long as the outage lasted.
        self.on_redis_down = on_redis_down
        self.keys = keys
        self.allow = tuple(allow)
        self.stop = stop
        self.worker = worker
        self.sending = keys.outbox_sending(worker)
        self.delivered = 0
        self.quarantine = Quarantine(redis, keys)
        self.thread = threading.Thread(target=self._run, daemon=True, name="notices")

    def start(self) -> Notifier:
        self._clear_the_way()
        self.redis.sadd(self.keys.notice_senders(), self.worker)  # recovery returns our notice if we die
        self.thread.start()
        return self

    def _clear_the_way(self) -> None:
        """Our keys of another type (some other writer's) are moved aside: the senders set stopped the worker at
        start, and an outbox failed every take of a notice, forever, read as Redis being down."""
        expected = {self.keys.notice_senders(): "set", self.keys.outbox(): "list", self.sending: "list"}
        clear_the_way(self.redis, self.quarantine, expected)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._requeue_leftovers()
                raw = self.redis.blmove(self.keys.outbox(), self.sending, 1.0, "RIGHT", "LEFT")
                if raw is not None:
                    try:
                        self._deliver(raw)
                    except Exception:  # one bad notice (its batch gone, garbage) never stops the others
                        log.exception("notices: dropping a notice that could not be delivered: %r", raw[:200])
                    finally:
                        self.redis.lrem(self.sending, 1, raw)
            except redis.exceptions.ResponseError as exc:
                log.warning("notices: redis refused a command (%s); checking our keys' types", exc)
                with contextlib.suppress(redis.exceptions.RedisError):
                    self._clear_the_way()
                self.stop.wait(1.0)
            except redis.exceptions.RedisError as exc:
                if self.on_redis_down is not None and isinstance(
                    exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
                ):
                    self.on_redis_down(exc)
                else:
                    log.warning("notices: redis unavailable (%s)", exc)
                self.stop.wait(1.0)

    def _requeue_leftovers(self) -> None:
        """A notice this worker was sending when it died (under the same name) goes back to the outbox."""
        return_notices(self.redis, self.keys, self.worker)

    def _deliver(self, raw: bytes) -> None:
        try:
            notice = orjson.loads(raw)
            batch, url = str(notice["batch"]), str(notice["url"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("notices: dropping an unreadable notice %r", raw[:200])
            return
        if not allowed(url, self.allow):
            log.warning("notices: batch %s asked for a POST to %s, which --notify-allow does not admit", batch, url)
            return
        body = orjson.dumps(read_batch(self.redis, self.keys, batch).to_dict())
        for attempt, delay in enumerate((0.0, *RETRY_DELAYS_S), start=1):
            if delay and self.stop.wait(delay):
                return
            if _post(url, body):
                self.delivered += 1
                log.info("notices: batch %s announced to %s (try %d)", batch, url, attempt)
                return
        log.error("notices: batch %s: POST to %s failed %d times; giving up", batch, url, len(RETRY_DELAYS_S) + 1)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is not followed: its target is a URL the allowlist never saw (urllib would turn the POST into a
    GET of any address the answer names). The 3xx reads as a failed try."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _post(url: str, body: bytes) -> bool:
    """One try: True for a 2xx status within POST_TIMEOUT_S, all of it (resolve, connect, send, status line and
    headers; the answer's body is never read). A socket timeout bounds each read, not the answer: a receiver
    trickling a byte every few seconds held the notices thread, and every notice behind it, for as long as it
    liked. So the try runs on a thread of its own, and at the deadline its connection, once made, is shut, ending
    it too (a name lookup or a connect still under way ends at its own timeout, the try already counted failed).
    An answer arriving just as the deadline passes counts as failed and is sent again: a notice comes at least
    once."""
    attempt = _Attempt(url, body)
    thread = threading.Thread(target=attempt.run, daemon=True, name="notice-post")
    thread.start()
    thread.join(POST_TIMEOUT_S)
    if thread.is_alive():
        attempt.abandon()
        log.warning("notices: POST to %s failed: no whole answer within %g s", url, POST_TIMEOUT_S)
        return False
    if attempt.error is not None:
        log.warning("notices: POST to %s failed: %s", url, attempt.error)
    return attempt.ok


class _Attempt:
    """One POST and the connections it opened, which `abandon` shuts from another thread."""

    def __init__(self, url: str, body: bytes) -> None:
        self.request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        self.ok = False
        self.error: str | None = None
        self._lock = threading.Lock()
        self._over = False
        # Duplicates of the connections' descriptors: shutting one down ends every read and write on its socket
        # (plain or TLS, mid-handshake too), and being ours it can never name a descriptor reused meanwhile.
        self._watched: list[socket.socket] = []

    def run(self) -> None:
        opener = urllib.request.build_opener(_NoRedirect, _WatchedHTTP(self), _WatchedHTTPS(self))
        try:
            with opener.open(self.request, timeout=POST_TIMEOUT_S) as resp:
                self.ok = 200 <= resp.status < 300
        except urllib.error.HTTPError as exc:
            exc.close()  # it holds the answer open (a body still arriving) until collected
            self.error = str(exc)
        except Exception as exc:  # this thread's one boundary: any failure is a failed try
            # HTTPException is no OSError (a garbled status line, too many headers), and a connection shut at the
            # deadline fails however the read it interrupted fails.
            self.error = str(exc) or type(exc).__name__
        finally:
            with self._lock:
                self._over = True
                for sock in self._watched:
                    sock.close()
                self._watched.clear()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self._over:
                raise TimeoutError("the try's deadline passed while connecting")
            self._watched.append(sock.dup())

    def abandon(self) -> None:
        with self._lock:
            self._over = True
            for sock in self._watched:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _WatchedConnection(http.client.HTTPConnection):
    """Shows its socket to its attempt once connected, before any TLS handshake (HTTPSConnection.connect runs
    this class's connect first, as its super())."""

    attempt: _Attempt

    def connect(self) -> None:
        super().connect()
        self.attempt.watch(self.sock)


class _WatchedHTTPSConnection(http.client.HTTPSConnection, _WatchedConnection):
    pass


class _WatchedHTTP(urllib.request.HTTPHandler):
    def __init__(self, attempt: _Attempt) -> None:
        super().__init__()
        self.attempt = attempt

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)

    def _connection(self, host: str, **kwargs: Any) -> http.client.HTTPConnection:
        conn = _WatchedConnection(host, **kwargs)
        conn.attempt = self.attempt
        return conn


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, attempt: _Attempt) -> None:
        super().__init__()
        self.attempt = attempt

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req, context=self._context)

    def _connection(self, host: str, **kwargs: Any) -> http.client.HTTPConnection:
        conn = _WatchedHTTPSConnection(host, **kwargs)
        conn.attempt = self.attempt
        return conn


def return_notices(redis: Redis, keys: Keys, worker: str) -> int:
    """Move a worker's notices in flight back to the outbox (it died, or restarted); returns how many."""
    moved = 0
    while redis.lmove(keys.outbox_sending(worker), keys.outbox(), "RIGHT", "RIGHT") is not None:
        moved += 1
    return moved
