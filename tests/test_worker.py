"""The batch worker against a real Redis with the real engine on tiny models."""

from __future__ import annotations

import os
import signal
import time
import zlib
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue

from producer.client import Client
from shared.job import Job
from shared.keys import Keys
from shared.serializer import serializer
from tests.conftest import tiny_config
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import assert_each_item_answered_once, drain, spawn_worker, wait_until
from worker.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_models: Path) -> Engine:
    return Engine(tiny_config(tiny_models, "nf4"), device="cpu", max_batch_rows=64)


def in_flight(redis: Redis) -> bool:
    """Jobs registered as running in RQ's started registries."""
    return any(redis.zcard(f"rq:wip:kevlaya:{q}") for q in ("kev", "laya", "kev:interactive", "laya:interactive"))


def mixed(n: int, **extra) -> list[dict]:
    return [
        {"custom_id": f"j{i}", "model": "kev" if i % 3 == 0 else "laya", "prompt": f"case {i}", **extra}
        for i in range(n)
    ]


def test_500_mixed_jobs_each_answered_once_with_few_switches(client: Client, redis: Redis, engine: Engine) -> None:
    handle = client.submit_batch(mixed(500), escalate=False)
    # max_wait far above any batch time: switches then depend on queue contents only, not on machine speed
    # (the anti-starvation switch is table-tested in test_policy.py).
    stats = drain(redis, engine, max_wait_ms=600_000)
    rows = assert_each_item_answered_once(client, redis, handle.id, 500)
    assert all(r.get("error") is None and r["text"] is not None for r in rows)
    assert stats.jobs == 500
    # 500 jobs at <= 64 rows: ~8 batches; grouped by model, one queue is drained, then the other.
    assert stats.switches <= 1
    assert stats.batches <= 12
    assert {r["model"] for r in rows} == {"kev", "laya"}
    assert client.status(handle.id).counts.finished == 500


def test_escalation_chain(client: Client, redis: Redis, engine: Engine) -> None:
    """Threshold 1.0: every Laya answer escalates; Kev's follow-up is the final answer."""
    items = [{"custom_id": f"l{i}", "model": "laya", "prompt": f"case {i}", "escalate": 1.0} for i in range(6)]
    items.append({"custom_id": "off", "model": "laya", "prompt": "case", "escalate": False})
    handle = client.submit_batch(items)
    stats = drain(redis, engine)
    rows = assert_each_item_answered_once(client, redis, handle.id, 7)
    for row in rows[:6]:
        assert row["model"] == "kev" and row["final"] is True
        (laya,) = row["chain"]
        assert laya["model"] == "laya" and laya["final"] is False
        assert laya["escalated_to"] == row["job_id"] == row["escalated_from"] + "-kev"
    assert rows[6]["model"] == "laya" and "chain" not in rows[6]
    counts = client.status(handle.id).counts
    assert (counts.escalated, counts.finished) == (6, 7)
    assert stats.escalations == 6


