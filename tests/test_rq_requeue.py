"""`rq requeue` of a failed kevlaya job (RQ's FailedJobRegistry.requeue / Job.requeue, what the command runs)
really runs it again, and its new result replaces the failure in its batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from redis import Redis
from rq.job import Job as RQJob
from rq.registry import FailedJobRegistry

from producer.client import Client
from shared.keys import INTERACTIVE, job_id
from shared.serializer import serializer
from tests.fakes import FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.outputs import RowOutput
from worker.settings import WorkerSettings


class FlakyEngine(FakeEngine):
    """Fails rows whose prompt says FLAKY while `flaky` is set (a bad GPU day), answers them afterwards."""

    flaky = True

    def run(self, jobs, **kw):
        out = super().run(jobs, **kw)
        return [
            RowOutput.failed("internal", "flaky") if self.flaky and "FLAKY" in (j.prompt or "") else o
            for j, o in zip(jobs, out, strict=True)
        ]


def drain(redis: Redis, engine: FakeEngine) -> None:
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1")).work()


def requeue_by_registry(client: Client, jid: str, lane: str) -> None:
    """`rq requeue --queue <queue> <id> --serializer shared.serializer.serializer`."""
    FailedJobRegistry(queue=client.queue("laya", lane)).requeue(jid)


def requeue_by_job(client: Client, jid: str, lane: str) -> None:
    RQJob.fetch(jid, connection=client.redis, serializer=serializer).requeue()


def requeue_without_serializer(client: Client, jid: str, lane: str) -> None:
    """`rq requeue --queue <queue> --all` with RQ's default serializer: the job's data is passed through."""
    FailedJobRegistry(client.queue("laya", lane).name, connection=client.redis).requeue(jid)


def requeue_by_command(client: Client, jid: str, lane: str) -> None:
    """The `rq requeue` command itself."""
    url = "redis://{host}:{port}/{db}".format(**client.redis.connection_pool.connection_kwargs)
    name = client.queue("laya", lane).name
    cmd = [sys.executable, "-c", "from rq.cli import main; main()", "requeue", "-u", url, "--queue", name, jid]
    proc = subprocess.run(cmd, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "requeue", [requeue_by_registry, requeue_by_job, requeue_without_serializer, requeue_by_command]
)
@pytest.mark.parametrize("lane", ["bulk", INTERACTIVE])
def test_rq_requeue_of_a_failed_job_runs_it_again(client: Client, redis: Redis, requeue, lane: str) -> None:
    items = [
        {"custom_id": "ok", "model": "laya", "prompt": "fine"},
        {"custom_id": "f", "model": "laya", "prompt": "FLAKY"},
    ]
    handle = client.submit_batch(items, escalate=False, lane=lane)
    engine = FlakyEngine()
    drain(redis, engine)
    failed = job_id(handle.id, "f")
    assert client.status(handle.id).counts.failed == 1 and client.status(handle.id).complete
    assert client.queue("laya", lane).failed_job_registry.get_job_ids() == [failed]

    engine.flaky = False
    requeue(client, failed, lane)
    assert client.queue("laya", lane).count == 1
    drain(redis, engine)

    assert engine.calls[-1] == ["f"]  # it really ran again
    rows = {r["custom_id"]: r for r in assert_each_item_answered_once(client, redis, handle.id, 2)}
    assert rows["f"].get("error") is None and rows["f"]["text"] == "answer to f"
    counts = client.status(handle.id).counts
    assert (counts.finished, counts.failed) == (2, 0) and client.status(handle.id).complete
    assert failed in client.queue("laya", lane).finished_job_registry.get_job_ids()
    assert client.queue("laya", lane).failed_job_registry.get_job_ids() == []
    assert RQJob.fetch(failed, connection=redis, serializer=serializer).get_status() == "finished"


def test_a_job_answered_before_a_crash_still_is_not_run_twice(client: Client, redis: Redis) -> None:
    """The re-run rule is for requeued failures only: a job whose answer was written is not run again."""
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "x"}], escalate=False)
    engine = FakeEngine()
    drain(redis, engine)
    jid = job_id(handle.id, "a")
    client.queue("laya").enqueue_job(RQJob.fetch(jid, connection=redis, serializer=serializer))  # a stray copy
    drain(redis, engine)
    assert engine.calls == [["a"]]
    assert client.status(handle.id).counts.finished == 1
