"""A sweep of every key kevlaya reads, with bytes some other writer left there (a buggy producer, redis-cli, an
older version): each case failed before its fix -- a traceback from an operator command, or a worker that could
not start or left a job stuck. Real Redis (the suite's own), the fake engine."""

from __future__ import annotations

import time

import orjson
import pytest
from click.testing import CliRunner, Result
from redis import Redis

from producer.cli import cli
from producer.client import Client
from shared.errors import BAD_PAYLOAD, INTERNAL
from shared.keys import Keys, QueueRef, job_id
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.outputs import RowOutput
from worker.rqcompat import RQBridge
from worker.settings import WorkerSettings

K = Keys()
LAYA_Q = "rq:queue:kevlaya:laya"

# Values no kevlaya writes where a result (a JSON object) belongs.
NOT_A_RESULT = {
    "not utf-8": b"\xff\xfe",
    "not json": b"{nope",
    "a json list": b"[1, 2]",
    "json null": b"null",
    "a json number": b"5",
    "an empty object": b"{}",
    "error is a string": b'{"custom_id": "i1", "job_id": "x", "error": "boom"}',
    "error without type": b'{"custom_id": "i1", "job_id": "x", "error": {"message": "m"}}',
    "job_id is a list": b'{"custom_id": "i1", "job_id": [1], "error": {"type": "internal", "message": "m"}}',
    "usage is a list": b'{"custom_id": "i1", "job_id": "x", "usage": [1]}',
    "another item's": b'{"custom_id": "i3", "job_id": "x", "text": "t"}',
}


def items(n: int) -> list[dict]:
    return [{"custom_id": f"i{i}", "model": "laya", "prompt": "unsure" if i == 0 else f"p{i}"} for i in range(n)]


def drain(redis: Redis, engine: FakeEngine | None = None, **settings) -> None:
    engine = engine or FakeEngine(rows=4)
    BatchWorker(redis, engine, FAKE_CONFIG, WorkerSettings(burst=True, worker_ttl_s=1, **settings)).work()


def answered(client: Client, redis: Redis, n: int = 4) -> str:
    """A batch of n items, all answered (i0 escalated: it has a step)."""
    batch = client.submit_batch(items(n)).id
    drain(redis)
    return batch


