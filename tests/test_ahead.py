"""The take ahead (worker.ahead): the next take is taken while one runs, and handed back or recovered without a
crash counted against its jobs (fake engine, in-process workers; a crash is a SimulatedCrash leaving `work()`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import TimeoutError as RedisTimeout
from rq.job import Job as RQJob

from producer.client import Client
from shared.keys import Keys, QueueRef, job_id
from tests.fakes import FakeEngine, SimulatedCrash
from tests.test_supervisor import _presence, _queue
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.rqcompat import RQBridge
from worker.rqcompat.decode import CRASHES_FIELD
from worker.settings import WorkerSettings

LAYA = QueueRef("laya")


def items(n: int, start: int = 0) -> list[dict]:
    return [{"custom_id": f"j{i}", "model": "laya", "prompt": f"case {i}"} for i in range(start, start + n)]


def held_ids(redis: Redis, worker: str = "w1") -> set[bytes]:
    return redis.smembers(Keys().held(worker))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


class FirstRunWaits(FakeEngine):
    """Its first run waits until the worker holds a take made ahead, then does `then` (and answers, unless `then`
    raises)."""

    def __init__(self, redis: Redis, then: Callable[[], None] = lambda: None, **kw: Any) -> None:
        super().__init__(**kw)
        self.redis = redis
        self.then = then
        self.saw_held: bool | None = None

    def run(self, jobs, *, time_limit_s=None):
        if self.saw_held is None:
            self.saw_held = wait_for(lambda: bool(held_ids(self.redis)))
            self.then()
        return super().run(jobs, time_limit_s=time_limit_s)


def burst(redis: Redis, engine: FakeEngine) -> BatchWorker:
    worker = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", idle_poll_s=0.02))
    worker.work()
    return worker


def crashes_of(redis: Redis, batch: str, ids: list[str]) -> list[int]:
    return [int(redis.hget(RQJob.key_for(job_id(batch, i)), CRASHES_FIELD) or 0) for i in ids]


def test_the_next_take_is_taken_while_one_runs_and_each_job_runs_once(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(24), escalate=False)
    engine = FirstRunWaits(redis, rows=8)
    worker = burst(redis, engine)
    assert engine.saw_held
    assert engine.calls == [[f"j{i}" for i in range(k, k + 8)] for k in (0, 8, 16)]
    assert_each_item_answered_once(client, redis, handle.id, 24)
    assert held_ids(redis) == set()
    assert redis.zcard(client.queue("laya").started_job_registry.key) == 0
    assert worker.stats.crashes_survived == 0


def test_with_the_take_ahead_off_nothing_is_taken_while_a_take_runs(client: Client, redis: Redis) -> None:
    """`take_ahead=False` (`kevlaya worker --take-ahead off`, the default on a CPU): the helper never runs, so
    while the engine runs a take the queue keeps the rest and this worker holds nothing; each take is written
    before the next is taken, and every job runs once."""
    handle = client.submit_batch(items(24), escalate=False)
    queue = client.queue("laya")
    seen: list[tuple[int, set[bytes]]] = []

    class Watching(FakeEngine):
        def run(self, jobs, *, time_limit_s=None):
            time.sleep(0.1)  # time enough for a helper, were there one, to take ahead
            seen.append((queue.count, held_ids(redis)))
            return super().run(jobs, time_limit_s=time_limit_s)

    engine = Watching(rows=8)
    settings = WorkerSettings(burst=True, name="w1", idle_poll_s=0.02, take_ahead=False)
    worker = BatchWorker(redis, engine, engine.config, settings)
    worker.work()
    assert seen == [(16, set()), (8, set()), (0, set())]
    assert engine.calls == [[f"j{i}" for i in range(k, k + 8)] for k in (0, 8, 16)]
    assert_each_item_answered_once(client, redis, handle.id, 24)
    assert worker.stats.crashes_survived == 0


def test_a_crash_counts_against_the_take_that_ran_not_the_one_taken_ahead(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(16), escalate=False)

    def crash() -> None:
        raise SimulatedCrash("killed mid-batch")

    try:
        burst(redis, FirstRunWaits(redis, crash, rows=8))
    except SimulatedCrash:
        pass
    else:
        raise AssertionError("the first take should have crashed the worker")
    assert len(held_ids(redis)) == 1  # the take made ahead, marked held when the worker died
    engine = FakeEngine(rows=8)
    worker = burst(redis, engine)
    assert worker.stats.crashes_survived == 1
    ran = [f"j{i}" for i in range(8)]
    ahead = [f"j{i}" for i in range(8, 16)]
    assert crashes_of(redis, handle.id, ran) == [1] * 8
    assert crashes_of(redis, handle.id, ahead) == [0] * 8
    # The crashed take comes back in halves (suspect groups), the held one as one take of its queue.
    calls = sorted(engine.calls, key=len)
    assert [len(c) for c in calls] == [4, 4, 8]
    assert set(calls[0] + calls[1]) == set(ran)
    assert set(calls[2]) == set(ahead)
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert held_ids(redis) == set()


def test_a_take_ahead_the_next_step_does_not_want_goes_back_in_order(client: Client, redis: Redis) -> None:
    """Interactive work arriving while a bulk take runs goes first: the bulk take made ahead is handed back to the
    front of its queue, in order, no crash or attempt counted, and no longer counted as running."""
    handle = client.submit_batch(items(16), escalate=False)
    engine = FirstRunWaits(redis, lambda: client.submit({"custom_id": "now", "model": "laya", "prompt": "hi"}), rows=8)
    burst(redis, engine)
    assert engine.calls[0] == [f"j{i}" for i in range(8)]
    assert engine.calls[1] == ["now"]
    assert engine.calls[2] == [f"j{i}" for i in range(8, 16)]
    assert crashes_of(redis, handle.id, [f"j{i}" for i in range(8, 16)]) == [0] * 8
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert client.status(handle.id).counts.running == 0
    assert held_ids(redis) == set()


def test_a_take_ahead_is_sized_as_the_step_after_its_take_sizes_it(client: Client, redis: Redis) -> None:
    """A take made ahead was sized before the take beside it ran; after it the engine may hold fewer rows (a KV
    pool kept): the take ahead is cut to that, the rest back at the front of the queue in order."""
    handle = client.submit_batch(items(16), escalate=False)
    engine = FirstRunWaits(redis, rows=8)
    engine.then = lambda: setattr(engine, "rows", 4)
    burst(redis, engine)
    assert engine.calls == [[f"j{i}" for i in range(k, k + n)] for k, n in ((0, 8), (8, 4), (12, 4))]
    assert crashes_of(redis, handle.id, [f"j{i}" for i in range(16)]) == [0] * 16
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert client.status(handle.id).counts.running == 0


def test_a_take_ahead_leaves_live_peers_their_work(redis: Redis) -> None:
    bridge = RQBridge(redis, Keys(), ["laya"], "me")
    _presence(redis, idle=["peer"], live=["me", "peer"])
    _queue(redis, bridge, 20)
    assert bridge.take_share(LAYA, 8, ttl_s=30, live_s=60, ahead=True).ids == []
    assert len(bridge.take_share(LAYA, 8, ttl_s=30, live_s=60).ids) == 8  # a take of its own turn shares
    # A busy live peer: a take ahead only while the queue holds a take for each worker.
    _presence(redis, idle=[], live=["me", "peer"])
    _queue(redis, bridge, 15)
    assert bridge.take_share(LAYA, 8, ttl_s=30, live_s=60, ahead=True).ids == []
    _queue(redis, bridge, 16)
    assert len(bridge.take_share(LAYA, 8, ttl_s=30, live_s=60, ahead=True).ids) == 8
    _presence(redis, idle=[], live=["me"], stale=("gone",))  # alone (a stale peer does not count): any depth
    _queue(redis, bridge, 3)
    assert len(bridge.take_share(LAYA, 8, ttl_s=30, live_s=60, ahead=True).ids) == 3


def test_a_dead_workers_held_take_is_requeued_not_charged(redis: Redis) -> None:
    """Recovery, at the bridge: of a dead incarnation's started entries, those of a held take go back to the queue
    (as lost, not crashed) and its held mark is cleared; the others are a crash's."""
    dead = RQBridge(redis, Keys(), ["laya"], "w1")
    _queue(redis, dead, 4)
    ran = dead.begin_batch()
    assert dead.take(LAYA, 2, ttl_s=-1, exec_id=ran) == ["j0", "j1"]
    ahead = dead.begin_batch()
    dead.mark_held(add=[ahead], ttl_s=60)
    assert dead.take(LAYA, 2, ttl_s=-1, exec_id=ahead) == ["j2", "j3"]
    alive = RQBridge(redis, Keys(), ["laya"], "w1")  # the same name, a new process
    found = {e.job_id: e for e in alive.abandoned(LAYA, in_flight=set(), others=False)}
    assert {i: e.crashed for i, e in found.items()} == {"j0": True, "j1": True, "j2": False, "j3": False}
    alive.requeue_lost(LAYA, [e for e in found.values() if not e.crashed])
    assert sorted(redis.lrange(alive.queues[LAYA].key, 0, -1)) == [b"j2", b"j3"]
    assert held_ids(redis) == set()


