"""The Python library as another service uses it: Client and AsyncClient give the same answers and errors."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from redis import Redis

from producer.aio import AsyncClient
from producer.client import Client
from shared.errors import BatchNotFoundError, ValidationError, WaitTimeoutError
from tests.fakes import FakeEngine
from tests.worker_helpers import drain

BAD_WAITS = [
    {"timeout_s": float("nan")},  # waited forever: no comparison with NaN is true
    {"timeout_s": -1.0},
    {"timeout_s": "5"},
    {"timeout_s": 1.0, "poll_s": 0},  # spun
    {"timeout_s": 1.0, "poll_s": -1.0},  # a raw ValueError from redis-py
    {"timeout_s": 1.0, "poll_s": float("nan")},  # a raw ConnectionError from redis-py
]


def _sync_and_async(redis_url: str, call: str, *args: Any, **kw: Any) -> list[Any]:
    """`call` on a Client and on an AsyncClient: what each returned, or the exception it raised."""
    out: list[Any] = [TimeoutError(f"{call} still running after 3 s")]

    def run_sync() -> None:
        try:
            out[0] = getattr(Client(redis_url=redis_url), call)(*args, **kw)
        except Exception as exc:
            out[0] = exc

    thread = threading.Thread(target=run_sync, daemon=True)  # a daemon: one that never returns ends with the test
    thread.start()
    thread.join(3)

    async def run() -> Any:
        client = AsyncClient(url=redis_url)
        try:
            return await asyncio.wait_for(getattr(client, call)(*args, **kw), 3)
        except Exception as exc:
            return exc
        finally:
            await client.aclose()

    out.append(asyncio.run(run()))
    return out


@pytest.mark.parametrize("kw", BAD_WAITS, ids=[str(k) for k in BAD_WAITS])
def test_a_wait_with_a_timeout_or_poll_that_is_no_number_of_seconds_is_refused(
    client: Client, redis_url: str, kw: dict[str, Any]
) -> None:
    batch, _ = client.submit({"model": "laya", "prompt": "p"})
    for outcome in _sync_and_async(redis_url, "wait", batch, **kw):
        assert isinstance(outcome, ValidationError), outcome


def test_result_by_job_id_is_the_final_kev_answer_in_both_clients(client: Client, redis: Redis, redis_url: str) -> None:
    """AsyncClient.result took only (batch, custom_id): `await result(job_id)` was a TypeError."""
    _, job = client.submit({"model": "laya", "prompt": "unsure about this"})
    assert _sync_and_async(redis_url, "result", job) == [None, None]  # pending
    drain(redis, FakeEngine())
    sync_row, async_row = _sync_and_async(redis_url, "result", job)
    assert sync_row == async_row
    assert sync_row["model"] == "kev" and sync_row["final"] and sync_row["escalated_from"] == job


@pytest.mark.parametrize("gone", ["never", "expired", "unknown-item"])
def test_the_result_of_an_item_that_does_not_exist_is_not_found_not_pending(
    client: Client, redis: Redis, redis_url: str, gone: str
) -> None:
    """`result(batch, custom_id)` answered None ("pending") for a batch never submitted or expired from Redis, so
    a service polling for it waited forever; `status` of the same batch raised BatchNotFoundError."""
    batch, job = client.submit({"custom_id": "a", "model": "laya", "prompt": "p"})
    if gone == "never":
        batch, job = "bnever", "bnever-0123456789abcdef0123"
    elif gone == "expired":
        redis.delete(*redis.keys(f"kevlaya:*{batch}*"))  # what the batch TTL does
    calls = [(batch, "zz")] if gone == "unknown-item" else [(batch, "a"), (job,)]
    for args in calls:
        for outcome in _sync_and_async(redis_url, "result", *args):
            assert isinstance(outcome, BatchNotFoundError), (args, outcome)


@pytest.mark.parametrize("args", [(123,), (None,), ("b", "\udcff"), ("b\udcff", "a")])
def test_result_of_an_impossible_id_is_not_found_in_both_clients(redis: Redis, redis_url: str, args: tuple) -> None:
    """These raised AttributeError / UnicodeEncodeError from inside the Redis client."""
    for outcome in _sync_and_async(redis_url, "result", *args):
        assert isinstance(outcome, BatchNotFoundError), outcome


def test_a_wait_ends_at_its_timeout_not_at_its_next_poll_in_both_clients(client: Client, redis_url: str) -> None:
    """AsyncClient.wait slept a whole poll_s past its deadline: timeout_s=0.2 with poll_s=30 took 30 s."""
    batch, _ = client.submit({"model": "laya", "prompt": "p"})
    for outcome in _sync_and_async(redis_url, "wait", batch, timeout_s=0.2, poll_s=30):
        assert isinstance(outcome, WaitTimeoutError), outcome
