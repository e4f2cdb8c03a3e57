"""Submission is idempotent under failure and concurrency, refuses closed batches, and checks everything
before its first write. Cancel keeps answers already computed."""

from __future__ import annotations

import threading

import pytest
from redis import Redis

from producer.client import PIPELINE_CHUNK, Client
from shared.errors import BatchClosedError, SubmissionError, ValidationError
from shared.keys import Keys, QueueRef
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


def jobs(n: int, **extra) -> list[dict]:
    return [{"custom_id": f"i{i}", "model": "laya", "prompt": f"case {i}", **extra} for i in range(n)]


def drain(redis: Redis) -> None:
    BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True)).work()


def queued(redis: Redis) -> int:
    return redis.llen("rq:queue:kevlaya:laya") + redis.llen("rq:queue:kevlaya:kev")


def test_concurrent_resubmits_count_and_enqueue_each_item_once(client: Client, redis: Redis) -> None:
    first = client.submit_batch(jobs(10), escalate=False)
    errors: list[BaseException] = []

    def resubmit() -> None:
        try:
            Client(redis=Redis(connection_pool=redis.connection_pool)).submit_batch(
                jobs(1500), batch_id=first.id, escalate=False
            )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=resubmit) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.status(first.id).counts.total == 1500
    assert queued(redis) == 1500
    assert redis.llen(Keys().batch_items(first.id)) == 1500
    drain(redis)
    assert len(assert_each_item_answered_once(client, redis, first.id, 1500)) == 1500
    assert client.status(first.id).complete


