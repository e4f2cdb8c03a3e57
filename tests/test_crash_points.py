"""Crash points of the take/settle path with the take ahead on (worker.ahead): the worker dies (a SimulatedCrash
leaving `work()`) or is stopped (SIGTERM's `request_stop`) at a named call, on the loop's thread or the helper's,
and a restarted worker drains. Every item ends with one final answer, counts add up, no follow-up is enqueued
twice, nothing stays started (fake engine, the suite's own redis-server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from redis import Redis

import worker.settle as settle_module
from producer.client import Client
from shared.keys import INTERACTIVE, Keys, QueueRef
from tests.fakes import FakeEngine, SimulatedCrash
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.settings import WorkerSettings

K = Keys()


def items(n: int) -> list[dict]:
    """Laya jobs, every third unsure (it escalates to a Kev follow-up), every fifth a Kev job."""
    return [
        {
            "custom_id": f"j{i}",
            "model": "kev" if i % 5 == 4 else "laya",
            "prompt": f"unsure case {i}" if i % 3 == 0 else f"case {i}",
        }
        for i in range(n)
    ]


class InteractiveArrives(FakeEngine):
    """Interactive work lands at the end of some runs: the next step switches and gives the take ahead back."""

    def __init__(self, client: Client, batch: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.client, self.batch, self.runs = client, batch, 0

    def run(self, jobs, *, time_limit_s=None):
        out = super().run(jobs, time_limit_s=time_limit_s)
        self.runs += 1
        if self.runs in (2, 4):
            job = {"custom_id": f"i{self.runs}", "model": "laya", "prompt": "unsure, interactive"}
            self.client.submit_batch([job], batch_id=self.batch, lane=INTERACTIVE)
        return out


def worker(redis: Redis, engine: FakeEngine) -> BatchWorker:
    settings = WorkerSettings(burst=True, name="w1", idle_poll_s=0.02, max_wait_ms=60_000, take_ahead=True)
    return BatchWorker(redis, engine, engine.config, settings)


def at_call(target: Any, name: str, k: int, act: Callable[[], None], *, after: bool) -> list[int]:
    """`act` at the k-th call of `target.name` (before or after the real call); returns the call counter."""
    real, calls = getattr(target, name), [0]

    def wrapped(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == k and not after:
            act()
        out = real(*args, **kw)
        if calls[0] == k and after:
            act()
        return out

    setattr(target, name, wrapped)
    return calls


def assert_settled(client: Client, redis: Redis, batch: str) -> None:
    total = redis.llen(K.batch_items(batch))
    rows = assert_each_item_answered_once(client, redis, batch, total)
    assert not [r for r in rows if r.get("error")]
    counts = client.status(batch).counts
    assert counts.finished == total and counts.failed == 0
    # Each escalated item: one step, one follow-up answered (its final answer).
    assert counts.escalated == counts.followups_done == redis.hlen(K.batch_steps(batch))
    assert int(redis.get(K.counter("duplicate_final_results")) or 0) == 0
    for ref in (QueueRef(m, lane) for m in ("laya", "kev") for lane in ("bulk", INTERACTIVE)):
        queue = client.queue(ref.model, ref.lane)
        assert redis.zcard(queue.started_job_registry.key) == 0 and queue.count == 0


def crash(what: str) -> Callable[[], None]:
    def act() -> None:
        raise SimulatedCrash(what)

    return act


# (where, method, k-th call, after the call): every write stage, on the loop's thread and the helper's (the even
# takes and the writes behind a take are the helper's), and the give-back of a take ahead.
POINTS = [
    ("bridge", "take_share", 2, True),
    ("bridge", "mark_held", 1, False),
    ("bridge", "mark_held", 3, True),
    ("bridge", "give_back", 1, False),
    ("bridge", "give_back", 1, True),
    ("bridge", "finish", 2, False),
    ("bridge", "finish", 3, True),
    ("settler", "triage", 2, True),
    ("settler", "unmark_running", 1, True),
    ("module", "enqueue_absent", 2, True),
    ("module", "record_results", 2, False),
    ("module", "record_results", 3, True),
]


def _target(w: BatchWorker, where: str) -> Any:
    return {"bridge": w.bridge, "settler": w.settler, "module": settle_module}[where]


@pytest.mark.parametrize(("where", "name", "k", "after"), POINTS)
def test_killed_at_a_crash_point_every_item_ends_once(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch, where: str, name: str, k: int, after: bool
) -> None:
    handle = client.submit_batch(items(24))
    engine = InteractiveArrives(client, handle.id, rows=4)
    w = worker(redis, engine)
    if where == "module":
        monkeypatch.setattr(settle_module, name, getattr(settle_module, name))  # undone after the test
    calls = at_call(_target(w, where), name, k, crash(f"killed at {name}#{k}"), after=after)
    with pytest.raises(SimulatedCrash):
        w.work()
    assert calls[0] == k
    monkeypatch.undo()
    worker(redis, FakeEngine(rows=4)).work()
    assert_settled(client, redis, handle.id)


@pytest.mark.parametrize(("where", "name", "k", "after"), POINTS)
def test_stopped_at_a_crash_point_nothing_stays_taken(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch, where: str, name: str, k: int, after: bool
) -> None:
    """SIGTERM at any of those points, the helper's take ahead included: the worker finishes what runs, gives the
    rest back and exits holding nothing; the next worker is charged no crash."""
    handle = client.submit_batch(items(24))
    engine = InteractiveArrives(client, handle.id, rows=4)
    w = worker(redis, engine)
    if where == "module":
        monkeypatch.setattr(settle_module, name, getattr(settle_module, name))
    at_call(_target(w, where), name, k, w.request_stop, after=after)
    w.work()
    monkeypatch.undo()
    for model in ("laya", "kev"):
        for lane in ("bulk", INTERACTIVE):
            assert redis.zcard(client.queue(model, lane).started_job_registry.key) == 0
    assert redis.scard(K.held("w1")) == 0
    assert worker(redis, FakeEngine(rows=4)).work().crashes_survived == 0
    assert_settled(client, redis, handle.id)
