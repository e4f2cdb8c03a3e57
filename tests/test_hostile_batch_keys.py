"""Producer-writable keys of a batch, of RQ and of the notice outbox replaced with other types or garbage,
at the worst moments: nothing is lost, counts stay exact, nothing stops (review findings, each reproduced
first against the code before its fix)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import orjson
import pytest
from click.testing import CliRunner
from redis import Redis
from redis.exceptions import ResponseError
from redis.exceptions import WatchError as RedisWatchError

from producer.aio import AsyncClient
from producer.cli import cli
from producer.client import Client
from shared import store
from shared.errors import INTERNAL, ConfigError, WaitTimeoutError, WrongTypeError
from shared.keys import Keys, QueueRef, followup_id, job_id
from shared.result import Result
from shared.store import BatchRecord, record_result, reopen_failed
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.notices import Notifier, allowed
from worker.outputs import RowOutput
from worker.settings import WorkerSettings

K = Keys()


def worker(redis: Redis, engine: FakeEngine | None = None, **settings) -> BatchWorker:
    return BatchWorker(
        redis, engine or FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True, worker_ttl_s=1, **settings)
    )


def test_a_cancelled_follow_up_with_wrong_typed_steps_ends_cancelled(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "unsure"}]).id
    w = worker(redis)
    w._step()  # Laya answers and escalates
    redis.hset(K.batch(batch), "cancel_requested", "1")
    redis.delete(K.batch_steps(batch))
    redis.set(K.batch_steps(batch), "x")
    w.work()
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row["error"]["type"] == "cancelled"


def test_a_garbage_counter_refuses_the_write_instead_of_half_writing(client: Client, redis: Redis) -> None:
    batch = client.submit_batch(
        [{"custom_id": f"x{i}", "model": "laya", "prompt": "p"} for i in range(3)], escalate=False
    ).id
    redis.hset(K.batch(batch), "finished", "abc")
    worker(redis).work()
    record = client.status(batch)
    assert (record.counts.finished, record.counts.running) == (3, 0)  # 'abc' read as 0, then counted
    assert record.status == "completed"


# What some other writer can leave in an ended-item counter: read as written, each kept `status --wait` waiting
# for good (the batch never complete) or ended it early, with counts like finished=-1 and queued=4 of 3 items.
HOSTILE_COUNTS = {
    "negative": b"-1",
    "garbage": b"abc",
    "not UTF-8": b"\xff\xfe",
    "huge": b"9" * 30,
    "an exponent (Lua's large numbers)": b"1e+25",
    "a float": b"3.0",
    "padded": b" 3",
    "deleted": None,
}


def _corrupt(redis: Redis, batch: str, field: str, value: bytes | None) -> None:
    if value is None:
        redis.hdel(K.batch(batch), field)
    else:
        redis.hset(K.batch(batch), field, value)


def _async_status(redis_url: str, batch: str) -> BatchRecord:
    async def run() -> BatchRecord:
        aclient = AsyncClient(redis_url=redis_url)
        try:
            return await aclient.status(batch)
        finally:
            await aclient.aclose()

    return asyncio.run(run())


def three(client: Client) -> str:
    return client.submit_batch(
        [{"custom_id": f"x{i}", "model": "laya", "prompt": "p"} for i in range(3)], escalate=False
    ).id


@pytest.mark.parametrize("name", list(HOSTILE_COUNTS))
def test_a_hostile_counter_of_an_answered_batch_still_reads_complete(
    client: Client, redis: Redis, redis_url: str, name: str
) -> None:
    batch = three(client)
    worker(redis).work()
    _corrupt(redis, batch, "finished", HOSTILE_COUNTS[name])
    for record in (client.status(batch), _async_status(redis_url, batch)):
        assert record.complete and record.status == "completed"
        assert record.counts.to_dict() == {
            **dict.fromkeys(("queued", "running", "failed", "escalated", "cancelled", "expired"), 0),
            "total": 3,
            "finished": 3,  # counted from the results hash, the one exact reading
        }
    assert client.wait(batch, timeout_s=5).complete
    res = CliRunner().invoke(cli, ["--redis-url", redis_url, "status", batch, "--wait", "--timeout", "5"])
    assert res.exit_code == 0 and "completed" in res.output, res.output


@pytest.mark.parametrize("name", list(HOSTILE_COUNTS))
@pytest.mark.parametrize("reader", ["sync", "async"])
def test_a_recount_writes_the_counters_back_so_the_next_reading_needs_none(
    client: Client, redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch, name: str, reader: str
) -> None:
    """Counters some other writer spoiled were counted from the results at every status poll of a `wait` (a
    scan of the whole results hash each time); the first recount now sets them to what the results hold."""
    batch = three(client)
    worker(redis).work()
    _corrupt(redis, batch, "finished", HOSTILE_COUNTS[name])
    scans: list[int] = []
    real = store.recount_ended
    monkeypatch.setattr(store, "recount_ended", lambda *a: (scans.append(1), real(*a))[1])
    read = (lambda: client.status(batch)) if reader == "sync" else (lambda: _async_status(redis_url, batch))
    assert read().counts.finished == 3
    assert redis.hmget(K.batch(batch), [*store.ENDED, "followups_done"]) == [b"3", b"0", b"0", b"0", b"0"]
    assert read().counts.finished == 3 and read().complete
    assert len(scans) == 1


def test_a_recount_writes_nothing_over_a_foreign_field_or_a_write_meanwhile(
    client: Client, redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = three(client)
    worker(redis).work()
    _corrupt(redis, batch, "finished", b"abc")
    redis.hset(K.batch_results(batch), "not-an-item", b"{}")  # no item's: the counters could never agree with HLEN
    assert client.status(batch).counts.finished == 3
    assert redis.hget(K.batch(batch), "finished") == b"abc"
    redis.hdel(K.batch_results(batch), "not-an-item")
    real = store.recount_ended

    def with_a_writer(*args):  # a worker's script writing the batch between the recount's reads and its write
        Redis.from_url(redis_url).hset(K.batch(batch), "last_done_at", "1")
        return real(*args)

    monkeypatch.setattr(store, "recount_ended", with_a_writer)
    assert client.status(batch).counts.finished == 3
    assert redis.hget(K.batch(batch), "finished") == b"abc"  # WATCHed: the transaction gave way


def test_a_reader_that_may_not_write_still_counts_over_spoiled_counters(
    client: Client, redis: Redis, redis_url: str
) -> None:
    """A read-only user (an ACL with reads and transactions, no writes) reads a batch whose counters were spoiled: the
    counts from the results, nothing written, no error."""
    batch = three(client)
    worker(redis).work()
    _corrupt(redis, batch, "finished", b"abc")
    rules = ["on", ">reader-secret", "~*", "&*", "-@all", "+@read", "+@transaction", "+ping"]
    redis.execute_command("ACL", "SETUSER", "reader", *rules)
    try:
        url = redis_url.replace("redis://", "redis://reader:reader-secret@", 1)
        reader = Client(redis_url=url)
        record = reader.status(batch)
        assert (record.counts.finished, record.complete) == (3, True)
        assert redis.hget(K.batch(batch), "finished") == b"abc"
    finally:
        redis.execute_command("ACL", "DELUSER", "reader")


def test_a_recount_refused_its_write_or_cut_off_while_watching_still_counts(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repair is a saving only. A write refusal that is no ACL's (NOREPLICAS: too few replicas for a write)
    and a connection dropped while watching (redis-py raises WatchError then, and retries nothing) each made a
    status read raise where the plain count had answered."""
    batch = three(client)
    worker(redis).work()
    _corrupt(redis, batch, "finished", b"abc")
    redis.config_set("min-replicas-to-write", 1)
    try:
        assert client.status(batch).counts.finished == 3
    finally:
        redis.config_set("min-replicas-to-write", 0)
    assert redis.hget(K.batch(batch), "finished") == b"abc"
    real, calls = store.recount_ended, []

    def cut_off_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RedisWatchError("A ConnectionError occurred while watching one or more keys")
        return real(*args)

    monkeypatch.setattr(store, "recount_ended", cut_off_once)
    assert client.wait(batch, timeout_s=5).counts.finished == 3
    assert len(calls) == 2