def run(redis_url: str, *args: str) -> Result:
    res = CliRunner().invoke(cli, ["--redis-url", redis_url, *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def lines(res: Result) -> list[dict]:
    return [orjson.loads(line) for line in res.stdout.splitlines()]


# ---- results, steps: export, the client's result(), retry-failed ---------------------------------------------
@pytest.mark.parametrize("fmt", ["kevlaya", "openai"])
@pytest.mark.parametrize("name", sorted(NOT_A_RESULT))
def test_an_unreadable_result_is_exported_as_its_items_error(
    client: Client, redis: Redis, redis_url: str, name: str, fmt: str
) -> None:
    """Each was a traceback (JSONDecodeError, AttributeError, KeyError) and no export at all."""
    batch = answered(client, redis)
    redis.hset(K.batch_results(batch), "i1", NOT_A_RESULT[name])
    rows = lines(run(redis_url, "results", batch, "--format", fmt))
    assert [r["custom_id"] for r in rows] == ["i0", "i1", "i2", "i3"]
    bad = rows[1]["error"]
    assert (bad["type"] if fmt == "kevlaya" else bad["code"]) == BAD_PAYLOAD
    assert all(r.get("error") is None for i, r in enumerate(rows) if i != 1)
    assert client.result(batch, "i1")["error"]["type"] == BAD_PAYLOAD
    assert client.result(job_id(batch, "i1"))["error"]["type"] == BAD_PAYLOAD


@pytest.mark.parametrize("name", sorted(NOT_A_RESULT))
def test_an_unreadable_step_leaves_the_chain_out(client: Client, redis: Redis, redis_url: str, name: str) -> None:
    batch = answered(client, redis)
    redis.hset(K.batch_steps(batch), "i0", NOT_A_RESULT[name])
    rows = lines(run(redis_url, "results", batch))
    assert rows[0]["custom_id"] == "i0" and "chain" not in rows[0] and rows[0].get("error") is None


class FailsFirst(FakeEngine):
    """Its first batch fails every item; later ones answer."""

    def run(self, jobs, *, time_limit_s=None):
        if not self.calls:
            self.calls.append([j.custom_id for j in jobs])
            return [RowOutput.failed(INTERNAL, "boom") for _ in jobs]
        return super().run(jobs, time_limit_s=time_limit_s)


def test_retry_failed_leaves_unreadable_results_and_retries_the_real_failures(
    client: Client, redis: Redis, redis_url: str
) -> None:
    """A traceback before (JSONDecodeError, AttributeError, KeyError, TypeError): nothing was retried."""
    batch = client.submit_batch(items(4), escalate=False).id
    other = client.submit_batch([{"custom_id": "o", "model": "laya", "prompt": "p"}], escalate=False).id
    drain(redis, FailsFirst(rows=8))
    for i, value in enumerate([b"\xff", b"[1]", b'{"custom_id": "i2", "job_id": "x", "error": "s"}']):
        redis.hset(K.batch_results(batch), f"i{i}", value)
    res = run(redis_url, "retry-failed", batch)
    assert res.exit_code == 0 and "requeued 1 failed item(s)" in res.stderr
    drain(redis)
    assert client.result(batch, "i3").get("error") is None
    assert client.result(other, "o")["error"]["type"] == INTERNAL  # untouched


def test_retry_failed_does_not_requeue_another_batchs_job(client: Client, redis: Redis, redis_url: str) -> None:
    """A failure naming another batch's job id had that job requeued and this item's failure deleted: the other
    job's answer was refused by its own batch, and this item stayed pending for good."""
    batch = client.submit_batch(items(2), escalate=False).id
    other = client.submit_batch([{"custom_id": "o", "model": "laya", "prompt": "p"}], escalate=False).id
    drain(redis, FailsFirst(rows=8))
    forged = {"custom_id": "i1", "job_id": job_id(other, "o"), "error": {"type": INTERNAL, "message": "m"}}
    redis.hset(K.batch_results(batch), "i1", orjson.dumps(forged))
    assert client.retry_failed(batch) == 1  # i0 only
    drain(redis)
    assert_each_item_answered_once(client, redis, batch, 2)
    assert client.result(batch, "i1")["job_id"] == job_id(other, "o")


def test_an_item_id_that_is_not_utf8(client: Client, redis: Redis, redis_url: str) -> None:
    """`cancel` and `results` ended in a UnicodeDecodeError traceback; so did the client's result(job id)."""
    batch = client.submit_batch(items(3), escalate=False).id
    redis.rpush(K.batch_items(batch), b"\xff\xfe")
    redis.sadd(K.batch_item_set(batch), b"\xff\xfe")
    with pytest.raises(Exception, match="no job"):
        client.result(f"{batch}-0000")
    assert run(redis_url, "cancel", batch).exit_code == 0
    rows = lines(run(redis_url, "results", batch))
    assert [r.get("error", {}).get("type") for r in rows[:3]] == ["cancelled"] * 3
    assert rows[3]["pending"] is True


# ---- the batch index -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf", "1e300", "9" * 400])
def test_batches_lists_a_batch_whose_created_at_no_clock_shows(
    client: Client, redis: Redis, redis_url: str, stamp: str
) -> None:
    """OverflowError / ValueError tracebacks from `kevlaya batches`."""
    batch = client.submit_batch(items(1)).id
    redis.hset(K.batch(batch), "created_at", stamp)
    res = run(redis_url, "batches")
    assert res.exit_code == 0 and res.stdout.startswith(batch)
    assert lines(run(redis_url, "batches", "--json"))[0]["batch"] == batch


# ---- schedule --list -------------------------------------------------------------------------------------------
SPEC = {"name": "s1", "every_s": 60, "inputs": ["a.jsonl"], "output": "o.jsonl"}
BAD_RUNS = [b"[]", b"null", b"7", b'"s"', b'{"slot": "x", "status": null}', b'{"slot": "x", "status": {}}']
BAD_SPECS = [{**SPEC, "every_s": "60"}, {**SPEC, "output": 5}, {**SPEC, "every_s": 0}, [SPEC], {**SPEC, "inputs": "a"}]


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("run_value", BAD_RUNS)
def test_schedule_list_leaves_out_an_unreadable_run(redis: Redis, redis_url: str, run_value: bytes, as_json) -> None:
    redis.sadd(K.schedules(), "s1")
    redis.hset(K.schedule("s1"), "spec", orjson.dumps(SPEC))
    redis.hset(K.schedule_runs("s1"), "20240101T000000Z", b'{"slot": "20240101T000000Z", "status": "missed"}')
    redis.hset(K.schedule_runs("s1"), "20240102T000000Z", run_value)
    res = run(redis_url, "schedule", "--list", *(["--json"] if as_json else []))
    assert res.exit_code == 0
    assert "1 missed" in res.stdout or '"missed":1' in res.stdout


@pytest.mark.parametrize("spec", BAD_SPECS, ids=range(len(BAD_SPECS)))
def test_schedule_list_shows_an_unreadable_spec_as_none(redis: Redis, redis_url: str, spec) -> None:
    redis.sadd(K.schedules(), "s1")
    redis.hset(K.schedule("s1"), "spec", orjson.dumps(spec))
    res = run(redis_url, "schedule", "--list", "--json")
    assert res.exit_code == 0 and lines(res)[0]["cadence"] is None


# ---- the worker: start, heartbeat, notices, stuck ids ------------------------------------------------------------
@pytest.mark.parametrize("key", ["rq:workers", "rq:workers:kevlaya:laya", K.workers(), K.notice_senders(), K.outbox()])
def test_a_wrong_typed_worker_key_does_not_stop_a_worker_starting(client: Client, redis: Redis, key: str) -> None:
    """RQ's worker sets, kevlaya's workers index and the notice senders set of another type: the worker died at
    start with a WRONGTYPE traceback (every worker, until someone deleted the key by hand)."""
    batch = client.submit_batch(items(4)).id
    redis.set(key, "x")
    drain(redis, name="w1", notify_allow=("http://127.0.0.1:1/",))
    assert_each_item_answered_once(client, redis, batch, 4)
    assert redis.type(key) != b"string"  # moved aside; recreated with its own type
    assert client.overview()["quarantine"]["total"] >= 1


@pytest.mark.parametrize("stamp", [b"nan", b"inf", b"list"])
def test_an_unreadable_first_seen_stamp_still_unsticks_the_job(client: Client, redis: Redis, stamp: bytes) -> None:
    """A stuck id whose first-seen stamp was NaN or infinity never compared older than the limit (the job stayed in
    RQ's intermediate list for good); a stamp of another type failed every recovery pass."""
    batch = client.submit_batch(items(1), escalate=False).id
    jid = job_id(batch, "i0")
    redis.lmove(LAYA_Q, LAYA_Q + ":intermediate")
    seen = K.first_seen(LAYA_Q + ":intermediate", jid)
    redis.rpush(seen, "x") if stamp == b"list" else redis.set(seen, stamp)
    bridge = RQBridge(redis, K, ["laya"], "w1")
    assert bridge.unstick_intermediate(QueueRef("laya"), older_than_s=60) == [jid]
    assert redis.lrange(LAYA_Q, 0, -1) == [jid.encode()]
    drain(redis)
    assert_each_item_answered_once(client, redis, batch, 1)


def test_a_workers_index_replaced_while_running_is_moved_aside_at_the_next_beat(client: Client, redis: Redis) -> None:
    """Each beat failed on it, read as Redis being down, which held recovery off for as long as it stayed."""
    batch = client.submit_batch(items(2)).id
    engine = FakeEngine(rows=1)
    real_run = engine.run

    def slow(jobs, **kw):
        redis.delete(K.workers())
        redis.set(K.workers(), "x")
        time.sleep(0.5)
        return real_run(jobs, **kw)

    engine.run = slow
    settings = WorkerSettings(burst=True, worker_ttl_s=1, heartbeat_interval_s=0.1)
    BatchWorker(redis, engine, FAKE_CONFIG, settings).work()
    assert_each_item_answered_once(client, redis, batch, 2)
    assert redis.type(K.workers()) == b"zset"
