"""Every byte in Redis is untrusted: entries a worker cannot read are quarantined, never fatal, and never
cost a real job a retry. Each case reproduces a write that stopped every worker before (fake engine)."""

from __future__ import annotations

import contextlib
import random
import zlib

import orjson
import pytest
from redis import Redis
from redis import exceptions as redis_exceptions

from producer.client import Client
from shared.job import Job
from shared.keys import Keys
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.settings import WorkerSettings

QUEUE = "rq:queue:kevlaya:laya"
STARTED = "rq:wip:kevlaya:laya"


def real(client: Client, n: int = 6, tag: str = "r") -> str:
    jobs = [{"custom_id": f"{tag}{i}", "model": "laya", "prompt": f"case {i}"} for i in range(n)]
    return client.submit_batch(jobs, escalate=False).id


def drain(redis: Redis) -> None:
    BatchWorker(redis, FakeEngine(rows=4), FAKE_CONFIG, WorkerSettings(burst=True, worker_ttl_s=1)).work()


def quarantined(client: Client) -> int:
    return client.overview()["quarantine"]["total"]


HOSTILE = {
    "non-utf8 id at the queue head": lambda r: r.lpush(QUEUE, b"\xff\xfe\x00bad"),
    "id with characters no id has": lambda r: r.lpush(QUEUE, b"a b\nc"),
    "job key of the wrong type at the head": lambda r: (r.rpush("rq:job:listjob", "x"), r.lpush(QUEUE, "listjob")),
    "job key that is a string": lambda r: (r.set("rq:job:strjob", "x"), r.lpush(QUEUE, "strjob")),
    "non-utf8 member in the started registry": lambda r: r.zadd(STARTED, {b"\xff\xfe:\xc3(": 1}),
    "member that is not id:execution": lambda r: r.zadd(STARTED, {b"garbage": 1}),
    "started registry of the wrong type": lambda r: r.set(STARTED, "x"),
    "zlib bomb as job data": lambda r: (
        r.hset("rq:job:bomb", mapping={"data": zlib.compress(b"[" * (64 << 20))}),
        r.lpush(QUEUE, "bomb"),
    ),
    "suspects list of garbage": lambda r: r.lpush("kevlaya:w:suspects:laya", b"\xff{not json"),
    "interactive suspects list of garbage": lambda r: r.lpush("kevlaya:w:suspects:laya:interactive", b"\xff{"),
    "interactive queue of the wrong type": lambda r: r.set(QUEUE + ":interactive", "x"),
    "intermediate list of bad bytes": lambda r: r.lpush(QUEUE + ":intermediate", b"\xff\xff"),
    "quarantine list itself of the wrong type": lambda r: (r.set("kevlaya:w:quarantine", "x"), r.lpush(QUEUE, b"\xff")),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_write_is_quarantined_and_real_jobs_are_answered(client: Client, redis: Redis, name: str) -> None:
    batch = real(client)
    HOSTILE[name](redis)
    drain(redis)
    drain(redis)  # a second start: nothing left over crashes it either
    rows = assert_each_item_answered_once(client, redis, batch, 6)
    assert all(r.get("error") is None for r in rows)


@pytest.mark.parametrize("name", ["job key of the wrong type at the head", "job key that is a string"])
def test_a_bad_job_at_the_front_is_quarantined_once(client: Client, redis: Redis, name: str) -> None:
    """Takes here are smaller than the queue, so the worker looks at the front job before each (its size): the
    look has no side effect, only the take quarantines the bad entry, once."""
    batch = real(client)
    HOSTILE[name](redis)
    drain(redis)
    assert_each_item_answered_once(client, redis, batch, 6)
    assert quarantined(client) == 1


class ExpectFails(FakeEngine):
    def expect(self, job: Job) -> bool:
        raise RuntimeError("a template the front job breaks")


def test_a_front_job_the_engine_cannot_plan_for_leaves_the_take_size(client: Client, redis: Redis) -> None:
    engine = ExpectFails(rows=4)
    batch = real(client)
    BatchWorker(redis, engine, FAKE_CONFIG, WorkerSettings(burst=True, worker_ttl_s=1)).work()
    assert_each_item_answered_once(client, redis, batch, 6)
    assert [len(c) for c in engine.calls] == [4, 2]


def test_a_wrong_typed_queue_key_is_moved_aside_and_the_queue_works_again(client: Client, redis: Redis) -> None:
    redis.set(QUEUE, "not a list")
    drain(redis)
    assert redis.type(QUEUE) == b"none"
    assert quarantined(client) == 1
    batch = real(client)
    drain(redis)
    assert_each_item_answered_once(client, redis, batch, 6)


def test_garbage_attempt_fields_cost_no_batch_mate_a_retry(client: Client, redis: Redis) -> None:
    batch = real(client, 8)
    ids = [i.decode() for i in redis.lrange(QUEUE, 0, -1)]
    redis.hset(
        f"rq:job:{ids[3]}", mapping={"kevlaya_attempts": "many", "kevlaya_crashes": b"\xff", "enqueued_at": b"\xff"}
    )
    drain(redis)
    rows = assert_each_item_answered_once(client, redis, batch, 8)
    assert all(r.get("error") is None for r in rows)
    assert all(redis.hget(f"rq:job:{i}", "kevlaya_attempts") in (b"1", b"many") for i in ids)


def test_wrong_typed_batch_keys_fail_only_their_own_jobs(client: Client, redis: Redis) -> None:
    victim = real(client, 3, "v")
    ok = real(client, 3, "o")
    redis.delete(Keys().batch_results(victim))
    redis.set(Keys().batch_results(victim), "x")  # results hash replaced by a string
    drain(redis)
    assert_each_item_answered_once(client, redis, ok, 3)
    assert quarantined(client) >= 1


def test_status_shows_what_was_quarantined(client: Client, redis: Redis) -> None:
    from click.testing import CliRunner

    from producer.cli import cli

    redis.lpush(QUEUE, b"\xff\xfe")
    drain(redis)
    url = redis.connection_pool.connection_kwargs
    out = CliRunner().invoke(cli, ["--redis-url", f"redis://127.0.0.1:{url['port']}/{url.get('db', 0)}", "status"])
    assert "quarantined (unreadable entries moved aside by workers): 1" in out.output
    assert "not a job id" in out.output


def _random_bytes(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 24)))