@pytest.mark.parametrize("name", list(HOSTILE_COUNTS))
def test_a_counter_corrupted_before_the_run_ends_complete(client: Client, redis: Redis, name: str) -> None:
    """The worker bumps the value it finds (`tonumber(v) or 0` + 1): -1 became 2 of 3, garbage 3 of 3 only when
    nothing had been counted yet, 9...9 became 1e+25, which Python read as 0."""
    batch = three(client)
    _corrupt(redis, batch, "finished", HOSTILE_COUNTS[name])
    worker(redis, FakeEngine(rows=1)).work()  # a take an item: the value is bumped three times
    record = client.wait(batch, timeout_s=5)
    assert (record.counts.finished, record.counts.queued, record.status) == (3, 0, "completed")


def test_hostile_counters_never_complete_a_batch_early(client: Client, redis: Redis, redis_url: str) -> None:
    batch = three(client)
    redis.hset(K.batch(batch), mapping={"finished": b"9" * 30, "failed": b"5", "escalated": b"7"})
    for record in (client.status(batch), _async_status(redis_url, batch)):
        assert not record.complete and record.status == "in_progress"  # was: completed, or `failed`, at once
        assert (record.counts.done, record.counts.queued, record.counts.escalated) == (0, 3, 0)
        assert record.eta_s(time.time()) is None
    with pytest.raises(WaitTimeoutError):
        client.wait(batch, timeout_s=0.2, poll_s=0.05)
    worker(redis).work()
    assert client.wait(batch, timeout_s=5).status == "completed"


