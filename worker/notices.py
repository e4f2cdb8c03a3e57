"""Delivering completion notices: a finished batch that asked for an HTTP POST gets one, from a worker,
with retries and backoff, and only to a URL the worker's allowlist admits (a producer cannot make the GPU
box call an arbitrary address)."""

from __future__ import annotations

import contextlib
import http.client
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

import orjson
import redis.exceptions
from redis import Redis

from shared.keys import Keys
from shared.quarantine import Quarantine, clear_the_way
from shared.store import read_batch

log = logging.getLogger("kevlaya.worker")

POST_TIMEOUT_S = 10.0
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

    def __init__(self, redis: Redis, keys: Keys, worker: str, *, allow: Sequence[str], stop: threading.Event) -> None:
        self.redis = redis
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


_OPENER = urllib.request.build_opener(_NoRedirect)


def _post(url: str, body: bytes) -> bool:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(request, timeout=POST_TIMEOUT_S) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:
        # HTTPException is no OSError: a garbled status line or an oversized header (a proxy mid-restart) is a
        # failed try like any other, not a reason to drop the notice without its retries.
        log.warning("notices: POST to %s failed: %s", url, exc)
        return False


def return_notices(redis: Redis, keys: Keys, worker: str) -> int:
    """Move a worker's notices in flight back to the outbox (it died, or restarted); returns how many."""
    moved = 0
    while redis.lmove(keys.outbox_sending(worker), keys.outbox(), "RIGHT", "RIGHT") is not None:
        moved += 1
    return moved
