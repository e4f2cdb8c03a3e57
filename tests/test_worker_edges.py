"""Hostile Redis data and crash points of the worker: each case failed before its fix (fake engine, the suite's
own redis-server)."""

from __future__ import annotations

import pytest
from redis import Redis

from producer.client import Client
from shared.keys import Keys, job_id
from tests.fakes import FakeEngine, SimulatedCrash
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.settings import WorkerSettings

K = Keys()
LAYA_Q = "rq:queue:kevlaya:laya"
KEV_Q = "rq:queue:kevlaya:kev"


def dups(redis: Redis) -> int:
    return int(redis.get(K.counter("duplicate_final_results")) or 0)


def burst(redis: Redis, engine: FakeEngine, **kw) -> BatchWorker:
    w = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", worker_ttl_s=1, **kw))
    w.work()
    return w


def test_same_id_twice_in_a_queue(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "x"}], escalate=False).id
    redis.rpush(LAYA_Q, job_id(batch, "a"))  # a stray second copy of the id, behind the first
    engine = FakeEngine()
    burst(redis, engine)
    assert_each_item_answered_once(client, redis, batch, 1)
    assert engine.answered == ["a"]
    assert dups(redis) == 0


def test_same_id_twice_escalating(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "unsure"}]).id
    redis.rpush(LAYA_Q, job_id(batch, "a"))
    engine = FakeEngine()
    burst(redis, engine)
    assert_each_item_answered_once(client, redis, batch, 1)
    assert engine.calls == [["a"], ["a"]]  # Laya once, its Kev follow-up once
    assert dups(redis) == 0
    assert client.status(batch).counts.escalated == 1


def test_kev_id_on_laya_queue(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "a", "model": "kev", "prompt": "x"}], escalate=False).id
    redis.lpush(LAYA_Q, job_id(batch, "a"))  # the id pushed onto another model's queue as well
    engine = FakeEngine()
    burst(redis, engine)
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row.get("error") is None and row["model"] == "kev"
    assert engine.answered == ["a"] and dups(redis) == 0
    assert client.status(batch).counts.finished == 1


def test_kev_id_only_on_laya_queue(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "a", "model": "kev", "prompt": "x"}], escalate=False).id
    redis.lmove(KEV_Q, LAYA_Q)  # the only copy of its id is on another model's queue
    engine = FakeEngine()
    burst(redis, engine)
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row.get("error") is None and row["model"] == "kev"
    assert engine.answered == ["a"] and dups(redis) == 0