def test_a_recount_sorts_the_ended_items_as_they_were_counted(client: Client, redis: Redis) -> None:
    batch = three(client)
    assert client.cancel(batch) == 3
    redis.hset(K.batch_results(batch), "x2", b"\xff not a result")  # some other writer's: exported as a failure
    redis.hset(K.batch(batch), mapping={"cancelled": b"-7", "failed": b"0"})
    record = client.status(batch)
    assert (record.counts.cancelled, record.counts.failed, record.counts.done) == (2, 1, 3)
    assert record.status == "cancelled"


def test_a_results_hash_of_the_wrong_type_is_named_not_waited_on(client: Client, redis: Redis) -> None:
    """Read as no answers, its batch stayed `in_progress` for good (the worker refuses to write there)."""
    batch = three(client)
    redis.set(K.batch_results(batch), "x")
    with pytest.raises(WrongTypeError, match=K.batch_results(batch)) as caught:
        client.wait(batch, timeout_s=5)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("value", [b"-5", b"9" * 30])
def test_a_hostile_counter_neither_keeps_nor_makes_the_announcement(client: Client, redis: Redis, value: bytes) -> None:
    """The worker announced a batch (events message, HTTP notice) when the counters summed to its size: a negative
    one never did, a huge one did before any item was answered."""
    jobs = [{"custom_id": f"x{i}", "model": "laya", "prompt": "p"} for i in range(3)]
    batch = client.submit_batch(jobs, escalate=False, notify_url="http://127.0.0.1:9/hook").id
    redis.hset(K.batch(batch), "finished", value)
    one = Result.failure(
        custom_id="x0", model="laya", job_id=job_id(batch, "x0"), batch=batch, error_type=INTERNAL, message="m"
    )
    assert record_result(redis, K, one)  # one item answered of three
    assert redis.hget(K.batch(batch), "notified_at") is None
    worker(redis).work()
    assert redis.hget(K.batch(batch), "notified_at") is not None
    notices = [orjson.loads(n) for n in redis.lrange(K.outbox(), 0, -1)]
    assert [n["batch"] for n in notices].count(batch) <= 1  # announced once (a worker may have sent it already)


