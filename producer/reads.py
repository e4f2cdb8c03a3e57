"""The client's read side: follow a batch, wait for it, read results, list batches and queues. Reads Redis only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from shared.enqueue import Queue, lane_depths
from shared.errors import BatchNotFoundError, WaitTimeoutError
from shared.keys import BATCH_ID_RE, Keys, QueueRef, job_id
from shared.store import BatchRecord, iter_export, quarantine_summary, read_batch, result_row, text_of


def known_batch_id(batch: str) -> str:
    """`batch` if a submit could have made it; else BatchNotFoundError (an argument that is not UTF-8 would
    otherwise fail in the Redis client's encoder, with a traceback)."""
    if not isinstance(batch, str) or not BATCH_ID_RE.match(batch):
        raise BatchNotFoundError(f"no batch {batch!r} (not a batch id: 1-128 letters, digits, '_' and '-')")
    return batch


class BatchReads:
    """What `Client` reads: its `redis`, `keys` and `queues` are set by the client."""

    redis: Redis
    keys: Keys
    queues: dict[QueueRef, Queue]

    def status(self, batch: str) -> BatchRecord:
        return read_batch(self.redis, self.keys, known_batch_id(batch))

    def wait(
        self, batch: str, *, poll_s: float = 0.5, timeout_s: float | None = None, on_poll: Any = None
    ) -> BatchRecord:
        """Poll until every item has a final result; returns the complete record. Raises WaitTimeoutError
        if timeout_s passes first (the batch goes on; wait again or export what is done)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # The worker that writes a batch's last result announces it on the events channel: the wait wakes
        # on that message, and polls at `poll_s` only to show progress (and in case a message was missed).
        with self.redis.pubsub(ignore_subscribe_messages=True) as events:
            events.subscribe(self.keys.events())
            while True:
                record = self.status(batch)
                if on_poll is not None:
                    on_poll(record)
                if record.complete:
                    return record
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    c = record.counts
                    raise WaitTimeoutError.for_batch(batch, c.done, c.total, timeout_s)
                events.get_message(timeout=poll_s if left is None else min(poll_s, left))

    def workers_seen(self, within_s: float = 60.0) -> int:
        """Workers whose heartbeat is younger than within_s."""
        return int(self.redis.zcount(self.keys.workers(), time.time() - within_s, "+inf"))

    def result(self, job_id_or_batch: str, custom_id: str | None = None) -> dict[str, Any] | None:
        """One item's final answer (or error), or None while it is pending: by (batch, custom_id), or by the
        job id `submit` returned."""
        if custom_id is None:
            batch, _, _ = job_id_or_batch.rpartition("-")
            texts = (text_of(c) for c in self.redis.sscan_iter(self.keys.batch_item_set(batch)))
            ids = {job_id(batch, c): c for c in texts if c is not None}
            if job_id_or_batch not in ids:
                raise BatchNotFoundError(f"no job {job_id_or_batch!r}")
            custom_id = ids[job_id_or_batch]
        else:
            batch = job_id_or_batch
        raw = self.redis.hget(self.keys.batch_results(batch), custom_id)
        return None if raw is None else result_row(batch, custom_id, raw)

    def iter_results(self, batch: str) -> Iterator[dict[str, Any]]:
        """One dict per item in input order: final answer (with its escalation chain) or error."""
        return iter_export(self.redis, self.keys, known_batch_id(batch))

    def _worker_row(self, raw_name: bytes, age_s: float) -> dict[str, Any]:
        name = raw_name.decode("utf-8", "replace")
        fields = ("jobs", "batches", "out_of_memory", "quarantined", "crashes_survived")
        try:
            values = self.redis.hmget(self.keys.worker_stats(name), fields)
        except ResponseError:
            values = [None] * len(fields)
        counts = {f: int(v) for f, v in zip(fields, values, strict=True) if v is not None and v.isdigit()}
        return {"name": name, "last_seen_s": round(age_s, 1), **counts}

    def batches(self, *, limit: int = 20) -> list[BatchRecord]:
        """The newest batches first (those whose keys have expired are left out)."""
        out: list[BatchRecord] = []
        if limit <= 0:
            return out
        for raw in self.redis.zrevrange(self.keys.batches(), 0, max(limit * 2, limit) - 1):
            try:
                out.append(self.status(raw.decode("utf-8", "replace")))
            except BatchNotFoundError:
                continue
            if len(out) >= limit:
                break
        return out

    def overview(self) -> dict[str, Any]:
        """Per model and lane: jobs queued and the head's wait in seconds; the workers seen in the last minute."""
        now = time.time()
        workers = self.redis.zrangebyscore(self.keys.workers(), now - 60, "+inf", withscores=True)
        queues: dict[str, dict[str, dict[str, Any]]] = {}
        for ref, d in lane_depths(self.redis, self.queues).items():
            queues.setdefault(ref.model, {})[ref.lane] = {"queued": d.queued, "oldest_wait_s": d.oldest_wait_s}
        return {
            "queues": queues,
            "workers": [self._worker_row(n, now - s) for n, s in workers],
            "quarantine": quarantine_summary(self.redis, self.keys),
        }
