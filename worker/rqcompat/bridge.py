"""RQBridge: kevlaya's queues over RQ's data model -- take, load, heartbeat, finish -- with registration
and reclaiming mixed in from their own modules."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson
import redis.exceptions
from redis import Redis
from rq import Queue
from rq.job import Job as RQJob
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

from shared.errors import PayloadError
from shared.keys import Keys, QueueRef, queue_refs
from shared.quarantine import Quarantine
from shared.serializer import serializer
from worker.rqcompat.decode import (
    CRASHES_FIELD,
    FAILED_FIELD,
    RawJob,
    decode_job,
    parse_rq_time,
    rq_now,
    valid_id,
)
from worker.rqcompat.reclaim import Reclaim
from worker.rqcompat.registration import Registration
from worker.rqcompat.scripts import (
    _FINISH_LUA,
    _IDLE_PEERS_LUA,
    _RECOVER_LUA,
    _REQUEUE_LUA,
    _TAKE_GROUP_LUA,
    _TAKE_LUA,
    _UNSTICK_LUA,
)

_JOB_PREFIX = RQJob.redis_job_namespace_prefix


@dataclass(frozen=True)
class SuspectTake:
    """One suspect group taken: its jobs, and whether they are to be written off instead of run."""

    jobs: list[RawJob]
    dead: bool = False


@dataclass(frozen=True)
class SharedTake:
    """One take of a queue: its job ids, and the rows it was allowed (the capacity asked for, or this worker's
    share of the queue's tail: worker.tail)."""

    ids: list[str]
    limit: int


@dataclass(frozen=True)
class QueueFacts:
    depth: int
    oldest_enqueued_at: float | None
    suspect_groups: int


class RQBridge(Registration, Reclaim):
    """RQ's queues and registries for kevlaya's queues, used by the batch worker."""

    def __init__(self, redis: Redis, keys: Keys, models: Sequence[str], worker_name: str) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_name = worker_name
        # A new incarnation per process: entries of an earlier process with the same --name are a crash's.
        self.incarnation = uuid.uuid4().hex[:8]
        self.quarantine = Quarantine(redis, keys)
        # Each model's lanes in priority order (RQ's worker registration lists them so, as `rq info` shows).
        self.refs = queue_refs(list(models))
        self.queues = {
            r: Queue(keys.queue_name(r.model, r.lane), connection=redis, serializer=serializer) for r in self.refs
        }
        self.started = {m: StartedJobRegistry(queue=q) for m, q in self.queues.items()}
        self.finished = {m: FinishedJobRegistry(queue=q) for m, q in self.queues.items()}
        self.failed = {m: FailedJobRegistry(queue=q) for m, q in self.queues.items()}
        self._take_script = redis.register_script(_TAKE_LUA)
        self._take_group = redis.register_script(_TAKE_GROUP_LUA)
        self._idle_peers = redis.register_script(_IDLE_PEERS_LUA)
        self._recover = redis.register_script(_RECOVER_LUA)
        self._requeue = redis.register_script(_REQUEUE_LUA)
        self._unstick = redis.register_script(_UNSTICK_LUA)
        self._finish = redis.register_script(_FINISH_LUA)
        self._seq = 0
        self.exec_id = f"{worker_name}.{self.incarnation}.0"
        # The execution ids this process has marked held and not yet seen unmarked (`mark_held`); the loop's and
        # the helper's thread both mark.
        self.held: set[str] = set()
        self._held_lock = threading.Lock()

    # ---- queue facts for the policy -----------------------------------------------------------
    def queue_facts(self, *, move_aside: bool = True) -> dict[QueueRef, QueueFacts]:
        """Per model and lane: queue length, the head job's enqueue time, and suspect groups waiting. A key of
        the wrong type reads as empty and (unless `move_aside` is False: a metrics scrape writes nothing) is
        moved aside."""
        refs = self.refs
        with self.redis.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.llen(self.queues[ref].key)
                pipe.lindex(self.queues[ref].key, 0)
                pipe.llen(self.keys.suspects(ref.model, ref.lane))
            raw = pipe.execute(raise_on_error=False)
        heads = [valid_id(h) if isinstance(h, bytes) else None for h in raw[1::3]]
        with self.redis.pipeline(transaction=False) as pipe:
            for head in heads:
                pipe.hget(RQJob.key_for(head), "enqueued_at") if head else pipe.echo("")
            times = pipe.execute(raise_on_error=False)
        out = {}
        for i, ref in enumerate(refs):
            depth, groups = raw[3 * i], raw[3 * i + 2]
            if isinstance(depth, Exception) and move_aside:
                self.quarantine.move_key(self.queues[ref].key, "queue key is not a list")
            if isinstance(groups, Exception) and move_aside:
                self.quarantine.move_key(self.keys.suspects(ref.model, ref.lane), "suspects key is not a list")
            when = times[i] if isinstance(times[i], bytes) else None
            out[ref] = QueueFacts(
                depth=depth if isinstance(depth, int) else 0,
                oldest_enqueued_at=parse_rq_time(when),
                suspect_groups=groups if isinstance(groups, int) else 0,
            )
        return out

    # ---- take ---------------------------------------------------------------------------------
    def begin_batch(self) -> str:
        """A new execution id for the next take, returned (and the default of the calls below). It names the
        worker and this process, so recovery can tell a dead worker's jobs at once and keeps one take's jobs
        together."""
        self._seq += 1
        self.exec_id = f"{self.worker_name}.{self.incarnation}.{self._seq}"
        return self.exec_id

    def take(self, ref: QueueRef, n: int, *, ttl_s: float, exec_id: str | None = None) -> list[str]:
        """Atomically pop up to n job ids, register them as started by this worker, and leave the idle set if any
        came. Ids that are not ids (bad bytes) are quarantined and dropped from the registry."""
        return self._take(ref, n, ttl_s=ttl_s, live_since=None, exec_id=exec_id).ids

    def take_share(
        self,
        ref: QueueRef,
        capacity: int,
        *,
        ttl_s: float,
        live_s: float,
        exec_id: str | None = None,
        ahead: bool = False,
    ) -> SharedTake:
        """As `take`, for this worker's share of the queue: worker.tail's rule over the queue's depth and the workers
        idle now (this one aside, each with a heartbeat within `live_s`), decided in the same script as the pop.
        A peer's take can then never fall between the look and the take: it has either shrunk the queue and left
        the idle set, or not yet begun. `ahead`: a take made while another runs (worker.ahead), which takes
        nothing while a live peer is idle, nor beside live peers while the queue holds less than a take for each
        worker."""
        live_since = time.time() - live_s
        return self._take(ref, capacity, ttl_s=ttl_s, live_since=live_since, exec_id=exec_id, ahead=ahead)

    def _take(
        self,
        ref: QueueRef,
        n: int,
        *,
        ttl_s: float,
        live_since: float | None,
        exec_id: str | None,
        ahead: bool = False,
    ) -> SharedTake:
        """The take script; `live_since` None shares with nobody (the script reads '' so)."""
        if n <= 0:
            return SharedTake([], n)
        exec_id = exec_id or self.exec_id
        try:
            raw = self._take_script(
                keys=[
                    self.queues[ref].key,
                    self.started[ref].key,
                    _JOB_PREFIX,
                    self.keys.workers(),
                    self.keys.idle_workers(),
                    *self._registries(),
                ],
                args=[
                    n,
                    time.time() + ttl_s,
                    exec_id,
                    self.worker_name,
                    rq_now(),
                    "" if live_since is None else live_since,
                    "1" if ahead else "",
                ],
            )
        except redis.exceptions.ResponseError as exc:
            self._bad_take(ref, exc)
            return SharedTake([], n)
        where = self.queues[ref].key
        ids = self._screen(ref, self._dropped(raw[1:], where=where), where=where, exec_id=exec_id)
        return SharedTake(ids, int(raw[0]))

    def take_group(self, ref: QueueRef, *, ttl_s: float, exec_id: str | None = None) -> SuspectTake | None:
        """Atomically pop one suspect group, register its jobs as started and leave the idle set; None when there is
        none."""
        exec_id = exec_id or self.exec_id
        try:
            raw = self._take_group(
                keys=[
                    self.keys.suspects(ref.model, ref.lane),
                    self.started[ref].key,
                    _JOB_PREFIX,
                    self.keys.idle_workers(),
                    *self._registries(),
                ],
                args=[time.time() + ttl_s, exec_id, self.worker_name, rq_now()],
            )
        except redis.exceptions.ResponseError as exc:
            self._bad_take(ref, exc, key=self.keys.suspects(ref.model, ref.lane))
            return None
        if not raw:
            return None
        where = self.keys.suspects(ref.model, ref.lane)
        record, ids = raw[0], self._dropped(raw[1:], where=where)
        try:
            dead = bool(orjson.loads(record).get("dead"))
        except (orjson.JSONDecodeError, AttributeError):
            self.quarantine.put(where, "suspect group is not a JSON record", record)
            dead = False
        good = self._screen(ref, ids, where=where, exec_id=exec_id)
        return SuspectTake(self.load(good), dead=dead)

    def _registries(self) -> list[str]:
        """Every queue's started registry: a take drops a copy of a job that any of them holds (scripts.held_now)."""
        return [registry.key for registry in self.started.values()]

    def _dropped(self, raw: Sequence[bytes], *, where: str) -> list[bytes]:
        """A take script's reply past its first field ({n dropped, dropped id..., id...}): the ids taken. Each
        copy it dropped (a job a take held then) is logged and recorded in the quarantine list."""
        n = int(raw[0])
        for job_id in raw[1 : 1 + n]:
            self.quarantine.put(where, "job queued again while a take held it; this copy dropped", job_id)
        return list(raw[1 + n :])

    def _bad_take(self, ref: QueueRef, exc: redis.exceptions.ResponseError, *, key: str | None = None) -> None:
        if "KEVLAYA_BAD_REGISTRY" in str(exc):
            self.quarantine.move_key(self.started[ref].key, "started registry is not a sorted set")
        elif "WRONGTYPE" in str(exc):
            self.quarantine.move_key(key or self.queues[ref].key, "key is not a list")
        else:
            raise exc

    def _screen(self, ref: QueueRef, raw_ids: Sequence[bytes], *, where: str, exec_id: str) -> list[str]:
        good = []
        for raw in raw_ids:
            job_id = valid_id(raw)
            if job_id is None:
                self.quarantine.put(where, "not a job id (bad bytes or characters)", raw)
                self.redis.zrem(self.started[ref].key, raw + b":" + exec_id.encode())
            else:
                good.append(job_id)
        return good

    def head(self, ref: QueueRef) -> RawJob | None:
        """The job at the front of a queue, decoded, without taking it and without a side effect (None: an empty
        queue, or bytes there that are not a job id, or a job key that is not a hash -- the take quarantines
        those when it comes to them, once)."""
        try:
            first = self.redis.lindex(self.queues[ref].key, 0)
            job_id = valid_id(first) if first is not None else None
            return None if job_id is None else decode_job(job_id, self.redis.hgetall(RQJob.key_for(job_id)))
        except redis.exceptions.ResponseError:
            return None

    def load(self, ids: Sequence[str]) -> list[RawJob]:
        """Fetch and decode job hashes; a malformed or hostile one comes back with its `problem` set."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(RQJob.key_for(job_id))
            hashes = pipe.execute(raise_on_error=False)
        out = []
        for job_id, h in zip(ids, hashes, strict=True):
            if isinstance(h, Exception):
                self.quarantine.put(RQJob.key_for(job_id), "job key is not a hash", job_id)
                out.append(RawJob(job_id, None, PayloadError(f"job key is not a hash ({h})"), 0, 0, None))
            else:
                out.append(decode_job(job_id, h))
        return out

    # ---- heartbeat ----------------------------------------------------------------------------
    def heartbeat(self, ref: QueueRef, ids: Iterable[str], *, ttl_s: float, exec_id: str | None = None) -> None:
        members = {f"{i}:{exec_id or self.exec_id}": time.time() + ttl_s for i in ids}
        if members:
            self.redis.zadd(self.started[ref].key, members, xx=True)

    # ---- takes in hand but not running (worker.ahead) -----------------------------------------
    def mark_held(self, *, add: Sequence[str] = (), remove: Sequence[str] = (), ttl_s: int) -> None:
        """Execution ids into and out of this worker's held set (`Keys.held`) in one round trip. A key of
        another type is moved aside and every mark of this process made again. This process's marks are kept in
        `held` too: one counts as made from before the call (an error may hide that it was) and as removed only
        once Redis said so, so `sweep_held` can remove whatever an error left behind."""
        if not add and not remove:
            return
        key = self.keys.held(self.worker_name)
        with self._held_lock:
            self.held.update(add)
            adds = list(add)
            for _ in range(2):
                with self.redis.pipeline(transaction=False) as pipe:
                    if adds:
                        pipe.sadd(key, *adds)
                    if remove:
                        pipe.srem(key, *remove)
                    pipe.expire(key, ttl_s)
                    replies = pipe.execute(raise_on_error=False)
                if not any(isinstance(r, redis.exceptions.ResponseError) for r in replies):
                    self.held.difference_update(remove)
                    return
                self.quarantine.move_key(key, "held set is not a set")
                adds = sorted(self.held.difference(remove))  # moving it aside took the other marks too

    def sweep_held(self, *, keep: Iterable[str], ttl_s: int) -> None:
        """Every mark of this process out of its held set but `keep` (the takes it holds now): a step that failed
        between marking a take and unmarking it (Redis down, a give-back refused) left its mark, which no later
        step would remove, and each later mark renews the set's expiry."""
        stale = self.held.difference(keep)
        if stale:
            self.mark_held(remove=sorted(stale), ttl_s=ttl_s)

    def give_back(self, ref: QueueRef, ids: Sequence[str], *, exec_id: str) -> None:
        """Jobs this worker took but will not run (a take made ahead that the next step does not want): back to
        the front of their queue in their order, no crash or attempt counted; idle workers woken (as a submit
        wakes them)."""
        self._to_front(ref, ref, list(reversed(ids)), exec_id)

    def move_to(self, ref: QueueRef, target: QueueRef, job_id: str, *, exec_id: str | None = None) -> None:
        """A job taken from `ref` that belongs to `target`'s queue: out of `ref`'s started registry and onto the front
        of `target`'s queue, in one step (no crash or attempt counted)."""
        self._to_front(ref, target, [job_id], exec_id or self.exec_id)

    def _to_front(self, ref: QueueRef, target: QueueRef, ids: Sequence[str], exec_id: str) -> None:
        """Jobs taken from `ref` under `exec_id`: out of its started registry and each pushed onto the front of
        `target`'s queue in turn (the last of `ids` ends first), in one script; idle workers woken."""
        args = [x for job_id in ids for x in (f"{job_id}:{exec_id}".encode(), job_id)]
        if args:
            keys = [self.started[ref].key, self.queues[target].key, _JOB_PREFIX]
            self._script_on_queue(target, self._requeue, keys, args)
            self.redis.publish(self.keys.queued(), target.lane)

    def idle_peers(self, *, live_s: float) -> int:
        """Workers between takes now, this one aside, with a heartbeat within `live_s` (as a take counts them)."""
        live_since = time.time() - live_s
        keys = [self.keys.workers(), self.keys.idle_workers()]
        return int(self._idle_peers(keys=keys, args=[self.worker_name, live_since]))

    # ---- finalise -----------------------------------------------------------------------------
    def finish(
        self, ref: QueueRef, done: Sequence[tuple[str, str | None]], *, ttl_s: int, exec_id: str | None = None
    ) -> None:
        """Move each (job_id, error message or None) out of started into finished/failed, in one pipeline.
        A hostile job key of the wrong type fails only its own commands (raise_on_error=False)."""
        if not done:
            return
        now_s, stamp = time.time(), rq_now()
        with self.redis.pipeline(transaction=False) as pipe:
            # The registries are the worker's own keys (a producer's ACL cannot write them): one command each
            # for the whole take, not one per job.
            exec_id = exec_id or self.exec_id
            pipe.zrem(self.started[ref].key, *[f"{job_id}:{exec_id}" for job_id, _ in done])
            finished = {job_id: now_s + ttl_s for job_id, error in done if error is None}
            failed = {job_id: now_s + ttl_s for job_id, error in done if error is not None}
            for registry, members in ((self.finished[ref], finished), (self.failed[ref], failed)):
                if members:
                    pipe.zadd(registry.key, members)
            args: list[str | bytes | int] = [stamp, ttl_s, FAILED_FIELD]
            for job_id, error in done:
                args += [job_id, b"" if error is None else zlib.compress(error.encode("utf-8", "replace"))]
            self._finish(keys=[_JOB_PREFIX], args=args, client=pipe)
            pipe.execute(raise_on_error=False)

    def clear_failed(self, ids: Sequence[str]) -> None:
        """Requeued failures about to run again: no longer marked failed, earlier crashes no longer count."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hdel(RQJob.key_for(job_id), FAILED_FIELD, CRASHES_FIELD)
            pipe.execute(raise_on_error=False)

    def cleanup_registries(self) -> None:
        """Drop expired entries of the finished and failed registries (RQ's own cleanup), so they do not
        grow forever when no stock RQ worker runs its maintenance."""
        for registry in (*self.finished.values(), *self.failed.values()):
            with contextlib.suppress(redis.exceptions.ResponseError):
                registry.cleanup()
