"""The library API when Redis or a notice endpoint misbehaves: Redis failing reads as one error of the project's
tree naming the URL (never a raw redis-py exception), a wait rides out a brief outage, and both clients take the
same keyword for the Redis URL."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from producer.aio import AsyncClient
from producer.client import Client
from shared.conn import connect_like
from shared.errors import ConfigError, RedisCommandError, RedisUnavailableError, StoreError
from shared.keys import Keys
from tests.fakes import FakeEngine
from tests.worker_helpers import drain
from worker.tools.embedded_redis import EmbeddedRedis, free_port

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
        client = AsyncClient(redis_url=url)
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
    with pytest.raises(RedisCommandError, match="holds another type of value") as caught:
        client.workers_seen()
    assert isinstance(caught.value.__cause__, ResponseError)
    assert f":{redis.connection_pool.connection_kwargs['port']}/" in str(caught.value)


# ---- a wait rides out a brief outage --------------------------------------------------------------------------


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test alone, to stop and start (AOF: the batch outlives the restart)."""
    with EmbeddedRedis(aof=True) as server:
        yield server


def outage_then_answers(server: EmbeddedRedis, batch_done: Callable[[], bool], down_s: float = 1.5) -> None:
    """While a wait runs: Redis stops, stays down `down_s`, starts again on the same port, and a worker
    answers the batch."""
    time.sleep(0.3)  # the wait is polling
    server.stop()
    time.sleep(down_s)
    server.start()
    redis = Redis.from_url(server.url)
    drain(redis, FakeEngine())
    assert batch_done()
    redis.close()


def test_a_wait_rides_out_a_brief_redis_outage(own_redis: EmbeddedRedis) -> None:
    client = Client(redis_url=own_redis.url)
    batch, _ = client.submit(JOB)
    outcome: list[Any] = []

    def wait() -> None:
        try:
            outcome.append(client.wait(batch, poll_s=0.1, timeout_s=30))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    outage_then_answers(own_redis, lambda: Client(redis_url=own_redis.url).status(batch).complete)
    thread.join(30)
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].complete and outcome[0].counts.done == 1


def test_an_async_wait_rides_out_a_brief_redis_outage(own_redis: EmbeddedRedis) -> None:
    client = Client(redis_url=own_redis.url)
    batch, _ = client.submit(JOB)

    async def run() -> Any:
        aclient = AsyncClient(redis_url=own_redis.url)
        try:
            waiting = asyncio.ensure_future(aclient.wait(batch, poll_s=0.1, timeout_s=30))
            done = lambda: Client(redis_url=own_redis.url).status(batch).complete  # noqa: E731
            await asyncio.to_thread(outage_then_answers, own_redis, done)
            return await asyncio.wait_for(waiting, 30)
        finally:
            await aclient.aclose()

    record = asyncio.run(run())
    assert record.complete and record.counts.done == 1


@pytest.mark.parametrize("timeout_s", [0.5, 1.5])
def test_a_wait_on_an_unreachable_redis_raises_the_mapped_error_at_its_deadline(timeout_s: float) -> None:
    url = down_url()
    started = time.monotonic()
    with pytest.raises(RedisUnavailableError) as caught:
        Client(redis_url=url).wait("b1", timeout_s=timeout_s)
    took = time.monotonic() - started
    assert timeout_s - 0.05 <= took < timeout_s + 0.5  # retried until the deadline, never slept past it
    assert_names_redis(caught.value, url)

    async def run() -> None:
        client = AsyncClient(redis_url=url)
        try:
            await client.wait("b1", timeout_s=timeout_s)
        finally:
            await client.aclose()

    started = time.monotonic()
    with pytest.raises(RedisUnavailableError):
        asyncio.run(run())
    assert timeout_s - 0.05 <= time.monotonic() - started < timeout_s + 0.5


# ---- one keyword for the Redis URL ----------------------------------------------------------------------------


def test_both_clients_take_the_redis_url_under_the_same_keyword(client: Client, redis_url: str) -> None:
    batch, _ = client.submit(JOB)

    async def status(**kw: str) -> Any:
        aclient = AsyncClient(**kw)
        try:
            return await aclient.status(batch)
        finally:
            await aclient.aclose()

    assert Client(redis_url=redis_url).status(batch).counts.total == 1
    assert asyncio.run(status(redis_url=redis_url)).counts.total == 1
    assert asyncio.run(status(url=redis_url)).counts.total == 1  # the older name still works
    with pytest.raises(ConfigError, match="once"):
        AsyncClient(redis_url=redis_url, url=down_url())


