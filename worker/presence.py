"""How a worker is present in Redis: registered where RQ's tools look (waiting out a Redis that is down,
failing fast on a refused credential), a heartbeat thread that keeps it and its running jobs alive, its
idle/busy state and counts, and its death when it stops."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis.exceptions
from redis import Redis

from shared.conn import redis_problem, url_of
from shared.errors import RedisUnavailableError
from shared.keys import Keys
from worker.rqcompat import RQBridge
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from worker.ahead import InHand

log = logging.getLogger("kevlaya.worker")

T = TypeVar("T")

# The wait for a Redis that is down: a backoff from REDIS_RETRY_FIRST_S, doubling up to REDIS_RETRY_MAX_S.
REDIS_RETRY_FIRST_S = 0.5
REDIS_RETRY_MAX_S = 10.0
# A --burst run (a cron job, CI) gives up on a Redis that stays down once the backoff has climbed to its cap
# (0.5 + 1 + 2 + 4 + 8 s): waiting for good, it never exited and nothing said why. A long-lived worker waits on.
BURST_REDIS_WAIT_S = 15.5


class Presence:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        bridge: RQBridge,
        settings: WorkerSettings,
        *,
        stop: threading.Event,
        in_flight: Callable[[], list[InHand]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.bridge = bridge
        self.settings = settings
        self.stop = stop
        self.in_flight = in_flight
        self.redis_ok_since = time.time()  # reset on every Redis error (recovery waits a TTL after one)
        # When the outage now going on was first met (monotonic), by the loop, the start-up or the heartbeat thread.
        self._down_since: float | None = None
        self._outage_lock = threading.Lock()
        self.rq_worker: Any = None
        self._beat: threading.Thread | None = None

    def wait_for_redis(self, fn: Callable[[], T]) -> T:
        """Call fn, waiting with backoff while Redis is down (the model stays loaded meanwhile); a burst worker
        waits BURST_REDIS_WAIT_S at most, then the ConnectionError goes on up (the command names the URL)."""
        delay, since = REDIS_RETRY_FIRST_S, time.monotonic()
        while True:
            try:
                value = fn()
            except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
                raise RedisUnavailableError(redis_problem(exc)) from exc  # retrying cannot fix a credential
            except redis.exceptions.ConnectionError as exc:
                self.redis_down(exc, retry_in_s=delay)
                if self.stop.is_set() or self.gives_up(since):
                    raise
                # A stop (SIGTERM) ends the wait at once: sleeping out a 10 s backoff, then trying once more
                # (a connect that can itself take the socket timeout) outlasts `docker stop`'s grace period.
                if self.stop.wait(delay):
                    raise
                delay = min(delay * 2, REDIS_RETRY_MAX_S)
            else:
                self.redis_up()
                return value

    def gives_up(self, down_since: float) -> bool:
        """Whether a worker that has found Redis down since `down_since` (monotonic) stops waiting: a burst one, at
        BURST_REDIS_WAIT_S."""
        return self.settings.burst and time.monotonic() - down_since >= BURST_REDIS_WAIT_S

    def redis_down(self, exc: redis.exceptions.RedisError, *, retry_in_s: float | None = None) -> None:
        """Note a Redis that could not be reached (by the loop, the start-up or the heartbeat thread). Only the
        outage's first error is a warning, saying what a burst run will do; each one after it is debug. A warning
        per retry (every second from the loop, every beat from the heartbeat) put a dozen lines before a burst
        run's one-line error in a cron mail, and one a second into a long-lived worker's log for the whole outage."""
        self.redis_ok_since = time.time()
        with self._outage_lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if not first:
            log.debug(
                "redis still unavailable (%s)%s", exc, "" if retry_in_s is None else f"; retrying in {retry_in_s:.1f} s"
            )
        elif self.settings.burst:
            log.warning(
                "redis at %s unavailable (%s); retrying, giving up after %g s", self._where(), exc, BURST_REDIS_WAIT_S
            )
        else:
            log.warning("redis at %s unavailable (%s); retrying until it is back", self._where(), exc)

    def redis_up(self) -> None:
        """Note a Redis call that worked: an outage going on ends, in one line."""
        if self._down_since is None:  # the common case, without the lock: one read of one attribute
            return
        with self._outage_lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            log.info("redis at %s is back after %.1f s", self._where(), time.monotonic() - since)

    @property
    def redis_down_now(self) -> bool:
        """Whether an outage is going on (its first error seen, no call working since)."""
        return self._down_since is not None

    def _where(self) -> str:
        return url_of(self.redis) if self.redis is not None else "(no connection)"

    def arrive(self) -> None:
        """Register (taking over a dead registration of our name), beat once, start the heartbeat thread."""
        ttl = self.settings.worker_ttl_s
        rq_worker = self.wait_for_redis(lambda: self.bridge.make_rq_worker(ttl))
        self.wait_for_redis(lambda: self.bridge.register(rq_worker, worker_ttl_s=ttl))
        self.rq_worker = rq_worker
        self.report(busy=False)
        # RQ's birth gives the worker key worker_ttl + 60 s; beat once now, so a crash right after start is
        # noticed within worker_ttl, not a minute later.
        self.wait_for_redis(lambda: rq_worker.heartbeat(ttl))
        self._seen()  # peers count it at once
        self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat")
        self._beat.start()

    def report(self, *, busy: bool, ok: int = 0, failed: int = 0, seconds: float = 0.0) -> None:
        """The worker's state where RQ's tools read it, and in the idle set that a queue's tail is shared with. A take
        that got rows has already left the idle set, in its own script (worker.rqcompat): peers sharing the tail
        must never see this worker idle with the queue already shrunk by its take."""
        if self.rq_worker is not None:
            self.bridge.report(self.rq_worker, busy=busy, ok=ok, failed=failed, seconds=seconds)
            name, idle = self.bridge.worker_name, self.keys.idle_workers()
            # A key of another type there only turns tail sharing off (worker.tail) until it is a sorted set again.
            with contextlib.suppress(redis.exceptions.ResponseError):
                self.redis.zrem(idle, name) if busy else self.redis.zadd(idle, {name: time.time()})

    def leave(self) -> None:
        """After `stop` is set: the heartbeat ends and the death is registered (if Redis answers)."""
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self.rq_worker is None:
            return
        try:
            self.redis.zrem(self.keys.idle_workers(), self.bridge.worker_name)
            self.rq_worker.register_death()
        except redis.exceptions.RedisError as exc:
            # Said already, in the outage's one line, when Redis is what the worker is stopping for.
            level = logging.DEBUG if self.redis_down_now else logging.WARNING
            log.log(level, "could not register death (%s)", exc)

    def _seen(self) -> None:
        """Our heartbeat in the workers index. That index of another type (some other writer's) is moved aside:
        it stopped the worker at start, and later failed every beat, each one read as Redis being down, which
        held recovery off for good."""
        try:
            self.redis.zadd(self.keys.workers(), {self.bridge.worker_name: time.time()})
        except redis.exceptions.ResponseError:
            self.bridge.quarantine.move_key(self.keys.workers(), "workers index is not a sorted set")
            self.redis.zadd(self.keys.workers(), {self.bridge.worker_name: time.time()})

    def _heartbeat_loop(self) -> None:
        rq_worker = self.rq_worker
        while not self.stop.wait(self.settings.heartbeat_interval_s):
            try:
                if not self.redis.exists(rq_worker.key):
                    rq_worker.register_birth()  # the key expired while Redis was away: announce ourselves again
                rq_worker.heartbeat(self.settings.worker_ttl_s)
                self._seen()
                for hand in self.in_flight():
                    ttl = self.settings.job_heartbeat_ttl_s
                    self.bridge.heartbeat(hand.ref, hand.ids, ttl_s=ttl, exec_id=hand.exec_id or None)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                self.redis_down(exc, retry_in_s=self.settings.heartbeat_interval_s)
            except redis.exceptions.RedisError as exc:
                self.redis_ok_since = time.time()
                log.warning("heartbeat failed: %s", exc)
            else:
                self.redis_up()
