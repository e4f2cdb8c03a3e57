"""The asyncio client: submit, wait and read results from async code."""

from __future__ import annotations

import asyncio

import pytest
from redis import Redis

from producer.aio import AsyncClient
from shared.errors import WaitTimeoutError
from tests.fakes import FAKE_CONFIG, FakeEngine
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


def test_async_client_round_trip(redis_url: str, redis: Redis) -> None:
    async def scenario() -> None:
        client = AsyncClient(url=redis_url)
        handle = await client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}])
        assert (await client.status(handle.id)).counts.queued == 1
        with pytest.raises(WaitTimeoutError):
            await client.wait(handle.id, timeout_s=0.1, poll_s=0.02)
        await asyncio.to_thread(BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True)).work)
        record = await client.wait(handle.id, timeout_s=10)
        assert record.status == "completed"
        row = await client.result(handle.id, "a")
        assert row is not None and row["text"] == "answer to a"
        await client.aclose()

    asyncio.run(scenario())
