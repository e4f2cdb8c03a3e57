"""An asyncio client for services that enqueue from async code.

Reads and waits use `redis.asyncio` and never block the event loop. Submitting, cancelling and retrying run
the synchronous client's transactions in a worker thread: RQ's enqueue API, which they are built on, is
synchronous.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from producer.client import BatchHandle, Client
from producer.outages import Outage, async_store_call
from producer.reads import answer_of, check_wait, custom_id_of, known_batch_id, known_custom_id, split_job_id
from shared.conn import check_bytes_replies, check_url, connect_async, connect_like
from shared.conn import redis_url as url_or_default
from shared.errors import ConfigError, WaitTimeoutError
from shared.job import Job
from shared.keys import DEFAULT_PREFIX, INTERACTIVE, Keys
from shared.store import BatchRecord, batch_record, queue_record_reads, record_fields, recount_and_repair, stored_ended


class AsyncClient:
    """`AsyncClient(redis_url=...)` or `AsyncClient(redis=<a redis.asyncio.Redis>)`, as `Client`: Client's submit,
    result, status, wait, cancel and retry, awaited; the rest on `.sync`. `url=`, the older name of `redis_url=`,
    still works. Given `redis=`, the synchronous half (`.sync`, which submits) is opened to that client's server,
    database and credentials (`shared.conn.connect_like`): the two halves always reach the same Redis."""

    def __init__(
        self,
        *,
        redis: AsyncRedis | None = None,
        redis_url: str | None = None,
        url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        **client_kw: Any,
    ) -> None:
        if redis is not None:
            if redis_url is not None or url is not None:
                raise ConfigError("AsyncClient: give redis= (a redis.asyncio.Redis) or redis_url=, not both")
            twin = connect_like(redis)  # first: a value that is no redis.asyncio.Redis is named as such
            check_bytes_replies(redis, "AsyncClient")
            self.sync = Client(redis=twin, prefix=prefix, **client_kw)
            self.redis = redis
            self._own_redis = False  # the caller's connection: it closes it, not aclose()
        else:
            if redis_url is not None and url is not None and redis_url != url:
                raise ConfigError("AsyncClient: give the Redis URL once, as redis_url= (url= is its older name)")
            url = check_url(url_or_default(redis_url or url))
            self.sync = Client(redis_url=url, prefix=prefix, **client_kw)
            self.redis = connect_async(url)
            self._own_redis = True
        self.redis_shown = self.sync.redis_shown  # the same Redis
        self.keys = Keys(prefix)

    async def submit(
        self, job: dict[str, Any] | Job, *, model: str | None = None, lane: str = INTERACTIVE
    ) -> tuple[str, str]:
        return await asyncio.to_thread(self.sync.submit, job, model=model, lane=lane)

    async def submit_batch(self, jobs: Iterable[Job | dict[str, Any]], **kw: Any) -> BatchHandle:
        return await asyncio.to_thread(self.sync.submit_batch, list(jobs), **kw)

    async def cancel(self, batch: str) -> int:
        return await asyncio.to_thread(self.sync.cancel, batch)

    async def retry_failed(self, batch: str) -> int:
        return await asyncio.to_thread(self.sync.retry_failed, batch)

    @async_store_call
    async def status(self, batch: str) -> BatchRecord:
        return await self._status(batch)

    async def _status(self, batch: str) -> BatchRecord:
        async with self.redis.pipeline(transaction=True) as pipe:
            queue_record_reads(pipe, self.keys, known_batch_id(batch))
            raw, running, total, submits, answered, steps = await pipe.execute(raise_on_error=False)
        fields = record_fields(self.keys, batch, raw, answered)
        ended = stored_ended(fields, answered)
        if ended is None:  # some other writer changed a counter: count the results instead, as `read_batch`
            ended = await asyncio.to_thread(recount_and_repair, self.sync.redis, self.keys, batch)
        return batch_record(batch, fields, ended, running, total, submits, steps)

    @async_store_call
    async def result(self, job_id_or_batch: str, custom_id: str | None = None) -> dict[str, Any] | None:
        """One item's final answer (or error), or None while it is pending: by (batch, custom_id), or by the
        job id `submit` returned, as `Client.result`. BatchNotFoundError when there is no such item."""
        if custom_id is None:
            batch = split_job_id(job_id_or_batch)
            ids = [raw async for raw in self.redis.sscan_iter(self.keys.batch_item_set(batch))]
            custom_id = custom_id_of(job_id_or_batch, batch, ids)
        else:
            batch, custom_id = known_batch_id(job_id_or_batch), known_custom_id(custom_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.batch_results(batch), custom_id)
            pipe.sismember(self.keys.batch_item_set(batch), custom_id)
            raw, in_batch = await pipe.execute(raise_on_error=False)
        return answer_of(batch, custom_id, None if isinstance(raw, Exception) else raw, in_batch)

    @async_store_call
    async def wait(self, batch: str, *, poll_s: float = 0.5, timeout_s: float | None = None) -> BatchRecord:
        """Until every item has a final result; WaitTimeoutError if timeout_s passes first. Redis being
        unreachable meanwhile is retried with backoff until the deadline, as `Client.wait`."""
        check_wait(poll_s, timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outage = Outage(deadline)
        retry = outage.async_retry()
        while True:
            record = await retry.call_with_retry(partial(self._status, batch), outage.async_give_up)
            if record.complete:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                c = record.counts
                raise WaitTimeoutError.for_batch(batch, c.done, c.total, timeout_s)
            # Never past the deadline (as the sync wait): a long poll stretched a short timeout to poll_s.
            await asyncio.sleep(poll_s if deadline is None else min(poll_s, max(deadline - time.monotonic(), 0.0)))

    async def aclose(self) -> None:
        """Close the connections this client opened (a `redis=` given to it stays open: it is the caller's)."""
        if self._own_redis:
            await self.redis.aclose()
        self.sync.redis.close()
