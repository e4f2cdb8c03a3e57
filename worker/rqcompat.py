"""Every place kevlaya touches RQ's internals, in one module, so the coupling is visible and tested
(tests/test_rq_contract.py pins what we rely on; pyproject pins the RQ version).

Why not RQ's own worker loop: it takes one job at a time, forks per job (unless SimpleWorker), imports
whatever function a job names, and a malformed hash can stop it. We keep RQ's data model -- queue lists,
job hashes, the started/finished/failed registries, worker registration -- and batch over it:

- take: one Lua script pops up to N ids from a queue AND registers them in the started registry
  atomically, so a crash can never leave a popped job unregistered;
- heartbeat: while a batch runs, a thread pushes the registry scores forward (ZADD XX);
- recover: a dead worker's entries go back as suspect groups (worker.recovery), in one script per group,
  so a crash of the recovering worker can neither lose nor double them.

Everything read from Redis is untrusted: ids, members, hashes and key types are checked, and what cannot
be read is quarantined (worker.quarantine) instead of raising.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson
import redis.exceptions
from redis import Redis
from rq import Queue, Retry
from rq.job import Job as RQJob
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.worker import SimpleWorker

from shared.errors import NotAllowedError, PayloadError, WorkerNameTakenError
from shared.jobfunc import RUN_DECISION, check_allowed
from shared.keys import JOB_ID_RE, Keys
from shared.quarantine import Quarantine, printable
from shared.serializer import serializer
from worker.recovery import SuspectGroup

CALLBACK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")
ATTEMPTS_FIELD = "kevlaya_attempts"
CRASHES_FIELD = "kevlaya_crashes"  # how many times a worker died while running this job
_JOB_PREFIX = RQJob.redis_job_namespace_prefix
MAX_DATA_BYTES = 4 << 20  # a job's inflated payload; real ones are < 200 KiB (shared.job.Limits)

# Marks this job hash as started by us. A hash of another type, or a garbage attempts field, is left alone
# (pcall): one hostile key must not abort the script after it has popped other jobs.
_MARK_STARTED_LUA = """
local function mark(jk, now, worker)
  if redis.call('TYPE', jk).ok == 'hash' then
    redis.pcall('HSET', jk, 'status', 'started', 'started_at', now, 'worker_name', worker, 'last_heartbeat', now)
    redis.pcall('HINCRBY', jk, 'kevlaya_attempts', 1)
  end
end
local function registry_ok(key)
  local t = redis.call('TYPE', key).ok
  return t == 'zset' or t == 'none'
end
"""

# KEYS: queue list, started registry, job key prefix. ARGV: n, score (expiry), exec id, worker, now string.
_TAKE_LUA = (
    _MARK_STARTED_LUA
    + """
