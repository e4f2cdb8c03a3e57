"""Paced bulk takes (worker/pace.py): short while interactive work is live, full otherwise; sized from measured
takes, so the size follows whatever a take costs. Then the worker with a fake engine whose batches take time."""

from __future__ import annotations

import time

import pytest
from redis import Redis

from producer.client import Client
from tests.fakes import FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.pace import PACE_STEPS, BulkPace, TakeTime
from worker.settings import WorkerSettings


def affine(fixed_s: float, per_row_s: float):
    return lambda rows: fixed_s + per_row_s * rows


def test_full_takes_unless_interactive_work_is_live() -> None:
    pace = BulkPace(take_s=0.6, window_s=10)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    assert pace.limit("laya", 240, now=100.0) == 240  # no interactive job seen yet
    pace.saw_interactive(100.0)
    assert pace.limit("laya", 240, now=105.0) == 120  # the last full take scaled to the target
    assert pace.limit("laya", 240, now=110.5) == 240  # the window passed with none


def test_unmeasured_model_takes_full_and_measures() -> None:
    pace = BulkPace(take_s=0.6, window_s=10)
    pace.saw_interactive(0.0)
    assert pace.limit("kev", 200, now=1.0) == 200


def test_zero_target_never_paces() -> None:
    pace = BulkPace(take_s=0, window_s=10)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.saw_interactive(0.0)
    assert pace.limit("laya", 240, now=0.0) == 240


@pytest.mark.parametrize(
    ("fixed_s", "per_row_s", "capacity"),
    [(0.3, 0.0036, 240), (0.05, 0.01, 256), (0.2, 0.002, 512), (0.0, 0.02, 64)],
)
def test_paced_takes_converge_on_the_target_whatever_a_take_costs(fixed_s, per_row_s, capacity) -> None:
    cost, target = affine(fixed_s, per_row_s), 0.6
    pace = BulkPace(take_s=target, window_s=10)
    pace.record("laya", TakeTime(capacity, cost(capacity)), allowed=capacity, paced=False)
    pace.saw_interactive(0.0)
    times, rows = [], []
    for _ in range(12):
        rows.append(pace.limit("laya", capacity, now=0.0))
        times.append(cost(rows[-1]))
        pace.record("laya", TakeTime(rows[-1], times[-1]), allowed=rows[-1], paced=True)
    ideal = (target - fixed_s) / per_row_s  # the rows that take `target`
    step = capacity // PACE_STEPS  # limits move in steps of an eighth of a full take
    if ideal >= capacity * pace.min_fraction:
        assert all(ideal - 2 * step <= r <= ideal * 1.2 for r in rows[-4:]), (ideal, rows)
    assert all(t <= max(cost(capacity), target * 1.2) for t in times)


def test_rows_never_fall_below_the_floor() -> None:
    pace = BulkPace(take_s=0.1, window_s=10)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.saw_interactive(0.0)
    for _ in range(10):
        rows = pace.limit("laya", 240, now=0.0)
        pace.record("laya", TakeTime(rows, 0.5 + 0.003 * rows), allowed=rows, paced=True)
    assert pace.limit("laya", 240, now=0.0) == 60  # a quarter of a full take: fixed costs alone exceed 0.1 s


def test_one_slow_take_moves_the_limit_at_most_by_the_clamp() -> None:
    pace = BulkPace(take_s=0.6, window_s=10)
    pace.saw_interactive(0.0)
    pace.record("laya", TakeTime(120, 0.6), allowed=120, paced=True)
    assert pace.limit("laya", 240, now=0.0) == 120
    pace.record("laya", TakeTime(120, 30.0), allowed=120, paced=True)  # e.g. it captured a graph
    assert pace.limit("laya", 240, now=0.0) == 60  # 120 / sqrt(2) = 84, down to a step of 240 / 8


def test_takes_the_queue_cut_short_are_not_counted() -> None:
    pace = BulkPace(take_s=0.6, window_s=10)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.record("laya", TakeTime(10, 0.3), allowed=240, paced=False)  # the last 10 rows of a queue
    pace.saw_interactive(0.0)
    assert pace.limit("laya", 240, now=0.0) == 120


class TimedEngine(FakeEngine):
    """A fake engine whose batch of n rows takes `fixed_s + per_row_s * n`, with a hook before each batch."""

    def __init__(self, before, *, fixed_s: float, per_row_s: float, **kw) -> None:
        super().__init__(**kw)
        self.before, self.cost = before, affine(fixed_s, per_row_s)
        self.seconds: list[float] = []

    def run(self, jobs, **kw):
        self.before(len(self.calls))
        started = time.perf_counter()
        time.sleep(self.cost(len(jobs)))
        out = super().run(jobs, **kw)
        self.seconds.append(time.perf_counter() - started)
        return out


def test_the_worker_paces_bulk_while_interactive_jobs_come_and_takes_full_batches_after(
    client: Client, redis: Redis
) -> None:
    backlog = client.submit_batch([{"custom_id": f"b{i}", "model": "laya", "prompt": "x"} for i in range(1400)])

    live: list[str] = []

    def before(n: int) -> None:  # an interactive job during batches 2..8, then none
        if 2 <= n <= 8:
            live.append(client.submit({"custom_id": f"i{n}", "model": "kev", "prompt": "quick"})[0])

    engine = TimedEngine(before, fixed_s=0.02, per_row_s=0.001, rows=128)  # a full take ~0.15 s
    settings = WorkerSettings(burst=True, name="w1", paced_take_ms=60, interactive_window_s=0.8)
    BatchWorker(redis, engine, engine.config, settings).work()
    sizes = [len(c) for c in engine.calls]
    lanes = ["i" if c[0].startswith("i") else "b" for c in engine.calls]
    bulk_sizes = [n for n, lane in zip(sizes, lanes, strict=True) if lane == "b"]
    assert bulk_sizes[:2] == [128, 128]  # before any interactive job: full takes
    first_live = lanes.index("i")
    paced = [n for n, lane in zip(sizes[first_live:], lanes[first_live:], strict=True) if lane == "b"][2:7]
    assert paced and max(paced) < 70, sizes  # ~40 rows make ~0.06 s
    assert bulk_sizes[-3] == 128, sizes  # the window passed: full takes again
    assert_each_item_answered_once(client, redis, backlog.id, 1400)
    assert len(live) == 7 and all(client.status(batch).counts.done == 1 for batch in live)
    assert sum(n for n, lane in zip(sizes, lanes, strict=True) if lane == "i") == 7, sizes
