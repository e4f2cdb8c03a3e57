"""Worker registration in RQ's keys, so `rq info` lists kevlaya's workers, and a dead registration under
our own name (a crash, then a restart with the same --name) is taken over at once."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import redis.exceptions
from redis import Redis
from rq import Queue
from rq.suspension import is_suspended
from rq.worker import SimpleWorker
from rq.worker_registration import REDIS_WORKER_KEYS as WORKERS_KEY
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from shared.errors import WorkerNameTakenError
from shared.keys import QueueRef
from shared.quarantine import Quarantine, clear_the_way
from shared.serializer import serializer
from worker.rqcompat.decode import _int, parse_rq_time


class Registration:
    """Mixed into RQBridge: needs `redis`, `worker_name` and `queues`."""

    redis: Redis
    worker_name: str
    queues: dict[QueueRef, Queue]
    quarantine: Quarantine

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
        # RQ adds the worker to its worker sets in one pipeline: a set some other writer replaced with another
        # type failed it, and no worker could start until someone deleted that key by hand.
        sets = [WORKERS_KEY, *(WORKERS_BY_QUEUE_KEY % name for name in rq_worker.queue_names())]
        clear_the_way(self.redis, self.quarantine, dict.fromkeys(sets, "set"))
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

    def suspended(self) -> bool:
        """`rq suspend` was run: finish the batch in flight, take nothing new until `rq resume`."""
        try:
            return bool(is_suspended(self.redis))
        except redis.exceptions.ResponseError:
            return False

    @staticmethod
    def report(rq_worker: SimpleWorker, *, busy: bool, ok: int = 0, failed: int = 0, seconds: float = 0.0) -> None:
        """The worker's state and job counts where `rq info` and rq-dashboard read them."""
        with rq_worker.connection.pipeline(transaction=False) as pipe:
            rq_worker.set_state("busy" if busy else "idle", pipeline=pipe)
            if ok:
                pipe.hincrby(rq_worker.key, "successful_job_count", ok)
            if failed:
                pipe.hincrby(rq_worker.key, "failed_job_count", failed)
            if seconds:
                pipe.hincrbyfloat(rq_worker.key, "total_working_time", seconds)
            pipe.execute(raise_on_error=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
