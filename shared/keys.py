"""Every Redis key and id kevlaya writes, in one place. The prefix is configurable (default `kevlaya:`).

Keys only workers write live under `<prefix>w:`, so a producer's Redis ACL can be denied writes there
(README, "Security"); batch keys live under `<prefix>batch:`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from shared.errors import ConfigError

DEFAULT_PREFIX = "kevlaya:"

# What a batch id may be: it becomes part of Redis keys and RQ job ids, which the worker checks against
# JOB_ID_RE before it trusts an id read from Redis. `\Z`, not `$`: `$` also matches before a final newline.
BATCH_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,256}\Z")

# Priority lanes, highest first: each model has one RQ queue per lane. `interactive` work is taken first;
# `bulk` (files, nightly runs) is never starved (worker.lanes), in full batches unless interactive work is live
# (worker.pace).
INTERACTIVE = "interactive"
BULK = "bulk"
LANES: tuple[str, ...] = (INTERACTIVE, BULK)


@dataclass(frozen=True, order=True)
class QueueRef:
    """One RQ queue of kevlaya: a model's lane."""

    model: str
    lane: str = BULK

    def __str__(self) -> str:
        return f"{self.model}/{self.lane}"


def queue_refs(models: tuple[str, ...] | list[str]) -> list[QueueRef]:
    """Every queue of these models, each model's lanes in priority order."""
    return [QueueRef(m, lane) for m in models for lane in LANES]