if not registry_ok(KEYS[2]) then return redis.error_reply('KEVLAYA_BAD_REGISTRY') end
local out = {}
for i = 1, tonumber(ARGV[1]) do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  redis.call('ZADD', KEYS[2], ARGV[2], id .. ':' .. ARGV[3])
  mark(KEYS[3] .. id, ARGV[5], ARGV[4])
  out[#out + 1] = id
end
return out
"""
)

# Pops one suspect group and registers its jobs as started, atomically. Returns {record, id...}.
# KEYS: suspects list, started registry, job key prefix. ARGV: score, exec id, worker, now string.
_TAKE_GROUP_LUA = (
    _MARK_STARTED_LUA
    + """
if not registry_ok(KEYS[2]) then return redis.error_reply('KEVLAYA_BAD_REGISTRY') end
local raw = redis.call('LPOP', KEYS[1])
if not raw then return {} end
local out = {raw}
local ok, rec = pcall(cjson.decode, raw)
if not ok or type(rec) ~= 'table' or type(rec['ids']) ~= 'table' then return out end
for _, id in ipairs(rec['ids']) do
  if type(id) == 'string' then
    redis.call('ZADD', KEYS[2], ARGV[1], id .. ':' .. ARGV[2])
    mark(KEYS[3] .. id, ARGV[4], ARGV[3])
    out[#out + 1] = id
  end
end
return out
"""
)

# A dead take's entries become suspect groups, all or nothing: if another worker claimed any entry first,
# nothing changes (it handles them). KEYS: started registry, suspects list, job key prefix.
# ARGV: n members, members..., n ids, (id, crashes)..., group records...
_RECOVER_LUA = """
local n = tonumber(ARGV[1])
for i = 2, n + 1 do
  if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then return 0 end
end
for i = 2, n + 1 do redis.call('ZREM', KEYS[1], ARGV[i]) end
local m = tonumber(ARGV[n + 2])
local pos = n + 3
for _ = 1, m do
  local jk = KEYS[3] .. ARGV[pos]
  if redis.call('TYPE', jk).ok == 'hash' then
    redis.pcall('HSET', jk, 'status', 'queued', 'kevlaya_crashes', ARGV[pos + 1])
  end
  pos = pos + 2
end
for i = #ARGV, pos, -1 do redis.call('LPUSH', KEYS[2], ARGV[i]) end
return 1
"""

# Entries of our own that lost their heartbeat (Redis failed mid-write): back to the queue front, no crash.
# KEYS: started registry, queue list, job key prefix. ARGV: (member, id)...
_REQUEUE_LUA = """
for i = 1, #ARGV, 2 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    local jk = KEYS[3] .. ARGV[i + 1]
    if redis.call('TYPE', jk).ok == 'hash' then redis.pcall('HSET', jk, 'status', 'queued') end
    redis.call('LPUSH', KEYS[2], ARGV[i + 1])
  end
end
return 1
"""


def rq_now() -> str:
    """RQ's timestamp format (UTC, microseconds, 'Z')."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rq_time(value: bytes | str | None) -> float | None:
    if not value:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def _int(value: bytes | None) -> int:
    """A counter field read from Redis; garbage reads as 0."""
    try:
        return int(value or 0)
    except ValueError:
        return 0


def valid_id(raw: bytes | str) -> str | None:
    """The id as text if it is one kevlaya or RQ could have written, else None."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None
    return text if JOB_ID_RE.match(text) else None


@dataclass(frozen=True)
class RawJob:
    """A job as found in Redis: its id, the decoded payload (or the reason it could not be decoded)."""

    id: str
    payload: dict[str, Any] | None
    problem: PayloadError | None
    attempts: int
    crashes: int
    enqueued_at: float | None


@dataclass(frozen=True)
class Taken:
    """What one take got: jobs to run, and whether they are a suspect group (`dead`: write them off)."""

    jobs: list[RawJob]
    suspect: bool = False
    dead: bool = False


@dataclass(frozen=True)
class QueueFacts:
    depth: int
    oldest_enqueued_at: float | None
    suspect_groups: int


@dataclass(frozen=True)
class Abandoned:
    """A started-registry entry nobody works on any more. `crashed`: its worker died (vs. lost track)."""

    member: bytes
    job_id: str
    exec_id: str
    crashed: bool


class RQBridge:
    """RQ's queues and registries for kevlaya's queues, used by the batch worker."""

    def __init__(self, redis: Redis, keys: Keys, models: Sequence[str], worker_name: str) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_name = worker_name
        # A new incarnation per process: entries of an earlier process with the same --name are a crash's.
        self.incarnation = uuid.uuid4().hex[:8]
        self.quarantine = Quarantine(redis, keys)
        self.queues = {m: Queue(keys.queue_name(m), connection=redis, serializer=serializer) for m in models}
        self.started = {m: StartedJobRegistry(queue=q) for m, q in self.queues.items()}
        self.finished = {m: FinishedJobRegistry(queue=q) for m, q in self.queues.items()}
        self.failed = {m: FailedJobRegistry(queue=q) for m, q in self.queues.items()}
        self._take = redis.register_script(_TAKE_LUA)
        self._take_group = redis.register_script(_TAKE_GROUP_LUA)
        self._recover = redis.register_script(_RECOVER_LUA)
        self._requeue = redis.register_script(_REQUEUE_LUA)
        self._seq = 0
        self.exec_id = f"{worker_name}.{self.incarnation}.0"

    # ---- worker registration (so `rq info` shows the worker) -----------------------------------
    def make_rq_worker(self, worker_ttl_s: int) -> SimpleWorker:
        return SimpleWorker(
            list(self.queues.values()),
            connection=self.redis,
            name=self.worker_name,
            serializer=serializer,
            worker_ttl=worker_ttl_s,
        )

    def register(self, rq_worker: SimpleWorker, *, worker_ttl_s: int) -> None:
        """Register our birth; a dead registration under our name (a crash, then a restart with the same
        --name) is taken over at once. A live one elsewhere is refused with WorkerNameTakenError."""
        key = rq_worker.key
        if self.redis.exists(key) and not self._registration_dead(key, worker_ttl_s):
            raise WorkerNameTakenError(
                f"a live worker named {self.worker_name!r} is registered (heartbeat within {worker_ttl_s} s); "
                "pick another --name or stop that worker"
            )
        with contextlib.suppress(redis.exceptions.ResponseError):
            self.redis.delete(key)
        rq_worker.register_birth()

    def _registration_dead(self, key: str, worker_ttl_s: int) -> bool:
        try:
            h = self.redis.hgetall(key)
        except redis.exceptions.ResponseError:
            return True  # not a hash: not a registration at all
        if not h or b"death" in h:
            return True
        last = parse_rq_time(h.get(b"last_heartbeat"))
        if last is None or time.time() - last > worker_ttl_s:
            return True
        host = h.get(b"hostname", b"").decode("utf-8", "replace")
        pid = _int(h.get(b"pid"))
        if host != socket.gethostname() or pid <= 0:
            return False
        return pid == os.getpid() or not _pid_alive(pid)

    def worker_alive(self, name: str) -> bool:
        """Its RQ worker key is a hash (heartbeats keep it from expiring) that records no death."""
        key = f"{SimpleWorker.redis_worker_namespace_prefix}{name}"
        try:
            return bool(self.redis.exists(key)) and not self.redis.hexists(key, "death")
        except redis.exceptions.ResponseError:
            return False

    # ---- queue facts for the policy -----------------------------------------------------------
    def queue_facts(self) -> dict[str, QueueFacts]:
        """Per model: queue length, the head job's enqueue time, and suspect groups waiting."""
        models = list(self.queues)
        with self.redis.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.llen(self.queues[m].key)
                pipe.lindex(self.queues[m].key, 0)
                pipe.llen(self.keys.suspects(m))
            raw = pipe.execute(raise_on_error=False)
        heads = [valid_id(h) if isinstance(h, bytes) else None for h in raw[1::3]]
        with self.redis.pipeline(transaction=False) as pipe:
            for head in heads:
                pipe.hget(RQJob.key_for(head), "enqueued_at") if head else pipe.echo("")
            times = pipe.execute(raise_on_error=False)
        out = {}
        for i, m in enumerate(models):
            depth, groups = raw[3 * i], raw[3 * i + 2]
            if isinstance(depth, Exception):
                self.quarantine.move_key(self.queues[m].key, "queue key is not a list")
            if isinstance(groups, Exception):
                self.quarantine.move_key(self.keys.suspects(m), "suspects key is not a list")
            when = times[i] if isinstance(times[i], bytes) else None
            out[m] = QueueFacts(
                depth=depth if isinstance(depth, int) else 0,
                oldest_enqueued_at=parse_rq_time(when),
                suspect_groups=groups if isinstance(groups, int) else 0,
            )
        return out

    # ---- take ---------------------------------------------------------------------------------
    def begin_batch(self) -> None:
        """A new execution id for the next take. It names the worker and this process, so recovery can
        tell a dead worker's jobs at once and keeps one take's jobs together."""
        self._seq += 1
        self.exec_id = f"{self.worker_name}.{self.incarnation}.{self._seq}"

    def take(self, model: str, n: int, *, ttl_s: float) -> list[str]:
        """Atomically pop up to n job ids and register them as started by this worker. Ids that are not
        ids (bad bytes) are quarantined and dropped from the registry."""
        if n <= 0:
            return []
        try:
            raw = self._take(
                keys=[self.queues[model].key, self.started[model].key, _JOB_PREFIX],
                args=[n, time.time() + ttl_s, self.exec_id, self.worker_name, rq_now()],
            )
        except redis.exceptions.ResponseError as exc:
            self._bad_take(model, exc)
            return []
        return self._screen(model, raw, where=self.queues[model].key)

    def take_group(self, model: str, *, ttl_s: float) -> Taken | None:
        """Atomically pop one suspect group and register its jobs as started; None when there is none."""
        try:
            raw = self._take_group(
                keys=[self.keys.suspects(model), self.started[model].key, _JOB_PREFIX],
                args=[time.time() + ttl_s, self.exec_id, self.worker_name, rq_now()],
            )
        except redis.exceptions.ResponseError as exc:
            self._bad_take(model, exc, key=self.keys.suspects(model))
            return None
        if not raw:
            return None
        record, ids = raw[0], raw[1:]
        try:
            dead = bool(orjson.loads(record).get("dead"))
        except (orjson.JSONDecodeError, AttributeError):
            self.quarantine.put(self.keys.suspects(model), "suspect group is not a JSON record", record)
            dead = False
        good = self._screen(model, ids, where=self.keys.suspects(model))
        return Taken(self.load(good), suspect=True, dead=dead)

    def _bad_take(self, model: str, exc: redis.exceptions.ResponseError, *, key: str | None = None) -> None:
        if "KEVLAYA_BAD_REGISTRY" in str(exc):
            self.quarantine.move_key(self.started[model].key, "started registry is not a sorted set")
        elif "WRONGTYPE" in str(exc):
            self.quarantine.move_key(key or self.queues[model].key, "key is not a list")
        else:
            raise exc

    def _screen(self, model: str, raw_ids: Sequence[bytes], *, where: str) -> list[str]:
        good = []
        for raw in raw_ids:
            job_id = valid_id(raw)
            if job_id is None:
                self.quarantine.put(where, "not a job id (bad bytes or characters)", raw)
                self.redis.zrem(self.started[model].key, raw + b":" + self.exec_id.encode())
            else:
                good.append(job_id)
        return good

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
    def heartbeat(self, model: str, ids: Iterable[str], *, ttl_s: float) -> None:
        members = {f"{i}:{self.exec_id}": time.time() + ttl_s for i in ids}
        if members:
            self.redis.zadd(self.started[model].key, members, xx=True)

    # ---- finalise -----------------------------------------------------------------------------
    def finish(self, model: str, done: Sequence[tuple[str, str | None]], *, ttl_s: int) -> None:
        """Move each (job_id, error message or None) out of started into finished/failed, in one pipeline.
        A hostile job key of the wrong type fails only its own commands (raise_on_error=False)."""
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
            pipe.execute(raise_on_error=False)

    def cleanup_registries(self) -> None:
        """Drop expired entries of the finished and failed registries (RQ's own cleanup), so they do not
        grow forever when no stock RQ worker runs its maintenance."""
        for registry in (*self.finished.values(), *self.failed.values()):
            with contextlib.suppress(redis.exceptions.ResponseError):
                registry.cleanup()

    # ---- enqueue (escalation follow-ups) ------------------------------------------------------
    def enqueue_once(self, model: str, job_id: str, payload: dict[str, Any], *, retries: int, ttl_s: int) -> bool:
        """Enqueue a follow-up unless a job with this id already exists (a retried parent re-enqueues nothing)."""
        if self.redis.exists(RQJob.key_for(job_id)):
            return False
        data = Queue.prepare_data(
            RUN_DECISION,
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
    def abandoned(self, model: str, *, in_flight: set[str], others: bool) -> list[Abandoned]:
        """Started entries nobody is working on any more:
        - ours whose heartbeat lapsed and that we are not running (we lost track, e.g. Redis failed mid-write);
        - an earlier process's under our name (we took its name over, so it is dead): crashed;
        - another worker's, once that worker is gone (its key expired or records a death), if `others`.
        A live worker's entries are never taken, even with a lapsed score: after a Redis outage every score
        may have lapsed while their owners are still running them."""
        key = self.started[model].key
        try:
            entries = self.redis.zrange(key, 0, -1, withscores=True)
        except redis.exceptions.ResponseError:
            self.quarantine.move_key(key, "started registry is not a sorted set")
            return []
        now_s = time.time()
        out, alive = [], {}
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
            elif owner == self.worker_name:
                out.append(Abandoned(member, job_id, exec_id, crashed=True))
            elif others:
                if owner not in alive:
                    alive[owner] = self.worker_alive(owner)
                if not alive[owner]:
                    out.append(Abandoned(member, job_id, exec_id, crashed=True))
        return out

    def crash_counts(self, ids: Sequence[str]) -> dict[str, int]:
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(RQJob.key_for(job_id), CRASHES_FIELD)
            raw = pipe.execute(raise_on_error=False)
        return {i: _int(v) if isinstance(v, bytes) else 0 for i, v in zip(ids, raw, strict=True)}

    def requeue_lost(self, model: str, entries: Sequence[Abandoned]) -> None:
        """Our own entries we lost track of: back to the queue front as they were (no crash counted)."""
        args = [x for e in entries for x in (e.member, e.job_id)]
        if args:
            self._requeue(keys=[self.started[model].key, self.queues[model].key, _JOB_PREFIX], args=args)

    def to_suspects(
        self, model: str, entries: Sequence[Abandoned], crashes: dict[str, int], groups: Sequence[SuspectGroup]
    ) -> bool:
        """Move a dead take's entries into suspect groups at the front, atomically. False if another worker
        claimed any of them first (it recovers them)."""
        records = [orjson.dumps({"ids": list(g.ids), "dead": g.dead}) for g in groups]
        args: list[Any] = [len(entries), *[e.member for e in entries], len(crashes)]
        for job_id, count in crashes.items():
            args += [job_id, count]
        done = self._recover(
            keys=[self.started[model].key, self.keys.suspects(model), _JOB_PREFIX], args=[*args, *records]
        )
        return bool(done)

    def stuck_intermediate(self, model: str, *, older_than_s: float) -> list[str]:
        """Ids left in RQ's intermediate list (by RQ tooling or a stock worker) for longer than older_than_s."""
        key = self.queues[model].intermediate_queue_key
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
            seen_key = self.keys.first_seen(key, job_id)
            if self.redis.set(seen_key, time.time(), nx=True, ex=86400):
                continue
            try:
                first = float(self.redis.get(seen_key) or time.time())
            except ValueError:
                first = 0.0
            if time.time() - first > older_than_s and self.redis.lrem(key, 1, raw):
                out.append(job_id)
        return out

    def requeue_front(self, model: str, job_id: str) -> None:
        with self.redis.pipeline() as pipe:
            pipe.hset(RQJob.key_for(job_id), "status", "queued")
            pipe.lpush(self.queues[model].key, job_id)
            pipe.execute(raise_on_error=False)

    def pending_started(self) -> int:
        total = 0
        for m, registry in self.started.items():
            try:
                total += self.redis.zcard(registry.key) + self.redis.llen(self.keys.suspects(m))
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def decode_job(job_id: str, raw: dict[bytes, bytes]) -> RawJob:
    """Decode one job hash without importing or calling anything it names. A refused job keeps whatever
    payload could be read, so its error can still be written to its batch item. No field is trusted."""
    attempts = _int(raw.get(ATTEMPTS_FIELD.encode())) if raw else 0
    crashes = _int(raw.get(CRASHES_FIELD.encode())) if raw else 0
    enqueued = parse_rq_time(raw.get(b"enqueued_at")) if raw else None
    payload: dict[str, Any] | None = None
    try:
        func, payload = _unpack(raw)
        _check(raw, func, payload)
    except PayloadError as problem:
        return RawJob(job_id, payload, problem, attempts, crashes, enqueued)
    return RawJob(job_id, payload, None, attempts, crashes, enqueued)


def _unpack(raw: dict[bytes, bytes]) -> tuple[Any, dict[str, Any] | None]:
    """(function name, payload dict or None) from RQ's `data` field: zlib-compressed JSON."""
    if not raw:
        raise PayloadError("job hash is missing (deleted or expired)")
    if b"data" not in raw:
        raise PayloadError("job hash has no 'data' field")
    data = raw[b"data"]
    # RQ stores data zlib-compressed; an uncompressed one is still JSON-checked below. Capped: a few bytes
    # of hostile zlib can expand to gigabytes.
    with contextlib.suppress(zlib.error):
        inflater = zlib.decompressobj()
        data = inflater.decompress(data, MAX_DATA_BYTES)
        if inflater.unconsumed_tail:
            raise PayloadError(f"job data inflates past {MAX_DATA_BYTES} bytes")
    decoded = serializer.loads(data)
    if not isinstance(decoded, list) or len(decoded) != 4:
        raise PayloadError("job data is not [func, instance, args, kwargs]")
    func, instance, args, kwargs = decoded
    shaped = instance is None and not kwargs and isinstance(args, list) and len(args) == 1
    return func, args[0] if shaped and isinstance(args[0], dict) else None


def _check(raw: dict[bytes, bytes], func: Any, payload: dict[str, Any] | None) -> None:
    """The function name first: a job naming anything else is refused before its arguments are looked at."""
    check_allowed(func if isinstance(func, str) else printable(func))
    for name in CALLBACK_FIELDS:
        if raw.get(name.encode()):
            value = raw[name.encode()].decode(errors="replace")
            raise NotAllowedError(f"job sets {name}={value!r}; callbacks are refused")
    if payload is None:
        raise PayloadError("job must call the allowlisted function with exactly one JSON-object argument")
