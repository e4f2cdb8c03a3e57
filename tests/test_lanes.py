"""Priority lanes: the lane choice table-driven, then the worker with the fake engine: interactive work
behind a bulk backlog goes in the next take, bulk is not starved, lanes survive a crash, follow-ups inherit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from redis import Redis

from producer.client import Client
from shared.keys import BULK, INTERACTIVE, Keys, QueueRef, followup_id, job_id
from tests.fakes import FakeEngine, SimulatedCrash
from tests.worker_helpers import assert_each_item_answered_once
from worker.lanes import BulkTurn, choose_queue
from worker.loop import BatchWorker
from worker.policy import QueueState
from worker.settings import WorkerSettings

Q = QueueState
KI, KB, LI, LB = QueueRef("kev", INTERACTIVE), QueueRef("kev", BULK), QueueRef("laya", INTERACTIVE), QueueRef("laya")
EMPTY = Q(0, 0)


def states(**given: QueueState) -> dict[QueueRef, QueueState]:
    out = {KI: EMPTY, KB: EMPTY, LI: EMPTY, LB: EMPTY}
    names = {"ki": KI, "kb": KB, "li": LI, "lb": LB}
    out.update({names[k]: v for k, v in given.items()})
    return out


@pytest.mark.parametrize(
    ("current", "given", "bulk_due", "expected"),
    [
        (None, {}, False, None),
        ("laya", {"lb": Q(5000, 60_000)}, False, LB),
        ("laya", {"lb": Q(5000, 60_000), "ki": Q(1, 5)}, False, KI),  # interactive first, even on another model
        ("laya", {"lb": Q(5000, 60_000), "li": Q(1, 5)}, False, LI),
        ("laya", {"lb": Q(5000, 60_000), "li": Q(1, 5)}, True, LB),  # bulk's turn
        ("laya", {"li": Q(1, 5)}, True, LI),  # bulk's turn, but no bulk waits
        ("laya", {"ki": Q(1, 5), "li": Q(1, 5)}, False, LI),  # within the lane: stay on the current model
        ("kev", {"ki": Q(1, 5), "li": Q(1, 3000)}, False, LI),  # ...unless the other waited past max_wait
        ("kev", {"kb": Q(10, 10), "lb": Q(10, 3000)}, False, LB),  # the bulk lane keeps the model policy
    ],
)
def test_choose_queue(current, given, bulk_due, expected) -> None:
    assert choose_queue(current, states(**given), max_wait_ms=2000, bulk_due=bulk_due) == expected


def test_bulk_gets_a_take_in_every_n_plus_one_under_constant_interactive_load() -> None:
    turn, served = BulkTurn(every=4), []
    for _ in range(50):
        ref = choose_queue("laya", states(lb=Q(5000, 1e6), li=Q(3, 10)), max_wait_ms=2000, bulk_due=turn.due)
        assert ref is not None
        turn.record(ref, bulk_waiting=True)
        served.append(ref.lane)
    gaps = "".join("b" if lane == BULK else "i" for lane in served).split("b")
    assert max(len(g) for g in gaps) == 4


class HookEngine(FakeEngine):
    """The fake engine calling `before(n)` before its n-th batch (0-based): work arriving mid-batch."""

    def __init__(self, before: Callable[[int], None], **kw) -> None:
        super().__init__(**kw)
        self.before = before

    def run(self, jobs, **kw):
        self.before(len(self.calls))
        return super().run(jobs, **kw)


def bulk(n: int, model: str = "laya") -> list[dict]:
    return [{"custom_id": f"b{i}", "model": model, "prompt": f"case {i}"} for i in range(n)]


def drain(redis: Redis, engine: FakeEngine, **settings) -> None:
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1", **settings)).work()


@pytest.mark.parametrize("model", ["laya", "kev"])
def test_interactive_job_behind_a_bulk_backlog_goes_in_the_next_take(client: Client, redis: Redis, model: str) -> None:
    backlog = client.submit_batch(bulk(1000), escalate=False)
    live: list[str] = []

    def before(n: int) -> None:
        if n == 0:  # while the first bulk take runs, a service sends one job
            live.append(client.submit({"custom_id": "now", "model": model, "prompt": "quick"})[0])

    engine = HookEngine(before, rows=64)
    drain(redis, engine)
    assert engine.calls[1] == ["now"]  # the very next take, alone: not behind 15 more bulk takes
    assert [len(c) for c in engine.calls[2:]] == [64] * 14 + [40]  # bulk takes stay full batches
    assert_each_item_answered_once(client, redis, backlog.id, 1000)
    assert_each_item_answered_once(client, redis, live[0], 1)


def test_bulk_is_not_starved_by_a_steady_interactive_stream(client: Client, redis: Redis) -> None:
    backlog = client.submit_batch(bulk(640), escalate=False)

    def before(n: int) -> None:  # three interactive jobs arrive during every batch
        client.submit_batch(
            [{"custom_id": f"i{n}-{k}", "model": "laya", "prompt": "quick"} for k in range(3)],
            batch_id=f"live{n}",
            lane=INTERACTIVE,
        )

    engine = HookEngine(before, rows=64)
    worker = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w1"))
    while client.status(backlog.id).counts.done < 640:
        assert len(engine.calls) < 200, "bulk starved"
        assert worker._step()
    lanes = "".join("b" if call[0].startswith("b") else "i" for call in engine.calls)
    assert max(len(run) for run in lanes.split("b")) <= WorkerSettings().bulk_every_takes
    assert lanes.count("b") == 10 and all(len(c) == 64 for c in engine.calls if c[0].startswith("b"))
    worker.request_stop()


def test_lanes_survive_a_crash_and_recovery(client: Client, redis: Redis) -> None:
    backlog = client.submit_batch(bulk(100), escalate=False)
    live = client.submit_batch(bulk(10), batch_id="live", escalate=False, lane=INTERACTIVE)
    engine = FakeEngine(rows=64, crash_once=True)
    with pytest.raises(SimulatedCrash):
        drain(redis, engine)
    assert engine.calls[0] == [f"b{i}" for i in range(10)]  # the interactive take died
    drain(redis, engine)
    # Recovered as interactive suspect groups (halves), run before any bulk take.
    assert [len(c) for c in engine.calls] == [10, 5, 5, 64, 36]
    assert_each_item_answered_once(client, redis, live.id, 10)
    assert_each_item_answered_once(client, redis, backlog.id, 100)
    interactive = client.queue("laya", INTERACTIVE)
    assert set(interactive.finished_job_registry.get_job_ids()) == {job_id("live", f"b{i}") for i in range(10)}
    assert redis.llen(Keys().suspects("laya", INTERACTIVE)) == 0


def test_a_follow_up_inherits_its_parents_lane(client: Client, redis: Redis) -> None:
    backlog = client.submit_batch(bulk(200, "kev"), escalate=False)
    bid, jid = client.submit({"custom_id": "u", "model": "laya", "prompt": "unsure about this"})
    engine = FakeEngine(rows=64)
    drain(redis, engine)
    # laya's interactive job, then its Kev follow-up before Kev's bulk backlog
    assert engine.calls[:2] == [["u"], ["u"]] and len(engine.calls[2]) == 64
    (row,) = assert_each_item_answered_once(client, redis, bid, 1)
    assert row["model"] == "kev" and row["job_id"] == followup_id(jid, "kev")
    assert followup_id(jid, "kev") in client.queue("kev", INTERACTIVE).finished_job_registry.get_job_ids()
    assert_each_item_answered_once(client, redis, backlog.id, 200)
