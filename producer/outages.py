"""Redis failing under the client: every call of `Client` and `AsyncClient` raises one `StoreError` (a
one-line message naming the Redis URL, no password; the redis-py error its `__cause__`), never a raw
redis-py exception a caller would have to know about. A wait alone rides out a brief outage (a Redis
restart, a failover): its Redis calls are retried with redis-py's `Retry` until the wait's own deadline."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import AbstractBackoff, EqualJitterBackoff
from redis.exceptions import AuthenticationError, RedisError
from redis.retry import Retry

from shared.conn import store_error

T = TypeVar("T")

OUTAGE_S = 60.0  # how long a wait with no timeout rides out Redis being unreachable before it raises
BACKOFF_BASE_S = 0.05  # the first retry of a wait's Redis call comes after 50-100 ms (base * 2, equal jitter) ...
BACKOFF_CAP_S = 1.0  # ... doubling to 0.5-1 s: a restarted Redis is seen within a second


class NamesItsRedis(Protocol):
    redis_shown: str  # the URL errors name, password hidden


def store_call(method: Callable[..., T]) -> Callable[..., T]:
    """`method` of a client, raising StoreError where Redis fails."""

    @functools.wraps(method)
    def call(self: NamesItsRedis, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except RedisError as exc:
            raise store_error(exc, self.redis_shown) from exc

    return call


def async_store_call(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """`store_call` of a coroutine method."""

    @functools.wraps(method)
    async def call(self: NamesItsRedis, *args: Any, **kwargs: Any) -> T:
        try:
            return await method(self, *args, **kwargs)
        except RedisError as exc:
            raise store_error(exc, self.redis_shown) from exc

    return call


def store_iter(rows: Iterator[T], redis_shown: str) -> Iterator[T]:
    """`rows`, raising StoreError where Redis fails mid-iteration (an export reads as it goes)."""
    try:
        yield from rows
    except RedisError as exc:
        raise store_error(exc, redis_shown) from exc


class Outage(AbstractBackoff):
    """A wait's Redis calls through an outage: redis-py's backoff (equal jitter), never sleeping past the wait's
    deadline, or `OUTAGE_S` into the outage for a wait without one; a refused credential is not retried."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.backoff = EqualJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)
        self.ends: float | None = None  # set by the outage's first failure

    def reset(self) -> None:  # each call starts outside an outage
        self.backoff.reset()
        self.ends = None

    def compute(self, failures: int) -> float:
        left = 0.0 if self.ends is None else self.ends - time.monotonic()
        return min(self.backoff.compute(failures), max(left, 0.0))

    def give_up(self, error: Exception) -> None:
        """`Retry`'s failure handler: raises `error` once retrying cannot help or the time is up."""
        if isinstance(error, AuthenticationError):  # a ConnectionError to redis-py, yet no retry fixes a password
            raise error
        now = time.monotonic()
        if self.ends is None:
            self.ends = self.deadline if self.deadline is not None else now + OUTAGE_S
        if now >= self.ends:
            raise error

    def retry(self) -> Retry:
        """A redis-py `Retry` of connection errors and timeouts, as often as this outage allows."""
        return Retry(self, -1)

    def async_retry(self) -> AsyncRetry:
        return AsyncRetry(self, -1)

    async def async_give_up(self, error: Exception) -> None:
        self.give_up(error)  # the asyncio Retry awaits its failure handler
