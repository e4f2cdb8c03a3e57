"""Paced bulk takes (worker/pace.py): short while interactive work is live, full otherwise; sized from measured
takes, so the size follows whatever a take costs. Then the worker with a fake engine whose batches take time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from redis import Redis

from producer.client import Client
from tests.fakes import FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.loop import BatchWorker
from worker.pace import PACE_STEPS, BulkPace, TakeTime
from worker.settings import WorkerSettings


def affine(fixed_s: float, per_row_s: float) -> Callable[[float], float]:
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


@pytest.mark.parametrize(("take_s", "window_s"), [(0, 10), (0.6, 0)])
def test_a_zero_target_or_window_never_paces(take_s: float, window_s: float) -> None:
    pace = BulkPace(take_s=take_s, window_s=window_s)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.saw_interactive(0.0)
    assert not pace.live(0.0)
    assert pace.limit("laya", 240, now=0.0) == 240


def run_paced(pace: BulkPace, cost: Callable[[float], float], capacity: int, takes: int) -> list[int]:
    rows = []
    for _ in range(takes):
        rows.append(pace.limit("laya", capacity, now=0.0))
        pace.record("laya", TakeTime(rows[-1], cost(rows[-1])), allowed=rows[-1], paced=True)
    return rows


@pytest.mark.parametrize(
    ("fixed_s", "per_row_s", "capacity"),
    [(0.3, 0.0036, 240), (0.3, 0.0023, 240), (0.05, 0.01, 256), (0.2, 0.002, 512), (0.0, 0.02, 64), (0.5, 0.003, 240)],
)
def test_paced_takes_settle_on_the_target_whatever_a_take_costs(
    fixed_s: float, per_row_s: float, capacity: int
) -> None:
    """Within one step of the rows that make the target (or at the floor, when even those are slower)."""
    cost, target = affine(fixed_s, per_row_s), 0.6
    pace = BulkPace(take_s=target, window_s=10)
    pace.record("laya", TakeTime(capacity, cost(capacity)), allowed=capacity, paced=False)
    pace.saw_interactive(0.0)
    rows = run_paced(pace, cost, capacity, 16)
    ideal = (target - fixed_s) / per_row_s  # the rows that take `target`
    step, floor = capacity // PACE_STEPS, capacity // 4
    if ideal < floor:
        assert rows[-4:] == [floor] * 4, (ideal, rows)
    else:
        assert all(abs(r - min(ideal, capacity)) <= step for r in rows[-4:]), (ideal, rows)


def test_a_slow_take_moves_the_limit_a_step_and_fast_takes_bring_it_back() -> None:
    cost = affine(0.3, 0.0023)  # 130 rows make 0.6 s
    pace = BulkPace(take_s=0.6, window_s=10)
    pace.record("laya", TakeTime(240, cost(240)), allowed=240, paced=False)
    pace.saw_interactive(0.0)
    settled = run_paced(pace, cost, 240, 8)[-1]
    rows = pace.limit("laya", 240, now=0.0)
    pace.record("laya", TakeTime(rows, 30.0), allowed=rows, paced=True)  # e.g. it captured a graph
    dropped = pace.limit("laya", 240, now=0.0)
    assert dropped >= int(settled * 0.5**0.5) - 30  # at most 1.4x down (then a step of 30)
    assert run_paced(pace, cost, 240, 8)[-1] == settled


def test_rows_never_fall_below_the_floor_and_leave_it_when_takes_get_cheap() -> None:
    pace = BulkPace(take_s=0.1, window_s=10)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.saw_interactive(0.0)
    assert run_paced(pace, affine(0.5, 0.003), 240, 10)[-1] == 60  # fixed costs alone exceed 0.1 s
    assert run_paced(pace, affine(0.0, 0.0002), 240, 12)[-1] == 240  # 500 rows would make 0.1 s


def test_takes_cut_short_are_not_counted() -> None:
    pace = BulkPace(take_s=0.6, window_s=10)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.record("laya", TakeTime(10, 0.3), allowed=240, paced=False)  # the last 10 rows of a queue
    pace.record("laya", TakeTime(3, 0.2), allowed=0, paced=False)  # a suspect group
    pace.saw_interactive(0.0)
    assert pace.limit("laya", 240, now=0.0) == 120


def test_each_spell_of_interactive_work_starts_from_the_last_full_take() -> None:
    pace = BulkPace(take_s=0.6, window_s=3)
    pace.record("laya", TakeTime(240, 1.2), allowed=240, paced=False)
    pace.saw_interactive(0.0)
    pace.record("laya", TakeTime(120, 6.0), allowed=120, paced=True)
    assert pace.limit("laya", 240, now=1.0) < 120
    pace.saw_interactive(60.0)  # a new spell, long after
    assert pace.limit("laya", 240, now=60.0) == 120


class TimedEngine(FakeEngine):
    """A fake engine whose batch of n rows takes `fixed_s + per_row_s * n`, with a hook before each batch."""

    def __init__(self, before: Callable[[int], None], *, fixed_s: float, per_row_s: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.before, self.cost = before, affine(fixed_s, per_row_s)

    def run(self, jobs: Any, **kw: Any) -> Any:
        self.before(len(self.calls))
        time.sleep(self.cost(len(jobs)))
        return super().run(jobs, **kw)


def test_the_worker_paces_bulk_while_interactive_jobs_come_and_takes_full_batches_after(
    client: Client, redis: Redis
) -> None:
    """Asserted by structure, not timing (a loaded machine only makes every take slower): full takes before any
    interactive job, paced ones while they come, full ones again once the window passed."""
    backlog = client.submit_batch([{"custom_id": f"b{i}", "model": "laya", "prompt": "x"} for i in range(1400)])
    live: list[str] = []

    def before(n: int) -> None:  # an interactive job during batches 2..8, then none
        if 2 <= n <= 8:
            live.append(client.submit({"custom_id": f"i{n}", "model": "kev", "prompt": "quick"})[0])

    engine = TimedEngine(before, fixed_s=0.02, per_row_s=0.001, rows=128)  # a full take ~0.15 s
    settings = WorkerSettings(burst=True, name="w1", paced_take_ms=60, interactive_window_s=0.5)
    BatchWorker(redis, engine, engine.config, settings).work()
    sizes = [len(c) for c in engine.calls]
    lanes = "".join("i" if c[0].startswith("i") else "b" for c in engine.calls)
    first, last = lanes.index("i"), lanes.rindex("i")
    assert sizes[:first] == [128] * first  # before any interactive job: full takes
    while_live = [n for n, lane in zip(sizes[first:last], lanes[first:last], strict=True) if lane == "b"]
    assert while_live and max(while_live) < 70, sizes  # ~40 rows make ~0.06 s; a full take 0.15 s
    assert 128 in sizes[last:], sizes  # the window passed: full takes again
    assert_each_item_answered_once(client, redis, backlog.id, 1400)
    assert len(live) == 7 and all(client.status(batch).counts.done == 1 for batch in live)
    assert sum(n for n, lane in zip(sizes, lanes, strict=True) if lane == "i") == 7, sizes
