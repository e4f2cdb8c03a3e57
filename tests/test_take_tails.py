"""Which other queues top up a take's small tail (`Taker._tail_queues`): models on the same base whose whole
queue fits the rest of the take, once the take's own queue ends in it."""

from __future__ import annotations

from typing import Any

import pytest

from shared.keys import BULK, QueueRef
from tests.fakes import FAKE_CONFIG
from worker.policy import QueueState
from worker.settings import WorkerSettings
from worker.take import Taker


def tails(model: str, depths: dict[str, int], *, taken: int, limit: int, **settings: Any) -> list[str]:
    taker = Taker(bridge=None, config=FAKE_CONFIG, settings=WorkerSettings(**settings))  # type: ignore[arg-type]
    states = {QueueRef(m, BULK): QueueState(d, 0.0) for m, d in depths.items()}
    return [ref.model for ref in taker._tail_queues(QueueRef(model, BULK), taken, limit, states)]


@pytest.mark.parametrize(
    ("model", "depths", "taken", "expected"),
    [
        ("kev", {"kev": 100, "laya": 50}, 100, ["laya"]),  # kev's tail topped up with laya's whole queue
        ("kev", {"kev": 100, "laya": 200}, 100, []),  # laya's queue does not fit the rest
        ("kev", {"kev": 300, "laya": 50}, 256, []),  # kev's queue does not end in this take
        ("laya", {"kev": 75, "laya": 176}, 176, ["kev"]),
        ("laya", {"kev": 75, "laya": 300}, 256, []),
        ("laya", {"kev": 0, "laya": 176}, 176, []),
    ],
)
def test_a_take_whose_queue_ends_in_it_is_topped_up_by_whole_small_tails(
    model: str, depths: dict[str, int], taken: int, expected: list[str]
) -> None:
    assert tails(model, depths, taken=taken, limit=256) == expected


def test_no_tails_mixed_when_switched_off() -> None:
    assert tails("kev", {"kev": 100, "laya": 50}, taken=100, limit=256, mixed_tails=False) == []
