"""The library API when Redis or a notice endpoint misbehaves: Redis failing reads as one error of the project's
tree naming the URL (never a raw redis-py exception), a wait rides out a brief outage, and both clients take the
same keyword for the Redis URL."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from producer.aio import AsyncClient
from producer.client import Client
from shared.errors import RedisCommandError, RedisUnavailableError, StoreError
from shared.keys import Keys
from worker.tools.embedded_redis import free_port

PASSWORD = "hunter2"
JOB = {"custom_id": "a", "model": "laya", "prompt": "p"}


def down_url() -> str:
    """A Redis URL (with a password) where nothing listens: every call is refused at once."""
    return f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"


def assert_names_redis(exc: BaseException, url: str) -> None:
    """One line naming the URL without its password; the redis-py error kept as the cause."""
    assert isinstance(exc, RedisUnavailableError), repr(exc)
    text = str(exc)
    assert "\n" not in text and PASSWORD not in text
    assert url.replace(PASSWORD, "***").rsplit("@", 1)[1] in text  # host:port/db
    assert isinstance(exc.__cause__, RedisConnectionError)


SYNC_CALLS: dict[str, Callable[[Client], Any]] = {
    "submit": lambda c: c.submit(JOB),
    "submit_batch": lambda c: c.submit_batch([JOB]),
    "status": lambda c: c.status("b1"),
    "wait": lambda c: c.wait("b1", timeout_s=0.3),
    "result": lambda c: c.result("b1", "a"),
    "result by job id": lambda c: c.result("b1-abc"),
    "iter_results": lambda c: list(c.iter_results("b1")),
    "batches": lambda c: c.batches(),
    "overview": lambda c: c.overview(),
    "workers_seen": lambda c: c.workers_seen(),
    "cancel": lambda c: c.cancel("b1"),
    "retry_failed": lambda c: c.retry_failed("b1"),
}


@pytest.mark.parametrize("call", list(SYNC_CALLS))
def test_client_calls_raise_a_store_error_naming_the_url_when_redis_is_down(call: str) -> None:
    url = down_url()
    with pytest.raises(StoreError) as caught:
        SYNC_CALLS[call](Client(redis_url=url))
    assert_names_redis(caught.value, url)


ASYNC_CALLS: dict[str, Callable[[AsyncClient], Awaitable[Any]]] = {
    "submit": lambda c: c.submit(JOB),
    "submit_batch": lambda c: c.submit_batch([JOB]),
    "status": lambda c: c.status("b1"),
    "wait": lambda c: c.wait("b1", timeout_s=0.3),
    "result": lambda c: c.result("b1", "a"),
    "result by job id": lambda c: c.result("b1-abc"),
    "cancel": lambda c: c.cancel("b1"),
    "retry_failed": lambda c: c.retry_failed("b1"),
}


@pytest.mark.parametrize("call", list(ASYNC_CALLS))
def test_async_client_calls_raise_a_store_error_naming_the_url_when_redis_is_down(call: str) -> None:
    url = down_url()

    async def run() -> BaseException:
        client = AsyncClient(url=url)
        try:
            await ASYNC_CALLS[call](client)
        except Exception as exc:
            return exc
        finally:
            await client.aclose()
        raise AssertionError(f"{call} returned with Redis down")

    exc = asyncio.run(run())
    assert isinstance(exc, StoreError), repr(exc)
    assert_names_redis(exc, url)


def test_a_command_redis_refuses_is_a_store_error_too(client: Client, redis: Redis) -> None:
    """Not only an outage: a reply that is an error (here a key some other writer gave another type)."""
    redis.set(Keys().workers(), "not a sorted set")
    with pytest.raises(RedisCommandError, match="answered with an error") as caught:
        client.workers_seen()
    assert isinstance(caught.value.__cause__, ResponseError)
    assert f":{redis.connection_pool.connection_kwargs['port']}/" in str(caught.value)
