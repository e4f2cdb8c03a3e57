"""A batch's lifecycle, OpenAI Batch style: status words, the completion window, listing, retrying failures."""

from __future__ import annotations

import time

import pytest
from redis import Redis

from producer.client import Client
from shared.keys import Keys, QueueRef
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


def drain(redis: Redis, engine: FakeEngine | None = None) -> None:
    BatchWorker(redis, engine or FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True)).work()


def items(n: int, **extra) -> list[dict]:
    return [{"custom_id": f"i{i}", "model": "laya", "prompt": f"case {i}", **extra} for i in range(n)]


def test_statuses_from_in_progress_to_completed(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(3))
    assert client.status(handle.id).status == "in_progress"
    data = client.status(handle.id).to_dict()
    assert data["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    drain(redis)
    data = client.status(handle.id).to_dict()
    assert data["status"] == "completed" and data["completed_at"] >= data["created_at"]
    assert data["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_finalizing_while_follow_ups_wait_then_completed(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(2, prompt="unsure"))
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True, mixed_tails=False))
    worker._run_take(worker._prepare(worker._take(QueueRef("laya"), {}, suspects=0, queued=2)))
    assert client.status(handle.id).status == "finalizing"
    drain(redis)
    assert client.status(handle.id).status == "completed"


def test_cancelling_then_cancelled(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(3))
    redis.hset(Keys().batch(handle.id), "cancel_requested", "1")
    assert client.status(handle.id).status == "cancelling"
    drain(redis)
    assert client.status(handle.id).status == "cancelled"


def test_items_queued_past_the_completion_window_expire_and_never_run(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(4), completion_window_s=0.05)
    time.sleep(0.1)
    assert client.status(handle.id).status == "expired"
    engine = FakeEngine()
    drain(redis, engine)
    assert engine.calls == []
    rows = assert_each_item_answered_once(client, redis, handle.id, 4)
    assert {r["error"]["type"] for r in rows} == {"expired"}
    record = client.status(handle.id)
    assert record.status == "expired" and record.counts.expired == 4 and record.complete


def test_validating_while_a_submit_is_writing(client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(self, batch, chunk, lane):
        raise ConnectionError("producer died")

    monkeypatch.setattr(Client, "_enqueue_chunk", dies)
    with pytest.raises(ConnectionError):
        client.submit_batch(items(2), batch_id="half")
    assert client.status("half").status == "validating"


def test_batches_are_listed_newest_first(client: Client, redis: Redis) -> None:
    ids = [client.submit_batch(items(1)).id for _ in range(3)]
    redis.zadd(Keys().batches(), {ids[0]: time.time() + 10})  # the newest by its index score
    assert [b.id for b in client.batches(limit=2)] == [ids[0], ids[2]]


def test_retry_failed_runs_failed_items_again(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(3))

    class FailsOnce(FakeEngine):
        def run(self, jobs, *, time_limit_s=None):
            from shared.errors import INTERNAL
            from worker.outputs import RowOutput

            if not self.calls:
                self.calls.append([j.custom_id for j in jobs])
                return [RowOutput.failed(INTERNAL, "boom") if j.custom_id == "i1" else self._answer(j) for j in jobs]
            return super().run(jobs, time_limit_s=time_limit_s)

    drain(redis, FailsOnce())
    assert client.status(handle.id).counts.failed == 1
    assert client.retry_failed(handle.id) == 1
    assert client.status(handle.id).counts.failed == 0 and client.status(handle.id).counts.queued == 1
    drain(redis)
    rows = assert_each_item_answered_once(client, redis, handle.id, 3)
    assert all(r.get("error") is None for r in rows)
    assert client.retry_failed(handle.id) == 0


def test_items_without_custom_id_get_positions_so_resubmits_are_idempotent(client: Client, redis: Redis) -> None:
    jobs = [{"model": "laya", "prompt": f"p{i}"} for i in range(5)]
    first = client.submit_batch(jobs)
    again = client.submit_batch(jobs, batch_id=first.id)
    assert (again.enqueued, again.skipped) == (0, 5)
    assert client.status(first.id).counts.total == 5


def test_result_by_job_id(client: Client, redis: Redis) -> None:
    batch, job_id = client.submit({"model": "laya", "prompt": "p"})
    assert client.result(job_id) is None
    drain(redis)
    row = client.result(job_id)
    assert row is not None and row["batch"] == batch and row["job_id"] == job_id
