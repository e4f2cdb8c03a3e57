"""The one way a job enters or leaves a kevlaya queue: RQ's public API (`Queue.prepare_data`, `enqueue_many`
on a pipeline, the canceled registry and job status), for the producer's submissions, cancels and the worker's
escalation follow-ups alike."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import WatchError
from rq import Queue, Retry
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.queue import EnqueueData
from rq.registry import CanceledJobRegistry

from shared.errors import KevlayaError
from shared.job import Job
from shared.jobfunc import RUN_DECISION
from shared.keys import Keys, QueueRef, queue_refs
from shared.quarantine import Quarantine, clear_the_way
from shared.serializer import serializer

ENQUEUE_TRIES = 3


@dataclass(frozen=True, kw_only=True)
class EnqueueSettings:
    """How long a job may run and how long its records live."""

    job_timeout_s: int = 1800
    ttl_s: int = 7 * 24 * 3600
    retries: int = 3


@dataclass(frozen=True)
class Entry:
    """One job to enqueue under a given RQ job id."""

    job_id: str
    job: Job


def queues_for(redis: Redis, keys: Keys, models: Sequence[str]) -> dict[QueueRef, Queue]:
    """Every lane's RQ queue of these models, each model's lanes in priority order."""
    return {
        ref: Queue(keys.queue_name(ref.model, ref.lane), connection=redis, serializer=serializer)
        for ref in queue_refs(list(models))
    }


def job_key(job_id: str) -> str:
    """The RQ job hash of an id."""
    return Queue.job_class.key_for(job_id)


def enqueue_entries(
    pipe: Pipeline, queues: Mapping[QueueRef, Queue], entries: Sequence[Entry], settings: EnqueueSettings
) -> None:
    """Add every entry to its model's lane's queue on `pipe` (a transaction the caller executes)."""
    for ref, queue in queues.items():
        datas = [_data(e, settings) for e in entries if e.job.queue == ref]
        if datas:
            queue.enqueue_many(datas, pipeline=pipe)


def expected_types(queues: Mapping[QueueRef, Queue], entries: Sequence[Entry]) -> dict[str, str]:
    """The Redis types an enqueue of these entries writes into (see shared.quarantine.clear_the_way)."""
    out = {queues[ref].key: "list" for ref in {e.job.queue for e in entries}}
    out[Queue.redis_queues_keys] = "set"
    out.update({job_key(e.job_id): "hash" for e in entries})
    return out


def enqueue_absent(
    redis: Redis,
    queues: Mapping[QueueRef, Queue],
    entries: Sequence[Entry],
    settings: EnqueueSettings,
    quarantine: Quarantine,
) -> list[Entry]:
    """Enqueue the entries whose job does not exist yet, in one transaction (WATCH on their job keys, so
    two workers re-running the same parent cannot both enqueue its follow-up). Returns those enqueued.

    A transaction that still failed a command (a key replaced with another type meanwhile) is undone --
    the job hashes it created are deleted, so "exists" cannot hide a job that is in no queue -- and tried
    again after the keys are moved aside."""
    if not entries:
        return []
    names = [job_key(e.job_id) for e in entries]
    for _ in range(ENQUEUE_TRIES):
        with redis.pipeline() as pipe:
            try:
                pipe.watch(*names)
                # Read in one round trip on another connection (the watching one answers one command at a time,
                # a round trip per follow-up): WATCH still fails the transaction if a key changes after it.
                with redis.pipeline(transaction=False) as look:
                    for name in names:
                        look.exists(name)
                    exists = look.execute()
                fresh = [e for e, found in zip(entries, exists, strict=True) if not found]
                if not fresh:
                    return []
                clear_the_way(redis, quarantine, expected_types(queues, fresh))
                pipe.multi()
                enqueue_entries(pipe, queues, fresh, settings)
                results = pipe.execute(raise_on_error=False)
            except WatchError:
                continue
        if not any(isinstance(r, Exception) for r in results):
            return fresh
        redis.delete(*[job_key(e.job_id) for e in fresh])
    raise KevlayaError(f"could not enqueue {len(entries)} follow-up(s): their keys keep changing type")


def _data(entry: Entry, settings: EnqueueSettings) -> EnqueueData:
    return Queue.prepare_data(
        RUN_DECISION,
        args=[entry.job.to_dict()],
        job_id=entry.job_id,
        description=f"{entry.job.model}:{entry.job.custom_id}",
        timeout=settings.job_timeout_s,
        result_ttl=settings.ttl_s,
        failure_ttl=settings.ttl_s,
        retry=Retry(max=settings.retries) if settings.retries > 0 else None,
    )


# Removes the given ids from a queue in one pass (LREM per id would be O(queue) each). KEYS[1]: the queue.
# ARGV: ids. Returns the ids removed.
_REMOVE_LUA = """
local drop = {}
for i = 1, #ARGV do drop[ARGV[i]] = true end
local keep, removed = {}, {}
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if drop[id] then removed[#removed + 1] = id else keep[#keep + 1] = id end
end
if #removed > 0 then
  redis.call('DEL', KEYS[1])
  for i = 1, #keep, 4000 do redis.call('RPUSH', KEYS[1], unpack(keep, i, math.min(i + 3999, #keep))) end
end
return removed
"""


def cancel_queued(redis: Redis, queue: Queue, job_ids: Sequence[str], *, ttl_s: int) -> list[str]:
    """Take these jobs out of the queue (one pass) and mark them canceled the way RQ's tools read it: status
    `canceled`, in the queue's canceled registry, and the job hash expiring with the batch. Returns the ids
    that were still queued (a worker may have taken the others)."""
    if not job_ids:
        return []
    removed = [i.decode() for i in redis.register_script(_REMOVE_LUA)(keys=[queue.key], args=list(job_ids))]
    registry = CanceledJobRegistry(queue=queue)
    with redis.pipeline(transaction=False) as pipe:
        for job_id in removed:
            job = RQJob(job_id, connection=redis)
            job.set_status(JobStatus.CANCELED, pipeline=pipe)
            registry.add(job, ttl=ttl_s, pipeline=pipe)
            pipe.expire(job.key, ttl_s)
        pipe.execute(raise_on_error=False)
    return removed


@dataclass(frozen=True)
class LaneDepth:
    """One lane's queue as `kevlaya status` shows it: jobs queued, and how long its head has waited."""

    queued: int
    oldest_wait_s: float | None


def lane_depths(redis: Redis, queues: Mapping[QueueRef, Queue]) -> dict[QueueRef, LaneDepth]:
    """Depth and head wait of every queue, in two round trips (a key of the wrong type reads as empty)."""
    refs = list(queues)
    with redis.pipeline(transaction=False) as pipe:
        for ref in refs:
            pipe.llen(queues[ref].key)
            pipe.lindex(queues[ref].key, 0)
        raw = pipe.execute(raise_on_error=False)
    heads = [h.decode("utf-8", "replace") if isinstance(h, bytes) else None for h in raw[1::2]]
    with redis.pipeline(transaction=False) as pipe:
        for head in heads:
            pipe.hget(job_key(head), "enqueued_at") if head else pipe.echo("")
        stamps = pipe.execute(raise_on_error=False)
    now = time.time()
    out = {}
    for i, ref in enumerate(refs):
        depth = raw[2 * i] if isinstance(raw[2 * i], int) else 0
        when = _rq_time(stamps[i]) if depth and isinstance(stamps[i], bytes) else None
        out[ref] = LaneDepth(depth, None if when is None else round(max(0.0, now - when), 3))
    return out


def _rq_time(value: bytes) -> float | None:
    """RQ's enqueued_at (UTC, '%Y-%m-%dT%H:%M:%S.%fZ') as a timestamp; None if unreadable."""
    try:
        stamp = datetime.strptime(value.decode("utf-8", "replace"), "%Y-%m-%dT%H:%M:%S.%fZ")
    except ValueError:
        return None
    return stamp.replace(tzinfo=timezone.utc).timestamp()


def stored_jobs(redis: Redis, job_ids: Sequence[str]) -> dict[str, Job]:
    """The jobs RQ still holds for these ids (JSON only: the serializer refuses anything else); ids whose
    hash expired or does not hold a kevlaya job are left out."""
    out = {}
    for rq_job in RQJob.fetch_many(list(job_ids), connection=redis, serializer=serializer):
        if rq_job is None:
            continue
        try:
            args = rq_job.args
            out[rq_job.id] = Job.from_dict(args[0], allow_system=True)
        except Exception:
            continue
    return out
