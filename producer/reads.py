"""The client's read side: follow a batch, wait for it, read results, list batches and queues. Reads Redis only."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from redis import Redis
from redis.client import PubSub
from redis.exceptions import ResponseError

from producer.outages import Outage, store_call, store_iter
from shared.enqueue import Queue, lane_depths
from shared.errors import BatchNotFoundError, ValidationError, WaitTimeoutError, WrongTypeError
from shared.keys import BATCH_ID_RE, Keys, QueueRef, job_id
from shared.store import BatchRecord, iter_export, quarantine_summary, read_batch, result_row, text_of
from shared.wrongtype import expecting


def known_batch_id(batch: str) -> str:
    """`batch` if a submit could have made it; else BatchNotFoundError (an argument that is not UTF-8 would
    otherwise fail in the Redis client's encoder, with a traceback)."""
    if not isinstance(batch, str) or not BATCH_ID_RE.match(batch):
        raise BatchNotFoundError(f"no batch {batch!r} (not a batch id: 1-128 letters, digits, '_' and '-')")
    return batch


def check_wait(poll_s: float, timeout_s: float | None) -> None:
    """ValidationError unless poll_s is a positive number of seconds and timeout_s None or not negative: no
    comparison with NaN is true, so `timeout_s=nan` waited forever; a poll of 0 spun, a negative or NaN one
    failed inside the Redis client."""
    if not _seconds(poll_s) or not 0 < poll_s < math.inf:
        raise ValidationError(f"poll_s {poll_s!r}: give a positive number of seconds", field="poll_s")
    if timeout_s is not None and (not _seconds(timeout_s) or not timeout_s >= 0):
        raise ValidationError(f"timeout_s {timeout_s!r}: give a non-negative number of seconds", field="timeout_s")


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_job_id(job: str) -> str:
    """The batch a job id `submit` returned names (`<batch>-<digest>`); BatchNotFoundError for no such id."""
    batch, _, _ = job.rpartition("-") if isinstance(job, str) else ("", "", "")
    if not BATCH_ID_RE.match(batch):
        raise BatchNotFoundError(f"no job {job!r}")
    return batch


def custom_id_of(job: str, batch: str, raw_ids: Iterable[bytes]) -> str:
    """The custom_id among the batch's items whose job id is `job`; BatchNotFoundError when none is (the id was
    never submitted, or its batch expired)."""
    for raw in raw_ids:
        custom_id = text_of(raw)
        if custom_id is not None and job_id(batch, custom_id) == job:
            return custom_id
    raise BatchNotFoundError(f"no job {job!r} (never submitted, or its batch expired)")


def known_custom_id(custom_id: str) -> str:
    """`custom_id` if a submit could have stored it (text that is UTF-8); else BatchNotFoundError."""
    if not isinstance(custom_id, str) or text_of(custom_id.encode("utf-8", "surrogatepass")) is None:
        raise BatchNotFoundError(f"no item {custom_id!r}")
    return custom_id


def answer_of(batch: str, custom_id: str, raw: bytes | None, in_batch: Any) -> dict[str, Any] | None:
    """What `result` returns from the item's stored result and whether the batch holds the item: None while
    it is pending, BatchNotFoundError when there is no such item (else a caller polling an expired batch's
    result, or a mistyped custom_id, would wait forever on a None)."""
    if raw is not None:
        return result_row(batch, custom_id, raw)
    if in_batch is not True and in_batch != 1:  # 0, or an error reading a key some writer gave another type
        raise BatchNotFoundError(f"no item {custom_id!r} in batch {batch!r} (never submitted, or expired)")
    return None


@dataclass(frozen=True, kw_only=True)
class BatchListing:
    """What `list_batches` read: the readable batches, newest first, and the errors naming the others' keys."""

    records: tuple[BatchRecord, ...]
    unreadable: tuple[WrongTypeError, ...]


class BatchReads:
    """What `Client` reads: its `redis`, `keys` and `queues` are set by the client."""

    redis: Redis
    redis_shown: str  # the URL a StoreError names (password hidden)
    keys: Keys
    queues: dict[QueueRef, Queue]

    @store_call
    def status(self, batch: str) -> BatchRecord:
        return read_batch(self.redis, self.keys, known_batch_id(batch))

    @store_call
    def wait(
        self, batch: str, *, poll_s: float = 0.5, timeout_s: float | None = None, on_poll: Any = None
    ) -> BatchRecord:
        """Poll until every item has a final result; returns the complete record. Raises WaitTimeoutError
        if timeout_s passes first (the batch goes on; wait again or export what is done). Redis being
        unreachable meanwhile is retried with backoff until the deadline (`OUTAGE_S` without one), and only
        then raised (RedisUnavailableError): a restart or failover does not end the wait."""
        check_wait(poll_s, timeout_s)
        known_batch_id(batch)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outage = Outage(deadline)
        retry = outage.retry()
        # The worker that writes a batch's last result announces it on the events channel: the wait wakes
        # on that message, and polls at `poll_s` only to show progress (and in case a message was missed).
        with self.redis.pubsub(ignore_subscribe_messages=True) as events:
            while True:
                record = retry.call_with_retry(partial(self._poll, events, batch), outage.give_up)
                if on_poll is not None:
                    on_poll(record)
                if record.complete:
                    return record
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    c = record.counts
                    raise WaitTimeoutError.for_batch(batch, c.done, c.total, timeout_s)
                wait_s = poll_s if left is None else min(poll_s, left)
                retry.call_with_retry(partial(events.get_message, timeout=wait_s), outage.give_up)

    def _poll(self, events: PubSub, batch: str) -> BatchRecord:
        """The batch's record, subscribed to the events channel first (again, after a failed subscribe)."""
        if not events.channels:
            events.subscribe(self.keys.events())
        return read_batch(self.redis, self.keys, batch)

    @store_call
    def workers_seen(self, within_s: float = 60.0) -> int:
        """Workers whose heartbeat is younger than within_s."""
        return int(self.redis.zcount(self.keys.workers(), time.time() - within_s, "+inf"))

    @store_call
    def result(self, job_id_or_batch: str, custom_id: str | None = None) -> dict[str, Any] | None:
        """One item's final answer (or error), or None while it is pending: by (batch, custom_id), or by the
        job id `submit` returned. BatchNotFoundError when there is no such item (or its batch expired)."""
        if custom_id is None:
            batch = split_job_id(job_id_or_batch)
            custom_id = custom_id_of(job_id_or_batch, batch, self.redis.sscan_iter(self.keys.batch_item_set(batch)))
        else:
            batch, custom_id = known_batch_id(job_id_or_batch), known_custom_id(custom_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.batch_results(batch), custom_id)
            pipe.sismember(self.keys.batch_item_set(batch), custom_id)
            raw, in_batch = pipe.execute(raise_on_error=False)
        return answer_of(batch, custom_id, None if isinstance(raw, Exception) else raw, in_batch)

    def iter_results(self, batch: str) -> Iterator[dict[str, Any]]:
        """One dict per item in input order: final answer (with its escalation chain) or error."""
        return store_iter(iter_export(self.redis, self.keys, known_batch_id(batch)), self.redis_shown)

    def _worker_row(self, raw_name: bytes, age_s: float) -> dict[str, Any]:
        name = raw_name.decode("utf-8", "replace")
        fields = ("jobs", "batches", "out_of_memory", "quarantined", "crashes_survived")
        try:
            values = self.redis.hmget(self.keys.worker_stats(name), fields)
        except ResponseError:
            values = [None] * len(fields)
        counts = {f: int(v) for f, v in zip(fields, values, strict=True) if v is not None and v.isdigit()}
        return {"name": name, "last_seen_s": round(age_s, 1), **counts}

    @store_call
    def batches(self, *, limit: int = 20) -> list[BatchRecord]:
        """The newest batches first (those whose keys have expired are left out, and those `list_batches` finds
        unreadable)."""
        return list(self.list_batches(limit=limit).records)

    @store_call
    def list_batches(self, *, limit: int = 20) -> BatchListing:
        """The newest readable batches first, up to `limit`, and an error for each batch met on the way whose key
        some other writer gave another type (`status` of it raises the same). Expired batches are left out."""
        records: list[BatchRecord] = []
        unreadable: list[WrongTypeError] = []
        if limit <= 0:
            return BatchListing(records=(), unreadable=())
        with expecting(self.redis, {self.keys.batches(): "zset"}):
            listed = self.redis.zrevrange(self.keys.batches(), 0, max(limit * 2, limit) - 1)
        for raw in listed:
            try:
                records.append(self.status(raw.decode("utf-8", "replace")))
            except BatchNotFoundError:  # expired, or an index entry no submit wrote
                continue
            except WrongTypeError as exc:  # one broken batch hides no other, and is not hidden itself
                unreadable.append(exc)
                continue
            if len(records) >= limit:
                break
        return BatchListing(records=tuple(records), unreadable=tuple(unreadable))

    @store_call
    def overview(self) -> dict[str, Any]:
        """Per model and lane: jobs queued and the head's wait in seconds; the workers seen in the last minute."""
        now = time.time()
        with expecting(self.redis, {self.keys.workers(): "zset"}):
            workers = self.redis.zrangebyscore(self.keys.workers(), now - 60, "+inf", withscores=True)
        queues: dict[str, dict[str, dict[str, Any]]] = {}
        for ref, d in lane_depths(self.redis, self.queues).items():
            queues.setdefault(ref.model, {})[ref.lane] = {"queued": d.queued, "oldest_wait_s": d.oldest_wait_s}
        return {
            "queues": queues,
            "workers": [self._worker_row(n, now - s) for n, s in workers],
            "quarantine": quarantine_summary(self.redis, self.keys),
        }
