"""An idle worker's wait that ends when work is queued: a submit publishes on `Keys.queued()` with each chunk it
enqueues, and the idle loop waits on that channel for up to its poll interval instead of sleeping the interval
out (a burst's first take started on average half an interval, ~50 ms, after its jobs landed).

The channel only shortens a wait: a message's content is never read, a missed one costs at most one interval,
and any trouble with the subscription (Redis down, the server dropping a slow subscriber) falls back to a plain
sleep and subscribes again at the next wait. Pending messages are drained at once, so a burst of chunks wakes the
loop once, and wakes come at most every `MIN_WAKE_GAP_S` (a flood on the channel does not make it spin).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from redis import Redis
from redis.client import PubSub
from redis.exceptions import RedisError

log = logging.getLogger("kevlaya.worker")

STOP_CHECK_S = 0.1  # a stop request ends a wait within this (a signal handler does no Redis I/O to end it)
# Wakes closer together than this keep waiting: a flood on the channel (anyone who may submit may publish there)
# makes an idle worker look at its queues at most this often, not at the flood's rate.
MIN_WAKE_GAP_S = 0.01


class Wake:
    """Waits of the idle loop on the queued channel (see the module docstring)."""

    def __init__(self, redis: Redis, channel: str, stop: threading.Event) -> None:
        self.redis = redis
        self.channel = channel
        self.stop = stop
        self._pubsub: PubSub | None = None
        self._woke_at = float("-inf")

    def wait(self, timeout_s: float) -> bool:
        """Until a submit announces queued work, `stop` is set (looked at every `STOP_CHECK_S`), or `timeout_s`
        passes. True: woken by a message."""
        deadline = time.monotonic() + timeout_s
        try:
            pubsub = self._subscribed()
            while not self.stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if pubsub.get_message(timeout=min(STOP_CHECK_S, left)) is not None:
                    self._drain()
                    now = time.monotonic()
                    if now - self._woke_at >= MIN_WAKE_GAP_S:
                        self._woke_at = now
                        return True
            return False
        except (RedisError, OSError, ValueError) as exc:  # ValueError: a reply redis-py could not parse
            log.debug("wake channel unavailable (%s): sleeping the poll interval", exc)
            self.close()
        self.stop.wait(max(0.0, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                self._pubsub.close()
            self._pubsub = None

    def _subscribed(self) -> PubSub:
        if self._pubsub is None:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(self.channel)
            self._pubsub = pubsub
        return self._pubsub

    def _drain(self) -> None:
        assert self._pubsub is not None
        while self._pubsub.get_message(timeout=0) is not None:
            pass
