"""Every place kevlaya touches RQ's internals, in one module, so the coupling is visible and tested
(tests/test_rq_contract.py pins what we rely on; pyproject pins the RQ version).

Why not RQ's own worker loop: it takes one job at a time, forks per job (unless SimpleWorker), imports
whatever function a job names, and a malformed hash can stop it. We keep RQ's data model -- queue lists,
job hashes, the started/finished/failed registries, worker registration -- and batch over it:

- take: one Lua script pops up to N ids from a queue AND registers them in the started registry
  atomically, so a crash can never leave a popped job unregistered (stronger than RQ's own
  LMOVE-into-intermediate-list then register, which needs a later sweep of the intermediate list);
- heartbeat: while a batch runs, a thread pushes the registry scores forward (ZADD XX);
- recover: entries whose heartbeat expired, or whose worker is gone, are requeued at the front while
  retries are left (one attempt used), else failed with a final `worker_died` result.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job as RQJob
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.worker import SimpleWorker

from shared.errors import NotAllowedError, PayloadError
from shared.jobfunc import check_allowed
from shared.serializer import serializer

CALLBACK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")
SUSPECT_FIELD = "kevlaya_suspect"  # set on a job whose worker died while running it: it then runs alone
ATTEMPTS_FIELD = "kevlaya_attempts"

# KEYS: queue list, started registry, job key prefix. ARGV: n, score (expiry), exec suffix, worker, now string.
_TAKE_LUA = """
local out = {}
for i = 1, tonumber(ARGV[1]) do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  redis.call('ZADD', KEYS[2], ARGV[2], id .. ':' .. ARGV[3])
  local jk = KEYS[3] .. id
  if redis.call('EXISTS', jk) == 1 then
    redis.call('HSET', jk, 'status', 'started', 'started_at', ARGV[5], 'worker_name', ARGV[4],
               'last_heartbeat', ARGV[5])
    redis.call('HINCRBY', jk, 'kevlaya_attempts', 1)
  end
  out[#out + 1] = id
end
return out
"""


def rq_now() -> str:
    """RQ's timestamp format (UTC, microseconds, 'Z')."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rq_time(value: bytes | str | None) -> float | None:
    if not value:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class RawJob:
    """A job as found in Redis: its id, the decoded payload (or the reason it could not be decoded)."""

    id: str
    payload: dict[str, Any] | None
    problem: PayloadError | None
    suspect: bool
    attempts: int
    enqueued_at: float | None


class RQBridge:
    """RQ's queues and registries for kevlaya's queues, used by the batch worker."""

    def __init__(self, redis: Redis, queue_names: dict[str, str], worker_name: str) -> None:
        self.redis = redis
        self.worker_name = worker_name
        self.queues = {m: Queue(n, connection=redis, serializer=serializer) for m, n in queue_names.items()}
        self.started = {m: StartedJobRegistry(queue=q) for m, q in self.queues.items()}
        self.finished = {m: FinishedJobRegistry(queue=q) for m, q in self.queues.items()}
        self.failed = {m: FailedJobRegistry(queue=q) for m, q in self.queues.items()}
        self._take = redis.register_script(_TAKE_LUA)
        self._seq = 0
        self.exec_id = f"{worker_name}.0"

    # ---- worker registration (so `rq info` shows the worker) -----------------------------------
    def make_rq_worker(self, worker_ttl_s: int) -> SimpleWorker:
        return SimpleWorker(
            list(self.queues.values()),
            connection=self.redis,
            name=self.worker_name,
            serializer=serializer,
            worker_ttl=worker_ttl_s,
        )

    def worker_alive(self, name: str) -> bool:
        """Its RQ worker key exists (heartbeats keep it from expiring) and records no death."""
        key = f"{SimpleWorker.redis_worker_namespace_prefix}{name}"
        return bool(self.redis.exists(key)) and not self.redis.hexists(key, "death")

    # ---- queue facts for the policy -----------------------------------------------------------
    def depth_and_oldest(self) -> dict[str, tuple[int, float | None]]:
        """Per model: queue length and the head job's enqueue time (epoch seconds)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for q in self.queues.values():
                pipe.llen(q.key)
                pipe.lindex(q.key, 0)
            raw = pipe.execute()
        heads = raw[1::2]
        with self.redis.pipeline(transaction=False) as pipe:
            for head in heads:
                pipe.hget(RQJob.key_for(head.decode()), "enqueued_at") if head else pipe.echo("")
            times = pipe.execute()
        return {m: (int(raw[2 * i]), parse_rq_time(times[i])) for i, m in enumerate(self.queues)}

    # ---- take ---------------------------------------------------------------------------------
    def take(self, model: str, n: int, *, ttl_s: float) -> list[str]:
        """Atomically pop up to n job ids and register them as started by this worker."""
        if n <= 0:
            return []
        ids = self._take(
            keys=[self.queues[model].key, self.started[model].key, RQJob.redis_job_namespace_prefix],
            args=[n, time.time() + ttl_s, self.exec_id, self.worker_name, rq_now()],
        )
        return [i.decode() for i in ids]

    def begin_batch(self) -> None:
        """A new execution id for the next batch. It names the worker, so recovery can tell a dead
        worker's jobs at once instead of waiting for their heartbeat to expire."""
        self._seq += 1
        self.exec_id = f"{self.worker_name}.{self._seq}"

    def load(self, ids: Sequence[str]) -> list[RawJob]:
        """Fetch and decode job hashes; a malformed or hostile one comes back with its `problem` set."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(RQJob.key_for(job_id))
            hashes = pipe.execute()
        return [decode_job(job_id, h) for job_id, h in zip(ids, hashes, strict=True)]

    # ---- heartbeat ----------------------------------------------------------------------------
    def heartbeat(self, model: str, ids: Iterable[str], *, ttl_s: float) -> None:
        members = {f"{i}:{self.exec_id}": time.time() + ttl_s for i in ids}
        if members:
            self.redis.zadd(self.started[model].key, members, xx=True)

    # ---- finalise -----------------------------------------------------------------------------
    def finish(self, model: str, done: Sequence[tuple[str, str | None]], *, ttl_s: int) -> None:
        """Move each (job_id, error message or None) out of started into finished/failed, in one pipeline."""
        now_s, stamp = time.time(), rq_now()
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id, error in done:
                pipe.zrem(self.started[model].key, f"{job_id}:{self.exec_id}")
                key = RQJob.key_for(job_id)
                if error is None:
                    pipe.zadd(self.finished[model].key, {job_id: now_s + ttl_s})
                    pipe.hset(key, mapping={"status": "finished", "ended_at": stamp})
                else:
                    pipe.zadd(self.failed[model].key, {job_id: now_s + ttl_s})
                    exc = zlib.compress(error.encode("utf-8", "replace"))
                    pipe.hset(key, mapping={"status": "failed", "ended_at": stamp, "exc_info": exc})
                pipe.expire(key, ttl_s)
            pipe.execute()

    # ---- enqueue (escalation follow-ups) ------------------------------------------------------
    def enqueue_once(self, model: str, job_id: str, payload: dict[str, Any], *, retries: int, ttl_s: int) -> bool:
        """Enqueue a follow-up unless a job with this id already exists (a retried parent re-enqueues nothing)."""
        if self.redis.exists(RQJob.key_for(job_id)):
            return False
        from rq import Retry

        data = Queue.prepare_data(
            "worker.jobs.run_decision",
            args=[payload],
            job_id=job_id,
            description=f"{model}:{payload.get('custom_id')}",
            result_ttl=ttl_s,
            failure_ttl=ttl_s,
            retry=Retry(max=retries) if retries > 0 else None,
        )
        self.queues[model].enqueue_many([data])
        return True

    # ---- recovery -----------------------------------------------------------------------------
    def abandoned(self, model: str, *, in_flight: set[str], others: bool) -> list[tuple[str, str]]:
        """(member, job_id) of started entries nobody is working on any more:
        - ours whose heartbeat lapsed and that we are not running (we lost track, e.g. Redis failed mid-write);
        - another worker's, once that worker is gone (its key expired or records a death), if `others`.
        A live worker's entries are never taken, even with a lapsed score: after a Redis outage every score
        may have lapsed while their owners are still running them."""
        entries = self.redis.zrange(self.started[model].key, 0, -1, withscores=True)
        now_s = time.time()
        out, alive = [], {}
        for member_raw, score in entries:
            member = member_raw.decode()
            job_id, _, exec_id = member.rpartition(":")
            owner = exec_id.rsplit(".", 1)[0]
            if owner == self.worker_name:
                if score < now_s and job_id not in in_flight:
                    out.append((member, job_id))
                continue
            if not others:
                continue
            if owner not in alive:
                alive[owner] = self.worker_alive(owner)
            if not alive[owner]:
                out.append((member, job_id))
        return out

    def claim(self, model: str, member: str) -> bool:
        """Remove an abandoned entry; only the caller that removes it handles the job (no double requeue)."""
        return bool(self.redis.zrem(self.started[model].key, member))

    def retries_left(self, job_id: str) -> int:
        value = self.redis.hget(RQJob.key_for(job_id), "retries_left")
        return int(value) if value else 0

    def requeue_front(self, model: str, job_id: str, *, use_retry: bool, suspect: bool) -> None:
        key = RQJob.key_for(job_id)
        with self.redis.pipeline() as pipe:
            if use_retry:
                pipe.hincrby(key, "retries_left", -1)
            mapping = {"status": "queued"}
            if suspect:
                mapping[SUSPECT_FIELD] = "1"
            pipe.hset(key, mapping=mapping)
            pipe.lpush(self.queues[model].key, job_id)
            pipe.execute()

    def give_back(self, model: str, job_id: str) -> None:
        """Un-take a job this worker holds: out of the started registry, back to the queue front, no retry used."""
        with self.redis.pipeline() as pipe:
            pipe.zrem(self.started[model].key, f"{job_id}:{self.exec_id}")
            pipe.hset(RQJob.key_for(job_id), "status", "queued")
            pipe.hincrby(RQJob.key_for(job_id), ATTEMPTS_FIELD, -1)  # taken, but never attempted
            pipe.lpush(self.queues[model].key, job_id)
            pipe.execute()

    def stuck_intermediate(self, model: str, *, older_than_s: float) -> list[str]:
        """Ids left in RQ's intermediate list (by RQ tooling or a stock worker) for longer than older_than_s."""
        queue = self.queues[model]
        key = queue.intermediate_queue_key
        out = []
        for raw in self.redis.lrange(key, 0, -1):
            job_id = raw.decode()
            seen_key = f"{key}:first_seen:{job_id}"
            if self.redis.set(seen_key, time.time(), nx=True, ex=86400):
                continue
            first = float(self.redis.get(seen_key) or time.time())
            if time.time() - first > older_than_s and self.redis.lrem(key, 1, job_id):
                out.append(job_id)
        return out

    def pending_started(self) -> int:
        return sum(self.redis.zcard(r.key) for r in self.started.values())


def decode_job(job_id: str, raw: dict[bytes, bytes]) -> RawJob:
    """Decode one job hash without importing or calling anything it names. A refused job keeps whatever
    payload could be read, so its error can still be written to its batch item."""
    attempts = int(raw.get(ATTEMPTS_FIELD.encode(), b"0") or 0) if raw else 0
    suspect = raw.get(SUSPECT_FIELD.encode()) == b"1" if raw else False
    enqueued = parse_rq_time(raw.get(b"enqueued_at")) if raw else None
    payload: dict[str, Any] | None = None
    try:
        func, payload = _unpack(raw)
        _check(raw, func, payload)
    except PayloadError as problem:
        return RawJob(job_id, payload, problem, suspect, attempts, enqueued)
    return RawJob(job_id, payload, None, suspect, attempts, enqueued)


def _unpack(raw: dict[bytes, bytes]) -> tuple[Any, dict[str, Any] | None]:
    """(function name, payload dict or None) from RQ's `data` field: zlib-compressed JSON."""
    if not raw:
        raise PayloadError("job hash is missing (deleted or expired)")
    if b"data" not in raw:
        raise PayloadError("job hash has no 'data' field")
    data = raw[b"data"]
    # RQ stores data zlib-compressed; an uncompressed one is still JSON-checked below.
    with contextlib.suppress(zlib.error):
        data = zlib.decompress(data)
    decoded = serializer.loads(data)
    if not isinstance(decoded, list) or len(decoded) != 4:
        raise PayloadError("job data is not [func, instance, args, kwargs]")
    func, instance, args, kwargs = decoded
    shaped = instance is None and not kwargs and isinstance(args, list) and len(args) == 1
    return func, args[0] if shaped and isinstance(args[0], dict) else None


def _check(raw: dict[bytes, bytes], func: Any, payload: dict[str, Any] | None) -> None:
    """The function name first: a job naming anything else is refused before its arguments are looked at."""
    check_allowed(func if isinstance(func, str) else repr(func))
    for name in CALLBACK_FIELDS:
        if raw.get(name.encode()):
            value = raw[name.encode()].decode(errors="replace")
            raise NotAllowedError(f"job sets {name}={value!r}; callbacks are refused")
    if payload is None:
        raise PayloadError("job must call the allowlisted function with exactly one JSON-object argument")