def test_a_held_set_of_another_type_is_moved_aside(redis: Redis) -> None:
    bridge = RQBridge(redis, Keys(), ["laya"], "w1")
    redis.set(Keys().held("w1"), "not a set")
    bridge.mark_held(add=["x"], ttl_s=60)
    assert held_ids(redis) == {b"x"}
    redis.set(Keys().held("w1"), "not a set")
    assert bridge.held_by("w1") == set()


def test_encodings_join_and_cut_as_the_take_does() -> None:
    from shared.errors import JobFailure
    from shared.job import Job
    from worker.engine import Encoded
    from worker.rows import Item

    jobs = [Job.from_dict({"custom_id": f"c{i}", "model": "laya", "prompt": "p"}) for i in range(3)]
    first = Encoded((jobs[0],), (Item(0, jobs[0], [1], 4, None),), 0.5)
    more = Encoded((jobs[1], jobs[2]), (JobFailure("internal", "x"), Item(1, jobs[2], [2], 4, None)), 0.25)
    both = first.then(more)
    assert both.of(jobs) and not both.of(jobs[:2])
    assert [getattr(i, "index", None) for i in both.items] == [0, None, 2]
    assert both.seconds == 0.75
    assert both.first(2).of(jobs[:2])


def test_a_crash_in_a_take_made_ahead_is_charged_to_it_once_it_runs(client: Client, redis: Redis) -> None:
    """Held only until it runs: a poison job in a take made ahead kills the worker as that take runs, and the crash
    is that take's (not the one before it)."""
    handle = client.submit_batch(
        [{"custom_id": f"j{i}", "model": "laya", "prompt": "POISON" if i == 10 else f"case {i}"} for i in range(16)],
        escalate=False,
    )
    engine = FirstRunWaits(redis, rows=8)
    try:
        burst(redis, engine)
    except SimulatedCrash:
        pass
    else:
        raise AssertionError("the poison job should have crashed the worker")
    assert engine.calls[1] == [f"j{i}" for i in range(8, 16)]
    found = RQBridge(redis, Keys(), ["laya"], "w1").abandoned(LAYA, in_flight=set(), others=False)
    assert {e.job_id for e in found} == {job_id(handle.id, f"j{i}") for i in range(8, 16)}
    assert all(e.crashed for e in found)