def test_an_async_client_given_a_connection_submits_and_reads_on_that_one_redis(
    redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`AsyncClient(redis=...)` was forwarded to the sync Client while the async half opened the default URL
    ($REDIS_URL, else localhost): submits went to one server and reads to another. $REDIS_URL points nowhere
    here, so a half still opened from it fails."""
    monkeypatch.setenv("REDIS_URL", down_url())

    async def run() -> tuple[str, int]:
        conn = AsyncRedis.from_url(redis_url)
        aclient = AsyncClient(redis=conn)
        try:
            handle = await aclient.submit_batch([JOB])
            record = await aclient.status(handle.id)
            await aclient.aclose()
            assert await conn.ping()  # the caller's connection: aclose() leaves it open
            return handle.id, record.counts.total
        finally:
            await conn.aclose()

    batch, total = asyncio.run(run())
    assert total == 1
    assert redis.scard(Keys().batch_item_set(batch)) == 1  # the submit wrote to the server the reads came from


def test_the_sync_half_copies_the_async_connections_server_db_credentials_and_tls() -> None:
    cases = {
        "rediss://u:pw@h.example:6390/2?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none": SSLConnection,
        "unix:///tmp/r.sock?db=4&password=pw": UnixDomainSocketConnection,
        "redis://:pw@10.0.0.7:6391/5": None,
    }
    for url, cls in cases.items():
        conn = AsyncRedis.from_url(url)
        want = {k: v for k, v in conn.connection_pool.connection_kwargs.items() if k in ("host", "port", "path", "db")}
        want |= {k: v for k, v in conn.connection_pool.connection_kwargs.items() if k in ("username", "password")}
        twin = connect_like(conn).connection_pool
        got = twin.connection_kwargs
        assert {k: got.get(k) for k in want} == want, url
        if cls is not None:
            assert twin.connection_class is cls
        if cls is SSLConnection:
            assert (got["ssl_ca_certs"], got["ssl_cert_reqs"]) == ("/ca.pem", "none")


@pytest.mark.parametrize(
    "given, why",
    [
        (Redis(), "not a redis.client.Redis"),  # the sync client: the other half could not be made from it
        ("redis://127.0.0.1:6379/0", "not a builtins.str"),
        (AsyncSentinel([("127.0.0.1", 1)]).master_for("svc"), "give redis_url= instead"),
    ],
    ids=["sync Redis", "a URL", "async Sentinel"],
)
def test_an_async_client_refuses_a_connection_it_cannot_pair_in_one_line(given: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as caught:
        AsyncClient(redis=given)
    assert "\n" not in str(caught.value)


def test_a_client_refuses_a_connection_that_decodes_replies(redis_url: str) -> None:
    """Every reader takes bytes (an id or a result that is not UTF-8 is data too): given a connection made with
    decode_responses=True, status, iter_results, batches, cancel and retry_failed raised a raw AttributeError."""
    conn = Redis.from_url(redis_url, decode_responses=True)
    try:
        with pytest.raises(ConfigError, match="without decode_responses") as caught:
            Client(redis=conn)
        assert "\n" not in str(caught.value)
    finally:
        conn.close()


def test_an_async_client_refuses_a_connection_that_decodes_replies(redis_url: str) -> None:
    """Its submits went through its own synchronous half, but `status` and `wait` raised a raw AttributeError."""
    conn = AsyncRedis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ConfigError, match="without decode_responses") as caught:
        AsyncClient(redis=conn)
    assert "\n" not in str(caught.value)
    asyncio.run(conn.aclose())


def test_an_async_client_takes_a_connection_or_a_url_not_both(redis_url: str) -> None:
    conn = AsyncRedis.from_url(redis_url)
    for kw in ({"redis_url": redis_url}, {"url": redis_url}):
        with pytest.raises(ConfigError, match="not both"):
            AsyncClient(redis=conn, **kw)


@pytest.mark.parametrize("prefix", ["", "   "])
def test_an_empty_prefix_is_refused_from_python_as_from_the_cli(prefix: str) -> None:
    """`--prefix ''` is refused by the CLI; the library refuses it too, before any connection, in one line: an
    empty prefix put kevlaya's keys (`batches`, `events`) bare among the database's other keys."""
    for make in (Client, AsyncClient):
        with pytest.raises(ConfigError, match="give a non-empty prefix"):
            make(redis_url="redis://127.0.0.1:1/0", prefix=prefix)
    with pytest.raises(ConfigError):
        Keys(prefix)
