"""Crash recovery: a dead take comes back as suspect groups, bisected on every further crash (fake engine,
in-process workers; a crash is a SimulatedCrash leaving the worker's `work()`)."""

from __future__ import annotations

import pytest
from redis import Redis

from producer.client import Client
from shared.keys import Keys, job_id
from tests.fakes import FAKE_CONFIG, FakeEngine, SimulatedCrash
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.recovery import SuspectGroup, max_crashes, plan_recovery
from worker.settings import WorkerSettings


@pytest.mark.parametrize(
    ("ids", "crashes", "want"),
    [
        ([], {}, []),
        (["a"], {"a": 1}, [SuspectGroup(("a",))]),  # alone, first crash: once more, alone
        (["a"], {"a": 2}, [SuspectGroup(("a",), dead=True)]),
        (["a"], {"a": 9}, [SuspectGroup(("a",), dead=True)]),
        (["a", "b"], {"a": 5, "b": 5}, [SuspectGroup(("a",)), SuspectGroup(("b",))]),
        (["a", "b", "c"], {}, [SuspectGroup(("a", "b")), SuspectGroup(("c",))]),
    ],
)
def test_plan_recovery_table(ids: list[str], crashes: dict[str, int], want: list[SuspectGroup]) -> None:
    assert plan_recovery(ids, crashes) == want


def test_crash_bounds() -> None:
    assert max_crashes(256) == 9
    assert max_crashes(1) == 2
    assert max_crashes(20) == 6


def run_until_done(redis: Redis, engine: FakeEngine, limit: int = 40, **settings) -> int:
    """Restart a burst worker (same --name, as a supervisor would) until it exits cleanly; returns crashes."""
    crashes = 0
    for _ in range(limit):
        try:
            BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", **settings)).work()
            return crashes
        except SimulatedCrash:
            crashes += 1
    raise AssertionError(f"still crashing after {limit} restarts")


def items(n: int, poison: int | None = None) -> list[dict]:
    return [
        {"custom_id": f"j{i}", "model": "laya", "prompt": "POISON" if i == poison else f"case {i}"} for i in range(n)
    ]


@pytest.mark.parametrize("poison", [0, 77, 255])
def test_a_poison_job_in_a_256_row_batch_is_dead_lettered_within_9_crashes(
    client: Client, redis: Redis, poison: int
) -> None:
    handle = client.submit_batch(items(256, poison), escalate=False)
    engine = FakeEngine(rows=256)
    crashes = run_until_done(redis, engine)
    assert crashes <= max_crashes(256) == 9
    rows = {r["custom_id"]: r for r in assert_each_item_answered_once(client, redis, handle.id, 256)}
    dead = rows.pop(f"j{poison}")
    assert dead["error"]["type"] == "worker_died"
    assert f"({crashes} crashes)" in dead["error"]["message"]
    assert all(r.get("error") is None for r in rows.values())
    assert job_id(handle.id, f"j{poison}") in client.queue("laya").failed_job_registry.get_job_ids()
    # Every innocent job ran to completion exactly once (crashed runs aside): no one-at-a-time re-runs.
    assert len(engine.answered) == len(set(engine.answered)) == 255


def test_one_kill_mid_batch_costs_one_rerun_in_halves(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(256), escalate=False)
    engine = FakeEngine(rows=256, crash_once=True)
    assert run_until_done(redis, engine) == 1
    assert [len(b) for b in engine.calls] == [256, 128, 128]
    assert_each_item_answered_once(client, redis, handle.id, 256)


def test_queued_jobs_are_not_held_behind_suspects(client: Client, redis: Redis) -> None:
    first = client.submit_batch(items(64), escalate=False)
    engine = FakeEngine(rows=64, crash_once=True)
    with pytest.raises(SimulatedCrash):
        BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1")).work()
    later = client.submit_batch([{"custom_id": f"n{i}", "model": "laya", "prompt": "new"} for i in range(64)])
    stats = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1")).work()
    # suspect half, then the new work, then the other suspect half: neither kind waits for the other to drain
    assert [b[0][0] for b in engine.calls[1:]] == ["j", "n", "j"]
    assert stats.jobs == 128 and stats.crashes_survived == 1 and stats.recovered == 64
    assert_each_item_answered_once(client, redis, first.id, 64)
    assert_each_item_answered_once(client, redis, later.id, 64)


def test_a_worker_killed_alone_is_retried_alone_once(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(1), escalate=False)
    assert run_until_done(redis, FakeEngine(crash_once=True)) == 1
    (row,) = assert_each_item_answered_once(client, redis, handle.id, 1)
    assert row.get("error") is None


def test_restart_with_the_same_name_takes_over_a_dead_registration(redis: Redis) -> None:
    from worker.rqcompat import RQBridge

    dead = RQBridge(redis, Keys(), ["laya"], "fixed")
    worker = dead.make_rq_worker(20)
    worker.register_birth()
    redis.hset(worker.key, "pid", "999999999")  # a process that no longer exists, on this host
    fresh = RQBridge(redis, Keys(), ["laya"], "fixed")
    fresh.register(fresh.make_rq_worker(20), worker_ttl_s=20)  # no 20-80 s wait, no "active worker" error
    assert fresh.worker_alive("fixed")


def test_a_live_worker_with_the_same_name_is_refused(redis: Redis) -> None:
    import os

    from shared.errors import WorkerNameTakenError
    from worker.rqcompat import RQBridge

    live = RQBridge(redis, Keys(), ["laya"], "fixed")
    worker = live.make_rq_worker(20)
    worker.register_birth()
    redis.hset(worker.key, "pid", str(os.getppid()))  # alive on this host, not us
    other = RQBridge(redis, Keys(), ["laya"], "fixed")
    with pytest.raises(WorkerNameTakenError, match="pick another --name"):
        other.register(other.make_rq_worker(20), worker_ttl_s=20)


def test_index_keys_are_trimmed_by_age(client: Client, redis: Redis) -> None:
    import time

    keys = Keys()
    redis.zadd(keys.batches(), {"ancient": time.time() - 3 * 7 * 86400, "recent": time.time()})
    redis.zadd(keys.workers(), {"gone": time.time() - 2 * 86400})
    redis.zadd("rq:finished:kevlaya:laya", {"old-job": time.time() - 10})  # score = expiry, passed
    BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True, name="w1")).work()
    assert redis.zrange(keys.batches(), 0, -1) == [b"recent"]
    assert redis.zscore(keys.workers(), "gone") is None
    assert redis.zcard("rq:finished:kevlaya:laya") == 0
