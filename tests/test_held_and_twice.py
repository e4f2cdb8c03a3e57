"""Two ways a take could go wrong quietly: held marks (worker.ahead) left behind when a step fails, and a job id
queued again while a take still holds it, run twice (fake engine, in-process workers, the suite's redis-server)."""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.client import Client
from shared.keys import Keys, QueueRef
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
