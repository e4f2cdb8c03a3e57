"""The Python client: submit jobs, follow batches, export results, cancel. Talks to Redis only."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from redis import Redis
from redis.exceptions import WatchError

from producer.outages import store_call
from producer.reads import BatchReads
from shared import models as known_models
from shared.conn import check_bytes_replies, connect, url_of
from shared.enqueue import (
    ENQUEUE_TRIES,
    EnqueueSettings,
    Entry,
    Queue,
    cancel_queued,
    enqueue_entries,
    expected_types,
    job_key,
    queues_for,
    stored_jobs,
)
from shared.errors import (
    CANCELLED,
    EXPIRED,
    BatchClosedError,
    KevlayaError,
    SubmissionError,
    ValidationError,
)
from shared.job import DEFAULT_LIMITS, Job, Limits
from shared.keys import BATCH_ID_RE, BULK, DEFAULT_PREFIX, INTERACTIVE, LANES, Keys, QueueRef, followup_id, job_id
from shared.quarantine import Quarantine, clear_the_way
from shared.result import Result
from shared.store import (
    DEFAULT_BATCH_TTL_S,
    BatchRecord,
    answers_escalated,
    answers_item,
    batch_state,
    ended_kind,
    notify_if_done,
    promote_step,
    record_result,
    stored_field,
    text_of,
)
from shared.wrongtype import expecting

# Jobs per enqueue transaction. About one worker take: a worker starts on the first chunk while the rest are
# still being written (600 jobs in one transaction were visible only ~0.2 s after the submit began).
PIPELINE_CHUNK = 256
DEFAULT_COMPLETION_WINDOW_S = 24 * 3600  # items still queued after this end as `expired` (OpenAI's 24 h)
DEFAULT_RETRIES = 3
DEFAULT_JOB_TIMEOUT_S = 1800


def new_batch_id() -> str:
    return f"b{int(time.time()):x}{secrets.token_hex(4)}"


def check_lane(lane: str) -> str:
    if lane not in LANES:
        raise ValidationError(f"unknown lane {lane!r}; allowed: {', '.join(LANES)}", field="lane")
    return lane


def check_batch_id(batch_id: str) -> str:
    """A batch id becomes part of Redis keys and job ids: letters, digits, '_' and '-', at most 128."""
    if not isinstance(batch_id, str) or not BATCH_ID_RE.match(batch_id):
        raise ValidationError(
            f"batch id {batch_id!r} is not 1-128 characters of letters, digits, '_' and '-'", field="batch"
        )
    return batch_id


def _no_parent(job: Job) -> None:
    """A dict cannot name a `parent` (a system field); a Job instance (built by hand, or by `Job.from_json`) could,
    and its answer was then counted as a follow-up's and recorded as escalated from a job that never ran."""
    if job.parent is not None:
        raise ValidationError("'parent' is set by kevlaya for escalation follow-ups, not by a submit", field="parent")


@dataclass(frozen=True)
class BatchHandle:
    """What submit_batch returns: the batch id, how many items were new, and how many were already there."""

    client: Client
    id: str
    enqueued: int
    skipped: int

    def status(self) -> BatchRecord:
        return self.client.status(self.id)

    def results(self) -> Iterator[dict[str, Any]]:
        return self.client.iter_results(self.id)

    def wait(self, *, poll_s: float = 0.5, timeout_s: float | None = None) -> BatchRecord:
        return self.client.wait(self.id, poll_s=poll_s, timeout_s=timeout_s)


