"""The producer against a real Redis: enqueue, idempotent resubmit, cancel, ordered export."""

from __future__ import annotations

import pytest
from redis import Redis
from rq import Queue

from producer.client import Client
from shared.errors import BatchNotFoundError, SubmissionError, ValidationError
from shared.jobfunc import RUN_DECISION
from shared.keys import Keys, job_id
from shared.serializer import serializer
from tests.helpers import answer


def items(n: int, model: str = "laya") -> list[dict]:
    return [{"custom_id": f"c{i}", "model": model, "prompt": f"case {i}"} for i in range(n)]


def test_submit_enqueues_allowlisted_json_jobs(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(3) + items(2, "kev")[:0] + [{"custom_id": "k", "model": "kev", "prompt": "x"}])
    assert handle.enqueued == 4
    laya = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    assert laya.count == 3
    job = laya.fetch_job(job_id(handle.id, "c0"))
    assert job.func_name == RUN_DECISION
    assert job.args[0]["prompt"] == "case 0" and job.args[0]["batch"] == handle.id
    assert job.retries_left == 3
    assert client.status(handle.id).counts.queued == 4


def test_nothing_enqueued_when_any_item_is_bad(client: Client, redis: Redis) -> None:
    bad = [*items(5), {"custom_id": "x", "model": "laya"}]
    with pytest.raises(SubmissionError) as info:
        client.submit_batch(bad)
    assert "line 6: missing 'prompt'" in str(info.value.errors[0])
    assert redis.dbsize() == 0


def test_an_empty_submission_is_refused_before_any_write(client: Client, redis: Redis) -> None:
    for batch_id in (None, "b-empty"):
        with pytest.raises(ValidationError, match="nothing to submit"):
            client.submit_batch([], batch_id=batch_id)
    assert redis.dbsize() == 0


def test_resubmit_into_same_batch_is_idempotent(client: Client, redis: Redis) -> None:
    first = client.submit_batch(items(10))
    again = client.submit_batch(items(12), batch_id=first.id)
    assert (again.enqueued, again.skipped) == (2, 10)
    assert Queue("kevlaya:laya", connection=redis, serializer=serializer).count == 12
    assert client.status(first.id).counts.total == 12


def test_export_in_input_order_when_finished_out_of_order(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(6))
    for i in (5, 2, 0, 4, 1, 3):
        answer(redis, handle.id, f"c{i}", text=f"answer {i}")
    rows = list(client.iter_results(handle.id))
    assert [r["custom_id"] for r in rows] == [f"c{i}" for i in range(6)]
    assert [r["text"] for r in rows] == [f"answer {i}" for i in range(6)]
    record = client.status(handle.id)
    assert record.complete and record.counts.finished == 6


def test_a_second_final_result_is_ignored(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(1))
    assert answer(redis, handle.id, "c0", text="first")
    assert not answer(redis, handle.id, "c0", text="second")
    (row,) = client.iter_results(handle.id)
    assert row["text"] == "first"
    assert client.status(handle.id).counts.finished == 1


def test_pending_items_are_marked_in_export(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(2))
    answer(redis, handle.id, "c1")
    rows = list(client.iter_results(handle.id))
    assert rows[0] == {"custom_id": "c0", "pending": True}


def test_cancel_cancels_queued_items_only(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(5))
    queue = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    redis.lrem(queue.key, 0, job_id(handle.id, "c0"))  # as if a worker had taken it
    answer(redis, handle.id, "c1")
    assert client.cancel(handle.id) == 3
    counts = client.status(handle.id).counts
    assert (counts.cancelled, counts.finished, counts.queued + counts.running) == (3, 1, 1)
    assert queue.count == 0
    assert client.status(handle.id).cancel_requested
    assert not any(r.get("error") for r in client.iter_results(handle.id) if r["custom_id"] in ("c0", "c1"))


def test_unknown_batch_is_a_clear_error(client: Client) -> None:
    with pytest.raises(BatchNotFoundError, match="no batch 'nope'"):
        client.status("nope")


def test_overview_lists_queue_depths_per_lane(client: Client) -> None:
    client.submit_batch([*items(3), {"custom_id": "k", "model": "kev", "prompt": "x"}])
    client.submit({"custom_id": "now", "model": "kev", "prompt": "y"})
    queues = client.overview()["queues"]
    assert {m: {lane: q["queued"] for lane, q in lanes.items()} for m, lanes in queues.items()} == {
        "kev": {"interactive": 1, "bulk": 1},
        "laya": {"interactive": 0, "bulk": 3},
    }
    assert queues["laya"]["interactive"]["oldest_wait_s"] is None
    assert 0 <= queues["laya"]["bulk"]["oldest_wait_s"] < 60


def test_lanes_are_rq_queues_with_their_defaults(client: Client, redis: Redis) -> None:
    """submit_batch goes to bulk (the queue name from before lanes), submit to interactive, unless told."""
    bulk = client.submit_batch(items(2))
    one, _ = client.submit({"custom_id": "x", "model": "laya", "prompt": "p"})
    told, _ = client.submit({"custom_id": "y", "model": "laya", "prompt": "p"}, lane="bulk")
    mine = client.submit_batch([{**items(1)[0], "lane": "interactive"}, *items(2)[1:]], lane="bulk")
    interactive = Queue("kevlaya:laya:interactive", connection=redis, serializer=serializer)
    assert set(interactive.get_job_ids()) == {job_id(one, "x"), job_id(mine.id, "c0")}
    laya = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    assert set(laya.get_job_ids()) == {
        job_id(bulk.id, "c0"),
        job_id(bulk.id, "c1"),
        job_id(told, "y"),
        job_id(mine.id, "c1"),
    }
    assert interactive.fetch_job(job_id(one, "x")).args[0]["lane"] == "interactive"
    with pytest.raises(ValidationError, match="unknown lane 'urgent'"):
        client.submit_batch(items(1), lane="urgent")


def test_cancel_covers_both_lanes(client: Client, redis: Redis) -> None:
    handle = client.submit_batch([{**j, "lane": "interactive"} for j in items(2)] + items(4)[2:])
    assert client.queue("laya", "interactive").count == 2 and client.queue("laya").count == 2
    assert client.cancel(handle.id) == 4
    assert client.queue("laya", "interactive").count == 0 and client.queue("laya").count == 0
    assert client.status(handle.id).counts.cancelled == 4
    assert len(client.queue("laya", "interactive").canceled_job_registry.get_job_ids()) == 2


def test_keys_respect_the_prefix(redis: Redis) -> None:
    client = Client(redis=redis, prefix="other:")
    handle = client.submit_batch(items(1))
    assert redis.exists(Keys("other:").batch(handle.id))
    assert Queue("other:laya", connection=redis, serializer=serializer).count == 1
