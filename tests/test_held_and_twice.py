"""Two ways a take could go wrong quietly: held marks (worker.ahead) left behind when a step fails, and a job id
queued again while a take still holds it, run twice (fake engine, in-process workers, the suite's redis-server)."""

from __future__ import annotations

import contextlib
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rq.job import Job as RQJob

from producer.client import Client
from shared.keys import Keys, QueueRef, job_id
from tests.fakes import FakeEngine, SimulatedCrash
from tests.test_ahead import FirstRunWaits, held_ids, items
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.rqcompat import RQBridge
from worker.settings import WorkerSettings

K = Keys()
LAYA = QueueRef("laya")


def quick(**kw: Any) -> WorkerSettings:
    """A burst worker whose own lapsed entries come back within a second (recovery of what it lost track of)."""
    quick_recovery = {"idle_poll_s": 0.02, "recovery_interval_s": 0.2}
    return WorkerSettings.with_heartbeat_ttl(1.0, burst=True, name="w1", **quick_recovery, **kw)


# ---- held marks ---------------------------------------------------------------------------------------------------
def test_a_redis_error_between_takes_leaves_no_held_mark_behind(client: Client, redis: Redis) -> None:
    """Redis fails in the step after a take ran: the take made ahead and the answered take waiting to be written are
    both marked held, and the loop lets go of them (they go back through recovery). Their marks go too, once Redis
    answers again: left, they stayed for the worker's whole life (each later mark renews the set's expiry)."""
    handle = client.submit_batch(items(16), escalate=False)
    engine = FirstRunWaits(redis, rows=8)
    worker = BatchWorker(redis, engine, engine.config, quick())
    real, looks, marked = worker.bridge.queue_facts, [0], []

    def facts(*, move_aside: bool = True) -> Any:
        if move_aside:  # the loop's own look (the helper's passes move_aside=False)
            looks[0] += 1
            if looks[0] == 2:
                marked.append(len(held_ids(redis)))
                raise RedisConnectionError("a blip between takes")
        return real(move_aside=move_aside)

    worker.bridge.queue_facts = facts  # type: ignore[method-assign]
    worker.work()
    assert marked == [2]  # the take ahead and the answered take, held when Redis failed
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert worker.stats.crashes_survived == 0
    assert held_ids(redis) == set()


def test_a_failed_give_back_leaves_no_held_mark_behind(client: Client, redis: Redis) -> None:
    """Interactive work arrives, the bulk take made ahead is given back, and Redis fails under the give-back."""
    handle = client.submit_batch(items(16), escalate=False)
    engine = FirstRunWaits(redis, lambda: client.submit({"custom_id": "now", "model": "laya", "prompt": "hi"}), rows=8)
    worker = BatchWorker(redis, engine, engine.config, quick())
    real, fails = worker.bridge.give_back, [1]

    def give_back(*args: Any, **kw: Any) -> None:
        if fails:
            fails.pop()
            raise RedisConnectionError("a blip under the give-back")
        real(*args, **kw)

    worker.bridge.give_back = give_back  # type: ignore[method-assign]
    worker.work()
    assert not fails
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert held_ids(redis) == set()


def test_a_restart_under_the_same_name_clears_the_dead_processes_spent_marks(redis: Redis) -> None:
    """An earlier process of this name marked a take held and died after its jobs had ended: no registry holds that
    take, so its mark is spent, and the new process (whose own marks renew the set's expiry) removes it; a mark of a
    take still registered stays until recovery returns that take."""
    dead = RQBridge(redis, K, ["laya"], "w1")
    redis.rpush(dead.queues[LAYA].key, "j0")
    spent, kept = dead.begin_batch(), dead.begin_batch()
    assert dead.take(LAYA, 1, ttl_s=60, exec_id=kept) == ["j0"]
    dead.mark_held(add=[spent, kept], ttl_s=60)
    alive = RQBridge(redis, K, ["laya"], "w1")
    mine = alive.begin_batch()
    alive.mark_held(add=[mine], ttl_s=60)
    alive.prune_held()
    assert held_ids(redis) == {kept.encode(), mine.encode()}