def _hostile_round(redis: Redis, rng: random.Random, batch: str) -> int:
    """Write garbage into keys a producer can write, beside (never over) the real jobs. Returns writes made."""
    writes = 0
    for _ in range(rng.randrange(3, 9)):
        with contextlib.suppress(redis_exceptions.ResponseError):  # a hostile write may fail on an earlier one
            writes += _hostile_write(redis, rng, batch)
    return writes


def _hostile_write(redis: Redis, rng: random.Random, batch: str) -> int:
    fake = f"fz{rng.randrange(10**9)}"
    choice = rng.randrange(14)
    queue = rng.choice([QUEUE, "rq:queue:kevlaya:kev", "rq:queue:kevlaya:laya:interactive"])
    if choice == 0:
        redis.rpush(queue, _random_bytes(rng))
    elif choice == 1:
        kind = rng.choice(["list", "set", "zset", "string"])
        {"list": redis.rpush, "set": redis.sadd}.get(kind, lambda k, v: redis.set(k, v))(
            f"rq:job:{fake}", "x"
        ) if kind != "zset" else redis.zadd(f"rq:job:{fake}", {"x": 1})
        redis.rpush(queue, fake)
    elif choice == 2:
        names = ("data", "enqueued_at", "kevlaya_attempts", "kevlaya_failed", "retries_left", "status")
        fields = {f: _random_bytes(rng) for f in names}
        redis.hset(f"rq:job:{fake}", mapping=fields)
        redis.rpush(queue, fake)
    elif choice == 3:
        redis.rpush(queue, fake)  # no hash at all
    elif choice == 4:
        queued = redis.lrange(QUEUE, 0, -1)
        if queued:
            redis.hset(b"rq:job:" + rng.choice(queued), "kevlaya_attempts", _random_bytes(rng))
    elif choice == 5:
        registry = rng.choice([STARTED, "rq:wip:kevlaya:kev", "rq:wip:kevlaya:kev:interactive"])
        redis.zadd(registry, {_random_bytes(rng) + b":x.y.1": 1})
    elif choice == 6:
        payload = {"custom_id": "forged", "model": "laya", "prompt": "p", "batch": batch}
        data = zlib.compress(orjson.dumps(["worker.jobs.run_decision", None, [payload], {}]))
        redis.hset(f"rq:job:{fake}", mapping={"data": data})
        redis.rpush(QUEUE, fake)
    elif choice == 7:
        other = f"kevlaya:batch:fz{rng.randrange(10**6)}"
        redis.rpush(other, "x")
        payload = {"custom_id": "c", "model": "laya", "prompt": "p", "batch": other.split(":")[-1]}
        data = zlib.compress(orjson.dumps(["worker.jobs.run_decision", None, [payload], {}]))
        redis.hset(f"rq:job:{fake}", mapping={"data": data})
        redis.rpush(QUEUE, fake)
    elif choice == 8:
        redis.rpush(queue + ":intermediate", _random_bytes(rng))
    elif choice == 10:  # garbage counters and fields in the real batch's record
        field = rng.choice(["finished", "failed", "escalated", "followups_done", "window_ends_at", "created_at"])
        redis.hset(Keys().batch(batch), field, _random_bytes(rng))
    elif choice == 11:  # the batch's running set and steps of another type
        key = rng.choice([Keys().batch_running(batch), Keys().batch_steps(batch), Keys().batch_submits(batch)])
        redis.delete(key)
        redis.set(key, _random_bytes(rng) or b"x")
    elif choice == 12:  # RQ's queue set and the notice outbox
        key = rng.choice(["rq:queues", Keys().outbox()])
        redis.delete(key)
        redis.set(key, _random_bytes(rng) or b"x")
    elif choice == 13:
        redis.lpush(Keys().outbox(), _random_bytes(rng))
    else:
        redis.hset(f"rq:job:{fake}", mapping={"data": _random_bytes(rng), "kevlaya_crashes": _random_bytes(rng)})
        redis.rpush(queue, fake)
    return 1


def test_fuzz_hostile_writes_between_real_jobs(client: Client, redis: Redis) -> None:
    rng = random.Random(20261130)
    writes = 0
    for round_no in range(40):
        batch = real(client, rng.randrange(1, 7), f"x{round_no}-")
        writes += _hostile_round(redis, rng, batch)
        drain(redis)
        n = client.status(batch).counts.total
        rows = assert_each_item_answered_once(client, redis, batch, n)
        assert all(r.get("error") is None for r in rows), round_no
        if round_no % 10 == 9:  # a queue key replaced while empty: moved aside, the queue works again
            redis.set(QUEUE, _random_bytes(rng) or b"x")
    assert writes > 150
    assert int(redis.get(Keys().counter("duplicate_final_results")) or 0) == 0