def test_a_submit_interrupted_part_way_then_resubmitted_counts_each_item_once(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Client._enqueue_chunk
    calls = {"n": 0}

    def dies_after_two_chunks(self, batch, chunk, lane):
        calls["n"] += 1
        if calls["n"] > 2:
            raise ConnectionError("producer killed")
        return real(self, batch, chunk, lane)

    monkeypatch.setattr(Client, "_enqueue_chunk", dies_after_two_chunks)
    with pytest.raises(ConnectionError):
        client.submit_batch(jobs(2500), batch_id="resume-me", escalate=False)
    written = 2 * PIPELINE_CHUNK
    assert written < 2500  # the third chunk would have held some
    assert client.status("resume-me").counts.total == written
    monkeypatch.setattr(Client, "_enqueue_chunk", real)
    again = client.submit_batch(jobs(2500), batch_id="resume-me", escalate=False)
    assert (again.enqueued, again.skipped) == (2500 - written, written)
    assert client.status("resume-me").counts.total == 2500
    assert queued(redis) == 2500
    drain(redis)
    assert_each_item_answered_once(client, redis, "resume-me", 2500)


def test_resubmit_into_a_cancelled_batch_is_refused(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(jobs(3))
    client.cancel(handle.id)
    with pytest.raises(BatchClosedError, match="cancelled"):
        client.submit_batch(jobs(5), batch_id=handle.id)
    assert client.status(handle.id).counts.total == 3


def test_resubmit_into_an_expired_batch_is_refused(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(jobs(3))
    redis.delete(*Keys().batch_keys(handle.id))  # its keys expired; the index still remembers it
    with pytest.raises(BatchClosedError, match="expired"):
        client.submit_batch(jobs(3), batch_id=handle.id)


@pytest.mark.parametrize("batch_id", ["a b", "x:y", "ü", "", "a" * 129, "../etc", "b\x00"])
def test_bad_batch_ids_are_refused_before_any_write(client: Client, redis: Redis, batch_id: str) -> None:
    with pytest.raises(ValidationError, match="batch id"):
        client.submit_batch(jobs(2), batch_id=batch_id)
    assert redis.dbsize() == 0


@pytest.mark.parametrize("depth", [65, 252, 300, 1023])
def test_deep_meta_is_refused_before_any_write(client: Client, redis: Redis, depth: int) -> None:
    meta: object = "leaf"
    for _ in range(depth):
        meta = {"m": meta}
    with pytest.raises(SubmissionError) as info:
        client.submit_batch([*jobs(2), {"custom_id": "deep", "model": "laya", "prompt": "p", "meta": meta}])
    assert "line 3: 'meta' nests" in str(info.value.errors[0])
    assert redis.dbsize() == 0


def test_meta_at_the_depth_limit_goes_through(client: Client, redis: Redis) -> None:
    meta: object = "leaf"
    for _ in range(63):
        meta = {"m": meta}
    handle = client.submit_batch([{"custom_id": "deep", "model": "laya", "prompt": "p", "meta": meta}])
    drain(redis)
    (row,) = assert_each_item_answered_once(client, redis, handle.id, 1)
    assert row["meta"] == meta


def _laya_answered_kev_queued(client: Client, redis: Redis, n: int) -> str:
    """A batch whose unsure Laya answers are written and whose Kev follow-ups wait in the queue."""
    handle = client.submit_batch([{"custom_id": f"u{i}", "model": "laya", "prompt": "unsure"} for i in range(n)])
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True, mixed_tails=False))
    worker._run_take(
        worker._prepare(worker._take(QueueRef("laya"), {}, suspects=0, queued=n))
    )  # one Laya take, no Kev take
    assert redis.llen("rq:queue:kevlaya:kev") == n
    return handle.id


def _assert_kept_laya_answers(client: Client, redis: Redis, batch: str, n: int) -> None:
    rows = assert_each_item_answered_once(client, redis, batch, n)
    for row in rows:
        assert row["model"] == "laya" and row.get("error") is None and row["final"] is True
        assert row["not_escalated"] == "cancelled" and "escalated_to" not in row and "chain" not in row
    counts = client.status(batch).counts
    assert (counts.finished, counts.cancelled, counts.escalated) == (n, 0, n)


def test_cancel_keeps_computed_laya_answers(client: Client, redis: Redis) -> None:
    batch = _laya_answered_kev_queued(client, redis, 5)
    assert client.cancel(batch) == 0  # nothing cancelled: every item had its answer
    assert redis.llen("rq:queue:kevlaya:kev") == 0
    _assert_kept_laya_answers(client, redis, batch, 5)


def test_a_worker_taking_a_cancelled_follow_up_keeps_the_laya_answer(client: Client, redis: Redis) -> None:
    batch = _laya_answered_kev_queued(client, redis, 4)
    redis.hset(Keys().batch(batch), "cancel_requested", "1")  # cancelled while the follow-ups are being taken
    drain(redis)
    _assert_kept_laya_answers(client, redis, batch, 4)


def test_cancel_is_one_pass_and_rq_tools_agree(client: Client, redis: Redis) -> None:
    from rq import Queue
    from rq.registry import CanceledJobRegistry

    other = client.submit_batch(jobs(50), escalate=False)
    handle = client.submit_batch([{**j, "custom_id": f"c{i}"} for i, j in enumerate(jobs(300))], escalate=False)
    assert client.cancel(handle.id) == 300
    queue = Queue("kevlaya:laya", connection=redis)
    assert queue.count == 50  # the other batch's jobs stay, in order
    assert [j.decode() for j in redis.lrange(queue.key, 0, 2)] == [
        f"{other.id}-{h}" for h in _hashes(["i0", "i1", "i2"])
    ]
    canceled = CanceledJobRegistry(queue=queue).get_job_ids()
    assert len(canceled) == 300 and all(i.startswith(handle.id) for i in canceled)
    job = queue.fetch_job(canceled[0])
    assert job.get_status() == "canceled"
    assert 0 < redis.ttl(job.key) <= client.batch_ttl_s  # nothing a cancel leaves behind lives forever
    counts = client.status(handle.id).counts
    assert (counts.cancelled, counts.queued, counts.running) == (300, 0, 0)


def _hashes(custom_ids: list[str]) -> list[str]:
    from shared.keys import job_id

    return [job_id("x", c)[2:] for c in custom_ids]


def test_running_count_shows_the_batch_in_flight(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(jobs(7), escalate=False)
    seen: list[int] = []

    class Watching(FakeEngine):
        def run(self, batch, *, time_limit_s=None):
            seen.append(client.status(handle.id).counts.running)
            return super().run(batch, time_limit_s=time_limit_s)

    BatchWorker(redis, Watching(), FAKE_CONFIG, WorkerSettings(burst=True)).work()
    assert seen == [7]
    assert client.status(handle.id).counts.running == 0