class CrashOnce:
    """Patches `attr` of `owner` so its next call raises SimulatedCrash (the process dies right there)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner, attr: str) -> None:
        real = getattr(owner, attr)
        self.fired = False

        def patched(*a, **kw):
            if not self.fired:
                self.fired = True
                raise SimulatedCrash(f"killed in {attr}")
            return real(*a, **kw)

        monkeypatch.setattr(owner, attr, patched)


def test_lone_suspect_killed_after_its_answer_is_written(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.rqcompat import RQBridge

    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "unsure"}]).id
    with pytest.raises(SimulatedCrash):  # first crash: an unrelated kill while it runs alone
        burst(redis, FakeEngine(crash_once=True))
    CrashOnce(monkeypatch, RQBridge, "finish")
    with pytest.raises(SimulatedCrash):  # second: killed after its step and follow-up are written, before finish
        burst(redis, FakeEngine())
    monkeypatch.undo()
    follow = redis.lpop(KEV_Q)  # its Kev follow-up in another worker's take meanwhile
    assert follow == (job_id(batch, "a") + "-kev").encode()
    engine = FakeEngine()
    burst(redis, engine)  # recovers the lone suspect
    redis.rpush(KEV_Q, follow)
    burst(redis, engine)
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row.get("error") is None and row["model"] == "kev"
    assert engine.answered == ["a"] and dups(redis) == 0
    laya = job_id(batch, "a")
    assert laya not in client.queue("laya").failed_job_registry.get_job_ids()  # not dead-lettered either
    counts = client.status(batch).counts
    assert (counts.finished, counts.failed, counts.escalated) == (1, 0, 1)


def test_negative_crash_count_on_a_poison_job(client: Client, redis: Redis) -> None:
    from tests.test_recovery import run_until_done

    batch = client.submit_batch([{"custom_id": "p", "model": "laya", "prompt": "POISON"}], escalate=False).id
    redis.hset(f"rq:job:{job_id(batch, 'p')}", "kevlaya_crashes", "-1000000")  # a hostile counter field
    crashes = run_until_done(redis, FakeEngine(), limit=10)
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row["error"]["type"] == "worker_died" and crashes <= 3


def test_follow_up_answered_before_its_parents_step_is_written(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.settle

    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "unsure"}]).id
    CrashOnce(monkeypatch, worker.settle, "record_results")  # killed after the follow-up is enqueued
    with pytest.raises(SimulatedCrash):
        burst(redis, FakeEngine())
    monkeypatch.undo()
    engine = FakeEngine()
    peer = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w2", worker_ttl_s=60))
    peer._step()  # a peer answers the Kev follow-up before anyone recovers the dead worker's Laya job
    assert engine.calls == [["a"]] and redis.hlen(K.batch_results(batch)) == 1
    burst(redis, engine)
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row["model"] == "kev" and [step["model"] for step in row.get("chain", [])] == ["laya"]
    counts = client.status(batch).counts
    assert (counts.finished, counts.escalated, counts.followups_done) == (1, 1, 1)
    assert dups(redis) == 0


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda r, k: r.delete(k),
        lambda r, k: r.hdel(k, "data"),
        lambda r, k: r.hset(k, "data", r.hget(k, "data")[:10]),
        lambda r, k: r.hset(k, "data", b"\xff\xfe\xfd"),
    ],
    ids=["hash deleted", "no data", "truncated data", "non-utf8 data"],
)
def test_a_real_job_with_an_unreadable_hash_ends_its_item(client: Client, redis: Redis, corrupt) -> None:
    batch = client.submit_batch(
        [{"custom_id": "a", "model": "laya", "prompt": "x"}, {"custom_id": "b", "model": "laya", "prompt": "y"}],
        escalate=False,
    ).id
    corrupt(redis, f"rq:job:{job_id(batch, 'a')}")
    burst(redis, FakeEngine())
    rows = {r["custom_id"]: r for r in assert_each_item_answered_once(client, redis, batch, 2)}
    assert rows["a"]["error"]["type"] == "bad_payload" and rows["b"].get("error") is None
    record = client.status(batch)
    assert record.complete and (record.counts.finished, record.counts.failed) == (1, 1)


def test_an_unreadable_follow_up_ends_its_escalated_item(client: Client, redis: Redis) -> None:
    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "unsure"}]).id
    w = BatchWorker(redis, FakeEngine(), FakeEngine().config, WorkerSettings(burst=True, name="w1", worker_ttl_s=1))
    w._step()  # Laya answers and escalates
    redis.delete(f"rq:job:{job_id(batch, 'a')}-kev")  # its follow-up's hash gone
    w.work()
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row["error"]["type"] == "bad_payload" and [s["model"] for s in row["chain"]] == ["laya"]
    counts = client.status(batch).counts
    assert (counts.failed, counts.escalated, counts.followups_done) == (1, 1, 1)
    assert client.status(batch).complete


def test_a_failing_take_size_hint_for_the_follow_ups_does_not_end_the_worker(client: Client, redis: Redis) -> None:
    """Sizing the next Kev take by a take's follow-ups is a hint: raising there (after the take is written) ended
    the loop and charged the next take a crash."""
    batch = client.submit_batch([{"custom_id": f"i{n}", "model": "laya", "prompt": "unsure"} for n in range(3)]).id

    class HintFails(FakeEngine):
        def expect(self, job: object) -> None:
            raise RuntimeError("a sizing hint failed")

    engine = HintFails()
    burst(redis, engine)
    rows = assert_each_item_answered_once(client, redis, batch, 3)
    assert all(r["model"] == "kev" and r.get("error") is None for r in rows)
    assert client.status(batch).counts.escalated == 3 and dups(redis) == 0