def test_a_crash_between_takes_does_not_charge_the_answered_take(client: Client, redis: Redis) -> None:
    """Answered, waiting to be written behind the take made ahead: the worker dies in the next step, before that
    take runs. Nothing was on the GPU: no crash is counted; the answers died with the process, so those jobs run
    again, whole takes of their queue (not suspect halves)."""
    handle = client.submit_batch(items(16), escalate=False)
    engine = FirstRunWaits(redis, rows=8)
    worker = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", idle_poll_s=0.02))
    real = worker.bridge.queue_facts
    looks = 0

    def facts(*, move_aside: bool = True) -> Any:
        nonlocal looks
        if move_aside:  # the loop's own look (the helper's passes move_aside=False)
            looks += 1
            if looks == 2:
                raise SimulatedCrash("kill -9 between takes")
        return real(move_aside=move_aside)

    worker.bridge.queue_facts = facts  # type: ignore[method-assign]
    try:
        worker.work()
    except SimulatedCrash:
        pass
    else:
        raise AssertionError("the worker should have died between its takes")
    assert engine.calls == [[f"j{i}" for i in range(8)]]
    again = FakeEngine(rows=8)
    assert burst(redis, again).stats.crashes_survived == 0
    assert crashes_of(redis, handle.id, [f"j{i}" for i in range(16)]) == [0] * 16
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert sorted(len(call) for call in again.calls) == [8, 8]