def test_a_field_no_item_owns_neither_completes_nor_announces_a_batch(client: Client, redis: Redis) -> None:
    """The results hash's size counted a field some other writer put there: two of three items answered read as a
    complete batch, announced while the third was still queued."""
    jobs = [{"custom_id": f"x{i}", "model": "laya", "prompt": "p"} for i in range(3)]
    batch = client.submit_batch(jobs, escalate=False, notify_url="http://127.0.0.1:9/hook").id
    redis.hset(K.batch_results(batch), "not-an-item", b"junk")
    for cid in ("x0", "x1"):
        failed = Result.failure(
            custom_id=cid, model="laya", job_id=job_id(batch, cid), batch=batch, error_type=INTERNAL, message="m"
        )
        assert record_result(redis, K, failed)
    assert redis.hget(K.batch(batch), "notified_at") is None
    record = client.status(batch)
    assert (record.counts.done, record.counts.failed, record.complete) == (2, 2, False)
    worker(redis).work()
    assert redis.hget(K.batch(batch), "notified_at") is not None
    assert client.status(batch).complete


@pytest.mark.parametrize("value", [b"-1", b"junk", None])
def test_a_hostile_follow_up_counter_is_recounted(client: Client, redis: Redis, value: bytes | None) -> None:
    """Follow-ups done is recounted from the results with the ended items when those are (the counters disagree)
    or when it is no plain count itself; a deleted one with the others sane reads as none done (a label's worth:
    it never keeps a batch from completing)."""
    jobs = [{"custom_id": f"x{i}", "model": "laya", "prompt": "unsure" if i else "p"} for i in range(3)]
    batch = client.submit_batch(jobs).id
    redis.hset(K.batch_results(batch), "not-an-item", b"junk")  # the counters disagree with the hash's size
    worker(redis).work()
    record = client.status(batch)
    assert record.counts.followups_done == record.counts.escalated == 2
    if value is None:
        redis.hdel(K.batch(batch), "followups_done")
    else:
        redis.hset(K.batch(batch), "followups_done", value)
    assert client.status(batch).counts.followups_done == record.counts.followups_done
    assert client.status(batch).complete


class FailsWhileFlaky(FakeEngine):
    """Fails every Kev row whose prompt says FLAKY while `flaky` is set (an escalated item's follow-up too)."""

    flaky = True

    def run(self, jobs, *, time_limit_s=None):
        out = super().run(jobs, time_limit_s=time_limit_s)
        fails = [self.flaky and j.model == "kev" and "FLAKY" in (j.prompt or "") for j in jobs]
        return [RowOutput.failed(INTERNAL, "flaky") if f else o for f, o in zip(fails, out, strict=True)]


@pytest.mark.parametrize("name", list(HOSTILE_COUNTS))
def test_retry_failed_over_hostile_counters_retries_and_sets_them_right(
    client: Client, redis: Redis, name: str
) -> None:
    """retry_failed decremented `failed` and `followups_done` with HINCRBY inside its transaction: on a value that
    is no integer to Redis that one command failed while the rest applied (the items were requeued, yet the caller
    saw an error), and a negative one went further below zero."""
    jobs = [
        {"custom_id": "k", "model": "kev", "prompt": "FLAKY"},
        {"custom_id": "e", "model": "laya", "prompt": "unsure FLAKY"},  # escalates; its Kev follow-up fails
        {"custom_id": "ok", "model": "laya", "prompt": "p"},
    ]
    batch = client.submit_batch(jobs).id
    engine = FailsWhileFlaky()
    worker(redis, engine).work()
    assert client.status(batch).counts.failed == 2
    for field in ("failed", "followups_done"):
        _corrupt(redis, batch, field, HOSTILE_COUNTS[name])
    assert client.retry_failed(batch) == 2
    assert redis.hmget(K.batch(batch), ["failed", "followups_done"]) == [b"0", b"0"]  # what the results hold
    engine.flaky = False
    worker(redis, engine).work()
    rows = assert_each_item_answered_once(client, redis, batch, 3)
    assert all(r.get("error") is None for r in rows)
    assert redis.hmget(K.batch(batch), ["finished", "failed", "followups_done"]) == [b"3", b"0", b"1"]


