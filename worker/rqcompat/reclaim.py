"""Taking back what nobody works on any more: a dead worker's started entries (as suspect groups, one
atomic script per dead take), our own lost entries, and ids stuck in RQ's intermediate list."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.exceptions
from redis import Redis
from rq import Queue
from rq.job import Job as RQJob
from rq.registry import StartedJobRegistry

from shared.keys import Keys, QueueRef
from shared.quarantine import Quarantine
from worker.recovery import SuspectGroup
from worker.rqcompat.decode import CRASHES_FIELD, _int, valid_id

_JOB_PREFIX = RQJob.redis_job_namespace_prefix


@dataclass(frozen=True)
class Abandoned:
    """A started-registry entry nobody works on any more. `crashed`: its worker died while running it (vs. lost
    track of it, or died while it was only held: `held_by` names that dead worker, whose held set lists it)."""

    member: bytes
    job_id: str
    exec_id: str
    crashed: bool
    held_by: str | None = None


class Reclaim:
    """Mixed into RQBridge: needs its keys, queues, registries, scripts and quarantine, and (from
    Registration) `worker_alive`."""

    redis: Redis
    keys: Keys
    worker_name: str
    incarnation: str
    queues: dict[QueueRef, Queue]
    started: dict[QueueRef, StartedJobRegistry]
    quarantine: Quarantine
    _recover: Any
    _requeue: Any
    _unstick: Any

    def abandoned(self, ref: QueueRef, *, in_flight: set[str], others: bool) -> list[Abandoned]:
        """Started entries nobody is working on any more:
        - ours whose heartbeat lapsed and that we are not running (we lost track, e.g. Redis failed mid-write);
        - an earlier process's under our name (we took its name over, so it is dead): crashed;
        - another worker's, once that worker is gone (its key expired or records a death), if `others`.
        A live worker's entries are never taken, even with a lapsed score: after a Redis outage every score
        may have lapsed while their owners are still running them."""
        key = self.started[ref].key
        try:
            entries = self.redis.zrange(key, 0, -1, withscores=True)
        except redis.exceptions.ResponseError:
            self.quarantine.move_key(key, "started registry is not a sorted set")
            return []
        now_s = time.time()
        out, alive = [], {}
        held: dict[str, set[str]] = {}
        for member, score in entries:
            parsed = _parse_member(member)
            if parsed is None:
                self.quarantine.put(key, "started entry is not '<job id>:<execution id>'", member)
                self.redis.zrem(key, member)
                continue
            job_id, exec_id, owner, incarnation = parsed
            if owner == self.worker_name and incarnation == self.incarnation:
                if score < now_s and job_id not in in_flight:
                    out.append(Abandoned(member, job_id, exec_id, crashed=False))
            elif owner == self.worker_name or others:
                if owner != self.worker_name and owner not in alive:
                    alive[owner] = self.worker_alive(owner)
                if owner == self.worker_name or not alive[owner]:
                    if owner not in held:
                        held[owner] = self.held_by(owner)
                    if exec_id in held[owner]:
                        out.append(Abandoned(member, job_id, exec_id, crashed=False, held_by=owner))
                    else:
                        out.append(Abandoned(member, job_id, exec_id, crashed=True))
        return out

    def held_by(self, owner: str) -> set[str]:
        """The execution ids a worker marked held (worker.ahead): its takes not running on its GPU."""
        key = self.keys.held(owner)
        try:
            raw = self.redis.smembers(key)
        except redis.exceptions.ResponseError:
            self.quarantine.move_key(key, "held set is not a set")
            return set()
        return {m.decode("utf-8", "replace") for m in raw}

    def prune_held(self) -> None:
        """Marks an earlier process under our name left in the held set we now share (it died) for takes no started
        registry holds any more (their jobs ended, or recovery returned them): nobody would remove them, and our
        own marks renew the set's expiry. A mark whose take is still registered stays: recovery reads it."""
        key = self.keys.held(self.worker_name)
        ours = f"{self.worker_name}.{self.incarnation}."
        theirs = {m for m in self.held_by(self.worker_name) if not m.startswith(ours)}
        if not theirs:
            return
        registered: set[str] = set()
        for registry in self.started.values():
            with contextlib.suppress(redis.exceptions.ResponseError):  # recovery moves such a registry aside
                for member in self.redis.zrange(registry.key, 0, -1):
                    parsed = _parse_member(member)
                    if parsed is not None:
                        registered.add(parsed[1])
        spent = theirs - registered
        if spent:
            with contextlib.suppress(redis.exceptions.ResponseError):
                self.redis.srem(key, *sorted(spent))

    def crash_counts(self, ids: Sequence[str]) -> dict[str, int]:
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(RQJob.key_for(job_id), CRASHES_FIELD)
            raw = pipe.execute(raise_on_error=False)
        return {i: _int(v) if isinstance(v, bytes) else 0 for i, v in zip(ids, raw, strict=True)}

    def requeue_lost(self, ref: QueueRef, entries: Sequence[Abandoned]) -> None:
        """Our own entries we lost track of: back to the queue front as they were (no crash counted). A queue
        key of the wrong type is moved aside first (the script refuses before it removes anything)."""
        args = [x for e in entries for x in (e.member, e.job_id)]
        if args:
            self._script_on_queue(ref, self._requeue, [self.started[ref].key, self.queues[ref].key, _JOB_PREFIX], args)
        # A dead worker's held takes are back in their queue: their marks go too.
        for owner in {e.held_by for e in entries if e.held_by is not None}:
            marks = {e.exec_id for e in entries if e.held_by == owner}
            with contextlib.suppress(redis.exceptions.ResponseError):
                self.redis.srem(self.keys.held(owner), *marks)

    def _script_on_queue(self, ref: QueueRef, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a script that pushes onto the model's queue; once more after moving a wrong-typed queue aside."""
        try:
            return script(keys=keys, args=args)
        except redis.exceptions.ResponseError as exc:
            if "KEVLAYA_BAD_QUEUE" not in str(exc):
                raise
            self.quarantine.move_key(self.queues[ref].key, "queue key is not a list")
            return script(keys=keys, args=args)

    def to_suspects(
        self, ref: QueueRef, entries: Sequence[Abandoned], crashes: dict[str, int], groups: Sequence[SuspectGroup]
    ) -> bool:
        """Move a dead take's entries into suspect groups at the front, atomically. False if another worker
        claimed any of them first (it recovers them)."""
        records = [orjson.dumps({"ids": list(g.ids), "dead": g.dead}) for g in groups]
        args: list[Any] = [len(entries), *[e.member for e in entries], len(crashes)]
        for job_id, count in crashes.items():
            args += [job_id, count]
        done = self._recover(
            keys=[self.started[ref].key, self.keys.suspects(ref.model, ref.lane), _JOB_PREFIX], args=[*args, *records]
        )
        return bool(done)

    def unstick_intermediate(self, ref: QueueRef, *, older_than_s: float) -> list[str]:
        """Ids left in RQ's intermediate list (by RQ tooling or a stock worker) for longer than older_than_s,
        moved back to the front of their queue (atomically). Returns them."""
        key = self.queues[ref].intermediate_queue_key
        try:
            raws = self.redis.lrange(key, 0, -1)
        except redis.exceptions.ResponseError:
            self.quarantine.move_key(key, "intermediate queue is not a list")
            return []
        out = []
        for raw in raws:
            job_id = valid_id(raw)
            if job_id is None:
                self.quarantine.put(key, "not a job id (bad bytes or characters)", raw)
                self.redis.lrem(key, 1, raw)
                continue
            first = self._first_seen(self.keys.first_seen(key, job_id))
            if first is not None and time.time() - first > older_than_s:
                names = [key, self.queues[ref].key, _JOB_PREFIX]
                if self._script_on_queue(ref, self._unstick, names, [job_id]):
                    out.append(job_id)
        return out

    def _first_seen(self, seen_key: str) -> float | None:
        """When an id was first seen stuck; None when first seen now. A stamp some other writer left unreadable
        (not a number, not finite, a key of another type) counts as long ago: NaN or infinity never compared
        older than the limit, and the job stayed stuck for good."""
        try:
            if self.redis.set(seen_key, time.time(), nx=True, ex=86400):
                return None
            first = float(self.redis.get(seen_key) or time.time())
        except ValueError:
            return 0.0
        except redis.exceptions.ResponseError:
            self.quarantine.move_key(seen_key, "first-seen stamp is not a string")
            return 0.0
        return first if math.isfinite(first) else 0.0

    def pending_started(self) -> int:
        total = 0
        for ref, registry in self.started.items():
            try:
                total += self.redis.zcard(registry.key) + self.redis.llen(self.keys.suspects(ref.model, ref.lane))
            except redis.exceptions.ResponseError:
                continue
        return total


def _parse_member(member: bytes) -> tuple[str, str, str, str | None] | None:
    """(job id, execution id, owner name, incarnation) of a started entry, or None if it is not ours to read."""
    try:
        text = member.decode("utf-8")
    except UnicodeDecodeError:
        return None
    job_id, sep, exec_id = text.rpartition(":")
    if not sep or valid_id(job_id) is None or not exec_id:
        return None
    parts = exec_id.rsplit(".", 2)
    if len(parts) == 3:
        return job_id, exec_id, parts[0], parts[1]
    return job_id, exec_id, parts[0], None  # an execution id of another writer: owner only