class PrepareFails(FakeEngine):
    """Encoding ahead raises for a take holding a job marked BADENC (the engine's `run` encodes it then)."""

    def prepare(self, jobs: Any) -> Any:
        if any("BADENC" in (j.prompt or "") for j in jobs):
            raise ValueError("the tokenizer choked")
        return None


def test_a_take_that_cannot_be_encoded_ahead_runs_as_it_would_have(client: Client, redis: Redis) -> None:
    jobs = [{"custom_id": f"j{i}", "model": "laya", "prompt": "BADENC" if i == 3 else f"case {i}"} for i in range(16)]
    handle = client.submit_batch(jobs, escalate=False)
    burst(redis, PrepareFails(rows=8))
    assert_each_item_answered_once(client, redis, handle.id, 16)


class PrepareDies(FakeEngine):
    def prepare(self, jobs: Any) -> Any:
        if any("DIES" in (j.prompt or "") for j in jobs):
            raise SimulatedCrash("a native crash while encoding")
        return None


def test_a_crash_while_a_take_ahead_is_encoded_is_charged_to_it_too(client: Client, redis: Redis) -> None:
    """Its jobs are held only once triaged and encoded: a job that crashes the host code is charged (and so
    bisected and dead-lettered), never passed over while the takes beside it are charged."""
    jobs = [{"custom_id": f"j{i}", "model": "laya", "prompt": "DIES" if i == 10 else f"case {i}"} for i in range(16)]
    handle = client.submit_batch(jobs, escalate=False)
    try:
        burst(redis, PrepareDies(rows=8))
    except SimulatedCrash:
        pass
    else:
        raise AssertionError("encoding j10 should have crashed the worker")
    burst(redis, FakeEngine(rows=8))
    assert crashes_of(redis, handle.id, [f"j{i}" for i in range(8, 16)]) == [1] * 8


def test_redis_failing_under_the_take_ahead_costs_no_answer(client: Client, redis: Redis) -> None:
    """A Redis error in the helper's look at the queue ends only the take ahead: the running take's answers are
    written, and every job is computed once."""
    handle = client.submit_batch(items(16), escalate=False)
    engine = FakeEngine(rows=8)
    worker = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", idle_poll_s=0.02))
    real = worker.bridge.queue_facts
    blips: list[int] = []

    def facts(*, move_aside: bool = True) -> Any:
        if not move_aside and not blips:
            blips.append(1)
            raise RedisTimeout("a blip")
        return real(move_aside=move_aside)

    worker.bridge.queue_facts = facts  # type: ignore[method-assign]
    worker.work()
    assert blips
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert sorted(engine.answered) == sorted(f"j{i}" for i in range(16))


def test_a_peer_gone_idle_meanwhile_gets_its_share_of_the_take_ahead(client: Client, redis: Redis) -> None:
    """The take ahead was made with no idle peer; by the boundary one is idle: the take is cut to this worker's
    share of what the queue would hold, the rest back at the front for the peer (here a peer that never takes,
    so this worker shares again take by take, as any take does)."""
    handle = client.submit_batch(items(16), escalate=False)

    def peer_goes_idle() -> None:
        now = time.time()
        redis.zadd(Keys().workers(), {"peer": now + 3600})
        redis.zadd(Keys().idle_workers(), {"peer": now})

    engine = FirstRunWaits(redis, peer_goes_idle, rows=8)
    burst(redis, engine)
    assert engine.calls[0] == [f"j{i}" for i in range(8)]
    assert engine.calls[1] == [f"j{i}" for i in range(8, 12)]  # half of the 8 the queue would hold
    assert_each_item_answered_once(client, redis, handle.id, 16)
    assert crashes_of(redis, handle.id, [f"j{i}" for i in range(16)]) == [0] * 16