class Client(BatchReads):
    """Producer API. `Client(redis_url=...)` or `Client(redis=...)`; all keys under `prefix`."""

    def __init__(
        self,
        *,
        redis: Redis | None = None,
        redis_url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        limits: Limits = DEFAULT_LIMITS,
        batch_ttl_s: int = DEFAULT_BATCH_TTL_S,
        retries: int = DEFAULT_RETRIES,
        job_timeout_s: int = DEFAULT_JOB_TIMEOUT_S,
    ) -> None:
        if redis is not None:
            check_bytes_replies(redis, "Client")
        self.redis = redis if redis is not None else connect(redis_url)
        self.redis_shown = url_of(self.redis)  # what a StoreError names
        self.keys = Keys(prefix)
        self.limits = limits
        self.batch_ttl_s = batch_ttl_s
        self.retries = retries
        self.job_timeout_s = job_timeout_s
        self.queues = queues_for(self.redis, self.keys, known_models.MODEL_NAMES)
        self.enqueue = EnqueueSettings(job_timeout_s=job_timeout_s, ttl_s=batch_ttl_s, retries=retries)
        self.quarantine = Quarantine(self.redis, self.keys)

    def queue(self, model: str, lane: str = BULK) -> Queue:
        """The RQ queue of a model's lane (RQ's own API: count, job ids, registries)."""
        return self.queues[QueueRef(model, lane)]

    # ---- submit ---------------------------------------------------------------------------
    @store_call
    def submit(
        self, job: dict[str, Any] | Job, *, model: str | None = None, lane: str = INTERACTIVE
    ) -> tuple[str, str]:
        """Submit one job as a batch of one; returns (batch_id, job_id): `result(job_id)` reads its answer.
        It goes to the `interactive` lane (taken before bulk work) unless `lane` or the job itself names one."""
        parsed = job if isinstance(job, Job) else self.validate(job, default_model=model)
        handle = self.submit_batch([parsed], lane=lane)
        return handle.id, job_id(handle.id, parsed.custom_id)

    def validate(self, obj: dict[str, Any], *, default_model: str | None = None, position: int = 1) -> Job:
        """A job from a dict; one without a custom_id gets `item-<position>` (its place in the submission),
        so resubmitting the same list into the same batch is idempotent."""
        if isinstance(obj, dict) and "custom_id" not in obj:
            obj = {**obj, "custom_id": f"item-{position}"}
        return Job.from_dict(obj, limits=self.limits, default_model=default_model)

    @store_call
    def submit_batch(
        self,
        jobs: Iterable[Job | dict[str, Any]],
        *,
        batch_id: str | None = None,
        model: str | None = None,
        escalate: bool = True,
        progress: Any = None,
        completion_window_s: float = DEFAULT_COMPLETION_WINDOW_S,
        notify_url: str | None = None,
        lane: str = BULK,
    ) -> BatchHandle:
        """Validate every job, then enqueue them. Items already in `batch_id` are skipped, however often and
        however concurrently they are submitted: each chunk claims its items and enqueues them in one
        transaction (WATCH on the batch's item set), so an item is counted and enqueued once.

        Raises SubmissionError (nothing enqueued) if any job is invalid or a custom_id repeats,
        ValidationError if there is no job at all, and BatchClosedError if `batch_id` names a cancelled or
        expired batch. Every check runs before the first write. `progress`, if given, is called with the number
        of jobs handled so far. `lane` is the lane of jobs that name none (`bulk` by default; `interactive` work
        is taken first).
        """
        if batch_id is not None:
            check_batch_id(batch_id)
        check_lane(lane)
        if not (isinstance(completion_window_s, (int, float)) and 0 < completion_window_s < math.inf):  # NaN too
            raise ValidationError(
                f"completion window {completion_window_s!r} s: give a positive number of seconds", field="expires_in"
            )
        parsed = self._validate_all(jobs, model)
        if not parsed:  # an empty batch would be announced complete at once, hiding the mistake
            raise ValidationError("nothing to submit: no jobs given (an empty file, or blank lines only)")
        batch = batch_id or new_batch_id()
        state = batch_state(self.redis, self.keys, batch)
        if state in ("cancelled", "expired"):
            raise BatchClosedError(f"batch {batch!r} is {state}; submit into a new batch instead")
        if notify_url is not None and not notify_url.startswith(("http://", "https://")):
            raise ValidationError(f"notify URL {notify_url!r} is not http(s)://", field="notify_url")
        token = secrets.token_hex(8)
        self._holding(batch, token)
        self._write_batch_header(batch, escalate=escalate, window_s=completion_window_s, notify_url=notify_url)
        enqueued = 0
        for start in range(0, len(parsed), PIPELINE_CHUNK):
            self._holding(batch, token)
            enqueued += self._enqueue_chunk(batch, parsed[start : start + PIPELINE_CHUNK], lane)
            if progress is not None:
                progress(min(start + PIPELINE_CHUNK, len(parsed)))
        self._done_submitting(batch, token)
        notify_if_done(self.redis, self.keys, batch)  # every item may have been answered while it was writing
        return BatchHandle(self, batch, enqueued=enqueued, skipped=len(parsed) - enqueued)

    def _validate_all(self, jobs: Iterable[Job | dict[str, Any]], model: str | None) -> list[Job]:
        parsed: list[Job] = []
        errors: list[ValidationError] = []
        seen: set[str] = set()
        for index, item in enumerate(jobs, start=1):
            try:
                if isinstance(item, Job):
                    # One `validate` made is taken as it is; one built by hand may hold anything: checked as a dict.
                    valid = item.validated_under(self.limits)
                    job = item if valid else Job.from_dict(item.to_dict(), limits=self.limits, allow_system=True)
                else:
                    job = self.validate(item, default_model=model, position=index)
                _no_parent(job)
            except ValidationError as exc:
                errors.append(exc.at_line(index))
                continue
            if job.custom_id in seen:
                errors.append(ValidationError(f"duplicate custom_id {job.custom_id!r}", field="custom_id", line=index))
            seen.add(job.custom_id)
            parsed.append(job)
        if errors:
            raise SubmissionError(errors)
        return parsed

    def _holding(self, batch: str, token: str) -> None:
        """This submit still writes into the batch: it stays `validating` and unannounced meanwhile. A submit
        that dies stops refreshing this and ages out (shared.store.SUBMIT_ALIVE_S)."""
        key = self.keys.batch_submits(batch)
        clear_the_way(self.redis, self.quarantine, {key: "zset"})
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {token: time.time()})
            pipe.expire(key, self.batch_ttl_s)
            pipe.execute()

    def _done_submitting(self, batch: str, token: str) -> None:
        self.redis.zrem(self.keys.batch_submits(batch), token)

    def _write_batch_header(self, batch: str, *, escalate: bool, window_s: float, notify_url: str | None) -> None:
        now = time.time()
        key = self.keys.batch(batch)
        with self.redis.pipeline() as pipe:
            pipe.hsetnx(key, "created_at", repr(now))
            pipe.hsetnx(key, "window_ends_at", repr(now + window_s))  # the first submit opens the window
            if notify_url:
                pipe.hset(key, "notify_url", notify_url)
            pipe.hset(key, mapping={"id": batch, "expires_at": repr(now + self.batch_ttl_s)})
            if not escalate:
                pipe.hset(key, "escalate_off", "1")
            pipe.zadd(self.keys.batches(), {batch: now})
            pipe.expire(key, self.batch_ttl_s)
            pipe.execute()

    def _enqueue_chunk(self, batch: str, jobs: Sequence[Job], lane: str) -> int:
        """Claim the chunk's new items and enqueue their RQ jobs in one transaction; retried if a
        concurrent submitter changed the batch's item set meanwhile. Returns how many were new.

        Keys of the wrong type are moved aside first; a transaction that still failed a command (one
        replaced meanwhile) is undone -- its items unclaimed, its job hashes deleted -- and tried again."""
        items, id_set = self.keys.batch_items(batch), self.keys.batch_item_set(batch)
        for _ in range(ENQUEUE_TRIES):
            with self.redis.pipeline() as pipe:
                try:
                    pipe.watch(id_set)
                    known = pipe.smismember(id_set, [j.custom_id for j in jobs])
                    fresh = [j for j, k in zip(jobs, known, strict=True) if not k]
                    if not fresh:
                        return 0
                    entries = [
                        Entry(job_id(batch, j.custom_id), replace(j, batch=batch, lane=j.lane or lane)) for j in fresh
                    ]
                    expected = {items: "list", id_set: "set"} | expected_types(self.queues, entries)
                    clear_the_way(self.redis, self.quarantine, expected)
                    pipe.multi()
                    ids = [j.custom_id for j in fresh]
                    pipe.rpush(items, *ids)
                    pipe.sadd(id_set, *ids)
                    for key in (items, id_set):
                        pipe.expire(key, self.batch_ttl_s)
                    enqueue_entries(pipe, self.queues, entries, self.enqueue)
                    pipe.publish(self.keys.queued(), lane)  # idle workers wake now, not at their next poll
                    results = pipe.execute(raise_on_error=False)
                except WatchError:
                    continue
            if not any(isinstance(r, Exception) for r in results):
                return len(fresh)
            self._undo_claim(batch, entries)
        raise KevlayaError(f"batch {batch}: could not enqueue a chunk, its keys keep changing type; nothing was lost")

    def _undo_claim(self, batch: str, entries: Sequence[Entry]) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(self.keys.batch_item_set(batch), *[e.job.custom_id for e in entries])
            for e in entries:
                pipe.lrem(self.keys.batch_items(batch), 1, e.job.custom_id)
                pipe.lrem(self.queues[e.job.queue].key, 1, e.job_id)
            pipe.delete(*[job_key(e.job_id) for e in entries])
            pipe.execute(raise_on_error=False)

    # ---- retry ----------------------------------------------------------------------------
    RETRY_TRIES = 50  # transactions tried while workers keep writing the batch's other results

    @store_call
    def retry_failed(self, batch: str) -> int:
        """Run the batch's failed items again (errors other than cancelled and expired): every error is removed
        and its job enqueued again in one transaction, so an item is never both or neither, and the batch is
        never seen complete (nor announced) half-way through the retry. Returns how many were requeued; an item
        whose job RQ no longer holds (expired) is left as it is."""
        record = self.status(batch)
        if record.cancel_requested:
            raise BatchClosedError(f"batch {batch!r} is cancelled; nothing to retry")
        if record.window_ends_at is not None and time.time() > record.window_ends_at:
            raise BatchClosedError(f"batch {batch!r} is past its completion window; a retried item would expire")
        results, key = self.keys.batch_results(batch), self.keys.batch(batch)
        # The keys this transaction reads and writes but a job's own (a pipeline's error names that one).
        kinds = {results: "hash", key: "hash", **{q.key: "list" for q in self.queues.values()}}
        for _ in range(self.RETRY_TRIES):
            with self.redis.pipeline() as pipe, expecting(self.redis, kinds):
                try:
                    pipe.watch(results)  # a worker writing any result meanwhile: read again, try again
                    failed: dict[str, dict[str, Any]] = {}
                    # The counters this retry changes, recounted from the results as they stand (WATCHed: every
                    # counter write of the worker's script comes with a result write). Set, not moved by HINCRBY:
                    # on a value some other writer left that is no integer to Redis, that one command failed while
                    # the rest of the transaction applied, and a negative one went further below zero.
                    failures = escalated = 0
                    for cid, raw in pipe.hscan_iter(results):
                        stored = stored_field(cid, raw)
                        failures += ended_kind(stored) == "failed"
                        escalated += answers_escalated(stored)
                        if stored is not None and retryable(batch, stored):
                            failed[stored["job_id"]] = stored
                    jobs = stored_jobs(self.redis, list(failed))
                    if not jobs:
                        return 0
                    pipe.multi()
                    for jid in jobs:
                        pipe.hdel(results, failed[jid]["custom_id"])
                        pipe.hdel(job_key(jid), "kevlaya_crashes")  # a fresh start: earlier crashes no longer count
                    followups = sum(1 for jid in jobs if failed[jid].get("escalated_from"))
                    pipe.hset(key, mapping={"failed": failures - len(jobs), "followups_done": escalated - followups})
                    pipe.hdel(key, "notified_at")  # the batch is announced again when it finishes again
                    enqueue_entries(pipe, self.queues, [Entry(jid, job) for jid, job in jobs.items()], self.enqueue)
                    pipe.execute()
                    return len(jobs)
                except WatchError:
                    continue
        raise KevlayaError(f"batch {batch}: its results kept changing; nothing was retried, try again")

    # ---- cancel ---------------------------------------------------------------------------
    @store_call
    def cancel(self, batch: str) -> int:
        """Cancel every still-queued item of the batch; running ones finish. Returns how many were cancelled.

        The flag is set first, so a worker that takes one of these jobs in the meantime cancels it too.
        """
        if self.status(batch).complete:  # raises BatchNotFoundError for an unknown batch
            return 0  # nothing left to cancel: a finished batch keeps its status
        with self.redis.pipeline() as pipe:
            pipe.hset(self.keys.batch(batch), "cancel_requested", "1")
            pipe.hsetnx(self.keys.batch(batch), "cancelled_at", repr(time.time()))  # a second cancel keeps the first's
            pipe.execute()
        # No submit writes an id that is not UTF-8: one there is no item of this batch, and no job of one.
        with expecting(self.redis, {self.keys.batch_items(batch): "list"}):
            raw_ids = self.redis.lrange(self.keys.batch_items(batch), 0, -1)
        custom_ids = [c for c in map(text_of, raw_ids) if c is not None]
        by_id = {job_id(batch, c): c for c in custom_ids}
        base_ids = set(by_id)
        by_id.update({followup_id(j, to): c for j, c in list(by_id.items()) for to in known_models.MODEL_NAMES})
        cancelled = 0
        for ref, queue in self.queues.items():
            with expecting(self.redis, {queue.key: "list"}):
                removed = cancel_queued(self.redis, queue, list(by_id), ttl_s=self.batch_ttl_s)
            for jid in removed:
                if jid not in base_ids and promote_step(self.redis, self.keys, batch, by_id[jid]):
                    continue  # a follow-up: the item keeps its computed Laya answer
                result = Result.failure(
                    custom_id=by_id[jid],
                    model=ref.model,
                    job_id=jid,
                    batch=batch,
                    error_type=CANCELLED,
                    message="cancelled before it ran",
                )
                cancelled += bool(record_result(self.redis, self.keys, result))
        return cancelled


def retryable(batch: str, row: dict[str, Any]) -> bool:
    """Whether a stored result (`stored_field`) is a failure of its item that `retry_failed` runs again: not an
    answer, a cancelled or expired item, or a value no job of this item wrote (left as it is: every byte in Redis
    is untrusted; a failure naming another batch's job requeued that job, and this item never got an answer
    again)."""
    if row.get("error") is None or row["error"]["type"] in (CANCELLED, EXPIRED):
        return False
    return answers_item(batch, row["custom_id"], row["job_id"])