def job_id(batch: str, custom_id: str) -> str:
    """Deterministic RQ job id: resubmitting an item into the same batch maps to the same job."""
    digest = hashlib.sha1(custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return f"{batch}-{digest}"


def followup_id(parent_job_id: str, model: str) -> str:
    """Deterministic id of an escalation follow-up: a retried parent never creates a second one."""
    return f"{parent_job_id}-{model}"


@dataclass(frozen=True)
class Keys:
    """Key names. RQ queue names are `<prefix><model>` (the bulk lane: the name queues had before lanes, so
    jobs queued by an older kevlaya stay where workers look) and `<prefix><model>:interactive`; RQ adds its
    own `rq:queue:` around them."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        # Empty, kevlaya's keys (`batches`, `events`, `w:...`) would sit bare among the database's other keys,
        # and a queue named after a model would be the model's bare name. The CLI's --prefix says the same.
        if not isinstance(self.prefix, str) or not self.prefix.strip():
            raise ConfigError(f"prefix {self.prefix!r}: give a non-empty prefix, e.g. {DEFAULT_PREFIX!r} (the default)")

    def queue_name(self, model: str, lane: str = BULK) -> str:
        return f"{self.prefix}{model}" if lane == BULK else f"{self.prefix}{model}:{lane}"

    def batch(self, batch: str) -> str:
        """Hash: id, created, expires, total, counters, flags."""
        return f"{self.prefix}batch:{batch}"

    def batch_items(self, batch: str) -> str:
        """List: custom_ids in input order."""
        return f"{self.prefix}batch:{batch}:items"

    def batch_item_set(self, batch: str) -> str:
        """Set: custom_ids already submitted (idempotent resubmission)."""
        return f"{self.prefix}batch:{batch}:ids"

    def batch_results(self, batch: str) -> str:
        """Hash: custom_id -> final result JSON. HSETNX keeps exactly one final result per item."""
        return f"{self.prefix}batch:{batch}:results"

    def batch_steps(self, batch: str) -> str:
        """Hash: custom_id -> the non-final (escalated) Laya result JSON."""
        return f"{self.prefix}batch:{batch}:steps"

    def batch_submits(self, batch: str) -> str:
        """Sorted set: submits still writing into the batch -> their last sign of life (a dead one ages out)."""
        return f"{self.prefix}batch:{batch}:submits"

    def batch_running(self, batch: str) -> str:
        """Set: job ids a worker has taken and not yet finalised."""
        return f"{self.prefix}batch:{batch}:running"

    def events(self) -> str:
        """Pub/sub channel: a batch id each time a batch reaches a terminal state (once per batch)."""
        return f"{self.prefix}events"

    def queued(self) -> str:
        """Pub/sub channel: a lane name each time a submit enqueues a chunk of jobs (idle workers wake on it
        instead of at their next poll)."""
        return f"{self.prefix}queued"

    def outbox(self) -> str:
        """List: JSON notices of finished batches that asked for an HTTP POST; workers deliver them."""
        return f"{self.prefix}notices"

    def outbox_sending(self, worker: str) -> str:
        """List: the notice a worker is delivering (moved back to the outbox if it dies meanwhile)."""
        return f"{self.prefix}w:notices:{worker}"

    def notice_senders(self) -> str:
        """Set: workers that deliver notices (recovery returns a dead one's notice in flight)."""
        return f"{self.prefix}w:notice-senders"

    def batches(self) -> str:
        """Sorted set: batch id -> created timestamp."""
        return f"{self.prefix}batches"

    def workers(self) -> str:
        """Sorted set: worker name -> last heartbeat timestamp."""
        return f"{self.prefix}w:workers"

    def idle_workers(self) -> str:
        """Sorted set: workers between takes -> since when (N workers share a queue's tail among the idle ones)."""
        return f"{self.prefix}w:idle"

    def worker_stats(self, name: str) -> str:
        """Hash: counters a worker publishes (batches, jobs, switches, peak memory)."""
        return f"{self.prefix}w:worker:{name}:stats"

    def counter(self, name: str) -> str:
        """Global counters (e.g. duplicate_final_results: second final answers refused by HSETNX)."""
        return f"{self.prefix}w:counter:{name}"

    def suspects(self, model: str, lane: str = BULK) -> str:
        """List: JSON groups of job ids whose worker died running them, each run again as one batch (per
        model and lane, so recovered work keeps its priority)."""
        return f"{self.prefix}w:suspects:{model}" if lane == BULK else f"{self.prefix}w:suspects:{model}:{lane}"

    def held(self, worker: str) -> str:
        """Set: execution ids of a worker's takes that are in its hands but not on its GPU (taken ahead while
        another take runs, or answered and still being written). A crash is not theirs: recovery returns their
        jobs to the front of their queue without counting one."""
        return f"{self.prefix}w:held:{worker}"

    def quarantine(self) -> str:
        """List: JSON records of entries the worker could not read, newest first (capped)."""
        return f"{self.prefix}w:quarantine"

    def quarantined_key(self, name: str, stamp: float) -> str:
        """Where a key of the wrong Redis type is renamed to, so nothing reads it again."""
        return f"{self.prefix}w:quarantined:{stamp:.6f}:{name}"

    def first_seen(self, queue_key: str, job_id: str) -> str:
        """String: when an id was first seen in RQ's intermediate list (stuck-job sweep)."""
        return f"{self.prefix}w:first-seen:{queue_key}:{job_id}"

    def schedules(self) -> str:
        """Set: names of the schedules `kevlaya schedule` has run (for `kevlaya schedule --list`)."""
        return f"{self.prefix}schedules"

    def schedule(self, name: str) -> str:
        """Hash: a schedule's spec (JSON), its last slot run and the batch of it."""
        return f"{self.prefix}schedule:{name}"

    def schedule_runs(self, name: str) -> str:
        """Hash: slot stamp (UTC, sortable) -> JSON record of that slot's run, or of its being missed."""
        return f"{self.prefix}schedule:{name}:runs"

    def schedule_slot(self, name: str, stamp: str) -> str:
        """String, SET NX: the scheduler that runs this slot (two schedulers of one schedule: one run per slot)."""
        return f"{self.prefix}schedule:{name}:slot:{stamp}"

    def batch_keys(self, batch: str) -> list[str]:
        return [
            self.batch(batch),
            self.batch_items(batch),
            self.batch_item_set(batch),
            self.batch_results(batch),
            self.batch_steps(batch),
            self.batch_running(batch),
            self.batch_submits(batch),
        ]