# ---- a job id queued twice ----------------------------------------------------------------------------------------
def test_a_job_queued_again_while_a_take_holds_it_runs_once(client: Client, redis: Redis) -> None:
    """j0 is pushed again behind the first take. The take made ahead meets that copy while the first take still runs
    it (its answer is not written yet): the copy is dropped, not run a second time."""
    handle = client.submit_batch(items(16), escalate=False)
    queue = client.queue("laya").key
    redis.linsert(queue, "BEFORE", job_id(handle.id, "j8"), job_id(handle.id, "j0"))
    engine = FirstRunWaits(redis, rows=8)
    worker = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", idle_poll_s=0.02))
    worker.work()
    assert sorted(engine.answered) == sorted(f"j{i}" for i in range(16))
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert int(redis.get(K.counter("duplicate_final_results")) or 0) == 0
    assert redis.zcard(client.queue("laya").started_job_registry.key) == 0


def test_a_second_copy_is_not_taken_while_the_first_is_registered(redis: Redis) -> None:
    """At the bridge: two takes (two workers, or one worker's take ahead) each meet a copy of j0; the second take
    skips it while the first take's started entry stands, whatever the hash's status says, in any lane's queue; once
    that entry is gone (finished, or given back) a copy is taken as any job is."""
    one, two = RQBridge(redis, K, ["laya"], "w1"), RQBridge(redis, K, ["laya"], "w2")
    redis.hset(RQJob.key_for("j0"), mapping={"status": "queued"})
    redis.rpush(one.queues[LAYA].key, "j0", "j1", "j0", "j2")
    first = one.begin_batch()
    assert one.take(LAYA, 1, ttl_s=60, exec_id=first) == ["j0"]
    redis.hset(RQJob.key_for("j0"), "status", "queued")  # another writer's edit changes nothing
    assert two.take(LAYA, 8, ttl_s=60) == ["j1", "j2"]
    assert redis.llen(one.queues[LAYA].key) == 0
    interactive = QueueRef("laya", "interactive")
    redis.rpush(one.queues[interactive].key, "j0")
    assert two.take(interactive, 8, ttl_s=60) == []
    one.give_back(LAYA, ["j0"], exec_id=first)  # its entry gone: the job is queued again, once
    assert two.take(LAYA, 8, ttl_s=60) == ["j0"]


def test_a_copy_met_while_the_first_takes_worker_is_dead_is_recovered_once(client: Client, redis: Redis) -> None:
    """The worker running j0 dies; a copy of j0 is met before recovery returns the dead take: the copy is dropped and
    recovery's group runs j0, once."""
    handle = client.submit_batch(items(4), escalate=False)
    with contextlib.suppress(SimulatedCrash):
        BatchWorker(redis, FakeEngine(rows=4, crash_once=True), FakeEngine().config, quick(take_ahead=False)).work()
    redis.rpush(client.queue("laya").key, job_id(handle.id, "j0"))
    engine = FakeEngine(rows=4)
    stats = BatchWorker(redis, engine, engine.config, quick(take_ahead=False)).work()
    assert stats.crashes_survived == 1
    assert sorted(engine.answered) == sorted(f"j{i}" for i in range(4))
    assert_each_item_answered_once(client, redis, handle.id, 4)


def test_a_job_hash_carrying_another_items_payload_neither_answers_it_nor_runs_it_twice(
    client: Client, redis: Redis
) -> None:
    """Another writer copies j2's data into j1's hash: j1's job would run as j2 (j2 run twice, its item answered by
    whichever came first) and j1's item would never end. The job is refused, and its own item ends with that error."""
    handle = client.submit_batch(items(4), escalate=False)
    own, other = RQJob.key_for(job_id(handle.id, "j1")), RQJob.key_for(job_id(handle.id, "j2"))
    redis.hset(own, "data", redis.hget(other, "data"))
    engine = FakeEngine(rows=8)
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", idle_poll_s=0.02)).work()
    assert sorted(engine.answered) == ["j0", "j2", "j3"]
    rows = {r["custom_id"]: r for r in assert_each_item_answered_once(client, redis, handle.id, 4)}
    assert rows["j1"]["error"]["type"] == "bad_payload"
    assert rows["j2"]["job_id"] == job_id(handle.id, "j2") and not rows["j2"].get("error")
    assert int(redis.get(K.counter("duplicate_final_results")) or 0) == 0
