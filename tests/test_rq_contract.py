"""The parts of RQ's data model kevlaya relies on (worker/rqcompat/). If RQ changes them, this fails."""

from __future__ import annotations

import zlib

import orjson
import rq
from redis import Redis
from rq import Queue, Retry
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.worker import SimpleWorker

from shared.keys import Keys, QueueRef
from shared.serializer import serializer
from worker.rqcompat import RQBridge, decode_job, parse_rq_time


def test_pinned_version() -> None:
    assert rq.__version__ == "2.12.0"


def test_enqueue_many_writes_what_we_decode(redis: Redis) -> None:
    queue = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    data = Queue.prepare_data("worker.jobs.run_decision", args=[{"custom_id": "a"}], job_id="j1", retry=Retry(max=3))
    queue.enqueue_many([data])
    assert redis.lrange("rq:queue:kevlaya:laya", 0, -1) == [b"j1"]
    raw = redis.hgetall("rq:job:j1")
    assert orjson.loads(zlib.decompress(raw[b"data"])) == ["worker.jobs.run_decision", None, [{"custom_id": "a"}], {}]
    assert parse_rq_time(raw[b"enqueued_at"]) is not None
    assert int(raw[b"retries_left"]) == 3
    job = decode_job("j1", raw)
    assert job.problem is None and job.payload == {"custom_id": "a"}


def test_take_registers_in_rqs_started_registry(redis: Redis) -> None:
    queue = Queue("kevlaya:kev", connection=redis, serializer=serializer)
    queue.enqueue_many([Queue.prepare_data("worker.jobs.run_decision", args=[{}], job_id=f"j{i}") for i in range(3)])
    bridge = RQBridge(redis, Keys(), ["kev"], "w1")
    bridge.begin_batch()
    assert bridge.take(QueueRef("kev"), 2, ttl_s=30) == ["j0", "j1"]
    registry = StartedJobRegistry(queue=queue)
    assert registry.key == "rq:wip:kevlaya:kev"
    assert sorted(registry.get_job_ids(cleanup=False)) == ["j0", "j1"]  # RQ parses our job:execution members
    assert queue.fetch_job("j0").get_status() == "started"
    bridge.finish(QueueRef("kev"), [("j0", None), ("j1", "internal: boom")], ttl_s=60)
    assert registry.get_job_ids(cleanup=False) == []
    assert FinishedJobRegistry(queue=queue).get_job_ids(cleanup=False) == ["j0"]
    assert FailedJobRegistry(queue=queue).get_job_ids(cleanup=False) == ["j1"]
    assert queue.fetch_job("j1").get_status() == "failed"


def test_worker_registration_keys(redis: Redis) -> None:
    bridge = RQBridge(redis, Keys(), ["kev"], "w2")
    worker = bridge.make_rq_worker(10)
    worker.register_birth()
    assert bridge.worker_alive("w2")
    assert [w.name for w in SimpleWorker.all(connection=redis)] == ["w2"]
    worker.register_death()
    assert not bridge.worker_alive("w2")
    assert Queue("kevlaya:kev", connection=redis).intermediate_queue_key == "rq:queue:kevlaya:kev:intermediate"


def test_rq_timestamps_read_as_rqs_own_format_reads_them() -> None:
    """`parse_rq_time` takes exactly what strptime with RQ's format takes (RQ's `utcformat`), to the
    microsecond; anything else (hostile bytes in a job hash) reads as None."""
    from datetime import datetime, timezone

    from rq.utils import now, utcformat

    def strptime(text: str) -> float | None:
        try:
            return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            return None

    stamps = [utcformat(now()), "2026-12-01T07:00:00.1Z", "2026-12-01T07:00:00.1234Z", "1999-01-31T23:59:59.999999Z"]
    for text in stamps:
        assert parse_rq_time(text) == parse_rq_time(text.encode()) == strptime(text) is not None
    bad = ["", "x", "2026-12-01T07:00:00Z", "2026-12-01 07:00:00.1Z", "2026-13-01T07:00:00.1Z"]
    bad += ["2026-02-30T07:00:00.1Z", "2026-12-01T07:00:00.1+05:00Z", "2026-12-01T07:00:00.1"]
    bad += ["\uff12026-12-01T07:00:00.1Z"]  # a fullwidth digit
    for text in bad:
        assert parse_rq_time(text) is None
    assert parse_rq_time(b"\xff\xfe\x00Z") is None