def _followup_failure(redis: Redis, batch: str, custom_id: str) -> str:
    """Records the failure of an item's Kev follow-up (it counts in `failed` and `followups_done`); its job id."""
    parent = job_id(batch, custom_id)
    jid = followup_id(parent, "kev")
    failure = Result.failure(
        custom_id=custom_id, model="kev", job_id=jid, batch=batch, error_type=INTERNAL, message="flaky"
    )
    assert record_result(redis, K, replace(failure, escalated_from=parent))
    return jid


@pytest.mark.parametrize("name", list(HOSTILE_COUNTS))
def test_reopening_a_failure_over_hostile_counters_never_stops_half_way(
    client: Client, redis: Redis, name: str
) -> None:
    """A failed job requeued (`rq requeue`) has its failure taken back (`reopen_failed`). The script decremented the
    counters with HINCRBY after deleting the failure: on a value that is no integer to Redis it stopped half-way (a
    Lua script keeps its writes), and a negative one went further below zero."""
    batch = three(client)
    jid = _followup_failure(redis, batch, "x0")
    for field in ("failed", "followups_done"):
        _corrupt(redis, batch, field, HOSTILE_COUNTS[name])
    assert reopen_failed(redis, K, batch, "x0", jid)
    assert redis.hget(K.batch_results(batch), "x0") is None
    for value in redis.hmget(K.batch(batch), ["failed", "followups_done"]):
        assert value is None or float(value) >= 0  # as the worker's scripts read a count: tonumber(v) or 0
    record = client.status(batch)
    assert (record.counts.failed, record.counts.done, record.counts.queued) == (0, 0, 3)


def test_reopening_a_failure_of_a_batch_whose_hash_is_no_hash_changes_nothing(client: Client, redis: Redis) -> None:
    batch = three(client)
    jid = _followup_failure(redis, batch, "x0")
    redis.delete(K.batch(batch))
    redis.set(K.batch(batch), "x")
    with pytest.raises(ResponseError):
        reopen_failed(redis, K, batch, "x0", jid)
    assert redis.hget(K.batch_results(batch), "x0") is not None  # was deleted, then the script failed


def test_a_batch_hash_of_the_wrong_type_writes_nothing(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "x", "model": "laya", "prompt": "p"}], escalate=False).id
    redis.delete(K.batch(batch))
    redis.set(K.batch(batch), "x")
    worker(redis).work()
    assert redis.hlen(K.batch_results(batch)) == 0  # refused before any write, quarantined, not half-done
    assert client.overview()["quarantine"]["total"] >= 1


def test_a_running_set_of_the_wrong_type_costs_nothing(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "x", "model": "laya", "prompt": "p"}], escalate=False).id
    redis.set(K.batch_running(batch), "x")
    worker(redis).work()
    assert_each_item_answered_once(client, redis, batch, 1)


class Saboteur(FakeEngine):
    """Replaces a key with a string while the engine runs (between the take and the writes)."""

    def __init__(self, redis: Redis, key: str) -> None:
        super().__init__()
        self.redis, self.key, self.done = redis, key, False

    def run(self, jobs, *, time_limit_s=None):
        if not self.done:
            self.done = True
            self.redis.delete(self.key)
            self.redis.set(self.key, "junk")
        return super().run(jobs, time_limit_s=time_limit_s)


