"""Redis failing under the client: every call of `Client` and `AsyncClient` raises one `StoreError` (a
one-line message naming the Redis URL, no password; the redis-py error its `__cause__`), never a raw
redis-py exception a caller would have to know about."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

from redis.exceptions import RedisError

from shared.conn import store_error

T = TypeVar("T")


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