def test_follow_ups_size_the_next_kev_take_before_it_happens(
    client: Client, redis: Redis, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker tells the engine of the longest new follow-up, so Kev's first take is planned for follow-up
    prompts (the parent's prompt and answer), not typical ones."""
    calls: list[tuple[str, str]] = []
    expect, run = engine.expect, engine.run
    monkeypatch.setattr(engine, "expect", lambda job: (calls.append(("expect", job.model)), expect(job))[1])
    monkeypatch.setattr(engine, "run", lambda jobs, **kw: (calls.append(("run", jobs[0].model)), run(jobs, **kw))[1])
    items = [{"custom_id": f"l{i}", "model": "laya", "prompt": "case " * (i + 1), "escalate": 1.0} for i in range(4)]
    items.append({"custom_id": "fields", "model": "laya", "input": {"income": "52000"}, "escalate": 1.0})  # no prompt
    client.submit_batch(items)
    drain(redis, engine)
    assert ("expect", "kev") in calls
    assert calls.index(("expect", "kev")) < calls.index(("run", "kev"))


class SizedByKind(FakeEngine):
    """Takes of 8 rows for generation, 30 for rows that score choices: whatever `expect` last saw."""

    scoring = False

    def capacity(self, model: str) -> int:
        return 30 if self.scoring else 8

    def expect(self, job: Job) -> bool:
        was, self.scoring = self.scoring, job.scores_choices
        return was != self.scoring


def test_a_full_take_is_sized_for_the_job_at_the_queues_front(client: Client, redis: Redis) -> None:
    """The last batch sized the next take (generation rows: few fit); the jobs waiting now score choices (more
    fit): before a full take the worker shows the engine the job at the queue's front and takes what that kind
    fits. A front it cannot read leaves the size as it was."""
    engine = SizedByKind(config=FAKE_CONFIG)
    choice = {"model": "laya", "prompt": "p", "choices": ["yes", "no"], "escalate": False}
    handle = client.submit_batch([{**choice, "custom_id": f"c{i}"} for i in range(50)])
    drain(redis, engine)
    assert [len(c) for c in engine.calls] == [30, 20]
    assert_each_item_answered_once(client, redis, handle.id, 50)
    engine = SizedByKind(config=FAKE_CONFIG)
    queue = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    handle = client.submit_batch([{**choice, "custom_id": f"d{i}"} for i in range(20)])
    redis.hset("rq:job:broken-front", mapping={"data": b"\x00garbage", "status": "queued"})
    redis.lpush(queue.key, "broken-front")
    drain(redis, engine)
    assert len(engine.calls[0]) == 7  # 8 taken, the broken one refused
    assert_each_item_answered_once(client, redis, handle.id, 20)


def test_each_batch_logs_the_loops_host_work_beside_the_engine(
    client: Client, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch line gives the take, triage and write seconds (the loop's host work, the GPU idle meanwhile)
    beside the engine's, and they fit in the batch's total."""
    import re

    client.submit_batch([{"custom_id": f"h{i}", "model": "laya", "prompt": "p", "escalate": False} for i in range(5)])
    with caplog.at_level("INFO", logger="kevlaya.worker"):
        drain(redis, FakeEngine(config=FAKE_CONFIG))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch model=")]
    found = re.search(r"total=([0-9.]+)s .*\(host: take ([0-9.]+)s, triage ([0-9.]+)s, write ([0-9.]+)s\)", line)
    assert found is not None, line
    total, take, triage, write = map(float, found.groups())
    assert min(take, triage, write) >= 0 and triage + write <= total + 0.01  # the total printed to 10 ms


def test_no_escalate_batch(client: Client, redis: Redis, engine: Engine) -> None:
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p", "escalate": 1.0}], escalate=False)
    drain(redis, engine)
    (row,) = client.iter_results(handle.id)
    assert row["model"] == "laya" and "chain" not in row


def test_planted_os_system_job_never_runs(client: Client, redis: Redis, engine: Engine, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    queue = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    queue.enqueue("os.system", f"touch {sentinel}", job_id="evil-1")
    queue.enqueue("builtins.eval", "__import__('os').system('touch " + str(sentinel) + "')", job_id="evil-2")
    handle = client.submit_batch(mixed(10))
    drain(redis, engine)
    assert not sentinel.exists()
    assert_each_item_answered_once(client, redis, handle.id, 10)
    failed = queue.failed_job_registry.get_job_ids()
    assert {"evil-1", "evil-2"} <= set(failed)
    exc = zlib.decompress(redis.hget("rq:job:evil-1", "exc_info")).decode()
    assert "not_allowed" in exc and "os.system" in exc


def test_malformed_hash_and_callbacks_are_refused(client: Client, redis: Redis, engine: Engine) -> None:
    queue = Queue("kevlaya:laya", connection=redis, serializer=serializer)
    redis.hset("rq:job:broken", mapping={"data": b"\x00garbage", "status": "queued"})
    redis.rpush(queue.key, "broken")
    redis.rpush(queue.key, "no-hash-at-all")
    handle = client.submit_batch(mixed(4))
    redis.hset(f"rq:job:{handle.id}-cb", mapping={"success_callback_name": "os.system"})
    job_ids = queue.get_job_ids()
    victim = next(j for j in job_ids if j.startswith(handle.id))
    redis.hset(f"rq:job:{victim}", "success_callback_name", "os.system")
    drain(redis, engine)
    rows = assert_each_item_answered_once(client, redis, handle.id, 4)
    errors = [r for r in rows if r.get("error")]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "not_allowed"
    assert "broken" in queue.failed_job_registry.get_job_ids()


def test_cancel_request_seen_by_worker(client: Client, redis: Redis, engine: Engine) -> None:
    handle = client.submit_batch(mixed(5))
    redis.hset(Keys().batch(handle.id), "cancel_requested", "1")  # flag set while jobs are still queued
    drain(redis, engine)
    counts = client.status(handle.id).counts
    assert counts.cancelled == 5 and counts.finished == 0


def test_kill_9_mid_batch_then_restart_answers_every_item_once(
    client: Client, redis: Redis, redis_url: str, nf4_config: Path, tmp_path: Path
) -> None:
    handle = client.submit_batch(mixed(300), escalate=False)
    log = tmp_path / "worker.log"
    args = ["--max-batch-rows", "40", "--job-heartbeat-ttl-s", "4"]
    proc = spawn_worker(redis_url, nf4_config, *args, log=log)

    wait_until(lambda: in_flight(redis) and client.status(handle.id).counts.done > 0, 120)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    proc = spawn_worker(redis_url, nf4_config, *args, "--burst", log=log)
    assert proc.wait(timeout=240) == 0
    recovery_s = time.monotonic() - killed_at
    assert_each_item_answered_once(client, redis, handle.id, 300)
    assert client.status(handle.id).counts.finished == 300
    print(f"recovery after kill -9: all 300 items final {recovery_s:.1f} s after the kill")


def test_sigterm_finishes_the_batch_and_leaves_the_rest_queued(
    client: Client, redis: Redis, redis_url: str, nf4_config: Path, tmp_path: Path
) -> None:
    handle = client.submit_batch(mixed(600), escalate=False)
    proc = spawn_worker(redis_url, nf4_config, "--max-batch-rows", "30", log=tmp_path / "w.log")
    wait_until(lambda: in_flight(redis), 120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    counts = client.status(handle.id).counts
    assert counts.running == 0
    assert counts.finished > 0 and counts.queued > 0 and counts.finished + counts.queued == 600
    assert not in_flight(redis)


def test_two_workers_on_one_redis_run_every_job_once(
    client: Client, redis: Redis, redis_url: str, nf4_config: Path, tmp_path: Path
) -> None:
    # Enough jobs for ~30 takes of 8 between two workers (the race is per take, not per job); 700 jobs ran
    # ~250 s on 2 loaded cores, against the 300 s limit.
    handle = client.submit_batch(mixed(240), escalate=False)
    procs = [
        spawn_worker(
            redis_url, nf4_config, "--burst", "--max-batch-rows", "10", "--name", f"w{i}", log=tmp_path / "w.log"
        )
        for i in range(2)
    ]
    try:
        assert [p.wait(timeout=280) for p in procs] == [0, 0]
    finally:
        for p in procs:  # a worker still running when the test gives up must not outlive it
            p.kill()
            p.wait()
    assert_each_item_answered_once(client, redis, handle.id, 240)
    ran = [int(redis.hget(Keys().worker_stats(f"w{i}"), "jobs") or 0) for i in range(2)]
    assert sum(ran) == 240, f"jobs run per worker: {ran}"
    assert min(ran) > 0, "both workers should have taken work"


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEVLAYA_FAULT", raising=False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