@pytest.mark.parametrize("key", ["rq:queue:kevlaya:kev", "rq:queues"])
def test_follow_ups_survive_a_queue_key_replaced_mid_batch(client: Client, redis: Redis, key: str) -> None:
    items = [
        {"custom_id": "a", "model": "laya", "prompt": "unsure"},
        {"custom_id": "b", "model": "laya", "prompt": "ok"},
    ]
    batch = client.submit_batch(items).id
    worker(redis, Saboteur(redis, key)).work()
    rows = {r["custom_id"]: r for r in assert_each_item_answered_once(client, redis, batch, 2)}
    assert rows["a"]["model"] == "kev" and rows["b"]["model"] == "laya"
    assert client.status(batch).status == "completed"


def test_submit_moves_a_wrong_typed_rq_queues_aside(client: Client, redis: Redis) -> None:
    redis.set("rq:queues", "x")
    handle = client.submit_batch([{"custom_id": f"a{i}", "model": "laya", "prompt": "p"} for i in range(1500)])
    assert client.status(handle.id).counts.total == 1500 and redis.llen("rq:queue:kevlaya:laya") == 1500


def test_requeue_of_lost_entries_into_a_wrong_typed_queue_loses_nothing(client: Client, redis: Redis) -> None:
    batch = client.submit_batch(
        [{"custom_id": f"a{i}", "model": "laya", "prompt": "p"} for i in range(3)], escalate=False
    ).id
    w = worker(redis)
    w.bridge.begin_batch()
    w.bridge.take(QueueRef("laya"), 3, ttl_s=-5)  # taken, then lost track of (its heartbeat lapsed, not in flight)
    redis.set("rq:queue:kevlaya:laya", "junk")
    w._maybe_recover(force=True)
    assert redis.llen("rq:queue:kevlaya:laya") == 3 and redis.zcard("rq:wip:kevlaya:laya") == 0
    w.work()
    assert_each_item_answered_once(client, redis, batch, 3)


def test_a_bad_notice_does_not_stop_the_notifier(redis: Redis) -> None:
    stop = threading.Event()
    notifier = Notifier(redis, K, "w1", allow=["http://127.0.0.1:1/"], stop=stop).start()
    redis.lpush(K.outbox(), orjson.dumps({"batch": "nope", "url": "http://127.0.0.1:1/x"}), b"\xff garbage")
    time.sleep(2.5)
    try:
        assert notifier.thread.is_alive()
        assert redis.llen(K.outbox()) == 0 and redis.llen(K.outbox_sending("w1")) == 0
    finally:
        stop.set()
        notifier.thread.join(timeout=5)


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://hooks.example.com/kevlaya/done", True),
        ("https://hooks.example.com.evil.net/kevlaya/x", False),
        ("https://hooks.example.com@evil.net/kevlaya/x", False),
        ("http://hooks.example.com/kevlaya/x", False),
        ("https://hooks.example.com:8443/kevlaya/x", False),
        ("https://hooks.example.com/other", False),
    ],
)
def test_notice_allowlist_compares_origins_not_strings(url: str, ok: bool) -> None:
    assert allowed(url, ["https://hooks.example.com/kevlaya"]) is ok


def test_a_worker_name_with_separators_is_refused(redis: Redis) -> None:
    with pytest.raises(ConfigError, match="--name 'gpu:0'"):
        worker(redis, name="gpu:0")


def test_concurrent_submits_each_hold_the_batch_open(client: Client, redis: Redis) -> None:
    client._holding("open", "other-submit")  # another producer still writing into this batch
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}], batch_id="open")
    worker(redis).work()
    record = client.status(handle.id)
    assert record.counts.done == 1 and not record.complete and record.status == "validating"
    client._done_submitting("open", "other-submit")
    assert client.status(handle.id).complete
